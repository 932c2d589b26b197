"""A decoder LM written by a user, not the built-in GPT, trained on the toolkit's byte corpus.

    python -m trainers.examples.decoder
    spmd-train trainers.examples.decoder:task --simulate-devices 8

Parallel attention + GELU MLP blocks on one LayerNorm, learned positions, dropout, in an
:class:`spmd.Stack`. Its layout under ``fsdp_tp``: docs/models.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import meshes
from spmd import Stack, constrain
from trainers.checkpoint import CheckpointConfig
from trainers.config import Config, MeshConfig, RunConfig
from trainers.data import DataConfig, TokenWindows, load_corpus
from trainers.loop import train
from trainers.lr import LRConfig
from trainers.optim import OptimizerConfig
from trainers.task import Task


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 256
    max_len: int = 128  # learned positions: sequences up to this length
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 512
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} does not divide by n_heads {self.n_heads}")


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], dims: tuple[str | None, ...]) -> nnx.Param:
    """A parameter initialised by ``init`` whose dims have the logical names ``dims``."""
    return nnx.Param(nnx.with_partitioning(init, dims)(rngs.params(), shape))


def _layer_norm(rngs: nnx.Rngs, d: int) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, rngs=rngs, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


class ParallelBlock(nnx.Module):
    """``(x, key) -> (x + dropout(attn(h)) + dropout(mlp(h)), next key)`` with ``h = LayerNorm(x)``."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, h, f = cfg.d_model, cfg.n_heads, cfg.d_ff
        k = d // h
        out_init = nnx.initializers.normal(stddev=0.02 / (2 * cfg.n_layers) ** 0.5)  # GPT-2's residual scaling
        self.norm = _layer_norm(rngs, d)
        self.w_qkv = _param(rngs, nnx.initializers.normal(d**-0.5), (d, 3, h, k), ("embed", None, "heads", "head_dim"))
        self.w_o = _param(rngs, out_init, (h, k, d), ("heads", "head_dim", "embed"))
        self.b_o = _param(rngs, nnx.initializers.zeros, (d,), ("embed",))
        self.w_in = _param(rngs, nnx.initializers.normal(d**-0.5), (d, f), ("embed", "mlp"))
        self.b_in = _param(rngs, nnx.initializers.zeros, (f,), ("mlp",))
        self.w_out = _param(rngs, out_init, (f, d), ("mlp", "embed"))
        self.b_out = _param(rngs, nnx.initializers.zeros, (d,), ("embed",))
        self.dropout = nnx.Dropout(cfg.dropout)

    def attention(self, h_BLD: jax.Array) -> jax.Array:
        q_BLHK, k_BLHK, v_BLHK = jnp.einsum("bld,dthk->tblhk", h_BLD, self.w_qkv[...])
        length, head_dim = h_BLD.shape[1], q_BLHK.shape[-1]
        scores_BHLL = jnp.einsum("bqhk,bshk->bhqs", q_BLHK, k_BLHK) * head_dim**-0.5
        causal_LL = jnp.tril(jnp.ones((length, length), bool))
        probs_BHLL = jax.nn.softmax(jnp.where(causal_LL, scores_BHLL, jnp.finfo(scores_BHLL.dtype).min), axis=-1)
        out_BLHK = jnp.einsum("bhqs,bshk->bqhk", probs_BHLL, v_BLHK)
        return jnp.einsum("blhk,hkd->bld", out_BLHK, self.w_o[...]) + self.b_o[...]

    def mlp(self, h_BLD: jax.Array) -> jax.Array:
        return jax.nn.gelu(h_BLD @ self.w_in[...] + self.b_in[...]) @ self.w_out[...] + self.b_out[...]

    def __call__(self, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        x_BLD, key = carry
        key, attn_key, mlp_key = jax.random.split(key, 3)
        h_BLD = self.norm(x_BLD)
        x_BLD = x_BLD + self.dropout(self.attention(h_BLD), rngs=attn_key) + self.dropout(self.mlp(h_BLD), rngs=mlp_key)
        return constrain(x_BLD, ("batch", "length", "embed")), key  # activations follow the batch, not the weights


class Decoder(nnx.Module):
    """``Decoder(cfg, rngs=...)(tokens[B, L], key=None) -> logits[B, L, V]``; ``key`` draws the dropout
    masks (default: the next key of the model's own stream; eval mode, ``model.eval()``, uses none)."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.tokens = _param(rngs, nnx.initializers.normal(0.02), (cfg.vocab_size, d), ("vocab", "embed"))
        self.positions = _param(rngs, nnx.initializers.normal(0.02), (cfg.max_len, d), (None, "embed"))
        self.dropout = nnx.Dropout(cfg.dropout)
        self.rngs = nnx.Rngs(dropout=rngs.params())  # the model's dropout stream
        self.blocks = Stack(lambda r: ParallelBlock(cfg, rngs=r), cfg.n_layers, rngs=rngs)
        self.norm = _layer_norm(rngs, d)
        self.head = _param(rngs, nnx.initializers.normal(d**-0.5), (d, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_BL: jax.Array, key: jax.Array | None = None) -> jax.Array:
        key = self.rngs.dropout() if key is None else key
        key, embed_key = jax.random.split(key)
        x_BLD = jnp.take(self.tokens[...], tokens_BL, axis=0) + self.positions[: tokens_BL.shape[1]]
        x_BLD = constrain(x_BLD, ("batch", "length", "embed"))
        x_BLD, _ = self.blocks((self.dropout(x_BLD, rngs=embed_key), key))  # type: ignore[arg-type]  # a tuple carry
        return self.norm(x_BLD) @ self.head[...]


# The user's program: model size, data, loss, task.
MODEL = DecoderConfig()


def loss(model, batch, rngs):
    logits_BLV = model(batch["inputs"], rngs.dropout())  # this step's dropout key, the same on every layout
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()


config = Config(
    mesh=MeshConfig(axes="data=2,fsdp=2,tensor=2"), rules="fsdp_tp",
    optimizer=OptimizerConfig(name="adamw", b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0),
    lr=LRConfig(kind="cosine", peak_lr=3e-3, warmup_steps=30),
    data=DataConfig(corpus="stdlib", seq_len=MODEL.max_len, global_batch=16),
    checkpoint=CheckpointConfig(every_steps=100),
    run=RunConfig(name="decoder", steps=300, eval_every=50, eval_batches=4, log_every=10))
task = Task(model=lambda rngs: Decoder(MODEL, rngs=rngs), loss=loss, name="decoder", config=config,
            data=lambda cfg: TokenWindows(load_corpus(cfg.data, "train"), cfg.data.seq_len),
            eval_data=lambda cfg: TokenWindows(load_corpus(cfg.data, "validation"), cfg.data.seq_len),
            tokens_per_example=config.data.seq_len,
            vocab_size=MODEL.vocab_size)  # each batch's inputs and targets are checked to lie in [0, 256)

if __name__ == "__main__":
    meshes.simulate_cpu_devices_unless_accelerator(8)
    print(train(task.config, task).eval_losses)
