"""The GPT's loss on packed rows: documents told apart by segment ids, and per-token loss weights.

    model.loss(tokens, targets, segment_ids=seg, positions=pos, weights=w)

Each document attends only to itself and its RoPE positions restart at 0 (:mod:`spmd.models.segments`),
so a packed row gives every document the loss and gradient it has alone. The loss is
``mean(weights * ce)`` over the rows' positions: with weights scaled so that they sum to B x L over
the global batch (``trainers.step`` does it once per step, before the batch is split), every mean
over microbatches and devices is the mean over weighted tokens of the global batch. Nothing here
communicates beyond what the GPT does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spmd.models import context
from spmd.models.loss import chunked_lm_loss, lm_loss

PACKED_KEYS = ("segment_ids", "positions", "weights")


def packed_loss(model, tokens_BL: jax.Array, targets_BL: jax.Array, *, z_loss: float = 0.0, pipeline=None,
                segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(loss, aux)`` of ``model`` (an ``spmd.models.GPT``) on packed rows (see the module docstring)."""
    if (segment_ids is None) != (positions is None):
        raise ValueError("packed rows need both segment_ids[B, L] and positions[B, L], or neither")
    for name, value in (("segment_ids", segment_ids), ("positions", positions), ("weights", weights)):
        if value is not None and value.shape != tokens_BL.shape:
            raise ValueError(f"{name} has shape {value.shape}; it must be [B, L] like the tokens {tokens_BL.shape}")
    if pipeline is not None and pipeline.enabled and segment_ids is not None:
        raise ValueError(f"packed documents (segment ids) do not run under a pipeline yet (pipeline schedule "
                         f"{pipeline.schedule!r}); use data.packing='concat' or a pipe axis of size 1")
    if pipeline is not None and pipeline.enabled:
        if weights is not None:
            raise ValueError(f"loss weights do not run under a pipeline yet (pipeline schedule {pipeline.schedule!r})")
        return model.loss(tokens_BL, targets_BL, z_loss=z_loss, pipeline=pipeline)
    x_BLD, stats = model.hidden_and_stats(tokens_BL, segment_ids, positions)
    order = context.sequence_order(targets_BL.shape[1])
    if order is not None:  # the mean is order-free
        targets_BL = targets_BL[:, order]
        weights = None if weights is None else weights[:, order]
    if model.cfg.loss_chunk:
        out = chunked_lm_loss(x_BLD, model.logits, targets_BL, chunk=model.cfg.loss_chunk, z_loss=z_loss,
                              weights=weights)
    else:
        out = lm_loss(model.logits(x_BLD), targets_BL, z_loss=z_loss, weights=weights)
    if weights is not None:  # eval: ce / weight over all batches is the loss per weighted token
        out = out[0], {**out[1], "weight": jnp.mean(weights.astype(jnp.float32))}
    if stats is None:
        return out
    from spmd.models.gpt import _with_moe_losses

    return _with_moe_losses(model.cfg, *out, stats)


def _per_document(values_BL: jax.Array, seg_BL: jax.Array) -> jax.Array:
    """``sums[B, L + 2]``: values summed per segment id (ids 0..L+1; padding has its own id)."""
    n = seg_BL.shape[1] + 2
    return jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=n))(values_BL, seg_BL)


def _weights(batch: dict) -> jax.Array:
    return batch.get("weights", jnp.ones(batch["inputs"].shape, jnp.float32)).astype(jnp.float32)


def document_count(model, batch: dict) -> jax.Array:
    """``documents[B]``: how many documents (segments with any loss weight) each row holds."""
    del model
    return jnp.sum(_per_document(_weights(batch), batch["segment_ids"]) > 0, -1).astype(jnp.float32)


def document_losses(model, batch: dict) -> jax.Array:
    """``loss_sum[B]``: per row, the sum over its documents of each document's mean weighted loss.
    Over an eval set, ``sum(loss_sum) / sum(document_count)`` is the loss per document (every
    document counts once, whatever its length)."""
    tokens_BL, seg_BL = batch["inputs"], batch["segment_ids"]
    x_BLD, _ = model.hidden_and_stats(tokens_BL, seg_BL, batch["positions"])
    logits_BLV = model.logits(x_BLD).astype(jnp.float32)
    order = context.sequence_order(tokens_BL.shape[1])
    if order is not None:
        logits_BLV = logits_BLV[:, jnp.argsort(jnp.asarray(order))]
    ce_BL = jax.nn.logsumexp(logits_BLV, -1) - jnp.take_along_axis(logits_BLV, batch["targets"][..., None], -1)[..., 0]
    w_BL = _weights(batch)
    loss_BS, w_BS = _per_document(w_BL * ce_BL, seg_BL), _per_document(w_BL, seg_BL)
    has = w_BS > 0
    return jnp.sum(jnp.where(has, loss_BS / jnp.where(has, w_BS, 1.0), 0.0), -1)
