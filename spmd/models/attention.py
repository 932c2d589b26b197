"""Causal attention kernels: ``attend(q, k, v, impl=...)``, one function, several implementations.

``q[B, L, H, K]``, ``k, v[B, L, G, K]`` (grouped KV heads), RoPE applied; returns ``out[B, L, H, K]``.
Implementations: ``naive``, ``xla``, ``cudnn``, ``blockwise`` (flash attention in plain JAX, memory
linear in L) and ``auto``. What each keeps in memory: docs/memory.md. ``segment_ids[B, L]`` (packed
documents, :mod:`spmd.models.segments`): a query sees only keys of its own segment; blockwise skips
block pairs that share no segment.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from spmd.collectives import varying_like
from spmd.models import segments

IMPLS = ("auto", "naive", "xla", "cudnn", "blockwise")
# auto with segment ids (packed rows): cuDNN takes them as a [B, 1, L, L] mask. Up to this length that is
# faster than the blockwise flash (an H100 at L 4096, 32/8 heads of 64, fwd + bwd: 0.26x the time,
# benchmarks/RESULTS.md gpu_train); past it the mask's L^2 memory grows and blockwise is taken.
CUDNN_SEGMENTS_UP_TO = 4096
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128


def naive(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Scores materialised whole: ``softmax(q k^T / sqrt(K) + causal [+ same segment]) v``."""
    b, l, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(b, l, g, h // g, k)
    scores_BGRLL = jnp.einsum("bqgrk,bsgk->bgrqs", q_BLGRK, k_BLGK).astype(jnp.float32) * k**-0.5
    causal_LL = jnp.tril(jnp.ones((l, l), dtype=bool))
    if segment_ids is not None:
        causal_LL = causal_LL & segments.same_segment(segment_ids, segment_ids)[:, None, None]
    scores_BGRLL = jnp.where(causal_LL, scores_BGRLL, jnp.finfo(jnp.float32).min)
    probs_BGRLL = jax.nn.softmax(scores_BGRLL, axis=-1).astype(q_BLHK.dtype)
    out_BLGRK = jnp.einsum("bgrqs,bsgk->bqgrk", probs_BGRLL, v_BLGK)
    return out_BLGRK.reshape(b, l, h, k)


def xla(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` with XLA's implementation (scores materialised)."""
    mask = None if segment_ids is None else segments.same_segment(segment_ids, segment_ids)[:, None]
    return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask, is_causal=True, implementation="xla")


def cudnn_unsupported(q_BLHK: jax.Array, k_BLGK: jax.Array) -> str | None:
    """Why cuDNN flash attention cannot run these inputs here (None: it can)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return f"it needs a GPU and the backend is {backend!r}"
    if q_BLHK.dtype not in CUDNN_DTYPES or k_BLGK.dtype != q_BLHK.dtype:
        return f"it takes bfloat16 or float16 q/k/v, got {q_BLHK.dtype} and {k_BLGK.dtype}"
    head_dim = q_BLHK.shape[-1]
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 8 and <= {CUDNN_MAX_HEAD_DIM}, got {head_dim}"
    return None


def cudnn(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention`` with cuDNN's fused flash attention (GPU only; segments as a mask bias)."""
    reason = cudnn_unsupported(q_BLHK, k_BLGK)
    if reason is not None:
        raise ValueError(f"attention implementation 'cudnn' cannot run: {reason}; "
                         f"use 'auto', 'blockwise', 'xla' or 'naive'")
    mask = None if segment_ids is None else segments.same_segment(segment_ids, segment_ids)[:, None]
    return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask, is_causal=True, implementation="cudnn")


# ------------------------------------------------------------------------------------ blockwise
def block_layout(length: int, block: int) -> tuple[int, int]:
    """``(n, size)``: the blockwise path's blocks for ``length`` positions (see the module docstring)."""
    if block < 1:
        raise ValueError(f"attention block must be >= 1, got {block}")
    n = -(-length // block)
    return n, -(-length // n)


def blockwise(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, block: int = 512,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """Flash attention in plain JAX: memory linear in L, forward and backward. With ``segment_ids``
    a block pair that shares no segment in any row is skipped (``segments.block_table``)."""
    b, l, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    n, size = block_layout(l, block)
    pad = n * size - l
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q_BLHK, k_BLGK, v_BLGK = (jnp.pad(x, widths) for x in (q_BLHK, k_BLGK, v_BLGK))
        if segment_ids is not None:  # padded positions: a segment of their own, after the last
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=segments.PAD_SEGMENT)
    q_BLGRK = q_BLHK.reshape(b, n * size, g, h // g, k)
    if segment_ids is None:
        out_BLGRK = _flash(q_BLGRK, k_BLGK, v_BLGK, size)
    else:
        seg = (segment_ids, segment_ids, segments.block_table(segment_ids, segment_ids, size))
        out_BLGRK = _flash_segments(q_BLGRK, k_BLGK, v_BLGK, seg, size)
    return out_BLGRK.reshape(b, n * size, h, k)[:, :l]


def _tile(x: jax.Array, i: jax.Array, size: int) -> jax.Array:
    """Block ``i`` (``size`` positions) of the length dim (dim 1)."""
    return lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _put(x: jax.Array, tile: jax.Array, i: jax.Array, size: int) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(x, tile.astype(x.dtype), i * size, axis=1)


def _scores(q_BQGRK: jax.Array, k_BSGK: jax.Array, i: jax.Array, j: jax.Array, size: int,
            causal: bool = True, seg: tuple | None = None) -> jax.Array:
    """Scaled f32 scores ``[B, G, R, Q, S]`` of query block ``i`` against key block ``j``, causally
    masked (``causal=False``: every key visible) and, with ``seg = (seg_q[B, Lq], seg_k[B, Lk], ...)``,
    masked to keys of the query's segment."""
    s = jnp.einsum("bqgrk,bsgk->bgrqs", q_BQGRK, k_BSGK, preferred_element_type=jnp.float32)
    s = s * q_BQGRK.shape[-1] ** -0.5
    if seg is not None:
        same_BQS = segments.same_segment(_tile(seg[0], i, size), _tile(seg[1], j, size))
        s = jnp.where(same_BQS[:, None, None], s, jnp.finfo(jnp.float32).min)
    if not causal:
        return s
    q_pos = i * size + lax.broadcasted_iota(jnp.int32, (size, size), 0)
    k_pos = j * size + lax.broadcasted_iota(jnp.int32, (size, size), 1)
    return jnp.where(q_pos >= k_pos, s, jnp.finfo(jnp.float32).min)


def block_forward(q_BLGRK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, size: int,
                  causal: bool = True, seg: tuple | None = None) -> tuple[jax.Array, jax.Array]:
    """``(out[B, L, G, R, K], lse[B, G, R, L] f32)`` by online softmax over key blocks of ``size``
    (``causal=False``: q and k are different spans, every key visible; used by context parallelism).
    ``seg = (seg_q[B, Lq], seg_k[B, Lk], needed[nq, nk])``: segment masking, and block pairs not
    ``needed`` skipped (a row no key of which is visible gets out 0, lse -inf)."""
    b, l, g, r, k = q_BLGRK.shape
    n, nk = l // size, k_BLGK.shape[1] // size
    low = jnp.finfo(jnp.float32).min

    def query_block(i, carry):
        out_BLGRK, lse_BGRL = carry
        q_i = _tile(q_BLGRK, i, size)

        def key_block(j, acc):
            m_BGRQ, sum_BGRQ, o_BGRQK = acc
            s = _scores(q_i, _tile(k_BLGK, j, size), i, j, size, causal, seg)
            m_new = jnp.maximum(m_BGRQ, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            if seg is not None:  # a masked score is 0, also in a row that has seen no visible key yet
                p = jnp.where(s > low, p, 0.0)
            rescale = jnp.exp(m_BGRQ - m_new)
            pv = jnp.einsum("bgrqs,bsgk->bgrqk", p.astype(v_BLGK.dtype), _tile(v_BLGK, j, size),
                            preferred_element_type=jnp.float32)
            return m_new, sum_BGRQ * rescale + p.sum(axis=-1), o_BGRQK * rescale[..., None] + pv

        init = (jnp.full((b, g, r, size), low, jnp.float32), jnp.zeros((b, g, r, size), jnp.float32),
                jnp.zeros((b, g, r, size, k), jnp.float32))
        init = tuple(varying_like(a, q_BLGRK, k_BLGK, v_BLGK) for a in init)  # inside a shard_map: vary as q/k/v
        if seg is not None:
            key_block = segments.skipping(key_block, seg[2], i)
        m_BGRQ, sum_BGRQ, o_BGRQK = lax.fori_loop(0, i + 1 if causal else nk, key_block, init)  # causal: j <= i
        if seg is None:
            o_BQGRK = jnp.transpose(o_BGRQK / sum_BGRQ[..., None], (0, 3, 1, 2, 4))
            lse_BGRQ = m_BGRQ + jnp.log(sum_BGRQ)
        else:  # rows that saw no visible key: out 0, lse -inf (they merge away under context parallelism)
            seen = sum_BGRQ > 0
            o_BQGRK = jnp.transpose(o_BGRQK / jnp.where(seen, sum_BGRQ, 1.0)[..., None], (0, 3, 1, 2, 4))
            lse_BGRQ = jnp.where(seen, m_BGRQ + jnp.log(jnp.where(seen, sum_BGRQ, 1.0)), -jnp.inf)
        return _put(out_BLGRK, o_BQGRK, i, size), lax.dynamic_update_slice_in_dim(lse_BGRL, lse_BGRQ, i * size, axis=3)

    init = (jnp.zeros(q_BLGRK.shape, q_BLGRK.dtype), jnp.zeros((b, g, r, l), jnp.float32))
    return lax.fori_loop(0, n, query_block, tuple(varying_like(a, q_BLGRK, k_BLGK, v_BLGK) for a in init))


def block_backward(size: int, residuals: tuple, dout_BLGRK: jax.Array,
                   causal: bool = True, seg: tuple | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """FlashAttention-2 backward: probabilities recomputed per block from the saved log-sum-exp.

    ``residuals = (q, k, v, out, lse)``; ``out`` and ``lse`` may be those of a longer attention that
    this span is part of (context parallelism), so each span's gradient is its exact share."""
    q_BLGRK, k_BLGK, v_BLGK, out_BLGRK, lse_BGRL = residuals
    l, k = q_BLGRK.shape[1], q_BLGRK.shape[-1]
    n, scale = l // size, k**-0.5
    nk = k_BLGK.shape[1] // size
    # D = rowsum(dO * O): the softmax Jacobian's diagonal term, one f32 per query row.
    delta_BGRL = jnp.einsum("blgrk,blgrk->bgrl", dout_BLGRK.astype(jnp.float32), out_BLGRK.astype(jnp.float32))

    def key_block(j, carry):
        dq_BLGRK, dk_BLGK, dv_BLGK = carry
        k_j, v_j = _tile(k_BLGK, j, size), _tile(v_BLGK, j, size)

        def query_block(i, acc):
            dq_BLGRK, dk_SGK, dv_SGK = acc
            q_i, do_i = _tile(q_BLGRK, i, size), _tile(dout_BLGRK, i, size)
            lse_i = lax.dynamic_slice_in_dim(lse_BGRL, i * size, size, axis=3)
            delta_i = lax.dynamic_slice_in_dim(delta_BGRL, i * size, size, axis=3)
            p = jnp.exp(_scores(q_i, k_j, i, j, size, causal, seg) - lse_i[..., None])
            dv_SGK = dv_SGK + jnp.einsum("bgrqs,bqgrk->bsgk", p.astype(do_i.dtype), do_i,
                                         preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqgrk,bsgk->bgrqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q_i.dtype)
            dq_i = jnp.einsum("bgrqs,bsgk->bqgrk", ds, k_j, preferred_element_type=jnp.float32)
            dq_BLGRK = _put(dq_BLGRK, _tile(dq_BLGRK, i, size) + dq_i, i, size)
            dk_SGK = dk_SGK + jnp.einsum("bgrqs,bqgrk->bsgk", ds, q_i, preferred_element_type=jnp.float32)
            return dq_BLGRK, dk_SGK, dv_SGK

        zeros = varying_like(jnp.zeros(k_j.shape, jnp.float32), *residuals, dout_BLGRK)
        acc = (dq_BLGRK, zeros, zeros)
        if seg is not None:
            query_block = segments.skipping(query_block, seg[2].T, j)
        dq_BLGRK, dk_j, dv_j = lax.fori_loop(j if causal else 0, n, query_block, acc)
        return dq_BLGRK, _put(dk_BLGK, dk_j, j, size), _put(dv_BLGK, dv_j, j, size)

    init = (jnp.zeros(q_BLGRK.shape, jnp.float32), jnp.zeros(k_BLGK.shape, jnp.float32),
            jnp.zeros(v_BLGK.shape, jnp.float32))
    dq, dk, dv = lax.fori_loop(0, nk, key_block, tuple(varying_like(a, *residuals, dout_BLGRK) for a in init))
    return dq.astype(q_BLGRK.dtype), dk.astype(k_BLGK.dtype), dv.astype(v_BLGK.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BLGRK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, size: int) -> jax.Array:
    return block_forward(q_BLGRK, k_BLGK, v_BLGK, size)[0]


def _flash_fwd(q_BLGRK, k_BLGK, v_BLGK, size):
    out_BLGRK, lse_BGRL = block_forward(q_BLGRK, k_BLGK, v_BLGK, size)
    return out_BLGRK, (q_BLGRK, k_BLGK, v_BLGK, out_BLGRK, lse_BGRL)


_flash.defvjp(_flash_fwd, block_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash_segments(q_BLGRK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, seg: tuple, size: int) -> jax.Array:
    return block_forward(q_BLGRK, k_BLGK, v_BLGK, size, seg=seg)[0]


def _flash_segments_fwd(q_BLGRK, k_BLGK, v_BLGK, seg, size):
    out_BLGRK, lse_BGRL = block_forward(q_BLGRK, k_BLGK, v_BLGK, size, seg=seg)
    return out_BLGRK, ((q_BLGRK, k_BLGK, v_BLGK, out_BLGRK, lse_BGRL), seg)


def _flash_segments_bwd(size, residuals, dout_BLGRK):
    res, seg = residuals
    return (*block_backward(size, res, dout_BLGRK, seg=seg), None)


_flash_segments.defvjp(_flash_segments_fwd, _flash_segments_bwd)


# ------------------------------------------------------------------------------------ dispatch
def resolve(impl: str, q_BLHK: jax.Array, k_BLGK: jax.Array, block: int = 512) -> str:
    """The implementation ``attend`` runs for ``impl`` on these inputs (``auto`` made concrete)."""
    if impl not in IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not one of {IMPLS}")
    if impl != "auto":
        return impl
    if cudnn_unsupported(q_BLHK, k_BLGK) is None:
        return "cudnn"
    return "blockwise" if q_BLHK.shape[1] > block else "naive"


def attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, *, impl: str = "auto", block: int = 512,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention of ``q`` over ``k, v`` with the implementation ``impl`` (see the module docstring);
    with ``segment_ids[B, L]`` a query attends only to keys of its own segment (packed documents), and
    ``auto`` picks cuDNN (segments as a mask) only up to :data:`CUDNN_SEGMENTS_UP_TO` positions."""
    chosen = resolve(impl, q_BLHK, k_BLGK, block)
    if segment_ids is None:
        if chosen == "blockwise":
            return blockwise(q_BLHK, k_BLGK, v_BLGK, block)
        return {"naive": naive, "xla": xla, "cudnn": cudnn}[chosen](q_BLHK, k_BLGK, v_BLGK)
    if impl == "auto" and chosen == "cudnn" and q_BLHK.shape[1] > CUDNN_SEGMENTS_UP_TO:  # the L^2 mask: flash
        chosen = "blockwise" if q_BLHK.shape[1] > block else "naive"
    if chosen == "blockwise":
        return blockwise(q_BLHK, k_BLGK, v_BLGK, block, segment_ids)
    return {"naive": naive, "xla": xla, "cudnn": cudnn}[chosen](q_BLHK, k_BLGK, v_BLGK, segment_ids)
