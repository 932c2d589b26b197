"""The optimizer chain: clip by global norm, then one optimizer with masked weight decay.

``make_optimizer`` returns ``chain(clip_by_global_norm(clip_norm), <optimizer>(schedule,
weight_decay, mask=decay_mask))`` for ``adamw``, ``sgd``, ``adafactor``, ``lamb`` or ``lars``; the
optimizer state takes the params' shardings. See docs/training.md.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

import spmd

__all__ = [
    "DEFAULT_NO_DECAY",
    "OPTIMIZER_NAMES",
    "OptimizerConfig",
    "decay_mask",
    "global_norm",
    "key_path_str",
    "make_optimizer",
]

OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "sgd", "adafactor", "lamb", "lars")

# Regexes searched (re.search) in the '/'-joined key path of each parameter.
DEFAULT_NO_DECAY: tuple[str, ...] = (
    r"(?<!un)embed",  # embed, embedding, token_embed, pos_embedding; not an "unembed" projection
    r"(^|/|_)bias(/|$)",  # bias, attn/out/bias, ln1_bias
    r"(^|/|_)scale(/|$)",  # norm/scale, ln1_scale (2-D once stacked over layers)
)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _compile_patterns(patterns: Any, where: str) -> tuple[re.Pattern[str], ...]:
    if isinstance(patterns, str) or not isinstance(patterns, (tuple, list)):
        raise ValueError(f"{where}={patterns!r} must be a tuple of regex strings, e.g. {DEFAULT_NO_DECAY}")
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"{where} entry {pattern!r} is not a string; patterns are regexes like {r'(^|/)bias$'!r}")
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"{where} entry {pattern!r} is not a valid regex: {err}") from None
    return tuple(compiled)


@dataclass(frozen=True)
class OptimizerConfig:
    """Which optimizer, its hyperparameters, clipping and what escapes weight decay.

    Attributes:
      name: "adamw" | "sgd" | "adafactor" | "lamb" | "lars".
      b1, b2: first/second moment decay (adamw, lamb), each in [0, 1).
      eps: denominator epsilon (adamw, lamb, lars trust ratio), > 0.
      weight_decay: decay coefficient >= 0 (0 = none).
      momentum: momentum in [0, 1) (sgd, lars; 0 = plain SGD).
      clip_norm: clip gradients to this global L2 norm (> 0); None = no clipping.
      no_decay: regexes for '/'-joined key paths never decayed (on top of the
        ``ndim <= 1`` rule).
    """

    name: str = "adamw"
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9
    clip_norm: float | None = 1.0
    no_decay: tuple[str, ...] = DEFAULT_NO_DECAY

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"OptimizerConfig.name={self.name!r} is not an optimizer; valid names: {OPTIMIZER_NAMES}")
        for field in ("b1", "b2", "momentum"):
            value = getattr(self, field)
            if not _is_real(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"OptimizerConfig.{field}={value!r} must be a number in [0, 1)")
        if not _is_real(self.eps) or self.eps <= 0:
            raise ValueError(f"OptimizerConfig.eps={self.eps!r} must be a finite number > 0")
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay={self.weight_decay!r} must be a finite number >= 0")
        if self.clip_norm is not None and (not _is_real(self.clip_norm) or self.clip_norm <= 0):
            raise ValueError(f"OptimizerConfig.clip_norm={self.clip_norm!r} must be a number > 0, or None for no clipping")
        _compile_patterns(self.no_decay, "OptimizerConfig.no_decay")
        if isinstance(self.no_decay, list):  # accept a list from overrides, store the hashable tuple
            object.__setattr__(self, "no_decay", tuple(self.no_decay))


def key_path_str(path: tuple[Any, ...]) -> str:
    """'/'-joined names of a ``jax.tree_util`` key path, e.g. ``"layers/mlp/w_in"`` (every part kept)."""
    return spmd.sharding.path_str(path, drop=())


def _ndim(leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)  # arrays, tracers and jax.ShapeDtypeStruct all have one
    return len(shape) if shape is not None else int(np.ndim(leaf))


def decay_mask(params: Any, patterns: tuple[str, ...] = DEFAULT_NO_DECAY) -> Any:
    """Tree like ``params`` with True where weight decay applies.

    False for leaves with ``ndim <= 1`` and for leaves whose '/'-joined key path
    matches any regex in ``patterns`` (``re.search``). Reads only shapes and
    paths, so ``params`` may hold arrays, tracers or ``jax.ShapeDtypeStruct``.
    """
    compiled = _compile_patterns(patterns, "decay_mask patterns")

    def decays(path: tuple[Any, ...], leaf: Any) -> bool:
        if _ndim(leaf) <= 1:
            return False
        name = key_path_str(path)
        return not any(p.search(name) for p in compiled)

    return jax.tree_util.tree_map_with_path(decays, params)


def global_norm(tree: Any) -> jax.Array:
    """L2 norm over every leaf of ``tree``: the quantity ``clip_norm`` bounds (log it pre-clip)."""
    return optax.tree.norm(tree)


def _adafactor(lr: optax.ScalarOrSchedule, weight_decay: float, mask: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Adafactor with LR-scaled decoupled weight decay (see the module docstring)."""
    parts = [
        optax.scale_by_factored_rms(),
        optax.clip_by_block_rms(1.0),
        optax.scale_by_param_block_rms(),
    ]
    if weight_decay > 0:
        parts.append(optax.add_decayed_weights(weight_decay, mask=mask))
    parts.append(optax.scale_by_learning_rate(lr))
    return optax.chain(*parts)


def _sgd(lr: optax.ScalarOrSchedule, momentum: float, weight_decay: float, mask: Callable[[Any], Any]) -> optax.GradientTransformation:
    sgd = optax.sgd(lr, momentum=momentum if momentum > 0 else None)
    if weight_decay == 0:
        return sgd
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=mask), sgd)


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule | float) -> optax.GradientTransformation:
    """``chain(clip_by_global_norm, optimizer)`` as configured, with LR ``schedule``.

    ``schedule`` is an ``optax.Schedule`` (``trainers.lr.make_schedule``)
    or a constant LR >= 0. The weight-decay mask is ``decay_mask(.., cfg.no_decay)``
    evaluated on whatever tree ``init``/``update`` receive.
    """
    if not isinstance(cfg, OptimizerConfig):
        raise ValueError(f"make_optimizer expects an OptimizerConfig, got {type(cfg).__name__}: {cfg!r}")
    if not callable(schedule) and not (_is_real(schedule) and schedule >= 0):
        raise ValueError(f"make_optimizer schedule={schedule!r} must be an optax.Schedule (step -> lr) or a number >= 0")
    mask = functools.partial(decay_mask, patterns=cfg.no_decay)
    wd = float(cfg.weight_decay)
    if cfg.name == "adamw":
        opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask)
    elif cfg.name == "sgd":
        opt = _sgd(schedule, cfg.momentum, wd, mask)
    elif cfg.name == "adafactor":
        opt = _adafactor(schedule, wd, mask)
    elif cfg.name == "lamb":
        opt = optax.lamb(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd, mask=mask)
    else:  # lars
        opt = optax.lars(
            schedule, weight_decay=wd, weight_decay_mask=mask, trust_ratio_mask=mask, eps=cfg.eps, momentum=cfg.momentum
        )
    if cfg.clip_norm is None:
        return opt
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)
