"""Context parallelism: causal attention with the sequence split over the ``seq`` axis.

With ``seq`` = n, the length is cut into 2n chunks and shard i holds chunks i and 2n-1-i
(:func:`balanced_positions`): every shard then has the same causal work. K/V reach every shard
either around a ring (``exchange="ring"``: n-1 ``ppermute`` hops of the local ``[B, L/n, G, K]``
K and V, each overlapping the attention of the block already there) or by one all-gather
(``exchange="allgather"``: ``K[B, L_seq, G, K] -> K[B, L, G, K]``, the whole K/V held per device).
Both move (n-1)/n of K/V per device in the forward pass; the backward sends K/V again and the dK/dV
partial sums home (ring: n-1 hops with K/V + one more; all-gather: a reduce-scatter). Attention
per block is the flash kernel of spmd.models.attention. See docs/context.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd.constraints import active_layout
from spmd.models import attention, segments
from spmd.models.attention import block_backward, block_forward, blockwise
from spmd.rules import axes_of

EXCHANGES = ("ring", "allgather")


def balanced_positions(length: int, n: int) -> np.ndarray:
    """Global position of each stored index: shard i's ``length / n`` slots hold chunks i, 2n-1-i."""
    if length % (2 * n):
        raise ValueError(f"context parallelism over seq={n} needs the length divisible by 2 x seq = {2 * n}, "
                         f"got length {length}; valid lengths are multiples of {2 * n}")
    c = length // (2 * n)
    chunks = [x for i in range(n) for x in (i, 2 * n - 1 - i)]
    return np.concatenate([np.arange(ch * c, (ch + 1) * c) for ch in chunks]).astype(np.int32)


def seq_shards(axis: str = "seq") -> int:
    """How many ways the active layout splits the length (1: no context parallelism): the size of
    ``axis`` when the rule set maps activation ``length`` to it, or when an enclosing region (a pipeline's)
    is manual over it: the length arrives split, each device holding its own shard."""
    active = active_layout()
    if active is None:
        return 1
    mesh, rules = active
    if not _manual(mesh, axis) and axis not in axes_of(dict(rules.activations).get("length")):
        return 1
    return dict(mesh.shape).get(axis, 1)


def _manual(mesh: Mesh, axis: str) -> bool:
    return axis in mesh.abstract_mesh.manual_axes


def length_is_manual(axis: str = "seq") -> bool:
    """Whether an enclosing region (a pipeline's) is manual over ``axis`` with the length split over it: the
    arrays in hand are this device's shard of every row, already in :func:`sequence_order`."""
    active = active_layout()
    return active is not None and _manual(active[0], axis) and dict(active[0].shape).get(axis, 1) > 1


def sum_over_length(x: jax.Array, axis: str = "seq") -> jax.Array:
    """``x`` summed over the shards of the length when they are held apart (:func:`length_is_manual`), so
    that a per-row sum of this device's positions becomes the whole row's; ``x`` itself otherwise."""
    return jax.lax.psum(x, axis) if length_is_manual(axis) else x


def sequence_order(length: int) -> np.ndarray | None:
    """The stored order of positions under the active layout (None: natural order)."""
    n = seq_shards()
    return balanced_positions(length, n) if n > 1 else None


def attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, *, impl: str = "auto", block: int = 512,
           exchange: str = "ring", **segments) -> jax.Array:
    """Causal attention under the active layout: :func:`context_attend` when the length is split
    over ``seq`` (inputs in :func:`sequence_order`), else ``spmd.models.attention.attend``.
    ``segment_ids=[B, L]`` (packed documents) is passed on to either."""
    n = seq_shards()
    if n == 1:
        return attention.attend(q_BLHK, k_BLGK, v_BLGK, impl=impl, block=block, **segments)
    if _manual(active_layout()[0], "seq"):  # inside a region manual over seq (a pipeline's): this device's shard
        # K/V by all-gather: a pipeline's table engine runs its stages in lax.switch branches, and a
        # collective-permute there (the ring) pairs the devices of different branches wrongly on XLA:CPU
        return _attend_shard(q_BLHK, k_BLGK, v_BLGK, "seq", n, "allgather", block, segments.get("segment_ids"))
    return context_attend(q_BLHK, k_BLGK, v_BLGK, mesh=active_layout()[0], exchange=exchange, block=block,
                          **segments)


def _block_size(span: int, block: int) -> int:
    """The largest divisor of ``span`` that is at most ``block`` (flash blocks must tile a span exactly)."""
    return max(d for d in range(1, min(span, block) + 1) if span % d == 0)


