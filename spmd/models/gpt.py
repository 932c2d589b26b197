"""GPT-style decoder-only transformer, written as single-device code with logical dims.

token embedding ``E[V, D]`` -> n_layers x (RMSNorm -> causal attention with RoPE (optionally
grouped KV heads) -> residual -> RMSNorm -> gated MLP -> residual), run as a :class:`Stack`
(scanned or unrolled: ``scan_layers``) -> final RMSNorm -> output head ``W[D, V]`` (or ``E``
transposed when tied) -> logits in f32.

Which dims shard over which mesh axes is decided by the rule set, not here; this module only
names dims. Parameters are f32 (``param_dtype``); matmuls run in ``dtype`` (bf16 or f32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd import remat as remat_lib
from spmd.constraints import constrain
from spmd.models import attention as attention_lib
from spmd.models import context, embedding
from spmd.models.layers import Attention, GatedMLP, RMSNorm, param, weight
from spmd.models.lora import LoRASpec
from spmd.models.loss import chunked_lm_loss, lm_loss
from spmd.models.loss import head_logits as _head_logits
from spmd.models.loss import with_moe_losses as _with_moe_losses
from spmd.models.moe import EXCHANGES, MoE
from spmd.models.piped import pipelined_lm_loss
from spmd.models.router import ROUTERS
from spmd.pipeline import PipelineConfig
from spmd.stack import FORMS as STACK_FORMS
from spmd.stack import Stack, stack_form

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
    rope_scaling: str = "none"  # "none" | "llama3" (frequencies scaled as Llama 3.1: the rope_* fields below)
    rope_factor: float = 8.0  # llama3: low frequencies divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over original_length / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under original_length / this are kept
    rope_original_length: int = 8192  # llama3: the context length the model was pretrained on
    norm_eps: float = 1e-6  # RMSNorm epsilon
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False
    tied_head_scale: bool = True  # tied head E^T scaled by d_model**-0.5; False: unscaled (Hugging Face)
    max_length: int = 0  # > 0: longer sequences are refused (a sliding window this model does not run)
    dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
    remat: bool = False  # shorthand for remat_policy "full" (True) / "none" (False)
    remat_policy: str = ""  # a spmd.remat policy name; "" takes it from remat
    scan_layers: str = "auto"  # the block stack: "scanned" | "unrolled" | "auto" (by depth and backend: spmd.stack.stack_form)
    attention: str = "auto"  # a spmd.models.attention implementation
    attention_block: int = 512  # query/key block of the blockwise attention paths
    context_exchange: str = "ring"  # K/V exchange when the length is split over seq: "ring" | "allgather"
    loss_chunk: int = 0  # cross-entropy over this many positions at a time (0: all at once)
    # mixture of experts (spmd.models.moe; docs/moe.md): 0 experts = dense MLPs everywhere
    n_experts: int = 0
    experts_per_token: int = 2  # top-k
    moe_every: int = 1  # every n-th block is MoE (blocks n-1, 2n-1, ...); 1: all
    moe_d_ff: int | None = None  # width F of each expert (and shared expert); None: d_ff
    capacity_factor: float = 0.0  # slots per expert = ceil(cf * tokens * k / E) per device; 0: dropless
    moe_exchange: str = "auto"  # dropless rows under expert parallelism: "ragged" | "padded" | "auto" (by backend)
    router: str = "softmax"  # "softmax" | "sigmoid"
    n_shared_experts: int = 0  # always-on experts (one SwiGLU of width n * moe_d_ff)
    aux_loss_weight: float = 0.01  # x load-balancing loss (mean over MoE blocks)
    router_z_loss_weight: float = 0.001  # x router z-loss (mean over MoE blocks)

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
        if self.scan_layers not in STACK_FORMS:
            raise ValueError(f"GPTConfig.scan_layers {self.scan_layers!r} is not one of {STACK_FORMS}")
        if self.attention not in attention_lib.IMPLS:
            raise ValueError(f"GPTConfig.attention {self.attention!r} is not one of {attention_lib.IMPLS}")
        if self.context_exchange not in context.EXCHANGES:
            raise ValueError(f"GPTConfig.context_exchange {self.context_exchange!r} is not one of {context.EXCHANGES}")
        if self.attention_block < 1 or self.loss_chunk < 0:
            raise ValueError(f"GPTConfig.attention_block must be >= 1 and loss_chunk >= 0, got "
                             f"{self.attention_block}, {self.loss_chunk}")
        if self.rope_scaling not in ("none", "llama3") or self.norm_eps <= 0 or self.max_length < 0:
            raise ValueError(f"GPTConfig.rope_scaling {self.rope_scaling!r} must be 'none' or 'llama3', norm_eps > 0 "
                             f"and max_length >= 0, got {self.norm_eps}, {self.max_length}")
        self._check_moe()

    def _check_moe(self) -> None:
        for name in ("n_experts", "n_shared_experts", "capacity_factor", "aux_loss_weight", "router_z_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"GPTConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.router not in ROUTERS:
            raise ValueError(f"GPTConfig.router {self.router!r} is not one of {ROUTERS}")
        if self.moe_exchange not in ("auto", *EXCHANGES):
            raise ValueError(f"GPTConfig.moe_exchange {self.moe_exchange!r} is not one of {('auto', *EXCHANGES)}")
        if not self.n_experts:
            return
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"GPTConfig.experts_per_token={self.experts_per_token} must be between 1 and "
                             f"n_experts={self.n_experts}")
        if self.moe_every < 1 or self.n_layers % self.moe_every:
            raise ValueError(f"GPTConfig.moe_every={self.moe_every} must be >= 1 and divide n_layers={self.n_layers}")
        if self.moe_d_ff is not None and self.moe_d_ff < 1:
            raise ValueError(f"GPTConfig.moe_d_ff must be >= 1 or None (= d_ff), got {self.moe_d_ff}")

    @property
    def policy(self) -> str:
        """The remat policy name in effect."""
        return self.remat_policy or remat_lib.resolve(self.remat)

    @property
    def llama3_scaling(self) -> tuple[float, float, float, int] | None:
        """``(factor, low, high, original length)`` of llama3 RoPE scaling, or None (``spmd.models.layers.rope``)."""
        if self.rope_scaling != "llama3":
            return None
        return self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_length

    def stack_form(self, backend: str | None = None) -> str:
        """``scanned`` or ``unrolled``: how the blocks run on ``backend`` (default: jax's)."""
        return stack_form(self.scan_layers, _make_block(self)[1], backend)

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

    @property
    def expert_ff(self) -> int:
        return self.moe_d_ff or self.ff


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x)).

    With ``moe=True`` the MLP is a :class:`MoE` and the block returns ``(x, stats)`` (the MoE's
    losses and load statistics, which :class:`Stack` sums over layers)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, moe: bool = False, lora: LoRASpec | None = None):
        self.attn_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k, rngs=rngs,
                              rope_theta=cfg.rope_theta, dtype=cfg.compute_dtype, impl=cfg.attention,
                              block=cfg.attention_block, exchange=cfg.context_exchange, bias=cfg.qkv_bias,
                              rope_scaling=cfg.llama3_scaling, lora=lora)
        self.mlp_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        self.mlp: MoE | GatedMLP
        if moe:
            self.mlp = MoE(cfg.d_model, cfg.expert_ff, cfg.n_experts, cfg.experts_per_token, rngs=rngs,
                           capacity_factor=cfg.capacity_factor, router=cfg.router, n_shared=cfg.n_shared_experts,
                           dtype=cfg.compute_dtype, exchange=None if cfg.moe_exchange == "auto" else cfg.moe_exchange)
        else:
            self.mlp = GatedMLP(cfg.d_model, cfg.ff, rngs=rngs, dtype=cfg.compute_dtype, lora=lora)

    def __call__(self, x_BLD: jax.Array, positions_L: jax.Array, *segment_ids: jax.Array) -> jax.Array | tuple[jax.Array, dict]:
        x_BLD = x_BLD + residual(self.attn(sub_block_input(self.attn_norm(x_BLD)), positions_L, *segment_ids))
        if isinstance(self.mlp, MoE):
            y_BLD, stats = self.mlp(sub_block_input(self.mlp_norm(x_BLD)))
            return residual(x_BLD + residual(y_BLD)), stats
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


