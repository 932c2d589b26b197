"""How a run steps and what it keeps between steps: the typed :class:`RunState` and the step strategies.

A strategy is what the loop asks about the state it carries: how a fresh one starts, what a checkpoint
holds of it, the train step, what runs after a step, how metrics are fetched, what eval reads and how
many steps the guard skipped. :class:`Plain` is the ordinary step; :class:`LocalSteps` is local SGD's
(replica groups that synchronise every H steps, :mod:`trainers.local_sgd`). A pipeline is not a
strategy: it lives inside the loss. :func:`trainers.setup.build` picks one.

:class:`RunState` is the train state with the data position (the train loader's state and the
rolled-back batches to step over). Checkpoints keep the plain orbax tree they always held:
:meth:`RunState.to_tree` gives ``(train state tree, data item)``, :meth:`RunState.from_tree` reads them back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from trainers.faults import guard as guard_lib
from trainers.local_sgd import LocalSGD
from trainers.state import ShardedState, TrainState
from trainers.step import eval_view

Metrics = dict[str, jax.Array]


class Plain:
    """The ordinary step: one state; the guard window travels in it and is saved as JSON beside it."""

    name = "plain"

    def __init__(self, sharded: ShardedState, stepped: ShardedState, train_step: Callable, mesh: Mesh,
                 spike_window: int) -> None:
        self.sharded, self.stepped, self.train_step, self.mesh = sharded, stepped, train_step, mesh
        self.spike_window = spike_window

    @property
    def abstract(self) -> TrainState:
        """A checkpoint's restore target on this mesh."""
        return self.sharded.abstract

    def fresh(self, params: Any = None, start: Callable[[TrainState], TrainState] | None = None) -> TrainState:
        """The state at step 0: as created, or with loaded ``params`` completed by the task's ``start``."""
        state = self.sharded.state if params is None else _loaded(self.sharded.state, params, start)
        return self.restored(state, {})

    def restored(self, state: TrainState, data: dict[str, Any]) -> TrainState:
        """A checkpoint's state as the step carries it: with the window its data item saved."""
        return guard_lib.attach(state, data.get("guard"), self.spike_window, self.mesh)

    def saved(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        """``(what the checkpoint's state holds, what its data item adds)``: the window goes beside it."""
        return guard_lib.detach(state), {"guard": guard_lib.window_to_json(state.guard)}

    def after_step(self, state: TrainState, step: int) -> TrainState:
        return state

    def fetch(self, metrics: list[Metrics]) -> list[dict[str, Any]]:
        return jax.device_get(metrics)

    def skipped(self, state: TrainState) -> int:
        return int(jax.device_get(state.skipped))

    def eval_view(self, state: TrainState) -> TrainState:
        """What eval reads: the params and the model's other variables."""
        return eval_view(state)

    def kept(self, state: TrainState) -> TrainState:
        """What ``Result.state`` holds: the state as checkpoints hold it."""
        return guard_lib.detach(state)

    def log_values(self) -> dict[str, float]:
        return {}

    def summary(self, steps: int) -> dict[str, float]:
        return {}


class LocalSteps(Plain):
    """Local SGD: every group's state (each with its window) plus the outer params, saved as one tree."""

    name = "local_sgd"

    def __init__(self, local: LocalSGD, sharded: ShardedState, stepped: ShardedState, mesh: Mesh,
                 spike_window: int) -> None:
        super().__init__(sharded, stepped, local.train_step, mesh, spike_window)
        self.local = local

    @property
    def abstract(self) -> TrainState:
        return self.local.abstract

    def fresh(self, params: Any = None, start: Callable[[TrainState], TrainState] | None = None) -> TrainState:
        one = self.stepped.state if params is None else _loaded(self.stepped.state, params, start)
        return self.local.start(one)

    def restored(self, state: TrainState, data: dict[str, Any]) -> TrainState:
        return state

    def saved(self, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
        return state, {}

    def after_step(self, state: TrainState, step: int) -> TrainState:
        return self.local.outer_step(state) if self.local.due(step) else state  # one all-reduce over data

    def fetch(self, metrics: list[Metrics]) -> list[dict[str, Any]]:
        return self.local.fetch(metrics)

    def skipped(self, state: TrainState) -> int:
        return self.local.skipped(state)

    def eval_view(self, state: TrainState) -> TrainState:
        return self.local.eval_view(state)

    def kept(self, state: TrainState) -> TrainState:
        return state

    def log_values(self) -> dict[str, float]:
        return {"data_bytes": float(self.local.bytes_sent)}

    def summary(self, steps: int) -> dict[str, float]:
        return self.local.summary(steps)

    def release_template(self, state: TrainState) -> None:
        """Free the one group's state the groups were made from (unless the state holds its arrays)."""
        kept = {id(x) for x in jax.tree.leaves(state)}
        [x.delete() for x in jax.tree.leaves(self.stepped.state) if id(x) not in kept]


def _loaded(state: TrainState, params: Any, start: Callable[[TrainState], TrainState] | None) -> TrainState:
    """A fresh state with loaded params (``checkpoint.init_from``), completed by the task's ``start`` (DPO: its reference)."""
    state = state.replace(params=params)
    return state if start is None else start(state)


@dataclasses.dataclass
class RunState:
    """What a run carries from step to step: the step, the train state as the strategy steps it, the
    train loader's position (None before the first batch) and the batches rolled back over."""

    step: int
    train: TrainState
    data: dict[str, Any] | None = None
    skip_batches: frozenset[int] = frozenset()

    def to_tree(self, strategy: Plain) -> tuple[TrainState, dict[str, Any]]:
        """``(state tree, data item)`` as checkpoints hold them (the same orbax tree as always)."""
        state, extra = strategy.saved(self.train)
        return state, {"train": self.data, "skip_batches": sorted(self.skip_batches), **extra}

    @classmethod
    def from_tree(cls, step: int, state: TrainState, data: dict[str, Any], strategy: Plain) -> RunState:
        """The run state of a restored checkpoint ``(step, state, data item)``."""
        return cls(step, strategy.restored(state, data), data.get("train"), frozenset(data.get("skip_batches", ())))
