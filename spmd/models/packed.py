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

from spmd.models import context, segments
from spmd.models.loss import chunked_lm_loss, lm_loss, with_moe_losses
from spmd.models.piped import pipelined_lm_loss

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
    if pipeline is not None and pipeline.enabled:
        loss, aux = pipelined_lm_loss(model, tokens_BL, targets_BL, z_loss, pipeline, segment_ids, positions, weights)
        return loss, {**aux, **_batch_metrics(model.cfg, segment_ids, weights)}  # as unpipelined: functions of the batch
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
    # eval: ce / loss_weight over all batches is the loss per weighted token; the packer's padding, and
    # the block pairs blockwise attention skips
    out = out[0], {**out[1], **_batch_metrics(model.cfg, segment_ids, weights)}
    if stats is None:
        return out

    return with_moe_losses(model.cfg, *out, stats)


def _batch_metrics(cfg, segment_ids: jax.Array | None, weights: jax.Array | None) -> dict[str, jax.Array]:
    """The metrics of the batch itself, the same with or without a pipeline: ``loss_weight`` (the mean
    weight of a position; eval divides ``ce`` and ``loss`` by it) and the packing metrics."""
    out = {} if weights is None else {"loss_weight": jnp.mean(weights.astype(jnp.float32))}
    return out if segment_ids is None else {**out, **_packing_metrics(cfg, segment_ids)}


def _packing_metrics(cfg, seg_BL: jax.Array) -> dict[str, jax.Array]:
    """``padding``: the fraction of positions in the packer's padding segment; ``attention_skipped``:
    the fraction of causal block pairs the blockwise path skips (with blockwise attention)."""
    length = seg_BL.shape[1]
    out = {"padding": jnp.mean((seg_BL == segments.padding_id(length)).astype(jnp.float32))}
    auto_blockwise = cfg.attention == "auto" and length > cfg.attention_block and jax.default_backend() != "gpu"
    if cfg.attention == "blockwise" or auto_blockwise:
        out["attention_skipped"] = segments.skipped(seg_BL, cfg.attention_block).astype(jnp.float32)
    return out


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