class MoEGroup(nnx.Module):
    """``moe_every - 1`` dense blocks, then one MoE block: the unit a Stack repeats when only every
    n-th block is MoE. Returns ``(x, stats)``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, lora: LoRASpec | None = None):
        self.dense = nnx.List([Block(cfg, rngs=rngs, lora=lora) for _ in range(cfg.moe_every - 1)])
        self.moe = Block(cfg, rngs=rngs, moe=True, lora=lora)

    def __call__(self, x_BLD: jax.Array, positions_L: jax.Array, *segment_ids: jax.Array) -> tuple[jax.Array, dict]:
        for block in self.dense:
            x_BLD = cast(jax.Array, block(x_BLD, positions_L, *segment_ids))  # a dense Block returns x alone
        return cast(tuple[jax.Array, dict], self.moe(x_BLD, positions_L, *segment_ids))  # a MoE Block returns (x, stats)


def _make_block(cfg: GPTConfig, lora: LoRASpec | None = None) -> tuple[Callable[[nnx.Rngs], nnx.Module], int]:
    """The Stack's repeated unit and its count: a Block (dense, or MoE when every block is), or a MoEGroup."""
    if not cfg.n_experts:
        return (lambda r: Block(cfg, rngs=r, lora=lora)), cfg.n_layers
    if cfg.moe_every == 1:
        return (lambda r: Block(cfg, rngs=r, moe=True, lora=lora)), cfg.n_layers
    return (lambda r: MoEGroup(cfg, rngs=r, lora=lora)), cfg.n_layers // cfg.moe_every


