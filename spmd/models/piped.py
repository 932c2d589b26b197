"""The GPT's loss with its blocks run as a pipeline over ``pipe`` (``spmd.pipeline.pipelined_loss``).

The embedding runs before the pipeline, the final norm, head and loss on its last stage. What a stage needs
besides the activations rides along as extra channels of them, ``x[B, L, D + C]`` (only the blocks see
``x[..., :D]``): each row's positions and segment ids (packed rows; under context parallelism the rows are in
``context.sequence_order`` and carry their positions unpacked too) and, with LoRA dropout, each row's index in
the batch (a stage folds the adapters' mask keys with it: the whole batch's masks) as base-256 digits, exact in
bf16; and with MoE blocks each router statistic summed over the blocks run so far, as a high and a low part
(about 16 bits in bf16). The head reads the sums at the first position and adds the MoE losses, so they are
differentiated through every stage; a microbatch's statistics are its own, as under gradient accumulation.
The targets travel with the loss weights (``[B, L, 2]`` int32, the weight's f32 bits). See docs/pipelines.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models import context, lora
from spmd.models.loss import head_logits, lm_loss, with_moe_losses
from spmd.models.moe import STATS

DIGIT = 256  # integers up to 256 are exact in bfloat16: ids and positions travel as two base-256 digits


def _add_stats(c_BLS: jax.Array, stats: dict[str, jax.Array]) -> jax.Array:
    """The statistics channels ``[B, L, 2 * len(STATS)]`` (high, low per statistic) plus ``stats``."""
    if set(stats) != set(STATS):
        raise ValueError(f"MoE statistics {sorted(stats)} are not the ones a pipeline carries {sorted(STATS)}")
    hi, lo = c_BLS[..., 0::2].astype(jnp.float32), c_BLS[..., 1::2].astype(jnp.float32)
    total = hi + lo + jnp.stack([stats[k].astype(jnp.float32) for k in STATS])
    new_hi = total.astype(c_BLS.dtype)
    new_lo = (total - new_hi.astype(jnp.float32)).astype(c_BLS.dtype)
    return jnp.stack([new_hi, new_lo], -1).reshape(c_BLS.shape)


def _read_stats(c_BLS: jax.Array) -> dict[str, jax.Array]:
    first = c_BLS[0, 0].astype(jnp.float32)  # every position carries the same sums
    return {k: first[2 * i] + first[2 * i + 1] for i, k in enumerate(STATS)}


def pipelined_lm_loss(model, tokens_BL: jax.Array, targets_BL: jax.Array, z_loss: float, pipeline,
                      segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                      weights: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """``(loss, aux)`` of ``model`` (an ``spmd.models.GPT``) with its blocks as a pipeline (module docstring);
    ``segment_ids``/``positions``/``weights`` as in :func:`spmd.models.packed.packed_loss`."""
    from spmd.pipeline import pipelined_loss

    cfg, d = model.cfg, model.cfg.d_model
    b, length = tokens_BL.shape
    order = context.sequence_order(length)
    if order is not None:  # context parallelism: rows in load-balanced order, each stage device holding its shard
        tokens_BL, targets_BL = tokens_BL[:, order], targets_BL[:, order]
        weights, segment_ids = (None if a is None else a[:, order] for a in (weights, segment_ids))
        positions = jnp.broadcast_to(jnp.asarray(order), (b, length)) if positions is None else positions[:, order]
    x_BLD = model.embed_tokens(tokens_BL)
    ints = [] if positions is None else [positions]  # carried: the positions (rows' own or reordered), segment ids
    ints += [] if segment_ids is None else [segment_ids]
    n_args, rows = len(ints), lora.has_dropout(model)  # and each row's index: the adapters' dropout masks
    ints += [jnp.broadcast_to(jnp.arange(b)[:, None], (b, length))] if rows else []
    extra = [jnp.stack([d for a in ints for d in (a // DIGIT, a % DIGIT)], -1)] if ints else []
    n_ints = 2 * len(ints)
    if ints and length + 1 >= DIGIT**2:
        raise ValueError(f"rows of length {length} under a pipeline: positions and segment ids travel as two "
                         f"base-{DIGIT} digits, so the length must be below {DIGIT**2 - 1}")
    if rows and b >= DIGIT**2:
        raise ValueError(f"a batch of {b} rows under a pipeline with LoRA dropout: each row's index travels as two "
                         f"base-{DIGIT} digits, so the batch must be below {DIGIT**2}")
    moe = bool(cfg.n_experts)
    if moe:
        extra.append(jnp.zeros((b, length, 2 * len(STATS)), x_BLD.dtype))
    if extra:
        x_BLD = jnp.concatenate([x_BLD, *(e.astype(x_BLD.dtype) for e in extra)], -1)
    apply, block_state = model.blocks.split()
    block_state = lora.carried_keys(block_state) if rows else block_state
    norm_def, norm_state = nnx.split(model.final_norm)

    def stage_fn(layers_state, x_BLE):
        args: tuple[jax.Array, ...] = (jnp.arange(x_BLE.shape[1]),)
        if n_ints:
            digits = x_BLE[..., d:d + n_ints].astype(jnp.int32)
            carried = tuple(digits[..., i] * DIGIT + digits[..., i + 1] for i in range(0, n_ints, 2))
            args = carried[:n_args] or args  # positions[, segments]
            if rows:  # each adapter's mask keys folded with the rows' indices (spmd.models.lora.dropout_mask)
                layers_state = lora.stage_keys(layers_state, carried[-1][:, 0])
        out = apply(layers_state, x_BLE[..., :d], *args)
        if not moe:
            return jnp.concatenate([out, x_BLE[..., d:]], -1) if extra else out
        y_BLD, stats = out
        c_BLS = _add_stats(x_BLE[..., d + n_ints:], stats)
        return jnp.concatenate([y_BLD, x_BLE[..., d:d + n_ints], c_BLS], -1)

    def head_fn(head, y_BLE, tw_BL2):
        x_BLD = nnx.merge(norm_def, head[0])(y_BLE[..., :d])
        w_BL = None if weights is None else jax.lax.bitcast_convert_type(tw_BL2[..., 1], jnp.float32)
        out = lm_loss(head_logits(cfg, x_BLD, head[1]), tw_BL2[..., 0], z_loss=z_loss, onehot=True, weights=w_BL)
        return with_moe_losses(cfg, *out, _read_stats(y_BLE[..., d + n_ints:])) if moe else out

    w_BL = jnp.ones(targets_BL.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    tw_BL2 = jnp.stack([targets_BL.astype(jnp.int32), jax.lax.bitcast_convert_type(w_BL, jnp.int32)], -1)
    return pipelined_loss(pipeline, stage_fn, head_fn, block_state, (norm_state, model.out_weight), x_BLD, tw_BL2,
                          compute_dtype=cfg.compute_dtype)
