"""GPT-style decoder-only transformer, written as single-device code with logical dims.

token embedding ``E[V, D]`` -> n_layers x (RMSNorm -> causal attention with RoPE (optionally
grouped KV heads) -> residual -> RMSNorm -> gated MLP -> residual), run as a :class:`Stack` scan
-> final RMSNorm -> output head ``W[D, V]`` (or ``E`` transposed when tied) -> logits in f32.

Which dims shard over which mesh axes is decided by the rule set, not here; this module only
names dims. Parameters are f32 (``param_dtype``); matmuls run in ``dtype`` (bf16 or f32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from spmd import remat as remat_lib
from spmd.constraints import constrain
from spmd.models import attention as attention_lib
from spmd.models.loss import chunked_lm_loss, lm_loss
from spmd.models.layers import Attention, GatedMLP, RMSNorm, param, weight
from spmd.pipeline import PipelineConfig, pipelined_loss
from spmd.stack import Stack

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: = n_heads (multi-head); fewer: grouped-query attention
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4 * d_model
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    remat: bool = False  # shorthand for remat_policy "full" (True) / "none" (False)
    remat_policy: str = ""  # a spmd.remat policy name; "" takes it from remat
    attention: str = "auto"  # a spmd.models.attention implementation
    attention_block: int = 512  # query/key block of the blockwise attention paths
    loss_chunk: int = 0  # cross-entropy over this many positions at a time (0: all at once)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"GPTConfig.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} does not divide by n_heads {self.n_heads}; set head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.remat_policy and self.remat_policy not in remat_lib.POLICIES:
            raise ValueError(f"GPTConfig.remat_policy {self.remat_policy!r} is not one of {remat_lib.POLICIES}")
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(f"GPTConfig.attention {self.attention!r} is not one of {attention_lib.IMPLS}")
        if self.attention_block < 1 or self.loss_chunk < 0:
            raise ValueError(f"GPTConfig.attention_block must be >= 1 and loss_chunk >= 0, got "
                             f"{self.attention_block}, {self.loss_chunk}")

    @property
    def policy(self) -> str:
        """The remat policy name in effect."""
        return self.remat_policy or remat_lib.resolve(self.remat)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def k(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def compute_dtype(self) -> jnp.dtype:
        return DTYPES[self.dtype]


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k, rngs=rngs,
                              rope_theta=cfg.rope_theta, dtype=cfg.compute_dtype, impl=cfg.attention,
                              block=cfg.attention_block)
        self.mlp_norm = RMSNorm(cfg.d_model, rngs=rngs)
        self.mlp = GatedMLP(cfg.d_model, cfg.ff, rngs=rngs, dtype=cfg.compute_dtype)

    def __call__(self, x_BLD: jax.Array, positions_L: jax.Array) -> jax.Array:
        x_BLD = x_BLD + residual(self.attn(sub_block_input(self.attn_norm(x_BLD)), positions_L))
        x_BLD = x_BLD + residual(self.mlp(sub_block_input(self.mlp_norm(x_BLD))))
        return residual(x_BLD)


def residual(x_BLD: jax.Array) -> jax.Array:
    """The residual stream's layout ``x[B, residual_length, D]``: a sub-block's output joins it here.

    Under sequence parallelism (``*_sp`` rules: ``x[B_data, L_tensor, D]``) a row-parallel output
    ``[B, L, D]{U_tensor}`` is reduce-scattered here instead of all-reduced; otherwise L stays whole."""
    return constrain(x_BLD, ("batch", "residual_length", "embed"))


def sub_block_input(h_BLD: jax.Array) -> jax.Array:
    """A norm's output, computed on the residual layout, then whole along L for attention or the MLP:
    under sequence parallelism the all-gather ``h[B, L_tensor, D] -> h[B, L, D]`` over ``tensor``."""
    return constrain(residual(h_BLD), ("batch", "length", "embed"))


class GPT(nnx.Module):
    """``GPT(cfg, rngs=nnx.Rngs(0))(tokens_BL) -> logits_BLV`` (f32)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, nnx.initializers.normal(stddev=1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.blocks = Stack(lambda r: Block(cfg, rngs=r), cfg.n_layers, rngs=rngs, remat=cfg.policy)
        self.final_norm = RMSNorm(cfg.d_model, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = param(rngs, nnx.initializers.truncated_normal(stddev=cfg.d_model**-0.5),
                              (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed_tokens(self, tokens_BL: jax.Array) -> jax.Array:
        """The token embedding: ``tokens[B, L] -> x[B, L, D]`` in the compute dtype, on the residual layout.

        The lookup is constrained whole along L before the residual layout: under sequence parallelism
        its vocab-parallel partial sums are then one reduce-scatter (a lookup constrained straight to
        ``L_tensor`` makes GSPMD gather the tokens over the batch axes and permute the result)."""
        x_BLD = jnp.take(weight(self.embed, self.cfg.compute_dtype), tokens_BL, axis=0)
        return residual(constrain(x_BLD, ("batch", "length", "embed")))

    def hidden(self, tokens_BL: jax.Array) -> jax.Array:
        """The final-normed hidden states ``x[B, L, D]`` the head reads."""
        x_BLD = self.embed_tokens(tokens_BL)
        positions_L = jnp.arange(tokens_BL.shape[1])
        return residual(self.final_norm(self.blocks(x_BLD, positions_L)))

    @property
    def out_weight(self) -> nnx.Param:
        """The output head's weight: ``W[D, V]``, or ``E[V, D]`` when tied."""
        return self.embed if self.cfg.tie_embeddings else self.head

    def logits(self, x_BLD: jax.Array) -> jax.Array:
        """The head: ``x[B, L, D] -> logits[B, L, V]`` in f32."""
        return _head_logits(self.cfg, x_BLD, self.out_weight)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return self.logits(self.hidden(tokens_BL))

    def loss(self, tokens_BL: jax.Array, targets_BL: jax.Array, *, z_loss: float = 0.0,
             pipeline: PipelineConfig | None = None) -> tuple[jax.Array, dict]:
        """``lm_loss(self(tokens), targets)``; with a ``pipeline`` config the blocks run as a pipeline
        over the ``pipe`` axis (embedding before it; final norm, head and loss on its last stage)."""
        if pipeline is None or not pipeline.enabled:
            if self.cfg.loss_chunk:
                return chunked_lm_loss(self.hidden(tokens_BL), self.logits, targets_BL, chunk=self.cfg.loss_chunk,
                                       z_loss=z_loss)
            return lm_loss(self(tokens_BL), targets_BL, z_loss=z_loss)
        cfg = self.cfg
        x_BLD = self.embed_tokens(tokens_BL)
        apply, block_state = self.blocks.split()
        norm_def, norm_state = nnx.split(self.final_norm)

        def stage_fn(layers_state, x_BLD):
            return apply(layers_state, x_BLD, jnp.arange(x_BLD.shape[1]))

        def head_fn(head, y_BLD, tg_BL):
            x_BLD = nnx.merge(norm_def, head[0])(y_BLD)
            return lm_loss(_head_logits(cfg, x_BLD, head[1]), tg_BL, z_loss=z_loss, onehot=True)

        return pipelined_loss(pipeline, stage_fn, head_fn, block_state, (norm_state, self.out_weight), x_BLD,
                              targets_BL)


def _head_logits(cfg: GPTConfig, x_BLD: jax.Array, w: nnx.Param | jax.Array) -> jax.Array:
    """``x[B, L, D] -> logits[B, L, V]`` in f32 through the head weight ``w`` (``W[D, V]``, or the
    embedding ``E[V, D]`` scaled by ``D**-0.5`` when ``cfg.tie_embeddings``)."""
    dt = cfg.compute_dtype
    if cfg.tie_embeddings:
        logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, weight(w, dt)) * cfg.d_model**-0.5
    else:
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, weight(w, dt))
    return constrain(logits_BLV.astype(jnp.float32), ("batch", "length", "vocab"))