class GPT(nnx.Module):
    """``GPT(cfg, rngs=nnx.Rngs(0))(tokens_BL) -> logits_BLV`` (f32).

    ``lora``: LoRA adapters on the projections it targets (:mod:`spmd.models.lora`; on the attention of MoE
    blocks, not on their experts); None (the default) adds none."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, lora: LoRASpec | None = None):
        self.cfg, self.lora = cfg, lora
        self.embed = param(rngs, nnx.initializers.normal(stddev=1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        make_block, n_blocks = _make_block(cfg, lora)
        self.blocks = Stack(make_block, n_blocks, rngs=rngs, remat=cfg.policy, scan=cfg.scan_layers)
        self.final_norm = RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = param(rngs, nnx.initializers.truncated_normal(stddev=cfg.d_model**-0.5),
                              (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed_tokens(self, tokens_BL: jax.Array) -> jax.Array:
        """The token embedding: ``tokens[B, L] -> x[B, L, D]`` in the compute dtype, on the residual layout.

        The lookup is constrained whole along L before the residual layout: under sequence parallelism
        its vocab-parallel partial sums are then one reduce-scatter (a lookup constrained straight to
        ``L_tensor`` makes GSPMD gather the tokens over the batch axes and permute the result). Inside a
        manual region the lookup is spelled out per vocab shard (:mod:`spmd.models.embedding`)."""
        x_BLD = embedding.lookup(weight(self.embed, self.cfg.compute_dtype), tokens_BL)
        return residual(constrain(x_BLD, ("batch", "length", "embed")))

    def hidden(self, tokens_BL: jax.Array) -> jax.Array:
        """The final-normed hidden states ``x[B, L, D]`` the head reads."""
        return self.hidden_and_stats(tokens_BL)[0]

    def hidden_and_stats(self, tokens_BL: jax.Array, segment_ids: jax.Array | None = None,
                         positions_BL: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        """``(hidden states x[B, L, D], MoE stats summed over MoE blocks or None when dense)``.

        Under context parallelism (``length`` over ``seq``) the positions are in
        ``context.sequence_order`` (load-balanced chunks) and so are the hidden states. Packed
        documents (``segment_ids[B, L]``, ``positions[B, L]``: :mod:`spmd.models.segments`) attend
        within their segment only, with RoPE positions from ``positions``."""
        if self.cfg.max_length and tokens_BL.shape[1] > self.cfg.max_length:
            raise ValueError(f"sequence length {tokens_BL.shape[1]} exceeds GPTConfig.max_length={self.cfg.max_length} "
                             "(this model's sliding window, which does not run here): use sequences up to it")
        order = context.sequence_order(tokens_BL.shape[1])
        positions_L = jnp.arange(tokens_BL.shape[1]) if order is None else jnp.asarray(order)
        x_BLD = self.embed_tokens(tokens_BL if order is None else tokens_BL[:, order])
        if segment_ids is not None:
            return self._packed_hidden(x_BLD, segment_ids, positions_BL, order)
        out = self.blocks(x_BLD, positions_L)
        x_BLD, stats = out if isinstance(out, tuple) else (out, None)
        return residual(self.final_norm(x_BLD)), stats

    def _packed_hidden(self, x_BLD, segment_ids, positions_BL, order):
        if positions_BL is None:
            raise ValueError("GPT: segment_ids need positions[B, L] (each token's index in its document)")
        if order is not None:
            segment_ids, positions_BL = segment_ids[:, order], positions_BL[:, order]
        out = self.blocks(x_BLD, positions_BL, segment_ids)
        x_BLD, stats = out if isinstance(out, tuple) else (out, None)
        return residual(self.final_norm(x_BLD)), stats

    @property
    def out_weight(self) -> nnx.Param:
        """The output head's weight: ``W[D, V]``, or ``E[V, D]`` when tied."""
        return self.embed if self.cfg.tie_embeddings else self.head

    def logits(self, x_BLD: jax.Array) -> jax.Array:
        """The head: ``x[B, L, D] -> logits[B, L, V]`` in f32."""
        return _head_logits(self.cfg, x_BLD, self.out_weight)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        logits_BLV = self.logits(self.hidden(tokens_BL))
        order = context.sequence_order(tokens_BL.shape[1])
        return logits_BLV if order is None else logits_BLV[:, np.argsort(order)]  # back to natural order

    def loss(self, tokens_BL: jax.Array, targets_BL: jax.Array, *, z_loss: float = 0.0,
             pipeline: PipelineConfig | None = None, **packed: jax.Array) -> tuple[jax.Array, dict]:
        """``lm_loss(self(tokens), targets)``; with a ``pipeline`` config the blocks run as a pipeline
        over the ``pipe`` axis (embedding before it; final norm, head and loss on its last stage).

        ``packed``: ``segment_ids``, ``positions`` (packed documents, see :meth:`hidden_and_stats`)
        and ``weights[B, L]`` (the loss is ``mean(weights * ce)``; :mod:`spmd.models.loss`)."""
        if packed:
            from spmd.models.packed import packed_loss

            return packed_loss(self, tokens_BL, targets_BL, z_loss=z_loss, pipeline=pipeline, **packed)
        if pipeline is None or not pipeline.enabled:
            x_BLD, stats = self.hidden_and_stats(tokens_BL)
            order = context.sequence_order(targets_BL.shape[1])
            targets_BL = targets_BL if order is None else targets_BL[:, order]  # the mean is order-free
            if self.cfg.loss_chunk:
                out = chunked_lm_loss(x_BLD, self.logits, targets_BL, chunk=self.cfg.loss_chunk, z_loss=z_loss)
            else:
                out = lm_loss(self.logits(x_BLD), targets_BL, z_loss=z_loss)
            return out if stats is None else _with_moe_losses(self.cfg, *out, stats)
        return pipelined_lm_loss(self, tokens_BL, targets_BL, z_loss, pipeline)
