"""The MoE router: top-k experts per token, their gates, and the load-balancing and z losses.

Single-device code on the whole batch ``x[B, L, D]``: under any rule set the router's matmul is
local to each token (``W_router[D, E]`` replicated), and the loss statistics are means over the
global batch (XLA all-reduces them over the batch axes; inside a region manual over batch axes, ``route``'s
``axes`` name them), so every mesh gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ROUTERS = ("softmax", "sigmoid")


STATS = ("aux_loss", "z_loss", "load_max", "load_min")  # Routing.stats' keys


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes: ``experts[T, K]`` (distinct per token), ``gates[T, K]`` (f32), and the
    router statistics as f32 scalars (``aux_loss``, ``z_loss``, ``load_max``, ``load_min``)."""

    experts_TK: jax.Array
    gates_TK: jax.Array
    stats: dict[str, jax.Array]


def route(logits_TE: jax.Array, k: int, kind: str = "softmax", *, axes: tuple[str, ...] = ()) -> Routing:
    """Top-``k`` routing of tokens ``T`` over experts ``E`` from f32 router logits ``[T, E]``.

    ``softmax``: scores ``p = softmax(logits)``; ``sigmoid``: ``s = sigmoid(logits)`` (affinities as in
    DeepSeek-V3). The ``k`` highest scores pick the experts; with ``k > 1`` the gates are the picked
    scores normalised to sum 1 (Mixtral, DeepSeek-V3), with ``k == 1`` the raw score (Switch), so the
    router receives a gradient through the gate.

    Statistics: ``f_e`` = fraction of the ``T*k`` assignments that go to expert e, ``P_e`` = mean over
    tokens of the (per-token normalised) scores; ``aux_loss = E * sum_e f_e * P_e`` (Switch/GShard,
    1.0 when balanced); ``z_loss = mean_t logsumexp(logits_t)^2`` (ST-MoE); ``load_max``/``load_min``
    = ``E * max_e f_e`` / ``E * min_e f_e`` (1.0 when balanced). ``axes``: manual axes (of an enclosing
    ``shard_map``) that split the tokens evenly; the means run over every device's tokens on them.
    """
    if kind not in ROUTERS:
        raise ValueError(f"router {kind!r} is not one of {ROUTERS}")
    t, e = logits_TE.shape
    if not 1 <= k <= e:
        raise ValueError(f"experts per token k={k} must be between 1 and the number of experts {e}")
    logits_TE = logits_TE.astype(jnp.float32)
    if kind == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        probs_TE = scores_TE
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
        probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    top_TK, experts_TK = jax.lax.top_k(scores_TE, k)
    gates_TK = top_TK / jnp.sum(top_TK, axis=-1, keepdims=True) if k > 1 else top_TK
    counts_E = jnp.sum(jax.nn.one_hot(experts_TK, e, dtype=jnp.float32), axis=(0, 1))
    f_E = counts_E / (t * k)
    p_E = jnp.mean(probs_TE, axis=0)
    z = jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)
    if axes:  # means over the tokens of every device: E + E + 1 floats all-reduced
        f_E, p_E, z = jax.lax.pmean((f_E, p_E, z), axes)
    stats = {
        "aux_loss": e * jnp.sum(f_E * p_E),
        "z_loss": z,
        "load_max": e * jnp.max(f_E),
        "load_min": e * jnp.min(f_E),
    }
    return Routing(experts_TK, gates_TK, stats)


def capacity(tokens: int, n_experts: int, k: int, factor: float) -> int:
    """Slots per expert for a group of ``tokens``: ``ceil(factor * tokens * k / E)``, at most ``tokens``
    (an expert can receive each token once); ``factor == 0`` is dropless: ``tokens`` slots."""
    if factor < 0:
        raise ValueError(f"capacity factor must be >= 0 (0 = dropless), got {factor}")
    if factor == 0:
        return tokens
    return max(1, min(tokens, math.ceil(factor * tokens * k / n_experts)))


def slots(experts_TK: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's slot in its expert's buffer, and whether it fits: ``(slot[T, K], kept[T, K])``.

    Slots are filled in priority order: every token's first choice before any second choice
    (GShard), tokens in order within a choice; assignments at slot >= ``capacity`` are dropped.
    """
    t, k = experts_TK.shape
    onehot_KTE = jax.nn.one_hot(experts_TK.T, n_experts, dtype=jnp.int32)
    before_KTE = jnp.cumsum(onehot_KTE.reshape(k * t, n_experts), axis=0).reshape(k, t, n_experts) - 1
    slot_TK = jnp.sum(before_KTE * onehot_KTE, axis=-1).T
    return slot_TK, slot_TK < capacity
