"""Loss-spike and divergence guard: detect bad steps inside the train step, act on them on the host.

In the step, a replicated window ``state.guard`` of the last accepted losses and gradient norms
flags a non-finite or spiking step, and :func:`check_update` a proposed update too large for the
params (``run.max_update_ratio``, ``run.max_param_growth``); a flagged update is not applied. In the
loop, :class:`Guard` logs each :class:`GuardEvent` and applies ``run.guard``: ``skip``, ``rollback``
or ``stop`` (a destructive update always stops the run). See docs/faults.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainers.state import TrainState

log = logging.getLogger(__name__)

POLICIES = ("skip", "rollback", "stop")
EVENT_KINDS = ("nonfinite", "loss_spike", "grad_norm_spike", "update_ratio", "param_norm")
UPDATE_KINDS = ("update_ratio", "param_norm")  # a destructive update: the lr or the model, not a batch
SPLIT_PREFIX = "guard/"
# Per-step flags the train step adds to its metrics for the guard; not logged as train metrics.
FLAG_KEYS = ("finite", "ok", "loss_spike", "grad_norm_spike", "loss_median", "grad_norm_median", "update_ratio_high",
             "param_norm_high", "param_norm0", "new_param_norm", "max_update_ratio", "max_param_growth")


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


DEFAULT_MAX_UPDATE_RATIO = 1.0  # run.max_update_ratio's default
ORDINARY_UPDATE_RATIO = 0.1  # updates up to this times the param norm are ordinary (Adam's are ~1e-3..1e-2 of it)


def validate_update_limits(max_update_ratio: float, max_param_growth: float) -> None:
    """Raise ValueError naming ``run.max_update_ratio`` / ``run.max_param_growth`` unless each is 0 (off) or valid."""
    for key, value, least in (("run.max_update_ratio", max_update_ratio, 0.0), ("run.max_param_growth", max_param_growth, 1.0)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value == 0 or (math.isfinite(value) and value > least)
        ):
            raise ValueError(f"{key} must be 0 (check off) or a finite number > {least:g}, got {value!r}")


# --------------------------------------------------------------------------------- device side
def init_state(window: int) -> dict[str, jax.Array]:
    """An empty window: ``{"loss": nan[W], "grad_norm": nan[W], "count": 0}``."""
    validate("skip", 0.0, window)
    empty = jnp.full((window,), jnp.nan, jnp.float32)
    return {"loss": empty, "grad_norm": empty, "count": jnp.zeros((), jnp.int32),
            "param_norm0": jnp.full((), jnp.nan, jnp.float32)}  # the param norm before the first accepted update


def window_bytes(window: int) -> int:
    """Bytes of :func:`init_state` ``(window)``: two f32[window], a count and the first param norm."""
    return 8 * window + 8


def check_update(guard_state: dict[str, jax.Array] | None, update_norm: jax.Array, param_norm: jax.Array,
                 new_param_norm: jax.Array, max_update_ratio: float, max_param_growth: float) -> dict[str, jax.Array]:
    """Flags of one step's proposed update (traced), before it is applied: ``update_ratio_high`` when
    ``|update| > max_update_ratio x |params|``, ``param_norm_high`` when ``new_param_norm`` (the train
    step passes the bound ``|params| + |update|``) is not finite or above ``max_param_growth x`` the
    params' norm before the first update (0 turns a check off)."""
    ratio = update_norm / jnp.maximum(param_norm, jnp.finfo(jnp.float32).tiny)
    high = ~jnp.isfinite(update_norm) | ((param_norm > 0) & (ratio > max_update_ratio)) if max_update_ratio > 0 \
        else jnp.zeros((), bool)
    ref = guard_state["param_norm0"] if guard_state is not None and "param_norm0" in guard_state else jnp.float32(jnp.nan)
    grown = (jnp.isfinite(ref) & (new_param_norm > max_param_growth * ref)) if max_param_growth > 0 else jnp.zeros((), bool)
    return {"update_ratio": ratio, "param_norm": param_norm, "new_param_norm": new_param_norm, "update_ratio_high": high,
            "param_norm_high": ~jnp.isfinite(new_param_norm) | grown, "param_norm0": ref,
            "max_update_ratio": jnp.float32(max_update_ratio), "max_param_growth": jnp.float32(max_param_growth)}


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


