"""Next-token cross-entropy from the last hidden states, in chunks so the logits never exist whole.

``chunked_lm_loss(x_BLD, logits_fn, targets_BL, chunk=C)`` equals
``lm_loss(logits_fn(x_BLD), targets_BL)``, computed ``C`` positions at a time with each chunk's
logits recomputed in the backward pass. See docs/memory.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from spmd.constraints import constrain
from spmd.models.layers import weight


def lm_loss(logits_BLV: jax.Array, targets_BL: jax.Array, *, z_loss: float = 0.0,
            onehot: bool | None = None, weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy (+ ``z_loss * mean(logsumexp^2)``, PaLM's z-loss), in f32.
    With ``weights[B, L]`` both means are of ``weights * ...`` (a weight 0 drops a position).

    ``onehot=True`` picks the target logit by a one-hot product instead of a gather: XLA's
    partitioner cannot partition that gather inside a partly manual ``shard_map`` (a pipeline stage,
    manual over ``pipe``; an accumulation loop, manual over ``data``) when the logits are sharded
    over an automatic batch axis and ``tensor``. ``None``: one-hot exactly inside such a region.
    """
    logits_BLV = logits_BLV.astype(jnp.float32)
    if onehot is None:
        context = jax.sharding.get_abstract_mesh()
        onehot = bool(context.manual_axes) and bool(context.auto_axes)
    if weights is not None:
        ce_BL, lse_BL = _onehot_losses(logits_BLV, targets_BL) if onehot else (
            optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL), None)
        lse = (lambda: lse_BL) if lse_BL is not None else (lambda: jax.nn.logsumexp(logits_BLV, axis=-1))
        return _with_z_loss(jnp.mean(weights * ce_BL), lse, z_loss, weights)
    if onehot:
        ce_BL, lse_BL = _onehot_losses(logits_BLV, targets_BL)
        return _with_z_loss(jnp.mean(ce_BL), lambda: lse_BL, z_loss)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()
    return _with_z_loss(ce, lambda: jax.nn.logsumexp(logits_BLV, axis=-1), z_loss)


def _onehot_losses(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position cross-entropy and logsumexp, the target logit picked by a one-hot product."""
    lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    onehot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=logits_BLV.dtype)
    target_BL = jnp.sum(logits_BLV * onehot_BLV, axis=-1)
    return lse_BL - target_BL, lse_BL


def _with_z_loss(ce: jax.Array, lse_BL: Callable[[], jax.Array], z_loss: float,
                 weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(ce [+ z_loss * mean([weights *] lse^2)], {"ce"[, "z_loss"]})``; the logsumexp is computed only when needed."""
    aux = {"ce": ce}
    if not z_loss:
        return ce, aux
    aux["z_loss"] = z_loss * jnp.mean(lse_BL() ** 2 if weights is None else weights * lse_BL() ** 2)
    return ce + aux["z_loss"], aux


def chunked_lm_loss(x_BLD: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], targets_BL: jax.Array, *,
                    chunk: int, z_loss: float = 0.0, weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy (+ ``z_loss * mean(logsumexp^2)``) of ``logits_fn(x_BLD)``
    against ``targets_BL``, computed ``chunk`` positions at a time; aux ``{"ce"[, "z_loss"]}``.

    ``logits_fn`` maps hidden states ``x[B, C, D]`` to logits ``[B, C, V]`` (any float dtype;
    the loss is taken in f32) and is called once per chunk, inside a scan and a checkpoint: it may
    read module parameters, which then receive gradients, but must not update state.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked_lm_loss: chunk={chunk!r} must be an integer >= 1")
    if x_BLD.ndim != 3 or targets_BL.shape != x_BLD.shape[:2]:
        raise ValueError(f"chunked_lm_loss: hidden states {x_BLD.shape} must be [B, L, D] and targets "
                         f"{targets_BL.shape} [B, L]")
    b, length, d = x_BLD.shape
    c = min(chunk, length)
    n = -(-length // c)
    pad = n * c - length
    if pad:  # the last chunk runs over padded positions; their losses are dropped below
        x_BLD = jnp.pad(x_BLD, ((0, 0), (0, pad), (0, 0)))
        targets_BL = jnp.pad(targets_BL, ((0, 0), (0, pad)))
    x_NBCD = jnp.moveaxis(x_BLD.reshape(b, n, c, d), 1, 0)
    targets_NBC = jnp.moveaxis(targets_BL.reshape(b, n, c), 1, 0)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # inside a scan CSE cannot merge the recomputation
    def chunk_losses(x_BCD: jax.Array, targets_BC: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _onehot_losses(logits_fn(x_BCD).astype(jnp.float32), targets_BC)

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, jax.Array]]:
        return carry, chunk_losses(*xs)

    _, (ce_NBC, lse_NBC) = jax.lax.scan(body, None, (x_NBCD, targets_NBC))

    def unchunk(y_NBC: jax.Array) -> jax.Array:
        return jnp.moveaxis(y_NBC, 0, 1).reshape(b, n * c)[:, :length]

    if weights is not None:  # weights[B, L]: as lm_loss
        return _with_z_loss(jnp.mean(weights * unchunk(ce_NBC)), lambda: unchunk(lse_NBC), z_loss, weights)
    return _with_z_loss(jnp.mean(unchunk(ce_NBC)), lambda: unchunk(lse_NBC), z_loss)


def with_moe_losses(cfg: Any, loss: jax.Array, aux: dict, stats: dict) -> tuple[jax.Array, dict]:
    """For a ``spmd.models.GPTConfig`` ``cfg``: ``loss + aux_loss_weight * aux_loss + router_z_loss_weight * z_loss`` (means over the MoE blocks),
    with the MoE statistics (means over MoE blocks) as ``moe_*`` metrics."""
    n_moe = cfg.n_layers // cfg.moe_every
    means = {f"moe_{k}": v / n_moe for k, v in stats.items()}
    loss = loss + cfg.aux_loss_weight * means["moe_aux_loss"] + cfg.router_z_loss_weight * means["moe_z_loss"]
    return loss, {**aux, **means}


def head_logits(cfg: Any, x_BLD: jax.Array, w: Any) -> jax.Array:
    """For a ``spmd.models.GPTConfig`` ``cfg``: ``x[B, L, D] -> logits[B, L, V]`` in f32 through the head weight ``w`` (``W[D, V]``, or the
    embedding ``E[V, D]`` when ``cfg.tie_embeddings``, scaled by ``D**-0.5`` unless not ``tied_head_scale``)."""
    dt = cfg.compute_dtype
    if cfg.tie_embeddings:
        logits_BLV = jnp.einsum("bld,vd->blv", x_BLD, weight(w, dt))
        logits_BLV = logits_BLV * cfg.d_model**-0.5 if cfg.tied_head_scale else logits_BLV
    else:
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, weight(w, dt))
    return constrain(logits_BLV.astype(jnp.float32), ("batch", "length", "vocab"))
