"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD.

A schedule is a plain ``optax.Schedule`` (``step -> lr``); ``total_steps`` always means the whole
run. ``scale_lr`` adapts a base LR to another global batch size. See docs/training.md.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import optax

__all__ = ["SCHEDULE_KINDS", "SCALING_RULES", "LRConfig", "make_lr_schedule", "scale_lr"]

SCHEDULE_KINDS: tuple[str, ...] = ("cosine", "linear", "constant", "wsd")
SCALING_RULES: tuple[str, ...] = ("linear", "sqrt")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class LRConfig:
    """What the LR does over a run of ``total_steps`` optimizer steps (``Config.lr``).

    Attributes:
      kind: "cosine" | "linear" | "constant" | "wsd" (warmup-stable-decay).
      peak_lr: LR at the end of warmup (> 0).
      warmup_steps: steps of linear warmup from 0 to ``peak_lr`` (0 = none).
      total_steps: length of the schedule, warmup included; 0 (the default) means the run's
        length (``run.steps``), so the run length is set in one place. Set it only for a
        schedule that should not end with the run.
      end_lr_fraction: final LR as a fraction of ``peak_lr`` (cosine, linear,
        wsd); ignored by "constant".
      decay_fraction: wsd only: the last ``decay_fraction * total_steps`` steps
        (rounded to an integer) decay linearly from peak to the end LR.
    """

    kind: str = "cosine"
    peak_lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 0  # 0: run.steps
    end_lr_fraction: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"lr.kind={self.kind!r} is not a schedule kind; valid kinds: {SCHEDULE_KINDS}")
        if not _is_real(self.peak_lr) or self.peak_lr <= 0:
            raise ValueError(f"lr.peak_lr={self.peak_lr!r} must be a finite number > 0")
        if not _is_int(self.total_steps) or self.total_steps < 0:
            raise ValueError(f"lr.total_steps={self.total_steps!r} must be an integer > 0, or 0 for run.steps")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"lr.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not _is_real(self.end_lr_fraction) or not 0.0 <= self.end_lr_fraction <= 1.0:
            raise ValueError(f"lr.end_lr_fraction={self.end_lr_fraction!r} must be in [0, 1]")
        if not _is_real(self.decay_fraction) or not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"lr.decay_fraction={self.decay_fraction!r} must be in [0, 1]")
        if self.total_steps == 0:
            return  # the checks against the length run in for_run(run.steps)
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"lr.warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}; "
                "warmup must fit inside the run (0 <= warmup_steps <= total_steps)"
            )
        if self.kind == "wsd" and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"lr: wsd warmup_steps={self.warmup_steps} + decay steps {self.decay_steps} "
                f"(decay_fraction={self.decay_fraction} of total_steps={self.total_steps}) exceed total_steps; "
                "lower warmup_steps or decay_fraction"
            )

    def for_run(self, steps: int | None) -> LRConfig:
        """This schedule with its length fixed: ``total_steps`` if set, else the run's ``steps``
        (validated against the length either way)."""
        if self.total_steps:
            return self
        if not _is_int(steps) or steps <= 0:
            raise ValueError(f"lr.total_steps=0 means the run's length, but none was given (steps={steps!r}); "
                             "pass the run's steps or set lr.total_steps")
        return dataclasses.replace(self, total_steps=steps)

    @property
    def end_lr(self) -> float:
        """The LR at ``total_steps`` (``peak_lr`` for the constant kind)."""
        return self.peak_lr if self.kind == "constant" else self.peak_lr * self.end_lr_fraction

    @property
    def decay_steps(self) -> int:
        """Steps of the final linear decay of the wsd kind."""
        return int(round(self.decay_fraction * self.total_steps))


def _decay_after_warmup(cfg: LRConfig) -> tuple[list[optax.Schedule], list[int]]:
    """The pieces after warmup and the (absolute) steps where each later piece starts."""
    peak, end = cfg.peak_lr, cfg.end_lr
    remaining = cfg.total_steps - cfg.warmup_steps
    if cfg.kind == "constant":
        return [optax.constant_schedule(peak)], []
    if cfg.kind in ("cosine", "linear"):
        if remaining == 0:  # warmup fills the run: nothing left to decay over
            return [optax.constant_schedule(end)], []
        if cfg.kind == "cosine":
            return [optax.cosine_decay_schedule(peak, decay_steps=remaining, alpha=cfg.end_lr_fraction)], []
        return [optax.linear_schedule(peak, end, transition_steps=remaining)], []
    # wsd: stable at peak, then linear decay over the last decay_steps.
    decay_start = cfg.total_steps - cfg.decay_steps
    stable = optax.constant_schedule(peak)
    if cfg.decay_steps == 0:
        return [stable], []
    decay = optax.linear_schedule(peak, end, transition_steps=cfg.decay_steps)
    if decay_start == cfg.warmup_steps:  # no stable phase
        return [decay], []
    return [stable, decay], [decay_start]


def make_lr_schedule(cfg: LRConfig, steps: int | None = None) -> optax.Schedule:
    """The schedule described by ``cfg`` over a run of ``steps`` (used when ``cfg.total_steps`` is 0):
    linear warmup 0 -> peak, then ``cfg.kind``."""
    if not isinstance(cfg, LRConfig):
        raise ValueError(f"make_lr_schedule expects an LRConfig, got {type(cfg).__name__}: {cfg!r}")
    cfg = cfg.for_run(steps)
    pieces, later_starts = _decay_after_warmup(cfg)
    if cfg.warmup_steps == 0:
        schedules, boundaries = pieces, later_starts
    else:
        warmup = optax.linear_schedule(0.0, cfg.peak_lr, transition_steps=cfg.warmup_steps)
        schedules, boundaries = [warmup, *pieces], [cfg.warmup_steps, *later_starts]
    if len(schedules) == 1:
        return schedules[0]
    return optax.join_schedules(schedules, boundaries)


def scale_lr(base_lr: float, global_batch: int, base_batch: int, rule: str = "linear") -> float:
    """``base_lr`` (tuned at ``base_batch``) rescaled for ``global_batch``.

    "linear": ``base_lr * global_batch / base_batch`` (Goyal et al., 2017).
    "sqrt":   ``base_lr * sqrt(global_batch / base_batch)``.
    """
    if rule not in SCALING_RULES:
        raise ValueError(f"scale_lr rule={rule!r} is not a scaling rule; valid rules: {SCALING_RULES}")
    if not _is_real(base_lr) or base_lr <= 0:
        raise ValueError(f"scale_lr base_lr={base_lr!r} must be a finite number > 0")
    for name, value in (("global_batch", global_batch), ("base_batch", base_batch)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"scale_lr {name}={value!r} must be an integer > 0")
    ratio = global_batch / base_batch
    return float(base_lr * (ratio if rule == "linear" else math.sqrt(ratio)))
