"""Pipeline configuration and the entry point models call: :func:`pipelined_loss`.

``PipelineConfig(schedule="1f1b", microbatches=8, virtual_stages=1, remat=False)`` says how a
model's block stack runs over the ``pipe`` mesh axis. The mesh comes from the active
``spmd.use_rules`` context (the trainer's step enters one); its ``pipe`` size is the number of
stages S. With no active mesh, a ``pipe`` axis of size 1, or ``schedule="none"``, the stack runs
as the plain scan on the whole batch (same loss: the mean over equal microbatches is the mean over
the batch), so one config serves every mesh.

With V > 1 (``interleaved``, or ``zb-v``, which needs V = 2) a run stores the stack in the schedule's
chunk order (:meth:`PipelineConfig.layer_order`). The global batch ``x[B_batch, L, D]`` is cut into M microbatches as the trainer's gradient accumulation
does: microbatch j holds rows ``j, j+M, j+2M, ...``, so under ``batch -> data`` no data moves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshes import axis_sizes
from spmd.constraints import active_layout, constrain
from spmd.pipeline.builders import get_schedule
from spmd.pipeline.engine import HeadFn, StageFn, run_schedule
from spmd.pipeline.order import NATURAL, LayerOrder, order_of
from spmd.pipeline.schedules import NAMES, Schedule

SCHEDULES = ("none", *NAMES)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How to pipeline a block stack: schedule name, microbatches M, virtual stages V, stage remat."""

    schedule: str = "none"  # "none" (plain scan) | "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zb-h2" | "zb-v"
    microbatches: int = 1
    virtual_stages: int = 1
    remat: bool = False  # gpipe only: rematerialise each stage in the backward pass

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.microbatches < 1:
            raise ValueError(f"pipeline.microbatches must be >= 1, got {self.microbatches}")
        if self.virtual_stages < 1:
            raise ValueError(f"pipeline.virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.schedule == "zb-v" and self.virtual_stages != 2:
            raise ValueError(f"pipeline.schedule 'zb-v' runs 2 chunks per stage: set pipeline.virtual_stages=2, "
                             f"got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", "zb-v"):
            raise ValueError(f"pipeline.virtual_stages={self.virtual_stages} needs schedule 'interleaved', "
                             f"got {self.schedule!r}")

    @property
    def enabled(self) -> bool:
        return self.schedule != "none"

    def make_schedule(self, n_stages: int, n_layers: int | None = None) -> Schedule:
        """The schedule table for ``n_stages`` stages (checks the layers split into S*V chunks)."""
        return get_schedule(self.schedule, n_stages, self.microbatches, self.virtual_stages, n_layers=n_layers)

    def layer_order(self, n_stages: int) -> LayerOrder:
        """The order a stack runs in place on ``n_stages`` stages: the interleaved schedule's chunk
        order ``LayerOrder(S, V)``, ZB-V's ``LayerOrder(S, 2, "v")``, natural otherwise (also with one
        stage or ``schedule="none"``)."""
        if not self.enabled or n_stages <= 1:
            return NATURAL
        return LayerOrder(n_stages, self.virtual_stages, "v" if self.schedule == "zb-v" else "loop")


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``, microbatch j = rows j, j+M, ... (local to each device)."""
    if x.shape[0] % m:
        raise ValueError(f"batch of {x.shape[0]} rows does not split into {m} microbatches")
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


def pipe_stages(axis: str = "pipe") -> int:
    """Size of the ``pipe`` axis of the active mesh (1 without one)."""
    active = active_layout()
    return 1 if active is None else axis_sizes(active[0]).get(axis, 1)


def pipelined_loss(
    config: PipelineConfig | None,
    stage_fn: StageFn,
    head_fn: HeadFn,
    stage_params: Any,
    head_params: Any,
    x_BLD: jax.Array,
    targets_BL: jax.Array,
    compute_dtype: Any = None,
) -> tuple[jax.Array, dict]:
    """``head_fn(head, stack(x), targets)``, pipelined over ``pipe`` when the config and mesh ask for it.

    ``stage_params`` may be stored in any :class:`LayerOrder` (read from the variables' metadata);
    unpipelined, the stack runs in natural order. ``compute_dtype`` (e.g. bf16): the dtype the stage
    weight matrices' FSDP gathers move in (the blocks cast them to it at use)."""
    S = pipe_stages()
    n_layers = jax.tree.leaves(stage_params)[0].shape[0]
    if config is None or not config.enabled or S == 1:
        if config is not None and config.enabled:
            config.make_schedule(1, n_layers)  # same input checks as on a real pipe axis
        return head_fn(head_params, stage_fn(order_of(stage_params).to_natural(stage_params), x_BLD), targets_BL)
    schedule = config.make_schedule(S, n_layers)
    mesh, rules = active_layout()
    M = config.microbatches
    return run_schedule(stage_fn, head_fn, stage_params, head_params, split_microbatches(x_BLD, M),
                        split_microbatches(targets_BL, M), schedule=schedule, mesh=mesh, rules=rules,
                        remat=config.remat, compute_dtype=compute_dtype)