def _weights(lse_BGRL: jax.Array, new_BGRL: jax.Array) -> jax.Array:
    """``exp(lse - new)`` laid out like ``out[B, L, G, R, 1]``."""
    return jnp.moveaxis(jnp.exp(lse_BGRL - new_BGRL), -1, 1)[..., None]


def _merge(o, lse, o2, lse2):
    """Two partial softmax attentions over disjoint keys -> their joint one (f32)."""
    new = jnp.logaddexp(lse, lse2)
    return o * _weights(lse, new) + o2.astype(jnp.float32) * _weights(lse2, new), new


def _merge_seen(o, lse, o2, lse2):
    """:func:`_merge` where either or both may have seen no key (lse -inf, packed documents)."""
    new = jnp.logaddexp(lse, lse2)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    w = lambda x: _weights(jnp.where(jnp.isfinite(x), x, -jnp.inf), safe)  # exp(-inf - finite) = 0
    return o * w(lse) + o2.astype(jnp.float32) * w(lse2), new


def _seg(sq, sk, size):
    """The segment argument of the flash kernels for query ids ``sq`` and key ids ``sk`` (None: none)."""
    return None if sq is None else (sq, sk, segments.block_table(sq, sk, size))


def _remote_forward(q, k, v, earlier, size, sq=None, sk=None):
    """Attention of the local queries ``[a, b]`` to a remote K/V block ``[chunk j, chunk 2n-1-j]``:
    from an earlier shard (j < i) both query chunks see its first chunk only; from a later shard
    only chunk b sees it, whole. Either way two ``c x c`` flash blocks: the load balance."""
    c = q.shape[1] // 2
    f32 = jnp.float32
    a, b = slice(0, c), slice(c, 2 * c)
    seg = lambda rows, keys: None if sq is None else _seg(sq[:, rows], sk[:, keys], size)

    def from_earlier(q, k, v):
        o_a, l_a = block_forward(q[:, :c], k[:, :c], v[:, :c], size, causal=False, seg=seg(a, a))
        o_b, l_b = block_forward(q[:, c:], k[:, :c], v[:, :c], size, causal=False, seg=seg(b, a))
        return jnp.concatenate([o_a, o_b], 1).astype(f32), jnp.concatenate([l_a, l_b], -1)

    def from_later(q, k, v):
        o1, l1 = block_forward(q[:, c:], k[:, :c], v[:, :c], size, causal=False, seg=seg(b, a))
        o2, l2 = block_forward(q[:, c:], k[:, c:], v[:, c:], size, causal=False, seg=seg(b, b))
        o_b, l_b = (_merge if sq is None else _merge_seen)(o1.astype(f32), l1, o2, l2)
        return (jnp.concatenate([jnp.zeros_like(o_b), o_b], 1),
                jnp.concatenate([jnp.full_like(l_b, -jnp.inf), l_b], -1))

    return lax.cond(earlier, from_earlier, from_later, q, k, v)


def _remote_backward(q, k, v, o, lse, do, earlier, size, sq=None, sk=None):
    """Gradients of :func:`_remote_forward`'s share: ``(dq[local], dk, dv[remote block])`` in f32,
    with ``o``/``lse`` the final (all-block) output and log-sum-exp of the local queries."""
    c = q.shape[1] // 2
    a, b = slice(0, c), slice(c, 2 * c)

    def span(keys, rows):
        res = (q[:, rows], k[:, keys], v[:, keys], o[:, rows], lse[..., rows])
        seg = None if sq is None else _seg(sq[:, rows], sk[:, keys], size)
        return [g.astype(jnp.float32) for g in block_backward(size, res, do[:, rows], causal=False, seg=seg)]

    def from_earlier():
        dq_a, dk_a, dv_a = span(a, a)
        dq_b, dk_b, dv_b = span(a, b)
        zero = jnp.zeros_like(dk_a)
        return (jnp.concatenate([dq_a, dq_b], 1), jnp.concatenate([dk_a + dk_b, zero], 1),
                jnp.concatenate([dv_a + dv_b, zero], 1))

    def from_later():
        dq_1, dk_1, dv_1 = span(a, b)
        dq_2, dk_2, dv_2 = span(b, b)
        return (jnp.concatenate([jnp.zeros_like(dq_1), dq_1 + dq_2], 1), jnp.concatenate([dk_1, dk_2], 1),
                jnp.concatenate([dv_1, dv_2], 1))

    return lax.cond(earlier, from_earlier, from_later)


# ------------------------------------------------------------------------------- the exchange
def _ring(kv, axis: str, n: int):
    """Send each shard's K/V to the next shard around the ring (one collective-permute)."""
    return lax.ppermute(kv, axis, [(d, (d + 1) % n) for d in range(n)])


