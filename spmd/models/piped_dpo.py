"""The DPO loss with the GPT's blocks run as a pipeline over ``pipe``: policy and reference in one pass.

The activations carry both models side by side, ``x[B, L, 2D + C]``: the policy's, the reference's, and each
token's position and segment id (with LoRA dropout its row's index too) as base-256 digits, as
:mod:`spmd.models.piped` carries them. Each stage runs its policy layers and, held constant, its reference
layers: the frozen copy's (:func:`spmd.models.dpo.with_reference`, laid out over ``pipe`` like the policy's)
or, with LoRA, its own with every adapter's ``b`` zero (:func:`spmd.models.lora.without_adapters`). The
last stage's head takes both per-token log-probabilities and gives ``objective`` the microbatch's pair keys,
which travel with the targets (``[B, L, 4]`` int32: targets, segment ids, the response mask's and weights'
f32 bits). The DPO loss and its metrics are sums over pairs divided by the rows' size, so the pipeline's
mean over equal microbatches is the whole batch's value. Under context parallelism each stage device holds
its shard of the length and the head adds each pair's sums over ``seq``. See docs/post-training.md.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models import context, lora
from spmd.models.lora import is_adapter
from spmd.models.loss import _onehot_losses, head_logits
from spmd.models.piped import DIGIT
from spmd.sharding import path_str

REFERENCES = ("copy", "base")  # the model's frozen copy (model.reference) | the model with its adapters off
# (policy log p[b, L], reference log p[b, L], {"segment_ids", "response", "weights"}[b, L]) -> (loss, metrics)
Objective = Callable[[jax.Array, jax.Array, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]
PAIR_KEYS = ("inputs", "targets", "segment_ids", "positions", "response", "weights")


def _refuse(model, batch: dict[str, jax.Array], pipeline, reference: str) -> None:
    """What cannot run, refused at trace time (before anything compiles), naming the value and what is valid."""
    where = f"run.objective=dpo under pipeline.schedule={pipeline.schedule!r}"
    if reference not in REFERENCES:
        raise ValueError(f"reference={reference!r} is not one of {REFERENCES}")
    if reference == "copy" and not hasattr(model, "reference"):
        raise TypeError(f"{where} with reference='copy' needs a model with a frozen copy of itself "
                        f"(spmd.models.dpo.with_reference), got a {type(model).__name__} without one")
    if reference == "base" and model.lora is None:
        raise ValueError(f"{where} with reference='base' (the model with its adapters off) needs a LoRA model, "
                         "got one without adapters: give it a frozen copy (spmd.models.dpo.with_reference)")
    missing = [k for k in PAIR_KEYS if k not in batch]
    if missing:
        raise ValueError(f"{where} reads packed pair rows (trainers.data.pairs); the batch has no {missing}")
    length = batch["inputs"].shape[1]
    if max(length + 1, batch["inputs"].shape[0] - 1) >= DIGIT**2 - 1:
        raise ValueError(f"rows of length {length}, {batch['inputs'].shape[0]} of them, under a pipeline: "
                         f"positions, segment ids and row indices travel as two base-{DIGIT} digits, so the length "
                         f"and the rows must be below {DIGIT**2 - 1}")


def _adapters_off(state: nnx.State) -> nnx.State:
    """``state`` (a stack's) with every adapter's ``b`` zero: the base layers (``without_adapters``)."""
    def off(path, a):
        name = path_str(path)
        return jnp.zeros_like(a) if is_adapter(name) and name.endswith("/b") else a

    return jax.tree_util.tree_map_with_path(off, state)


def _hidden(out) -> jax.Array:
    """A stack's output without its MoE statistics (the DPO loss reads none)."""
    return out[0] if isinstance(out, tuple) else out


def _logps(cfg, x_BLD: jax.Array, w, targets_BL: jax.Array) -> jax.Array:
    """``log p(targets)`` ``[B, L]`` f32 from the final-normed hidden states (one-hot pick: a manual region)."""
    return -_onehot_losses(head_logits(cfg, x_BLD, w), targets_BL)[0]


def _f32_bits(a_BL: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a_BL.astype(jnp.float32), jnp.int32)


def pipelined_dpo_loss(model, batch: dict[str, jax.Array], pipeline, objective: Objective, *,
                       reference: str = "copy") -> tuple[jax.Array, dict]:
    """``objective(policy_logps, reference_logps, pair_keys)`` of ``model`` (an ``spmd.models.GPT``) on packed
    pair rows, its blocks and the reference's as one pipeline (module docstring); the mean over microbatches.
    ``reference``: ``"copy"`` (``model.reference``) or ``"base"`` (LoRA: the adapters off)."""
    from spmd.pipeline import pipelined_loss

    _refuse(model, batch, pipeline, reference)
    order = context.sequence_order(batch["inputs"].shape[1])
    if order is not None:  # context parallelism: rows in load-balanced order, each stage device holding its shard
        batch = {k: batch[k][:, order] for k in PAIR_KEYS}
    cfg, d, copy = model.cfg, model.cfg.d_model, reference == "copy"
    ref_model = model.reference if copy else model
    tokens_BL = batch["inputs"]
    x_BLD = model.embed_tokens(tokens_BL)
    r_BLD = jax.lax.stop_gradient(ref_model.embed_tokens(tokens_BL))
    ints = [batch["positions"], batch["segment_ids"]]
    rows = lora.has_dropout(model)  # each row's index too: the policy's adapter masks (spmd.models.lora.stage_keys)
    ints += [jnp.broadcast_to(jnp.arange(tokens_BL.shape[0])[:, None], tokens_BL.shape)] if rows else []
    ints_BLC = jnp.stack([g for a in ints for g in (a // DIGIT, a % DIGIT)], -1)
    x_BLE = jnp.concatenate([x_BLD, r_BLD.astype(x_BLD.dtype), ints_BLC.astype(x_BLD.dtype)], -1)
    apply, block_state = model.blocks.split()
    block_state = lora.carried_keys(block_state) if rows else block_state
    ref_apply, ref_state = ref_model.blocks.split() if copy else (apply, None)
    norm_def, norm_state = nnx.split(model.final_norm)
    ref_norm_def, ref_norm_state = nnx.split(ref_model.final_norm)

    def stage_fn(params, x_BLE):
        digits = x_BLE[..., 2 * d:].astype(jnp.int32)
        positions, segments, *row = (digits[..., i] * DIGIT + digits[..., i + 1] for i in range(0, len(ints) * 2, 2))
        own, frozen = params if copy else (params, None)
        own = lora.stage_keys(own, row[0][:, 0]) if rows else own
        frozen = frozen if copy else _adapters_off(own)
        y_BLD = _hidden(apply(own, x_BLE[..., :d], positions, segments))
        r_BLD = _hidden(ref_apply(jax.lax.stop_gradient(frozen), jax.lax.stop_gradient(x_BLE[..., d:2 * d]),
                                  positions, segments))
        return jnp.concatenate([y_BLD, jax.lax.stop_gradient(r_BLD), x_BLE[..., 2 * d:]], -1)

    def head_fn(head, y_BLE, keys_BL4):
        own_norm, own_w = head[0], head[1]
        ref_norm, ref_w = jax.lax.stop_gradient(head[2:] if copy else head[:2])
        targets_BL = keys_BL4[..., 0]
        policy_BL = _logps(cfg, nnx.merge(norm_def, own_norm)(y_BLE[..., :d]), own_w, targets_BL)
        ref_BL = _logps(cfg, nnx.merge(ref_norm_def, ref_norm)(y_BLE[..., d:2 * d]), ref_w, targets_BL)
        keys = {k: jax.lax.bitcast_convert_type(keys_BL4[..., i], jnp.float32) for i, k in ((2, "response"), (3, "weights"))}
        return objective(policy_BL, jax.lax.stop_gradient(ref_BL), {"segment_ids": keys_BL4[..., 1], **keys})

    keys_BL4 = jnp.stack([batch["targets"].astype(jnp.int32), batch["segment_ids"].astype(jnp.int32),
                          _f32_bits(batch["response"]), _f32_bits(batch["weights"])], -1)
    stage_params = (block_state, ref_state) if copy else block_state
    head_params = (norm_state, model.out_weight) + ((ref_norm_state, ref_model.out_weight) if copy else ())
    return pipelined_loss(pipeline, stage_fn, head_fn, stage_params, head_params, x_BLE, keys_BL4,
                          compute_dtype=cfg.compute_dtype)