def update(guard_state: dict[str, jax.Array], loss: jax.Array, grad_norm: jax.Array, accepted: jax.Array,
           param_norm: jax.Array | None = None) -> dict[str, jax.Array]:
    """The window after this step (traced): accepted values enter the ring buffer, others do not; the
    first accepted step's ``param_norm`` (before its update) becomes the reference of ``max_param_growth``."""
    window = guard_state["loss"].shape[0]
    i = guard_state["count"] % window
    put = lambda buf, v: jnp.where(accepted, buf.at[i].set(v.astype(jnp.float32)), buf)
    out = {
        "loss": put(guard_state["loss"], loss),
        "grad_norm": put(guard_state["grad_norm"], grad_norm),
        "count": guard_state["count"] + accepted.astype(jnp.int32),
    }
    if "param_norm0" in guard_state:
        ref = guard_state["param_norm0"]
        out["param_norm0"] = ref if param_norm is None else \
            jnp.where(jnp.isnan(ref) & accepted, param_norm.astype(jnp.float32), ref)
    return out


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
        if self.kind == "update_ratio":
            head = (f"step {self.step} (batch {self.data_index}): the update would move the params by {self.value:.3g} "
                    f"times their norm (limit run.max_update_ratio={self.threshold:.3g}); it was not applied. ")
            if math.isfinite(self.value) and self.value <= ORDINARY_UPDATE_RATIO:  # the limit is what is wrong
                return head + (f"An update of {self.value:.3g} times the norm is an ordinary one: run.max_update_ratio="
                               f"{self.threshold:.3g} is too small for this run; raise it (default "
                               f"{DEFAULT_MAX_UPDATE_RATIO:g}) or set it to 0 to turn the check off")
            return head + ("The learning rate is far too large for this model (lr.peak_lr), or the optimizer state is "
                           "broken")
        if self.kind == "param_norm":
            return (f"step {self.step} (batch {self.data_index}): the params after this update could have norm "
                    f"{self.value:.6g} (|params| + |update|), above the limit {self.threshold:.6g} (run.max_param_growth x their norm "
                    f"{self.median:.6g} before the first update; non-finite counts too); it was not applied")
        what = "loss or gradient norm is not finite" if self.kind == "nonfinite" else self.kind.replace("_", " ")
        return (f"step {self.step} (batch {self.data_index}): {what}: value {self.value:.6g}, "
                f"threshold {self.threshold:.6g}, running median {self.median:.6g}")


def events_of(step: int, data_index: int, flags: dict[str, Any], spike_factor: float) -> list[GuardEvent]:
    """The events one step's fetched metrics describe (empty for a good step)."""
    if bool(flags.get("ok", flags["finite"])):
        return []
    loss, gn = float(flags["loss"]), float(flags["grad_norm"])
    if not math.isfinite(loss) or not math.isfinite(gn):
        value = loss if not math.isfinite(loss) else gn
        return [GuardEvent(step, data_index, "nonfinite", value, math.nan, float(flags.get("loss_median", math.nan)))]
    events = []
    if bool(flags.get("update_ratio_high", False)):
        events.append(GuardEvent(step, data_index, "update_ratio", float(flags["update_ratio"]),
                                 float(flags["max_update_ratio"]), math.nan))
    if bool(flags.get("param_norm_high", False)):
        ref = float(flags["param_norm0"])
        events.append(GuardEvent(step, data_index, "param_norm", float(flags["new_param_norm"]),
                                 float(flags["max_param_growth"]) * ref, ref))
    for kind, value, median in (("loss_spike", loss, flags["loss_median"]), ("grad_norm_spike", gn, flags["grad_norm_median"])):
        if bool(flags[kind]):
            events.append(GuardEvent(step, data_index, kind, value, spike_factor * float(median), float(median)))
    return events


