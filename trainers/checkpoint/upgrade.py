"""Conversions on load: a step written in an older parameter layout restores into the current one.

A :class:`Conversion` recognises an old layout in a step's stored metadata tree, turns the restore
target (current layout) into the target that step was written with, and turns what was read back
into the current layout. :func:`plan` chains every registered conversion that recognises the step;
the checkpointer calls it once per step it restores. Each conversion applied is logged at info level.
Built in: the GPT's fused projections (``w_k``, ``w_v`` -> ``w_kv``; ``w_gate``, ``w_up`` ->
``w_gate_up``) and a state guard window without ``param_norm0``. Add one with :func:`register`.
See docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Conversion:
    """One old layout -> the current one.

    ``recognises(stored)``: whether the stored metadata tree (nested dicts) holds the old layout;
    ``old_target(abstract)``: the restore target as the old layout stores it (same shardings where
    the arrays agree); ``convert(value)``: what was read with that target, in the current layout
    (applied to whatever the checkpointer read, so it must leave other parts alone).
    """

    name: str
    recognises: Callable[[Any], bool]
    old_target: Callable[[Any], Any]
    convert: Callable[[Any], Any]


_CONVERSIONS: list[Conversion] = []


def register(conversion: Conversion) -> Conversion:
    """Add a conversion that :func:`plan` tries on every step restored (in registration order)."""
    if any(c.name == conversion.name for c in _CONVERSIONS):
        raise ValueError(f"a checkpoint conversion named {conversion.name!r} is already registered")
    _CONVERSIONS.append(conversion)
    return conversion


def plan(stored: Any, abstract: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``(target, finish)``: read the step with ``target``, then ``finish(read value)`` is in the layout of
    ``abstract``. With no conversion recognising ``stored``: ``(abstract, identity)``."""
    applied = [c for c in _CONVERSIONS if c.recognises(stored)]
    target = abstract
    for conversion in applied:
        target = conversion.old_target(target)

    def finish(value: Any) -> Any:
        for conversion in reversed(applied):
            logger.info("checkpoint conversion applied: %s", conversion.name)
            value = conversion.convert(value)
        return value

    return target, finish


# ------------------------------------------------------------------------ helpers for dict layouts
def any_dict(tree: Any, test: Callable[[Mapping[str, Any]], bool]) -> bool:
    """Whether some dict in a nested dict/list/tuple tree passes ``test``."""
    if isinstance(tree, Mapping):
        return test(tree) or any(any_dict(v, test) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(any_dict(v, test) for v in tree)
    return False


def map_dicts(tree: Any, test: Callable[[Any], bool], fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """``tree`` (any pytree) with every dict that passes ``test`` replaced by ``fn(dict)``."""
    def is_match(x: Any) -> bool:
        return isinstance(x, dict) and test(x)

    return jax.tree.map(lambda x: fn(x) if is_match(x) else x, tree, is_leaf=is_match)


def _without_axis(sharding: Any, ndim: int, axis: int) -> Any:
    """``sharding`` of an ``ndim`` array with dim ``axis`` removed (named shardings; others as they are)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    del entries[axis]
    return _named(sharding, entries)


def _with_axis(sharding: Any, ndim: int, axis: int) -> Any:
    """``sharding`` of an ``ndim`` array with an unsharded dim inserted at ``axis``."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    entries = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    entries.insert(axis, None)
    return _named(sharding, entries)


def _named(sharding: NamedSharding, entries: list[Any]) -> NamedSharding:
    while entries and entries[-1] is None:  # the canonical spec, as the toolkit's shardings spell it
        entries.pop()
    return NamedSharding(sharding.mesh, P(*entries), memory_kind=sharding.memory_kind)


def split_target(new: str, olds: tuple[str, ...], axis: int = -2) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """For a dict holding ``new`` (a ShapeDtypeStruct stacking ``olds`` on ``axis``): the dict with the
    ``olds`` in its place, each shaped and sharded as ``new`` without that dim."""
    def fn(d: dict[str, Any]) -> dict[str, Any]:
        leaf = d[new]
        ax = axis % len(leaf.shape)
        shape = leaf.shape[:ax] + leaf.shape[ax + 1:]
        sharding = _without_axis(getattr(leaf, "sharding", None), len(leaf.shape), ax)
        out = {k: v for k, v in d.items() if k != new}
        out.update({o: jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding) for o in olds})
        return out
    return fn


def stack_values(new: str, olds: tuple[str, ...], axis: int = -2) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """For a dict holding ``olds`` (arrays): the dict with them stacked on ``axis`` as ``new``, placed
    as the first of them with an unsharded dim at ``axis``."""
    def fn(d: dict[str, Any]) -> dict[str, Any]:
        parts = [d[o] for o in olds]
        ax = axis % (parts[0].ndim + 1)
        out = {k: v for k, v in d.items() if k not in olds}
        sharding = _with_axis(getattr(parts[0], "sharding", None), parts[0].ndim, ax)
        stack = jax.jit(lambda *p: jnp.stack(p, axis=ax),
                        out_shardings=sharding if isinstance(sharding, NamedSharding) else None)
        out[new] = stack(*parts)
        return out
    return fn


def fuse(name: str, new: str, olds: tuple[str, ...], axis: int = -2) -> Conversion:
    """A conversion of separate parameters ``olds`` (and their optimizer moments, which sit in dicts of
    the same keys) into one ``new`` stacking them on ``axis``."""
    def old_layout(d: Mapping[str, Any]) -> bool:
        return all(o in d for o in olds) and new not in d

    return Conversion(
        name=name,
        recognises=lambda stored: any_dict(stored, old_layout),
        old_target=lambda abstract: map_dicts(abstract, lambda d: new in d, split_target(new, olds, axis)),
        convert=lambda value: map_dicts(value, old_layout, stack_values(new, olds, axis)),
    )


# The GPT before fused projections (spmd.models.layers): w_k, w_v [D, G, K] -> w_kv [D, G, 2, K];
# w_gate, w_up [D, F] -> w_gate_up [D, 2, F] (a leading stacked ``layers`` dim, if any, kept).
FUSED_KV = register(fuse("gpt fused k/v: w_k, w_v -> w_kv", "w_kv", ("w_k", "w_v")))
FUSED_GATE_UP = register(fuse("gpt fused gate/up: w_gate, w_up -> w_gate_up", "w_gate_up", ("w_gate", "w_up")))


# A guard window saved in the state (local SGD keeps one per replica group) before it held
# ``param_norm0`` (trainers.faults.guard): read without it, then NaN, as in a fresh window.
def _window(d: Mapping[str, Any]) -> bool:
    return {"loss", "grad_norm", "count"} <= set(d)


def _add_param_norm0(d: dict[str, Any]) -> dict[str, Any]:
    count = d["count"]
    fill = jax.jit(lambda c: jnp.full(c.shape, jnp.nan, jnp.float32), out_shardings=count.sharding)
    return {**d, "param_norm0": fill(count)}


GUARD_PARAM_NORM = register(Conversion(
    name="guard window without param_norm0",
    recognises=lambda stored: any_dict(stored, lambda d: _window(d) and "param_norm0" not in d),
    old_target=lambda abstract: map_dicts(abstract, lambda d: _window(d) and "param_norm0" in d,
                                          lambda d: {k: v for k, v in d.items() if k != "param_norm0"}),
    convert=lambda value: map_dicts(value, lambda d: _window(d) and "param_norm0" not in d
                                    and isinstance(d["count"], jax.Array), _add_param_norm0),
))
