"""Loss-spike and divergence guard: detect bad steps inside the train step, act on them on the host.

In the step, a replicated window ``state["guard"]`` of the last accepted losses and gradient norms
flags a non-finite or spiking step, whose update is not applied. In the loop, :class:`Guard` logs each
:class:`GuardEvent` and applies ``run.guard``: ``skip``, ``rollback`` or ``stop``. See docs/faults.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

POLICIES = ("skip", "rollback", "stop")
EVENT_KINDS = ("nonfinite", "loss_spike", "grad_norm_spike")
SPLIT_PREFIX = "guard/"
# Per-step flags the train step adds to its metrics for the guard; not logged as train metrics.
FLAG_KEYS = ("finite", "ok", "loss_spike", "grad_norm_spike", "loss_median", "grad_norm_median")


class DivergenceError(RuntimeError):
    """The guard stopped the run: a bad step under ``run.guard="stop"``, or too many bad steps."""


def validate(policy: str, spike_factor: float, spike_window: int) -> None:
    """Raise ValueError naming the offending guard setting and what would be valid."""
    if policy not in POLICIES:
        raise ValueError(f"run.guard must be one of {POLICIES}, got {policy!r}")
    if isinstance(spike_factor, bool) or not isinstance(spike_factor, (int, float)) or not (
        spike_factor == 0 or (math.isfinite(spike_factor) and spike_factor > 1)
    ):
        raise ValueError(f"run.spike_factor must be 0 (spike detection off) or a finite number > 1, got {spike_factor!r}")
    if isinstance(spike_window, bool) or not isinstance(spike_window, int) or spike_window < 1:
        raise ValueError(f"run.spike_window must be an integer >= 1, got {spike_window!r}")


# --------------------------------------------------------------------------------- device side
def init_state(window: int) -> dict[str, jax.Array]:
    """An empty window: ``{"loss": nan[W], "grad_norm": nan[W], "count": 0}``."""
    validate("skip", 0.0, window)
    empty = jnp.full((window,), jnp.nan, jnp.float32)
    return {"loss": empty, "grad_norm": empty, "count": jnp.zeros((), jnp.int32)}


def check(guard_state: dict[str, jax.Array], loss: jax.Array, grad_norm: jax.Array, spike_factor: float) -> dict[str, jax.Array]:
    """Flags of one step (traced): ``finite``, ``loss_spike``, ``grad_norm_spike``, ``ok`` and both medians.

    Medians are NaN until the window is full; spikes are only flagged with a full window and
    ``spike_factor > 0``.
    """
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    full = guard_state["count"] >= guard_state["loss"].shape[0]
    loss_median = jnp.where(full, jnp.median(guard_state["loss"]), jnp.nan)
    gn_median = jnp.where(full, jnp.median(guard_state["grad_norm"]), jnp.nan)
    if spike_factor > 0:
        loss_spike = full & finite & (loss > spike_factor * loss_median)
        gn_spike = full & finite & (grad_norm > spike_factor * gn_median)
    else:
        loss_spike = gn_spike = jnp.zeros((), bool)
    return {
        "finite": finite,
        "loss_spike": loss_spike,
        "grad_norm_spike": gn_spike,
        "ok": finite & ~loss_spike & ~gn_spike,
        "loss_median": loss_median,
        "grad_norm_median": gn_median,
    }


def update(guard_state: dict[str, jax.Array], loss: jax.Array, grad_norm: jax.Array, accepted: jax.Array) -> dict[str, jax.Array]:
    """The window after this step (traced): accepted values enter the ring buffer, others do not."""
    window = guard_state["loss"].shape[0]
    i = guard_state["count"] % window
    put = lambda buf, v: jnp.where(accepted, buf.at[i].set(v.astype(jnp.float32)), buf)
    return {
        "loss": put(guard_state["loss"], loss),
        "grad_norm": put(guard_state["grad_norm"], grad_norm),
        "count": guard_state["count"] + accepted.astype(jnp.int32),
    }


# --------------------------------------------------------------------------------- host side
@dataclasses.dataclass(frozen=True)
class GuardEvent:
    """One bad step: ``kind`` is one of EVENT_KINDS; ``threshold``/``median`` are NaN without a full window."""

    step: int
    data_index: int
    kind: str
    value: float
    threshold: float
    median: float

    def describe(self) -> str:
        what = "loss or gradient norm is not finite" if self.kind == "nonfinite" else self.kind.replace("_", " ")
        return (f"step {self.step} (batch {self.data_index}): {what}: value {self.value:.6g}, "
                f"threshold {self.threshold:.6g}, running median {self.median:.6g}")


def events_of(step: int, data_index: int, flags: dict[str, Any], spike_factor: float) -> list[GuardEvent]:
    """The events one step's fetched metrics describe (empty for a good step)."""
    if bool(flags.get("ok", flags["finite"])):
        return []
    loss, gn = float(flags["loss"]), float(flags["grad_norm"])
    if not bool(flags["finite"]):
        value = loss if not math.isfinite(loss) else gn
        return [GuardEvent(step, data_index, "nonfinite", value, math.nan, float(flags.get("loss_median", math.nan)))]
    events = []
    for kind, value, median in (("loss_spike", loss, flags["loss_median"]), ("grad_norm_spike", gn, flags["grad_norm_median"])):
        if bool(flags[kind]):
            events.append(GuardEvent(step, data_index, kind, value, spike_factor * float(median), float(median)))
    return events