def _source(i, s, n):
    """The shard whose K/V block a shard holds at ring step ``s``, and whether it comes earlier."""
    j = (i - s) % n
    return j, j < i


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attend_local(q, k, v, axis: str, n: int, size: int, exchange: str):
    return _forward(q, k, v, axis, n, size, exchange)[0]


def _forward(q, k, v, axis, n, size, exchange, seg=None):
    """Local ``q[B, 2c, G, R, K]`` against every shard's ``k, v[B, 2c, G, K]``: (out, residuals).
    ``seg[B, 2c]``: the local segment ids (packed documents), exchanged with K/V."""
    i = lax.axis_index(axis)
    if exchange == "allgather":
        k_all, v_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        s_all = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
        take = lambda x, s: lax.dynamic_slice_in_dim(x, _source(i, s, n)[0] * k.shape[1], k.shape[1], 1)
        block = lambda s: tuple(take(x, s) for x in (k_all, v_all))
        o, lse = block_forward(q, k, v, size, causal=True, seg=_seg(seg, seg, size))
        o = o.astype(jnp.float32)

        def body(s, carry):
            kb, vb = block(s)
            sk = None if seg is None else take(s_all, s)
            return _merge(*carry, *_remote_forward(q, kb, vb, _source(i, s, n)[1], size, seg, sk))

        o, lse = lax.fori_loop(1, n, body, (o, lse))
    else:
        nxt = _ring(jnp.stack([k, v]), axis, n)  # K/V as one buffer, in flight while the local block runs
        s_nxt = None if seg is None else _ring(seg, axis, n)
        o, lse = block_forward(q, k, v, size, causal=True, seg=_seg(seg, seg, size))
        o = o.astype(jnp.float32)

        def body(s, carry):
            o, lse, kv, sk = carry
            ahead, s_ahead = _ring(kv, axis, n), None if sk is None else _ring(sk, axis, n)
            o, lse = _merge(o, lse, *_remote_forward(q, kv[0], kv[1], _source(i, s, n)[1], size, seg, sk))
            return o, lse, ahead, s_ahead

        o, lse, kv, sk = lax.fori_loop(1, n - 1, body, (o, lse, nxt, s_nxt))
        o, lse = _merge(o, lse, *_remote_forward(q, kv[0], kv[1], _source(i, n - 1, n)[1], size, seg, sk))
    out = o.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _attend_fwd(q, k, v, axis, n, size, exchange):
    return _forward(q, k, v, axis, n, size, exchange)


