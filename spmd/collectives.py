"""Explicit collectives for ``shard_map`` code, documented in the scaling book's notation.

Inside ``jax.shard_map`` each device holds one block of every array; these functions move data
between the blocks along named mesh axes. Notation: ``A[I_X, J]`` is an array whose dim I is
sharded over axis X; ``A[I, J]{U_X}`` is an unreduced partial sum over X (each device holds a
summand). The collectives are subscript edits:

=============== ============================== =========================== ==================
function        before                         after                       HLO op
=============== ============================== =========================== ==================
psum            ``A[I, J]{U_X}``               ``A[I, J]``                 all-reduce
pmean           ``A[I, J]{U_X}``               ``A[I, J] / |X|``           all-reduce
all_gather      ``A[I_X, J]``                  ``A[I, J]``                 all-gather
psum_scatter    ``A[I, J]{U_X}``               ``A[I_X, J]``               reduce-scatter
all_to_all      ``A[I_X, J]``                  ``A[I, J_X]``               all-to-all
ppermute        ``A[I_X]`` block on device i   block moves to perm(i)      collective-permute
=============== ============================== =========================== ==================

Costs on a ring of n devices with per-link bandwidth W, for an array of V bytes in total:
all-gather and reduce-scatter move ``V (n-1)/n`` bytes per device (~V/W time), all-reduce twice
that (a reduce-scatter followed by an all-gather), all-to-all about a quarter of all-gather on a
bidirectional ring, and ppermute one block per device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax

AxisName = str | tuple[str, ...]


def psum(x: jax.Array, axis: AxisName) -> jax.Array:
    """All-reduce (sum): ``A[I]{U_X} -> A[I]``. Every device ends with the sum of all blocks."""
    return lax.psum(x, axis)


def pmean(x: jax.Array, axis: AxisName) -> jax.Array:
    """All-reduce (mean): ``A[I]{U_X} -> A[I] / |X|``, e.g. averaging data-parallel gradients."""
    return lax.pmean(x, axis)


def all_gather(x: jax.Array, axis: AxisName, *, dim: int = 0, tiled: bool = True, invariant: bool = False) -> jax.Array:
    """All-gather: ``A[I_X, J] -> A[I, J]`` along tensor dim ``dim``.

    ``tiled=True`` concatenates the blocks (shape grows |X|-fold along ``dim``); ``tiled=False``
    stacks them in a new dim of size |X| inserted at position ``dim``. ``invariant=True`` marks the
    result as identical on every device of X, which ``out_specs=P()`` needs under shard_map's
    replication checking.
    """
    return lax.all_gather(x, axis, axis=dim, tiled=tiled, to="invarying" if invariant else "varying")


def psum_scatter(x: jax.Array, axis: AxisName, *, dim: int = 0) -> jax.Array:
    """Reduce-scatter: ``A[I, J]{U_X} -> A[I_X, J]``: sum over X, each device keeps its block of ``dim``.

    Half an all-reduce; what FSDP does with weight gradients.
    """
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def all_to_all(x: jax.Array, axis: AxisName, *, split_dim: int, concat_dim: int) -> jax.Array:
    """All-to-all: ``A[I_X, J] -> A[I, J_X]`` moves the sharding from ``concat_dim`` to ``split_dim``.

    ``split_dim`` is cut into |X| blocks sent one to each device; the received blocks are
    concatenated along ``concat_dim`` (the dim that was sharded). Used for MoE dispatch and for
    switching between sequence and head sharding.
    """
    return lax.all_to_all(x, axis, split_axis=split_dim, concat_axis=concat_dim, tiled=True)


def ppermute(x: jax.Array, axis: str, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """Collective permute: the block on axis index ``src`` goes to ``dst`` for each (src, dst).

    Devices that receive nothing get zeros. Pipelines pass activations between stages this way.
    """
    return lax.ppermute(x, axis, perm=list(perm))


def shift(x: jax.Array, axis: str, size: int, *, offset: int = 1, wrap: bool = True) -> jax.Array:
    """ppermute by ``offset`` positions along an axis of ``size`` devices (ring when ``wrap``)."""
    if wrap:
        perm = [(i, (i + offset) % size) for i in range(size)]
    else:
        perm = [(i, i + offset) for i in range(size) if 0 <= i + offset < size]
    return ppermute(x, axis, perm)


def axis_index(axis: str) -> jax.Array:
    """This device's position along ``axis`` (0 .. |axis|-1)."""
    return lax.axis_index(axis)