def peek_bad(pending: Sequence[tuple[int, int, dict[str, Any]]], lag: int = 2) -> bool:
    """Whether the step ``lag`` steps back among the loop's unfetched ``(step, batch, metrics)`` was bad,
    read only if its flag is already computed (no stall): the guard then acts within ``lag + 1`` steps
    rather than at the next log step. One process only (processes must fetch at the same steps)."""
    if len(pending) <= lag or jax.process_count() > 1:
        return False
    metrics = pending[-1 - lag][2]
    ok = metrics.get("ok", metrics.get("finite"))
    if ok is None or not getattr(ok, "is_ready", lambda: True)():
        return False
    return not bool(np.all(jax.device_get(ok)))


def check_learned(start: int, stop: int, skipped: int, events: Sequence[GuardEvent], policy: str) -> None:
    """A run that took steps ``start + 1 .. stop`` and skipped ``skipped`` of them learned nothing when
    it skipped them all: a DivergenceError (exit 3) naming the last cause, whatever ``run.max_bad_steps``."""
    if stop <= start or skipped < stop - start:
        return
    last = f"; last: {events[-1].describe()}" if events else ""
    raise DivergenceError(f"no update was applied: run.guard={policy!r} skipped every one of the {stop - start} steps "
                          f"{start + 1}..{stop} (a non-finite loss or gradient norm, or a spike){last}; the params "
                          f"are those of step {start}. Look for NaN or infinite inputs or loss weights, or a "
                          "learning rate that is too large")


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
        update = next((e for e in events if e.kind in UPDATE_KINDS), None)
        if update is not None:  # not a bad batch: skipping or rolling back would meet it again
            raise DivergenceError(f"run.guard={self.policy!r} stopped the run: {update.describe()}; the params are "
                                  f"those of step {step - 1}; last good checkpoint: {list(last_checkpoint()) or 'none'}")
        if self.policy == "stop":
            raise DivergenceError(f"run.guard='stop': {first.describe()}; last good checkpoint: {list(last_checkpoint()) or 'none'}")
        if self.policy == "skip" and self.streak >= self.max_bad_steps:
            raise DivergenceError(
                f"{self.streak} consecutive steps ending at step {step} had a non-finite loss or gradient norm or a spike "
                f"(limit run.max_bad_steps={self.max_bad_steps}); last: {first.describe()}; "
                f"last good checkpoint: {list(last_checkpoint()) or 'none'}"
            )
        return events

    def rolled_back(self, to_step: int, skipped_batches: Collection[int], at_step: int) -> None:
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
    out = {"loss": as_list(host["loss"]), "grad_norm": as_list(host["grad_norm"]), "count": int(host["count"])}
    if "param_norm0" in host:
        out["param_norm0"] = as_list(np.reshape(host["param_norm0"], (1,)))[0]
    return out


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
    ref = (data or {}).get("param_norm0")  # absent in windows saved before the update checks
    host = {"loss": loss, "grad_norm": grad_norm, "count": np.asarray(count, np.int32),
            "param_norm0": np.asarray(np.nan if ref is None else ref, np.float32)}
    # from a callback, not device_put: with many processes device_put compares values across them, and NaN != NaN
    return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, rep_, lambda index: a[index]), host)


def add_window(sharded: Any, window: int, mesh: jax.sharding.Mesh) -> Any:
    """``sharded`` (a ``trainers.state.ShardedState``) with an empty replicated guard window in its state."""
    if sharded.state.guard is not None:
        raise ValueError(f"the state already has a guard window; fields: {sorted(sharded.state.as_dict())}")
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(sharded.state)):  # an abstract state
        window_state = jax.eval_shape(lambda: init_state(window))
    else:
        window_state = jax.jit(lambda: init_state(window), out_shardings=rep)()
    return dataclasses.replace(sharded, state=sharded.state.replace(guard=window_state),
                               shardings=sharded.shardings.replace(guard=jax.tree.map(lambda _: rep, window_state)))


def attach(state: TrainState, saved: Any, window: int, mesh: jax.sharding.Mesh) -> TrainState:
    """``state`` with the window a checkpoint's data state saved (:func:`window_to_json`; None: empty)."""
    return state.replace(guard=window_from_json(saved, window, mesh))


def detach(state: TrainState) -> TrainState:
    """``state`` without its window: what checkpoints hold (the window is saved as JSON beside it)."""
    return state.replace(guard=None)
