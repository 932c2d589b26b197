"""Packed documents: segment ids, which keys a query may see, and which attention blocks can be skipped.

A row of ``L`` tokens may hold several documents, told apart by ``segment_ids[B, L]`` (int32; the
packer numbers a row's documents 1, 2, ... and its padding ``L + 1`` (:func:`padding_id`), weight 0: ids
never decrease along a row, which keeps the block ranges tight; see trainers.data.packing). A query
attends only to keys of its own segment (and, causally, not later ones); positions restart at 0 in
every document (``positions[B, L]``, RoPE reads them). Nothing here communicates: the block table
is computed from the segment ids the device holds (under GSPMD, an ``any`` over the batch rows).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd.collectives import varying_axes

PAD_SEGMENT = -1  # the segment of positions the blockwise path pads a length with (never a packer id)


def padding_id(length: int) -> int:
    """The segment id of a row's padding: ``length + 1``, above every document's (1 .. length)."""
    return length + 1


def same_segment(seg_q_BQ: jax.Array, seg_k_BS: jax.Array) -> jax.Array:
    """``visible[B, Q, S]``: query q and key s are in the same segment."""
    return seg_q_BQ[:, :, None] == seg_k_BS[:, None, :]


def _block_ranges(seg_BL: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    b, length = seg_BL.shape
    seg_BNS = seg_BL.reshape(b, length // size, size)
    return seg_BNS.min(-1), seg_BNS.max(-1)


def block_table(seg_q_BL: jax.Array, seg_k_BL: jax.Array, size: int) -> jax.Array:
    """``needed[nq, nk]`` (bool): query block i and key block j share a segment id range in some row.

    Disjoint ranges ``[min, max]`` cannot share an id, so a pair marked False is fully masked in
    every row and is skipped; a pair marked True may still be fully masked (the test is by range)."""
    lo_q, hi_q = _block_ranges(seg_q_BL, size)
    lo_k, hi_k = _block_ranges(seg_k_BL, size)
    overlap_BQK = (lo_q[:, :, None] <= hi_k[:, None, :]) & (lo_k[:, None, :] <= hi_q[:, :, None])
    return overlap_BQK.any(axis=0)


def skipping(body: Callable, needed: jax.Array, i: jax.Array) -> Callable:
    """A ``fori_loop`` body over ``j`` that runs ``body`` only where ``needed[i, j]``."""

    def run(j, acc):
        types = jax.eval_shape(body, j, acc)  # inside shard_map the body's outputs may vary over more axes
        skip = lambda j, acc: jax.tree.map(_vary_like, acc, types)
        return lax.cond(needed[i, j], body, skip, j, acc)

    return run


def _vary_like(a: jax.Array, t) -> jax.Array:
    """``a`` cast to vary over the manual axes ``t`` (an output type) varies over."""
    missing = tuple(sorted(varying_axes(t) - varying_axes(jax.typeof(a))))
    return lax.pcast(a, missing, to="varying") if missing else a


def skipped(segment_ids: jax.Array, block: int) -> jax.Array:
    """The fraction (f32 scalar, traceable) of causal block pairs (key block <= query block) the
    blockwise path skips for ``segment_ids[B, L]`` with blocks of ``block`` positions (padded as the
    attention pads)."""
    length = segment_ids.shape[1]
    n = -(-length // block)
    size = -(-length // n)
    seg = jnp.pad(jnp.asarray(segment_ids), ((0, 0), (0, n * size - length)), constant_values=PAD_SEGMENT)
    causal = jnp.tril(jnp.ones((n, n), dtype=bool))
    needed = block_table(seg, seg, size) & causal
    return 1.0 - needed.sum() / causal.sum()


def skipped_fraction(segment_ids: np.ndarray, block: int) -> float:
    """:func:`skipped` as a Python float."""
    return float(skipped(jnp.asarray(segment_ids), block))


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """``positions[B, L]``: each token's index within its segment (restarting at every change of id)."""
    seg = np.asarray(segment_ids)
    b, length = seg.shape
    idx = np.broadcast_to(np.arange(length), (b, length))
    start = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    first = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    return (idx - first).astype(np.int32)
