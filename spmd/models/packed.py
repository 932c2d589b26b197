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
from flax import nnx

from spmd.models import context, segments
from spmd.models.loss import chunked_lm_loss, head_logits, lm_loss, with_moe_losses

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
        return _pipelined(model, tokens_BL, targets_BL, z_loss, pipeline, segment_ids, positions, weights)
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


DIGIT = 256  # integers up to 256 are exact in bfloat16: ids and positions travel as two base-256 digits


def _pipelined(model, tokens_BL, targets_BL, z_loss, pipeline, segment_ids, positions, weights):
    """The blocks as a pipeline over ``pipe`` (``spmd.pipeline.pipelined_loss``), packed rows and weights
    included: each row's segment ids and positions ride along as 4 extra channels of the activations
    ``x[B, L, D + 4]`` (base-256 digits, exact in bf16; the stages pass them on untouched), and the
    weights with the targets (``[B, L, 2]`` int32, the weight's f32 bits)."""
    from spmd.pipeline import pipelined_loss

    cfg, d = model.cfg, model.cfg.d_model
    if context.seq_shards() > 1:
        raise ValueError(f"context parallelism (seq={context.seq_shards()}) does not run under a pipeline yet "
                         f"(pipeline schedule {pipeline.schedule!r}); use seq=1 or a pipe axis of size 1")
    if cfg.n_experts:
        raise ValueError(f"GPTConfig.n_experts={cfg.n_experts}: MoE blocks do not run under a pipeline yet")
    if tokens_BL.shape[1] + 1 >= DIGIT**2:
        raise ValueError(f"packed rows of length {tokens_BL.shape[1]} under a pipeline: segment ids and positions "
                         f"travel as two base-{DIGIT} digits, so the length must be below {DIGIT**2 - 1}")
    x_BLD = model.embed_tokens(tokens_BL)
    with_layout = segment_ids is not None
    if with_layout:
        ints_BL4 = jnp.stack([segment_ids // DIGIT, segment_ids % DIGIT, positions // DIGIT, positions % DIGIT], -1)
        x_BLD = jnp.concatenate([x_BLD, ints_BL4.astype(x_BLD.dtype)], -1)
    apply, block_state = model.blocks.split()
    norm_def, norm_state = nnx.split(model.final_norm)

    def stage_fn(layers_state, x_BLE):
        if not with_layout:
            return apply(layers_state, x_BLE, jnp.arange(x_BLE.shape[1]))
        ints = x_BLE[..., d:].astype(jnp.int32)
        seg_BL, pos_BL = ints[..., 0] * DIGIT + ints[..., 1], ints[..., 2] * DIGIT + ints[..., 3]
        y_BLD = apply(layers_state, x_BLE[..., :d], pos_BL, seg_BL)
        return jnp.concatenate([y_BLD, x_BLE[..., d:]], -1)

    def head_fn(head, y_BLE, tw_BL2):
        x_BLD = nnx.merge(norm_def, head[0])(y_BLE[..., :d])
        w_BL = jax.lax.bitcast_convert_type(tw_BL2[..., 1], jnp.float32)
        return lm_loss(head_logits(cfg, x_BLD, head[1]), tw_BL2[..., 0], z_loss=z_loss, onehot=True, weights=w_BL)

    w_BL = jnp.ones(targets_BL.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    tw_BL2 = jnp.stack([targets_BL.astype(jnp.int32), jax.lax.bitcast_convert_type(w_BL, jnp.int32)], -1)
    loss, aux = pipelined_loss(pipeline, stage_fn, head_fn, block_state, (norm_state, model.out_weight), x_BLD, tw_BL2)
    return loss, {**aux, **_batch_metrics(cfg, segment_ids, weights)}  # as unpipelined: functions of the batch


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