class Guard:
    """Applies ``run.guard`` to the events of fetched steps; see the module docstring."""

    def __init__(self, policy: str, *, spike_factor: float, spike_window: int, max_bad_steps: int, logger: Any = None) -> None:
        validate(policy, spike_factor, spike_window)
        if isinstance(max_bad_steps, bool) or not isinstance(max_bad_steps, int) or max_bad_steps < 1:
            raise ValueError(f"run.max_bad_steps must be an integer >= 1, got {max_bad_steps!r}")
        self.policy, self.spike_factor, self.max_bad_steps = policy, spike_factor, max_bad_steps
        self.logger = logger
        self.streak = 0
        self.rollbacks = 0
        self.events: list[GuardEvent] = []

    def observe(self, step: int, data_index: int, flags: dict[str, Any], *,
                last_checkpoint: Callable[[], Sequence[int]] = list) -> list[GuardEvent]:
        """Record one fetched step; returns its events (the caller rolls back if policy says so).

        Raises DivergenceError under ``"stop"`` on any event, and under ``"skip"`` after
        ``max_bad_steps`` bad steps in a row.
        """
        events = events_of(step, data_index, flags, self.spike_factor)
        if not events:
            self.streak = 0
            return []
        self.streak += 1
        for event in events:
            self.events.append(event)
            self._record(event)
        first = events[0]
        if self.policy == "stop":
            raise DivergenceError(f"run.guard='stop': {first.describe()}; last good checkpoint: {list(last_checkpoint()) or 'none'}")
        if self.policy == "skip" and self.streak >= self.max_bad_steps:
            raise DivergenceError(
                f"{self.streak} consecutive steps ending at step {step} had a non-finite loss or gradient norm or a spike "
                f"(limit run.max_bad_steps={self.max_bad_steps}); last: {first.describe()}; "
                f"last good checkpoint: {list(last_checkpoint()) or 'none'}"
            )
        return events

    def rolled_back(self, to_step: int, skipped_batches: Sequence[int], at_step: int) -> None:
        """Log a rollback; raises DivergenceError past ``max_bad_steps`` rollbacks."""
        self.rollbacks += 1
        self.streak = 0
        text = f"rolled back from step {at_step} to checkpoint step {to_step}; batches skipped from now on: {sorted(skipped_batches)}"
        log.warning("guard: %s", text)
        if self.logger is not None:
            self.logger.message(f"guard: {text}")
            self.logger.log(at_step, {"to_step": to_step, "skipped_batches": len(skipped_batches)}, prefix=SPLIT_PREFIX + "rollback")
        if self.rollbacks > self.max_bad_steps:
            raise DivergenceError(f"{self.rollbacks} rollbacks (limit run.max_bad_steps={self.max_bad_steps}); the run keeps diverging")

    def _record(self, event: GuardEvent) -> None:
        text = f"guard ({self.policy}): {event.describe()}"
        log.warning("%s", text)
        if self.logger is not None:
            self.logger.message(text)
            self.logger.log(event.step, {"value": event.value, "threshold": event.threshold, "median": event.median,
                                         "data_index": event.data_index}, prefix=SPLIT_PREFIX + event.kind)


