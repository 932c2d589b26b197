"""Building blocks of the reference models: single-device code with logical dims.

Every parameter is created with :func:`param`, which records its logical dims as NNX metadata
(``out_sharding``, the key ``nnx.with_partitioning`` uses) without sharding it eagerly, so the
same module runs on one device with no mesh, and the toolkit shards it from the metadata.

Parameters are stored in ``param_dtype`` (f32) and cast to the compute ``dtype`` (bf16 or f32)
at use; norms, softmax and the loss run in f32. Tensor names carry their shape letters
(B batch, L length, D embed, F mlp, H heads, G kv_heads, K head_dim, V vocab).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.constraints import constrain
from spmd.models.attention import attend

Init = Callable[..., jax.Array]


def param(
    rngs: nnx.Rngs, init: Init, shape: Sequence[int], dims: Sequence[str | None], dtype: jnp.dtype = jnp.float32
) -> nnx.Param:
    """An ``nnx.Param`` carrying its logical dims (sharded later from the metadata, never eagerly)."""
    if len(shape) != len(dims):
        raise ValueError(f"param of shape {tuple(shape)} given {len(dims)} dims {tuple(dims)}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(dims), eager_sharding=False)


def weight(var: nnx.Param, dtype: jnp.dtype) -> jax.Array:
    """A parameter as used in compute: cast to ``dtype`` and laid out by the *activation* rules.

    Under FSDP this is where a weight ``W[D_fsdp, F]`` is all-gathered to ``W[D, F]`` (activation
    rules never shard ``embed``) while TP dims (``mlp``, ``heads`` -> tensor) stay sharded. Saying
    so explicitly gives GSPMD the clean plan: one all-gather per weight per pass.
    """
    dims = var.get_metadata().get("out_sharding")
    value = var[...]
    if dims is None:
        return value.astype(dtype)
    dims = tuple(dims)
    while len(dims) > value.ndim and dims[0] in ("layers", "stage"):
        dims = dims[1:]  # inside a Stack's scan the stacked dims are sliced away
    if value.dtype != dtype:
        value = constrain(value.astype(dtype), dims, kind="params")
    return constrain(value, dims)


def fan_in_init(fan_in: int) -> Init:
    """Truncated normal with std 1/sqrt(fan_in) (fan_in counted over all contracted dims)."""
    return nnx.initializers.truncated_normal(stddev=fan_in**-0.5)


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in f32; scale[D] (replicated unless ``embed`` is sharded)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6, dims: tuple[str, ...] = ("embed",)):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), dims)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * weight(self.scale, jnp.float32)).astype(x.dtype)


def rope(x_BLHK: jax.Array, positions_L: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotary position embedding on the last dim (pairs (i, i + K/2)), computed in f32."""
    k = x_BLHK.shape[-1]
    if k % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {k}")
    freq_K2 = theta ** (-jnp.arange(0, k // 2, dtype=jnp.float32) * 2.0 / k)
    angle_LK2 = positions_L.astype(jnp.float32)[:, None] * freq_K2[None, :]
    sin, cos = jnp.sin(angle_LK2)[None, :, None, :], jnp.cos(angle_LK2)[None, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


class Attention(nnx.Module):
    """Causal multi-head attention with optional grouped KV heads (G kv heads, H = G * R queries).

    Parameters: ``w_q[D, H, K]``, ``w_k[D, G, K]``, ``w_v[D, G, K]``, ``w_o[H, K, D]``. Under TP
    (heads -> tensor) q/k/v are column-parallel and w_o is row-parallel: its output is a partial
    sum that XLA all-reduces over ``tensor`` (one all-reduce per block, forward).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, rngs: nnx.Rngs,
                 rope_theta: float = 10_000.0, dtype: jnp.dtype = jnp.float32, impl: str = "auto", block: int = 512):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        init = fan_in_init(d_model)
        self.w_q = param(rngs, init, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"))
        self.w_k = param(rngs, init, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
        self.w_v = param(rngs, init, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"))
        self.w_o = param(rngs, fan_in_init(n_heads * head_dim), (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"))
        self.n_kv_heads, self.rope_theta, self.dtype = n_kv_heads, rope_theta, dtype
        self.impl, self.block = impl, block  # spmd.models.attention

    def __call__(self, x_BLD: jax.Array, positions_L: jax.Array) -> jax.Array:
        dt = self.dtype
        q_BLHK = jnp.einsum("bld,dhk->blhk", x_BLD, weight(self.w_q, dt))
        k_BLGK = jnp.einsum("bld,dgk->blgk", x_BLD, weight(self.w_k, dt))
        v_BLGK = jnp.einsum("bld,dgk->blgk", x_BLD, weight(self.w_v, dt))
        q_BLHK = constrain(rope(q_BLHK, positions_L, self.rope_theta), ("batch", "length", "heads", "head_dim"))
        k_BLGK = rope(k_BLGK, positions_L, self.rope_theta)
        out_BLHK = attend(q_BLHK, k_BLGK, v_BLGK, impl=self.impl, block=self.block)
        out_BLHK = constrain(out_BLHK, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("blhk,hkd->bld", out_BLHK, weight(self.w_o, dt))


class GatedMLP(nnx.Module):
    """SwiGLU MLP: ``down(silu(x @ w_gate) * (x @ w_up))`` with ``w_gate, w_up[D, F]``, ``w_down[F, D]``.

    Under TP (mlp -> tensor) gate/up are column-parallel and w_down row-parallel: one all-reduce
    of the ``[B, L, D]`` output over ``tensor`` per block in the forward pass.
    """

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.w_gate = param(rngs, fan_in_init(d_model), (d_model, d_ff), ("embed", "mlp"))
        self.w_up = param(rngs, fan_in_init(d_model), (d_model, d_ff), ("embed", "mlp"))
        self.w_down = param(rngs, fan_in_init(d_ff), (d_ff, d_model), ("mlp", "embed"))
        self.dtype = dtype

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_BLF = jnp.einsum("bld,df->blf", x_BLD, weight(self.w_gate, dt))
        up_BLF = jnp.einsum("bld,df->blf", x_BLD, weight(self.w_up, dt))
        h_BLF = constrain(jax.nn.silu(gate_BLF) * up_BLF, ("batch", "length", "mlp"))
        return jnp.einsum("blf,fd->bld", h_BLF, weight(self.w_down, dt))
