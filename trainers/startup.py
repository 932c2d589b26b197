"""Before a run's first step: the checks :func:`trainers.setup.build` makes before it creates anything,
and where the run starts (:meth:`trainers.setup.Run.start`): its newest usable checkpoint, else the
``init_from`` params, else fresh. See docs/training.md ("Resuming") and docs/faults.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

import meshes
from spmd.rules import Rules
from trainers import checks, pretrained
from trainers.checkpoint import Checkpointer, NoUsableCheckpointError, resolve_init_from
from trainers.config import Config
from trainers.local_sgd import check_resume
from trainers.state import ShardedState, TrainState
from trainers.strategy import LocalSteps, Plain
from trainers.task import Task

log = logging.getLogger(__name__)

# the rules a run checks before it builds (the rest of the layout stage is the dry run's and the planner's report)
RUN_RULES = ("pipelined_task", "task", "batch")


def check_run(cfg: Config, task: Task, mesh: Mesh, rules: Rules) -> None:
    """Refuse, before any state is built or compiled: processes that disagree on the config or mesh,
    then the checks pass (:mod:`trainers.checks`) on this mesh: a pipelined config for a task that does
    not pipeline, the task's own layout checks, a batch that does not split over the batch axes and
    accumulation. Every issue found raises (the first)."""
    meshes.distributed.check_consistent(meshes.distributed.fingerprint(mesh, cfg.to_dict()))  # no-op on one process
    issues = checks.check(cfg, stages=("config", "layout"), select=RUN_RULES, mesh_shape=dict(mesh.shape), task=task,
                          rules=rules)
    for issue in issues:
        raise ValueError(str(issue))


def resume(cfg: Config, ckpt: Checkpointer, strategy: Plain,
           say: Callable[[str], None]) -> tuple[int, TrainState, dict[str, Any]] | None:
    """``(step, state, data item)`` of the newest usable checkpoint, or None: none (or ``run.resume=false``
    on an empty directory; on one with steps it is refused), or none usable with ``checkpoint.allow_fresh_start``."""
    if not cfg.run.resume:
        if ckpt.all_steps():
            raise ValueError(
                f"run.resume=false but {ckpt.directory} already holds checkpoint steps {ckpt.all_steps()}; a fresh run "
                "would mix its checkpoints with them. Use another run.run_dir, delete them, or set run.resume=true"
            )
        return None
    groups = strategy.local.groups if isinstance(strategy, LocalSteps) else None
    newest = ckpt.newest_tree()  # written in the other mode or with another number of replica groups: refused
    if newest is not None:
        check_resume(newest[1], groups, newest[0])
    try:
        return ckpt.restore(strategy.abstract)
    except NoUsableCheckpointError as exc:
        if not cfg.checkpoint.allow_fresh_start:
            raise
        text = f"no usable checkpoint; starting from scratch (checkpoint.allow_fresh_start=true): {exc}"
        log.warning("%s", text)
        say(text)
        return None


def loaded_params(cfg: Config, sharded: ShardedState, say: Callable[[str], None]) -> Any:
    """The params ``checkpoint.init_from`` names (a Hugging Face folder read shard by shard, or a step
    of another run), sharded as ``sharded``'s; None without it."""
    if pretrained.hf_path(cfg.checkpoint.init_from) is not None:
        params = pretrained.read_hf_params(cfg, sharded.abstract.params)
        say(f"initialised params from {cfg.checkpoint.init_from}; fresh optimizer, step 0")
        return params
    if not cfg.checkpoint.init_from:
        return None
    directory, step = resolve_init_from(cfg.checkpoint.init_from)
    with Checkpointer(directory, cfg.checkpoint, read_only=True, layer_orders=sharded.layer_orders) as source:
        step, params = source.restore_params(sharded.abstract.params, step=step)
    say(f"initialised params from step {step} of {directory}; fresh optimizer, step 0")
    return params
