"""Grouped expert matmuls: each row through its own expert, computing only the rows that exist.

``grouped_mlp(x[R, D], group[R], ...)`` runs row r through SwiGLU expert ``group[r]`` (rows with
``group == G`` are absent: output 0). Rows are counting-sorted by expert into blocks of ``b`` rows,
each block owned by one expert (its rows padded to a multiple of ``b``); a loop multiplies each
used block by its expert's weights, sliced in place. Buffers hold ``max_rows + G * (b - 1)`` rows
(a static bound); the loops run only over the blocks that hold rows, a trip count known at run
time, so the work follows the rows present. ``b``: the largest power of two (<= 128) whose padding
stays under 1/16 of the expected rows. On GPU and TPU the rows go unpadded through
``jax.lax.ragged_dot`` instead (grouped-GEMM kernels; XLA:CPU lowers it to every row times every
group). Under expert parallelism it runs inside the MoE layer's shard_map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from spmd import collectives

MAX_BLOCK = 128


def block_rows(rows: int, n_groups: int) -> int:
    """Rows per block: the largest power of two <= 128 with ``n_groups * (b - 1) <= rows / 16``."""
    b = 1
    while b < MAX_BLOCK and n_groups * (2 * b - 1) * 16 <= rows:
        b *= 2
    return b


def n_blocks(max_rows: int, n_groups: int, block: int) -> int:
    """Blocks for at most ``max_rows`` present rows in ``n_groups`` groups, each padded to a block
    multiple: ``sum_g ceil(count_g / b) <= (max_rows + G * (b - 1)) // b``."""
    return max(1, (max_rows + n_groups * (block - 1)) // block)


def _per_block(x_NB: jax.Array, w_G: jax.Array, group_N: jax.Array, used: jax.Array, spec: str) -> jax.Array:
    """``einsum(spec)(x[n], w[group[n]])`` for the ``used`` first blocks n (the rest: 0), in a loop that
    slices one expert's weights at a time (a gather of every block's weights is slow on CPU and holds
    N copies) and runs ``used`` times (a traced trip count: the work follows the rows present)."""
    def body(n, y_NB):
        w_blk = jax.lax.dynamic_index_in_dim(w_G, group_N[n], keepdims=False)
        blk = jnp.einsum(spec, jax.lax.dynamic_index_in_dim(x_NB, n, keepdims=False), w_blk)
        return jax.lax.dynamic_update_index_in_dim(y_NB, blk.astype(y_NB.dtype), n, 0)

    blk = jax.eval_shape(functools.partial(jnp.einsum, spec), *(jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                                                                 for a in (x_NB, w_G)))
    y_NB = collectives.varying_like(jnp.zeros((x_NB.shape[0], *blk.shape), blk.dtype), x_NB, w_G)
    return jax.lax.fori_loop(0, used, body, y_NB)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gathered_matmul(x_NB: jax.Array, w_G: jax.Array, group_N: jax.Array, used: jax.Array, spec: str) -> jax.Array:
    """``y[n] = einsum(spec)(x[n], w[group[n]])`` for the ``used`` first blocks n (the rest 0); ``spec``
    contracts one dim, e.g. ``"bd,dtf->btf"`` (the weights' trailing dims stay apart: a reshape of
    ``[2, F_tensor]`` into ``[2F]`` is no tiling of the merged dim, and XLA moves it with an all-to-all)."""
    return _per_block(x_NB, w_G, group_N, used, spec)


def _gathered_fwd(x_NB, w_G, group_N, used, spec):
    return _gathered_matmul(x_NB, w_G, group_N, used, spec), (x_NB, w_G, group_N, used)


def _gathered_bwd(spec, res, dy_NB):
    """For ``spec = "x,w->y"``: ``dx[n] = einsum("y,w->x")(dy[n], w[group[n]])``; ``dw[g] = sum over g's
    blocks of einsum("x,y->w")(x[n], dy[n])``, added in place; both over the used blocks only."""
    x_NB, w_G, group_N, used = res
    operands, ys = spec.split("->")
    xs, ws = operands.split(",")
    dx_NB = _per_block(dy_NB, w_G, group_N, used, f"{ys},{ws}->{xs}")

    def add(n, dw_G):
        g = group_N[n]
        x_blk, dy_blk = (jax.lax.dynamic_index_in_dim(a, n, keepdims=False) for a in (x_NB, dy_NB))
        part = jax.lax.dynamic_index_in_dim(dw_G, g, keepdims=False) + jnp.einsum(f"{xs},{ys}->{ws}", x_blk, dy_blk)
        return jax.lax.dynamic_update_index_in_dim(dw_G, part.astype(dw_G.dtype), g, 0)

    dw_G = collectives.varying_like(jnp.zeros(w_G.shape, w_G.dtype), w_G, x_NB, dy_NB)
    dw_G = jax.lax.fori_loop(0, used, add, dw_G)
    zero = np.zeros((), jax.dtypes.float0)
    return dx_NB, dw_G, np.zeros(group_N.shape, jax.dtypes.float0), zero


_gathered_matmul.defvjp(_gathered_fwd, _gathered_bwd)


IMPLS = ("loop", "ragged")


def grouped_mlp(x_RD: jax.Array, group_R: jax.Array, w_gate_up_GDTF: jax.Array, w_down_GFD: jax.Array, *,
                max_rows: int, expected_rows: int | None = None, impl: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``(y[R, D], rows)``: row r through expert ``group[r]``'s SwiGLU, 0 where ``group[r] == G``
    (absent); ``rows`` (int32 scalar): the rows the experts computed, padding included.

    ``max_rows`` bounds the present rows (a static shape: the buffers hold that many plus padding);
    ``expected_rows`` (default ``max_rows``) sets the block size, so padding stays small for the
    typical count when the bound is a worst case. ``impl``: ``"loop"`` (the block loop above) or
    ``"ragged"`` (rows sorted by expert, unpadded, through ``jax.lax.ragged_dot``: one grouped-GEMM
    kernel per matrix on GPU and TPU); None: ``"loop"`` on CPU, ``"ragged"`` elsewhere.
    """
    r, d = x_RD.shape
    g = w_gate_up_GDTF.shape[0]
    if max_rows < 1:
        raise ValueError(f"grouped_mlp needs max_rows >= 1 (a bound on the present rows), got {max_rows}")
    impl = impl or ("loop" if jax.default_backend() == "cpu" else "ragged")
    if impl not in IMPLS:
        raise ValueError(f"grouped_mlp impl={impl!r}; valid: {', '.join(IMPLS)}")
    b = 1 if impl == "ragged" else block_rows(min(expected_rows or max_rows, max_rows), g)
    nb = n_blocks(max_rows, g, b)
    onehot_RG = jax.nn.one_hot(group_R, g, dtype=jnp.int32)  # absent rows (group G): all zero
    count_G = jnp.sum(onehot_RG, axis=0)
    blocks_G = (count_G + b - 1) // b
    end_G = jnp.cumsum(blocks_G)
    used = jnp.minimum(end_G[-1], nb)
    rank_R = jnp.sum((jnp.cumsum(onehot_RG, axis=0) - 1) * onehot_RG, axis=-1)  # place within its group
    first_row_R = jnp.take((end_G - blocks_G) * b, jnp.minimum(group_R, g - 1))
    dest_R = jnp.where(group_R < g, first_row_R + rank_R, nb * b)  # absent rows fall outside: dropped
    x_ND = jnp.zeros((nb * b, d), x_RD.dtype).at[dest_R].set(x_RD, mode="drop")
    if impl == "ragged":  # rows grouped by expert in order, count_G each: what ragged_dot's group sizes say
        gate_NF, up_NF = (jax.lax.ragged_dot(x_ND, w_gate_up_GDTF[:, :, i], count_G) for i in range(2))
        y_ND = jax.lax.ragged_dot(jax.nn.silu(gate_NF) * up_NF, w_down_GFD, count_G)
        return y_ND.at[dest_R].get(mode="fill", fill_value=0), jnp.sum(count_G)
    group_N = jnp.minimum(jnp.sum(end_G[None, :] <= jnp.arange(nb)[:, None], axis=1), g - 1)  # the block's expert
    h_NBTF = _gathered_matmul(x_ND.reshape(nb, b, d), w_gate_up_GDTF, group_N, used, "bd,dtf->btf")
    h_NBF = jax.nn.silu(h_NBTF[..., 0, :]) * h_NBTF[..., 1, :]
    y_NBD = _gathered_matmul(h_NBF, w_down_GFD, group_N, used, "bf,fd->bd")
    return y_NBD.reshape(nb * b, d).at[dest_R].get(mode="fill", fill_value=0), used * b