def read_events(run_dir: str | Path) -> list[GuardEvent]:
    """The guard events recorded in a run directory's metrics JSONL, in order."""
    from trainers.logger import read_metrics

    events = []
    for rec in read_metrics(run_dir):
        kind = str(rec.get("split", ""))[len(SPLIT_PREFIX):] if str(rec.get("split", "")).startswith(SPLIT_PREFIX) else ""
        if kind in EVENT_KINDS:
            events.append(GuardEvent(int(rec["step"]), int(rec["data_index"]), kind, rec["value"], rec["threshold"], rec["median"]))
    return events


def window_of(guard_state: dict[str, Any]) -> np.ndarray:
    """The accepted losses in the window, oldest first (for inspection and tests)."""
    loss, count = np.asarray(guard_state["loss"]), int(guard_state["count"])
    w = loss.shape[0]
    order = [(count + k) % w for k in range(w)] if count >= w else list(range(count))
    return loss[order]


def window_to_json(guard_state: dict[str, Any]) -> dict[str, Any]:
    """The window as JSON data (NaN as null) for the checkpoint's data item."""
    host = jax.device_get(guard_state)
    as_list = lambda a: [None if not math.isfinite(float(v)) else float(v) for v in np.asarray(a)]
    return {"loss": as_list(host["loss"]), "grad_norm": as_list(host["grad_norm"]), "count": int(host["count"])}


def window_from_json(data: dict[str, Any] | None, window: int, mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    """A replicated window from :func:`window_to_json` data (empty for None). A window of another
    size keeps the newest accepted values that fit."""
    validate("skip", 0.0, window)
    loss = np.full((window,), np.nan, np.float32)
    grad_norm, count = loss.copy(), 0
    if data:
        try:
            old_loss = np.asarray([np.nan if v is None else v for v in data["loss"]], np.float32)
            old_gn = np.asarray([np.nan if v is None else v for v in data["grad_norm"]], np.float32)
            old_count = int(data["count"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"guard window data must have 'loss', 'grad_norm' lists and an int 'count', got {data!r}") from exc
        if old_loss.shape[0] == window and old_gn.shape[0] == window:
            loss, grad_norm, count = old_loss, old_gn, old_count
        else:
            n = old_loss.shape[0]
            order = [(old_count + k) % n for k in range(n)] if old_count >= n else list(range(old_count))
            keep = order[-window:]
            loss[: len(keep)], grad_norm[: len(keep)], count = old_loss[keep], old_gn[keep], len(keep)
    rep_ = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    host = {"loss": loss, "grad_norm": grad_norm, "count": np.asarray(count, np.int32)}
    # from a callback, not device_put: with many processes device_put compares values across them, and NaN != NaN
    return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, rep_, lambda index: a[index]), host)


def add_window(sharded: Any, window: int, mesh: jax.sharding.Mesh) -> Any:
    """``sharded`` (a ``trainers.state.ShardedState``) with an empty replicated guard window in its state."""
    from trainers.state import ShardedState

    if "guard" in sharded.state:
        raise ValueError(f"the state already has a 'guard' window; keys: {sorted(sharded.state)}")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    window_state = jax.jit(lambda: init_state(window), out_shardings=rep)()
    return ShardedState(sharded.model, {**sharded.state, "guard": window_state},
                   {**sharded.shardings, "guard": jax.tree.map(lambda _: rep, window_state)})
