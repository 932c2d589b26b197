"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD.

A schedule is a plain ``optax.Schedule`` (a function ``step -> lr``), so the
same object drives the optimizer and the ``lr`` metric the train step logs.
Every kind starts with a linear warmup from 0 to ``peak_lr`` over
``warmup_steps``; what follows the warmup is the only thing that differs:

- cosine:   half a cosine from peak down to the end LR at ``total_steps``;
- linear:   a straight line from peak down to the end LR at ``total_steps``;
- constant: stays at peak;
- wsd:      warmup-stable-decay: stays at peak, then a straight line down to
            the end LR over the last ``decay_fraction`` of ``total_steps``.

``end lr = peak_lr * end_lr_fraction`` for the decaying kinds. Step ``s`` means
"the LR used for the update that produces step ``s + 1``", so step 0 is 0 when
there is warmup, step ``warmup_steps`` is the peak and step ``total_steps`` is
the end LR; steps past ``total_steps`` hold the end LR.

The pieces are optax building blocks glued with ``optax.join_schedules``, which
hands each piece the step counted from its own start.
(``optax.warmup_cosine_decay_schedule`` would give the cosine kind too, but its
``decay_steps`` includes the warmup, which is easy to get wrong; here
``total_steps`` always means the whole run.)

``scale_lr`` adapts a base LR tuned at one global batch size to another: the
linear rule of Goyal et al. (2017) for SGD-like large-batch training, or the
square-root rule often preferred for Adam-family optimizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import optax

__all__ = ["SCHEDULE_KINDS", "SCALING_RULES", "ScheduleConfig", "make_schedule", "scale_lr"]

SCHEDULE_KINDS: tuple[str, ...] = ("cosine", "linear", "constant", "wsd")
SCALING_RULES: tuple[str, ...] = ("linear", "sqrt")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ScheduleConfig:
    """What the LR does over a run of ``total_steps`` optimizer steps.

    Attributes:
      kind: "cosine" | "linear" | "constant" | "wsd" (warmup-stable-decay).
      peak_lr: LR at the end of warmup (> 0).
      warmup_steps: steps of linear warmup from 0 to ``peak_lr`` (0 = none).
      total_steps: length of the whole run, warmup included (> 0).
      end_lr_fraction: final LR as a fraction of ``peak_lr`` (cosine, linear,
        wsd); ignored by "constant".
      decay_fraction: wsd only: the last ``decay_fraction * total_steps`` steps
        (rounded to an integer) decay linearly from peak to the end LR.
    """

    kind: str = "cosine"
    peak_lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    end_lr_fraction: float = 0.1
    decay_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"ScheduleConfig.kind={self.kind!r} is not a schedule kind; valid kinds: {SCHEDULE_KINDS}")
        if not _is_real(self.peak_lr) or self.peak_lr <= 0:
            raise ValueError(f"ScheduleConfig.peak_lr={self.peak_lr!r} must be a finite number > 0")
        if not _is_int(self.total_steps) or self.total_steps <= 0:
            raise ValueError(f"ScheduleConfig.total_steps={self.total_steps!r} must be an integer > 0")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"ScheduleConfig.warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"ScheduleConfig.warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}; "
                "warmup must fit inside the run (0 <= warmup_steps <= total_steps)"
            )
        if not _is_real(self.end_lr_fraction) or not 0.0 <= self.end_lr_fraction <= 1.0:
            raise ValueError(f"ScheduleConfig.end_lr_fraction={self.end_lr_fraction!r} must be in [0, 1]")
        if not _is_real(self.decay_fraction) or not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"ScheduleConfig.decay_fraction={self.decay_fraction!r} must be in [0, 1]")
        if self.kind == "wsd" and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"ScheduleConfig: wsd warmup_steps={self.warmup_steps} + decay steps {self.decay_steps} "
                f"(decay_fraction={self.decay_fraction} of total_steps={self.total_steps}) exceed total_steps; "
                "lower warmup_steps or decay_fraction"
            )

    @property
    def end_lr(self) -> float:
        """The LR at ``total_steps`` (``peak_lr`` for the constant kind)."""
        return self.peak_lr if self.kind == "constant" else self.peak_lr * self.end_lr_fraction

    @property
    def decay_steps(self) -> int:
        """Steps of the final linear decay of the wsd kind."""
        return int(round(self.decay_fraction * self.total_steps))


def _decay_after_warmup(cfg: ScheduleConfig) -> tuple[list[optax.Schedule], list[int]]:
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


def make_schedule(cfg: ScheduleConfig) -> optax.Schedule:
    """The schedule described by ``cfg``: linear warmup 0 -> peak, then ``cfg.kind``."""
    if not isinstance(cfg, ScheduleConfig):
        raise ValueError(f"make_schedule expects a ScheduleConfig, got {type(cfg).__name__}: {cfg!r}")
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