def _attend_bwd(axis, n, size, exchange, residuals, do, seg=None):
    q, k, v, o, lse = residuals
    i = lax.axis_index(axis)
    f32 = jnp.float32
    dq, dk, dv = (g.astype(f32) for g in block_backward(size, residuals, do, causal=True, seg=_seg(seg, seg, size)))
    if exchange == "allgather":
        k_all, v_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        s_all = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
        span = k.shape[1]
        dk_all = lax.dynamic_update_slice_in_dim(jnp.zeros(k_all.shape, f32), dk, i * span, 1)
        dv_all = lax.dynamic_update_slice_in_dim(jnp.zeros(v_all.shape, f32), dv, i * span, 1)

        def body(s, carry):
            dq, dk_all, dv_all = carry
            j, earlier = _source(i, s, n)
            kb, vb = (lax.dynamic_slice_in_dim(x, j * span, span, 1) for x in (k_all, v_all))
            sk = None if seg is None else lax.dynamic_slice_in_dim(s_all, j * span, span, 1)
            dq_s, dk_s, dv_s = _remote_backward(q, kb, vb, o, lse, do, earlier, size, seg, sk)
            add = lambda acc, g: lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, j * span, span, 1) + g, j * span, 1)
            return dq + dq_s, add(dk_all, dk_s), add(dv_all, dv_s)

        dq, dk_all, dv_all = lax.fori_loop(1, n, body, (dq, dk_all, dv_all))
        dk, dv = (lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True) for x in (dk_all, dv_all))
    else:
        def body(s, carry):
            dq, kv, dkv, sk = carry
            kv, dkv = _ring(kv, axis, n), _ring(dkv, axis, n)  # a block's dK/dV sums travel with it
            sk = None if sk is None else _ring(sk, axis, n)
            dq_s, dk_s, dv_s = _remote_backward(q, kv[0], kv[1], o, lse, do, _source(i, s, n)[1], size, seg, sk)
            return dq + dq_s, kv, dkv + jnp.stack([dk_s, dv_s]), sk

        dq, _, dkv, _ = lax.fori_loop(1, n, body, (dq, jnp.stack([k, v]), jnp.stack([dk, dv]), seg))
        dk, dv = _ring(dkv, axis, n)  # each block's sums go home: one hop on
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attend_local.defvjp(_attend_fwd, _attend_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attend_segments(q, k, v, seg, axis: str, n: int, size: int, exchange: str):
    return _forward(q, k, v, axis, n, size, exchange, seg)[0]


def _attend_segments_fwd(q, k, v, seg, axis, n, size, exchange):
    out, res = _forward(q, k, v, axis, n, size, exchange, seg)
    return out, (res, seg)


def _attend_segments_bwd(axis, n, size, exchange, residuals, do):
    res, seg = residuals
    return (*_attend_bwd(axis, n, size, exchange, res, do, seg), None)


_attend_segments.defvjp(_attend_segments_fwd, _attend_segments_bwd)


def context_attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, *, mesh: Mesh, axis: str = "seq",
                   exchange: str = "ring", block: int = 512, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal attention of ``q[B, L_seq, H, K]`` over ``k, v[B, L_seq, G, K]`` whose length is in
    :func:`balanced_positions` order and sharded over ``axis`` (other axes stay automatic)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"context exchange {exchange!r} is not one of {EXCHANGES}")
    n = mesh.shape[axis]
    if n == 1:
        return blockwise(q_BLHK, k_BLGK, v_BLGK, block, segment_ids)
    b, length, h, _ = q_BLHK.shape
    g = k_BLGK.shape[2]
    balanced_positions(length, n)  # the divisibility check, with its message

    def local(q, k, v, *seg):  # this device's rows and heads: q[b, 2c, h, K], k, v[b, 2c, g, K]; seg[b, 2c]
        return _attend_shard(q, k, v, axis, n, exchange, block, *seg)

    rows, heads = _manual_dims(mesh, axis, b, h, g)
    spec = P(rows or None, axis, heads or None)
    names = {axis, *rows, *heads}
    if segment_ids is not None:  # packed documents: segment ids travel with K/V
        return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(rows or None, axis)),
                             out_specs=spec, axis_names=names, check_vma=False)(q_BLHK, k_BLGK, v_BLGK, segment_ids)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, axis_names=names,
                         check_vma=False)(q_BLHK, k_BLGK, v_BLGK)


def _attend_shard(q, k, v, axis: str, n: int, exchange: str, block: int, seg=None):
    """One device's shard inside a region manual over ``axis``: ``q[b, 2c, h, K]`` (chunks i, 2n-1-i of
    :func:`balanced_positions`) over every shard's ``k, v[b, 2c, g, K]``; ``seg[b, 2c]`` its segment ids.
    Flash tiles of at most a quarter of a chunk: the ``[H, size, size]`` f32 score tiles then shrink
    with the local span, so per-device temporaries fall as 1/seq even where a chunk is a few blocks long."""
    span = q.shape[1] // 2
    size = _block_size(span, min(block, max(1, span // 4)))
    gl = k.shape[2]
    q5 = q.reshape(*q.shape[:2], gl, q.shape[2] // gl, q.shape[3])
    out = _attend_local(q5, k, v, axis, n, size, exchange) if seg is None else \
        _attend_segments(q5, k, v, seg, axis, n, size, exchange)
    return out.reshape(q.shape)


def _manual_dims(mesh: Mesh, axis: str, b: int, h: int, g: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The axes the active rules split the batch and the heads over, taken manual beside ``axis``: each
    device then exchanges only its own rows' and heads' K/V over ``axis`` (left automatic, GSPMD gathers
    them over those axes first). Heads only when q's and the K/V heads split alike (groups stay local)."""
    layout = active_layout()
    if layout is None:
        return (), ()
    rules, sizes = layout[1], dict(mesh.shape)
    q_spec, k_spec = ((*rules.spec(("batch", "length", d), kind="activations", mesh_sizes=sizes), None, None, None)
                      for d in ("heads", "kv_heads"))  # a spec may drop its trailing None dims
    size = lambda axes: int(np.prod([sizes[a] for a in axes], dtype=int))
    rows = tuple(a for a in axes_of(q_spec[0]) if a != axis)
    rows = rows if rows and b % size(rows) == 0 else ()
    heads = axes_of(q_spec[2])
    heads = heads if heads and heads == axes_of(k_spec[2]) and axis not in heads and not set(heads) & set(rows) \
        and h % size(heads) == 0 and g % size(heads) == 0 else ()
    return rows, heads
