"""What a pipeline's schedule table costs the planner: its table, the busiest stage's sends, its stash.

The table ``cfg.pipeline`` runs on a pipe axis of a given size (:func:`spmd.pipeline.get_schedule`),
built once per shape and cached, since the planner asks for the same table from the memory, traffic
and time models of every layout it ranks. Formulas: docs/planning.md.
"""

from __future__ import annotations

import functools

from spmd.pipeline import Schedule, get_schedule
from trainers.config import Config


def pipeline_schedule(cfg: Config, pipe: int) -> Schedule:
    """The schedule table ``cfg.pipeline`` runs on a pipe axis of this size (built once per shape)."""
    p = cfg.pipeline
    return _schedule(p.schedule, pipe, p.microbatches, p.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, pipe: int, microbatches: int, virtual_stages: int) -> Schedule:
    return get_schedule(name, pipe, microbatches, virtual_stages)


def carried_models(cfg: Config) -> int:
    """Models whose activations one pipeline carries side by side: 2 under DPO (the policy's and the
    reference's, ``spmd.models.piped_dpo``), so its sends, stash and slots are twice the LM loss's; else 1."""
    return 2 if cfg.run.objective == "dpo" else 1


def pipeline_sends(cfg: Config, pipe: int) -> int:
    """Activations ``x[B/M, L, D]`` the busiest stage sends over ``pipe`` per pipeline run: the table
    engine's sends (:meth:`spmd.pipeline.Schedule.sent_bytes` per stage); GPipe: ``2 (M + S - 1)``, what
    its scans sent when they permuted on every tick (they now send ``2 M``; kept as an upper bound)."""
    p = cfg.pipeline
    return _sends(p.schedule, pipe, p.microbatches, p.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _sends(name: str, pipe: int, microbatches: int, virtual_stages: int) -> int:
    schedule = _schedule(name, pipe, microbatches, virtual_stages)
    if schedule.name == "gpipe":
        return 2 * (schedule.n_microbatches + pipe - 1)
    return max(schedule.sent_bytes(1).per_stage)


def stash_sizes(cfg: Config, pipe: int) -> tuple[int, int]:
    """The schedule table's stash and gradient slots per stage (:meth:`spmd.pipeline.Schedule.stash_sizes`)."""
    p = cfg.pipeline
    return _stash(p.schedule, pipe, p.microbatches, p.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _stash(name: str, pipe: int, microbatches: int, virtual_stages: int) -> tuple[int, int]:
    return _schedule(name, pipe, microbatches, virtual_stages).stash_sizes()


def weight_stash_size(cfg: Config, pipe: int) -> int:
    """Split schedules' B-to-W slots per stage (:meth:`spmd.pipeline.Schedule.weight_stash_size`); 0 without W."""
    p = cfg.pipeline
    return _weight_stash(p.schedule, pipe, p.microbatches, p.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _weight_stash(name: str, pipe: int, microbatches: int, virtual_stages: int) -> int:
    return _schedule(name, pipe, microbatches, virtual_stages).weight_stash_size()


def pipeline_bubble(cfg: Config, pipe: int) -> float:
    """Idle share of the pipeline's step as the engine runs it (0 without a pipeline or with pipe=1): the
    table advances tick by tick, each tick as long as its slowest op (``Schedule.lockstep_time`` with the
    ops' costs in chunk forwards), against the work of one stage."""
    if pipe <= 1 or not cfg.pipeline.enabled:
        return 0.0
    p = cfg.pipeline
    return _bubble(p.schedule, pipe, p.microbatches, p.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _bubble(name: str, pipe: int, microbatches: int, virtual_stages: int) -> float:
    table = _schedule(name, pipe, microbatches, virtual_stages)
    work = table.n_microbatches * table.n_virtual * sum(table.op_costs().values())
    return 1 - work / table.lockstep_time()
