"""Causal attention kernels: ``attend(q, k, v, impl=...)``, one function, several implementations.

Shapes: ``q[B, L, H, K]``, ``k, v[B, L, G, K]`` with ``H = G * R`` (grouped KV heads), RoPE already
applied; returns ``out[B, L, H, K]`` in ``q``'s dtype. Softmax runs in f32.

Implementations (``GPTConfig.attention``):

- ``naive``: the full ``[B, G, R, L, L]`` score matrix in f32 (quadratic memory in L);
- ``auto``: the best implementation for this backend and shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "naive")


def naive(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array) -> jax.Array:
    """Scores materialised whole: ``softmax(q k^T / sqrt(K) + causal) v``."""
    b, l, h, k = q_BLHK.shape
    g = k_BLGK.shape[2]
    q_BLGRK = q_BLHK.reshape(b, l, g, h // g, k)
    scores_BGRLL = jnp.einsum("bqgrk,bsgk->bgrqs", q_BLGRK, k_BLGK).astype(jnp.float32) * k**-0.5
    causal_LL = jnp.tril(jnp.ones((l, l), dtype=bool))
    scores_BGRLL = jnp.where(causal_LL, scores_BGRLL, jnp.finfo(jnp.float32).min)
    probs_BGRLL = jax.nn.softmax(scores_BGRLL, axis=-1).astype(q_BLHK.dtype)
    out_BLGRK = jnp.einsum("bgrqs,bsgk->bqgrk", probs_BGRLL, v_BLGK)
    return out_BLGRK.reshape(b, l, h, k)


def attend(q_BLHK: jax.Array, k_BLGK: jax.Array, v_BLGK: jax.Array, *, impl: str = "auto", block: int = 512) -> jax.Array:
    """Causal attention of ``q`` over ``k, v`` with the implementation ``impl`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"attention implementation {impl!r} is not one of {IMPLS}")
    return naive(q_BLHK, k_BLGK, v_BLGK)
