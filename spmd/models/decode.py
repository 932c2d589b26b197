"""Autoregressive generation from a :class:`GPT` with a KV cache: prefill the prompt, then decode.

    tokens_BN = generate(model, prompt_BP, max_new_tokens=32, temperature=0.0)   # greedy

The model's own blocks run (``Attention.qkv`` / ``Attention.out``, its norms and MLP or MoE),
scanned over the stacked layers with a cache ``k, v[layers, B, P + N, n, K]`` (n KV slots).
Under a layout (``mesh`` and ``rules``, the training rule sets) the batch shards as ``batch``
and the cache's KV slots as ``kv_heads``: heads over ``tensor``, one all-reduce of the
row-parallel output per layer and token, as in training; GQA reads each KV slot once for its
query heads. Sampling: temperature 0 is greedy; else top-k, then top-p (nucleus), then a draw
with a key folded from ``seed`` and the step, so a seed gives the same tokens on any layout.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import Mesh

from spmd.constraints import constrain, use_rules
from spmd.models.gpt import GPT, Block
from spmd.models.layers import kv_slots
from spmd.rules import Rules

CACHE_DIMS = (None, "batch", None, "kv_heads", "head_dim")
LAYER_LOOPS = ("auto", "scan", "unrolled")
# auto: the layers as a Python loop on CPU and GPU, scanned on TPU. The scanned step slices every layer's
# weights out of the stacked arrays and rewrites the whole stacked cache on each token; the loop reads
# per-layer buffers and updates each layer's cache in place (CPU, `benchmarks.decode_gpu --quick`: 1.8x the
# tokens/s at batch 1). Its cost: one copy of the block weights for the call (the per-layer buffers).
UNROLLED_ON = ("cpu", "gpu")
Layers = Any
Cache = Any


def cached_attention(q_BLHK: jax.Array, k_BTnK: jax.Array, v_BTnK: jax.Array, positions_L: jax.Array) -> jax.Array:
    """Causal attention of queries at ``positions_L`` over a cache of ``T`` slots (slot t = position t;
    slots after a query's position are masked, written or not), grouped: query heads ``n * R``."""
    b, length, h, k = q_BLHK.shape
    n = k_BTnK.shape[2]
    q_BLnRK = q_BLHK.reshape(b, length, n, h // n, k)
    scores = jnp.einsum("blnrk,btnk->bnrlt", q_BLnRK, k_BTnK, preferred_element_type=jnp.float32) * k**-0.5
    mask_LT = jnp.arange(k_BTnK.shape[1])[None, :] <= positions_L[:, None]
    probs = jax.nn.softmax(jnp.where(mask_LT, scores, -jnp.inf), axis=-1).astype(v_BTnK.dtype)
    return jnp.einsum("bnrlt,btnk->blnrk", probs, v_BTnK).reshape(b, length, h, k)


def _block_step(block: Block, x_BLD: jax.Array, k_BTnK: jax.Array, v_BTnK: jax.Array, positions_L: jax.Array,
                start: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block on ``x_BLD`` at ``positions_L``, its k and v written into its cache at ``start``."""
    q_BLHK, k_BLnK, v_BLnK = block.attn.qkv(block.attn_norm(x_BLD), positions_L)
    k_BTnK = jax.lax.dynamic_update_slice_in_dim(k_BTnK, k_BLnK.astype(k_BTnK.dtype), start, axis=1)
    v_BTnK = jax.lax.dynamic_update_slice_in_dim(v_BTnK, v_BLnK.astype(v_BTnK.dtype), start, axis=1)
    x_BLD = x_BLD + block.attn.out(cached_attention(q_BLHK, k_BTnK, v_BTnK, positions_L))
    y = block.mlp(block.mlp_norm(x_BLD))  # a MoE returns (y, its statistics)
    return x_BLD + (y[0] if isinstance(y, tuple) else y), k_BTnK, v_BTnK


def _step(model: GPT, layers: Layers, tokens_BL: jax.Array, start: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Run ``tokens_BL`` at positions ``start + arange(L)`` through every block, writing their k and v
    into the cache; returns (last position's logits[B, V] in f32, cache).

    ``layers``: ``(graphdef, params, rest)`` stacked over layers with a stacked cache ``(k, v)`` (the blocks
    scanned), or a list of per-layer blocks with a list of per-layer ``(k, v)`` (a Python loop: each
    block's weights and cache are buffers of their own, so a step reads each weight once and updates
    each cache in place, where a scanned step slices the stacked weights and rewrites the stacked cache)."""
    positions_L = start + jnp.arange(tokens_BL.shape[1])
    x_BLD = model.embed_tokens(tokens_BL)
    if isinstance(layers, list):
        new = []
        for block, (k_BTnK, v_BTnK) in zip(layers, cache):
            x_BLD, k_BTnK, v_BTnK = _block_step(block, x_BLD, k_BTnK, v_BTnK, positions_L, start)
            new.append((constrain(k_BTnK, CACHE_DIMS[1:]), constrain(v_BTnK, CACHE_DIMS[1:])))
        return model.logits(model.final_norm(x_BLD[:, -1:]))[:, 0], new
    graphdef, params, rest = layers

    def body(x_BLD, layer):
        params, rest, k_BTnK, v_BTnK = layer
        x_BLD, k_BTnK, v_BTnK = _block_step(nnx.merge(graphdef, params, rest), x_BLD, k_BTnK, v_BTnK, positions_L,
                                            start)
        return x_BLD, (k_BTnK, v_BTnK)

    x_BLD, stacked = jax.lax.scan(body, x_BLD, (params, rest, *cache))
    return model.logits(model.final_norm(x_BLD[:, -1:]))[:, 0], tuple(constrain(c, CACHE_DIMS) for c in stacked)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next tokens ``[B]``: argmax at temperature 0; else a draw from ``softmax(logits / temperature)``
    restricted to the ``top_k`` most likely tokens (0: all) and then to the smallest set whose
    probability reaches ``top_p`` (1.0: all)."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p < 1.0:
        sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p  # the first token is always kept
        cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        logits_BV = jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def _emit(on_tokens: Callable[[np.ndarray], None] | None, token_B: jax.Array) -> None:
    """Hand the step's tokens to ``on_tokens`` on the host as they are made (in order), when given."""
    if on_tokens is not None:
        io_callback(lambda t: on_tokens(np.asarray(t)), None, token_B, ordered=True)


def layer_loop(loop: str, backend: str | None = None) -> str:
    """``scan`` or ``unrolled``: ``loop`` itself, or for ``auto`` unrolled on the backends of :data:`UNROLLED_ON`."""
    if loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop {loop!r} is not one of {', '.join(LAYER_LOOPS)}")
    if loop != "auto":
        return loop
    return "unrolled" if (backend or jax.default_backend()) in UNROLLED_ON else "scan"


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 8, 9, 10, 11))  # the seed is traced: one program for any seed
def _generate(graphdef, state, prompt_BP, max_new_tokens, temperature, top_k, top_p, seed, mesh, rules, on_tokens,
              loop):
    with use_rules(rules, mesh) if mesh is not None else contextlib.nullcontext():
        model = nnx.merge(graphdef, state)
        cfg = model.cfg
        b, p = prompt_BP.shape
        shape = (b, p + max_new_tokens, kv_slots(cfg.n_heads, cfg.kv_heads), cfg.k)
        block_def, params, rest = nnx.split(model.blocks.block, nnx.Param, ...)
        layers: Layers
        cache: Cache
        if loop == "unrolled":  # each layer's weights sliced once per call, outside the token loop
            layers = [nnx.merge(block_def, *jax.tree.map(lambda a, i=i: a[i], (params, rest)))
                      for i in range(cfg.n_layers)]
            cache = [tuple(constrain(jnp.zeros(shape, cfg.compute_dtype), CACHE_DIMS[1:]) for _ in range(2))
                     for _ in range(cfg.n_layers)]
        else:
            layers = (block_def, params, rest)
            cache = tuple(constrain(jnp.zeros((cfg.n_layers, *shape), cfg.compute_dtype), CACHE_DIMS) for _ in range(2))
        key = jax.random.key(seed)
        logits_BV, cache = _step(model, layers, prompt_BP, jnp.int32(0), cache)
        first_B = sample(logits_BV, jax.random.fold_in(key, 0), temperature, top_k, top_p)
        _emit(on_tokens, first_B)

        def decode(carry, i):
            token_B, cache = carry
            logits_BV, cache = _step(model, layers, token_B[:, None], p + i, cache)
            token_B = sample(logits_BV, jax.random.fold_in(key, i + 1), temperature, top_k, top_p)
            _emit(on_tokens, token_B)
            return (token_B, cache), token_B

        _, rest_NB = jax.lax.scan(decode, (first_B, cache), jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
        return jnp.concatenate([first_B[:, None], rest_NB.T], axis=1)


def generate(model: GPT, prompt_tokens: np.ndarray | jax.Array, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, *, mesh: Mesh | None = None,
             rules: Rules | str | None = None, on_tokens: Callable[[np.ndarray], None] | None = None,
             loop: str = "auto") -> jax.Array:
    """``max_new_tokens`` tokens ``[B, N]`` (int32) continuing ``prompt_tokens[B, P]``, one jitted program
    (prefill, then a scan of decode steps). ``mesh`` and ``rules`` lay the batch and heads out as in
    training (the model's parameters already sharded on that mesh, e.g. by ``trainers.load_model``).
    ``on_tokens``: called on the host with each step's tokens ``[B]`` as they are made, in order (streaming).
    ``loop``: the layers per token as a ``scan`` or ``unrolled`` (a Python loop over per-layer weight and
    cache buffers; :func:`layer_loop` says what ``auto`` picks); the same tokens either way."""
    cfg = model.cfg
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be [batch, length >= 1], got shape {prompt.shape}")
    if max_new_tokens < 1 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need max_new_tokens >= 1, temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got "
                         f"{max_new_tokens}, {temperature}, {top_k}, {top_p}")
    if not isinstance(model.blocks.block, Block):
        raise ValueError(f"generation runs models whose stack repeats one block; moe_every={cfg.moe_every} does not")
    total = prompt.shape[1] + max_new_tokens
    if cfg.max_length and total > cfg.max_length:
        raise ValueError(f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"GPTConfig.max_length={cfg.max_length}")
    if int(jnp.max(prompt)) >= cfg.vocab_size or int(jnp.min(prompt)) < 0:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got {int(jnp.min(prompt))}.."
                         f"{int(jnp.max(prompt))}")
    form = layer_loop(loop)
    graphdef, state = nnx.split(model)
    if mesh is not None:
        with jax.set_mesh(mesh):
            return _generate(graphdef, state, prompt, max_new_tokens, float(temperature), int(top_k), float(top_p),
                             int(seed), mesh, rules if rules is not None else "none", on_tokens, form)
    return _generate(graphdef, state, prompt, max_new_tokens, float(temperature), int(top_k), float(top_p),
                     int(seed), None, None, on_tokens, form)
