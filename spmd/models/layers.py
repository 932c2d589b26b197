"""Building blocks of the reference models: single-device code with logical dims.

Every parameter is created with :func:`param`, which records its logical dims as NNX metadata
(``out_sharding``, the key ``nnx.with_partitioning`` uses) without sharding it eagerly, so the
same module runs on one device with no mesh, and the toolkit shards it from the metadata.

Parameters are stored in ``param_dtype`` (f32) and cast to the compute ``dtype`` (bf16 or f32)
at use; norms, softmax and the loss run in f32. Tensor names carry their shape letters
(B batch, L length, D embed, F mlp, H heads, G kv_heads, K head_dim, V vocab).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.constraints import constrain, dim_shards
from spmd.models import context
from spmd.models import lora as lora_lib

Init = Callable[..., jax.Array]


def param(
    rngs: nnx.Rngs, init: Init, shape: Sequence[int], dims: Sequence[str | None], dtype: jnp.dtype = jnp.float32
) -> nnx.Param:
    """An ``nnx.Param`` carrying its logical dims (sharded later from the metadata, never eagerly)."""
    if len(shape) != len(dims):
        raise ValueError(f"param of shape {tuple(shape)} given {len(dims)} dims {tuple(dims)}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(dims), eager_sharding=False)


def weight(var: nnx.Param, dtype: jnp.dtype, *, gather: bool = True) -> jax.Array:
    """A parameter as used in compute: cast to ``dtype`` and laid out by the *activation* rules.

    Under FSDP this is where a weight ``W[D_fsdp, F]`` is all-gathered to ``W[D, F]`` (activation
    rules never shard ``embed``) while TP dims (``mlp``, ``heads`` -> tensor) stay sharded. Saying
    so explicitly gives GSPMD the clean plan: one all-gather per weight per pass. The cast runs on
    the shard first (constrained to the *parameter* layout), so the gather moves ``dtype``: under
    bf16 compute half the bytes of f32 (cast and gathered in one constraint, XLA gathers the f32
    shard and converts after). ``gather=False``: the cast shard only, in the parameter layout (to
    combine shards before one gather, as the fused q/k/v weight does).
    """
    dims = var.get_metadata().get("out_sharding")
    value = var[...]
    if dims is None:
        return value.astype(dtype)
    dims = tuple(dims)
    while len(dims) > value.ndim and dims[0] in ("layers", "stage"):
        dims = dims[1:]  # inside a Stack's scan the stacked dims are sliced away
    if value.dtype != dtype or not gather:
        value = constrain(value.astype(dtype), dims, kind="params")
    return constrain(value, dims) if gather else value


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


def rope(x_BLHK: jax.Array, positions_L: jax.Array, theta: float = 10_000.0,
         scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotary position embedding on the last dim (pairs (i, i + K/2)), computed in f32; positions
    ``[L]`` shared by the rows, or ``[B, L]`` per row (packed documents restart at 0); ``scaling``
    ``(factor, low, high, original length)`` scales the frequencies as Llama 3.1 does."""
    k = x_BLHK.shape[-1]
    if k % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {k}")
    freq_K2 = theta ** (-jnp.arange(0, k // 2, dtype=jnp.float32) * 2.0 / k)
    if scaling is not None:
        freq_K2 = llama3_frequencies(freq_K2, *scaling)
    if positions_L.ndim == 1:
        angle_LK2 = positions_L.astype(jnp.float32)[:, None] * freq_K2[None, :]
        sin, cos = jnp.sin(angle_LK2)[None, :, None, :], jnp.cos(angle_LK2)[None, :, None, :]
    else:
        angle_BLK2 = positions_L.astype(jnp.float32)[..., None] * freq_K2
        sin, cos = jnp.sin(angle_BLK2)[:, :, None, :], jnp.cos(angle_BLK2)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


def llama3_frequencies(freq: jax.Array, factor: float, low: float, high: float, original: int) -> jax.Array:
    """Llama 3.1's RoPE frequencies: wavelengths over ``original / low`` divided by ``factor``, under
    ``original / high`` kept, smoothly interpolated between."""
    wavelen = 2 * jnp.pi / freq
    scaled = jnp.where(wavelen > original / low, freq / factor, freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def fused_param(rngs: nnx.Rngs, init: Init, part_shape: Sequence[int], n: int, axis: int,
                dims: Sequence[str | None], dtype: jnp.dtype = jnp.float32) -> nnx.Param:
    """``n`` parameters of ``part_shape`` stacked on a new dim ``axis``, each drawn as :func:`param` draws one
    (one ``rngs.params()`` key per part, in order), so a fused weight starts equal to its separate parts."""
    parts = [init(rngs.params(), tuple(part_shape), dtype) for _ in range(n)]
    value = jnp.stack(parts, axis=axis)
    if value.ndim != len(dims):
        raise ValueError(f"param of shape {value.shape} given {len(dims)} dims {tuple(dims)}")
    return nnx.Param(value, out_sharding=tuple(dims), eager_sharding=False)


def kv_slots(n_heads: int, n_kv_heads: int) -> int:
    """How many KV slots the fused q/k/v weight has under the active layout: ``n_kv_heads``, or the
    number of shards ``t`` of ``heads`` when ``t`` exceeds it (each KV head copied to the ``t / G``
    shards whose query heads read it). Raises naming both head counts when neither divides the other."""
    t = dim_shards("heads")
    if n_kv_heads % t == 0:
        return n_kv_heads
    if t % n_kv_heads == 0 and n_heads % t == 0:
        return t
    raise ValueError(f"n_heads={n_heads}, n_kv_heads={n_kv_heads} cannot shard over {t} tensor shards of heads: "
                     f"valid sizes: {', '.join(map(str, valid_head_shards(n_heads, n_kv_heads)))}")


def valid_head_shards(n_heads: int, n_kv_heads: int) -> list[int]:
    """Shard counts of ``heads`` the attention runs on: divisors of ``n_kv_heads`` (KV heads sharded),
    and multiples of it that divide ``n_heads`` (KV heads replicated over the shards sharing one)."""
    return [t for t in range(1, n_heads + 1)
            if n_kv_heads % t == 0 or (t % n_kv_heads == 0 and n_heads % t == 0)]


class Attention(nnx.Module):
    """Causal multi-head attention with optional grouped KV heads (G kv heads, H = G * R queries).

    Parameters: ``w_q[D, H, K]``, ``w_kv[D, G, 2, K]`` (k then v per KV head), ``w_o[H, K, D]``.
    At use, q and kv are fused per KV slot into one weight ``W[D, n_tensor, H/n + 2, K]`` (a slot's
    H/n query heads, then its k and v): one matmul ``x[B, L, D] @ W``, so under TP (heads, kv_heads
    -> tensor) one all-reduce of the ``[B, L, D]`` input gradient over ``tensor`` in the backward
    pass, and one of the row-parallel ``w_o`` output in the forward pass. n = G when ``tensor``
    divides G (the concat is local). When ``tensor`` = t > G (t a multiple of G dividing H) the kv
    part is stored replicated over ``tensor`` (``w_kv[D, G, 2, K]``, D*G*2*K per shard) and each
    shard takes a copy of its group's k and v (n = t); the ``w_kv`` gradient is then all-reduced
    over ``tensor`` (param-sized). See docs/sharding.md. ``bias=True`` adds ``b_q[H, K]`` and
    ``b_kv[G, 2, K]``, fused the same way.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, rngs: nnx.Rngs,
                 rope_theta: float = 10_000.0, dtype: jnp.dtype = jnp.float32, impl: str = "auto", block: int = 512,
                 exchange: str = "ring", bias: bool = False,
                 rope_scaling: tuple[float, float, float, int] | None = None, lora: lora_lib.LoRASpec | None = None):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        init = fan_in_init(d_model)
        self.w_q = param(rngs, init, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"))
        self.w_kv = fused_param(rngs, init, (d_model, n_kv_heads, head_dim), 2, 2,
                                ("embed", "kv_heads", None, "head_dim"))
        self.w_o = param(rngs, fan_in_init(n_heads * head_dim), (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"))
        if bias:
            self.b_q = param(rngs, nnx.initializers.zeros, (n_heads, head_dim), ("heads", "head_dim"))
            self.b_kv = param(rngs, nnx.initializers.zeros, (n_kv_heads, 2, head_dim), ("kv_heads", None, "head_dim"))
        lora_lib.attention_adapters(self, lora, d_model, n_heads, n_kv_heads, head_dim, rngs)  # none unless given
        self.n_heads, self.n_kv_heads, self.rope_theta, self.dtype = n_heads, n_kv_heads, rope_theta, dtype
        self.bias, self.rope_scaling, self.lora = bias, rope_scaling, lora
        self.impl, self.block = impl, block  # spmd.models.attention
        self.exchange = exchange  # K/V exchange under context parallelism (spmd.models.context)

    def fused_qkv(self, w_q: nnx.Param | None = None, w_kv: nnx.Param | None = None) -> jax.Array:
        """The fused weight ``W[D, n, H/n + 2, K]`` in the compute dtype (slot dim over ``kv_heads``' axes);
        given ``b_q`` and ``b_kv`` in place of the weights, the fused bias ``b[n, H/n + 2, K]``."""
        h, g = self.n_heads, self.n_kv_heads
        n = kv_slots(h, g)
        w_q, w_kv = (self.w_q, self.w_kv) if w_q is None else (w_q, w_kv)
        # shards combined first (in the parameter layout), then one gather of the fused weight; both are
        # constraint outputs, which save_all_but_gathered recomputes rather than keeps
        w_q_DHK = weight(w_q, self.dtype, gather=False)
        w_q_DnRK = w_q_DHK.reshape(*w_q_DHK.shape[:-2], n, h // n, w_q_DHK.shape[-1])
        w_kv_DG2K = weight(w_kv, self.dtype, gather=False)
        w_kv_Dn2K = jnp.repeat(w_kv_DG2K, n // g, axis=-3) if n > g else w_kv_DG2K  # a copy per shard sharing it
        dims = ("embed", "kv_heads", None, "head_dim")[4 - w_q_DHK.ndim - 1:]
        w_DnSK = constrain(jnp.concatenate([w_q_DnRK, w_kv_Dn2K], axis=-2), dims, kind="params")
        return constrain(w_DnSK, dims)

    def qkv(self, x_BLD: jax.Array, positions_L: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(q[B, L, H, K], k[B, L, n, K], v[B, L, n, K])``, RoPE applied at ``positions_L`` (n KV slots)."""
        w_DnSK = self.fused_qkv()
        n, s = w_DnSK.shape[1], w_DnSK.shape[2]
        qkv_BLnSK = jnp.einsum("bld,dnsk->blnsk", x_BLD, w_DnSK)
        if self.bias:
            qkv_BLnSK = qkv_BLnSK + self.fused_qkv(self.b_q, self.b_kv)
        qkv_BLnSK = constrain(qkv_BLnSK, ("batch", "length", "kv_heads", None, "head_dim"))
        b, l, _, _, k = qkv_BLnSK.shape
        # one split (its gradient one concatenate; slices would each pad their gradient to the whole)
        q_BLnRK, k_BLn1K, v_BLn1K = jnp.split(qkv_BLnSK, [s - 2, s - 1], axis=3)
        q_BLHK = q_BLnRK.reshape(b, l, n * (s - 2), k)
        k_BLnK, v_BLnK = k_BLn1K.squeeze(3), v_BLn1K.squeeze(3)
        if self.lora is not None:  # LoRA adapters (spmd.models.lora), before RoPE as on the projections
            use = functools.partial(weight, dtype=self.dtype)
            q_BLHK = lora_lib.add(q_BLHK, self, "q_proj", x_BLD, use)
            k_BLnK = lora_lib.add_kv(k_BLnK, self, "k_proj", x_BLD, use)
            v_BLnK = lora_lib.add_kv(v_BLnK, self, "v_proj", x_BLD, use)
        q_BLHK = rope(q_BLHK, positions_L, self.rope_theta, self.rope_scaling)
        q_BLHK = constrain(q_BLHK, ("batch", "length", "heads", "head_dim"))
        return q_BLHK, rope(k_BLnK, positions_L, self.rope_theta, self.rope_scaling), v_BLnK

    def out(self, out_BLHK: jax.Array) -> jax.Array:
        """The row-parallel output projection ``o[B, L, H, K] -> y[B, L, D]``."""
        out_BLHK = constrain(out_BLHK, ("batch", "length", "heads", "head_dim"))
        y_BLD = jnp.einsum("blhk,hkd->bld", out_BLHK, weight(self.w_o, self.dtype))
        return y_BLD if self.lora is None else lora_lib.add(y_BLD, self, "o_proj", out_BLHK,
                                                                  functools.partial(weight, dtype=self.dtype))

    def __call__(self, x_BLD: jax.Array, positions_L: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        q_BLHK, k_BLnK, v_BLnK = self.qkv(x_BLD, positions_L)
        seg = {} if segment_ids is None else {"segment_ids": segment_ids}  # packed documents
        out_BLHK = context.attend(q_BLHK, k_BLnK, v_BLnK, impl=self.impl, block=self.block, exchange=self.exchange,
                                  **seg)
        return self.out(out_BLHK)


class GatedMLP(nnx.Module):
    """SwiGLU MLP: ``down(silu(x @ W_gate) * (x @ W_up))`` with gate and up fused as ``w_gate_up[D, 2, F]``
    (gate then up) and ``w_down[F, D]``.

    Under TP (mlp -> tensor) ``w_gate_up[D, 2, F_tensor]`` is column-parallel (one matmul, so one
    all-reduce of its ``[B, L, D]`` input gradient over ``tensor`` in the backward pass) and
    ``w_down[F_tensor, D]`` row-parallel (one all-reduce of its ``[B, L, D]`` output, forward).
    """

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32,
                 lora: lora_lib.LoRASpec | None = None):
        self.w_gate_up = fused_param(rngs, fan_in_init(d_model), (d_model, d_ff), 2, 1, ("embed", None, "mlp"))
        self.w_down = param(rngs, fan_in_init(d_ff), (d_ff, d_model), ("mlp", "embed"))
        self.dtype, self.lora = dtype, lora
        lora_lib.mlp_adapters(self, lora, d_model, d_ff, rngs)  # none unless given

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        dt = self.dtype
        gate_up_BL2F = jnp.einsum("bld,dcf->blcf", x_BLD, weight(self.w_gate_up, dt))
        gate_BL1F, up_BL1F = jnp.split(gate_up_BL2F, 2, axis=2)  # gradient: one concatenate, not two pads
        gate_BLF, up_BLF = gate_BL1F.squeeze(2), up_BL1F.squeeze(2)
        if self.lora is not None:  # LoRA adapters (spmd.models.lora)
            use = functools.partial(weight, dtype=dt)
            gate_BLF = lora_lib.add(gate_BLF, self, "gate_proj", x_BLD, use)
            up_BLF = lora_lib.add(up_BLF, self, "up_proj", x_BLD, use)
        h_BLF = constrain(jax.nn.silu(gate_BLF) * up_BLF, ("batch", "length", "mlp"))
        y_BLD = jnp.einsum("blf,fd->bld", h_BLF, weight(self.w_down, dt))
        return y_BLD if self.lora is None else lora_lib.add(y_BLD, self, "down_proj", h_BLF,
                                                                 functools.partial(weight, dtype=dt))
