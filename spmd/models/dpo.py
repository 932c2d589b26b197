"""Direct preference optimisation (DPO) on packed preference pairs: per-pair log-probabilities and the loss.

    logp_BL = token_logps(model, batch)                                  # log p(target) at every position
    chosen_BP, rejected_BP, n_chosen_BP, n_rejected_BP = pair_logps(logp_BL, batch, pairs_per_row=P)
    losses_BP, rewards_c_BP, rewards_r_BP = dpo_losses(chosen_BP, rejected_BP, ref_chosen_BP, ref_rejected_BP,
                                                       beta=0.1, loss="sigmoid")

Pair ``k`` of a row is segments ``2k + 1`` (chosen) and ``2k + 2`` (rejected); ``response[B, L]`` marks
the targets a sequence's log-probability sums. The sums are per row (``[B, L] x one_hot[B, L, P]``):
nothing communicates beyond the model's forward (under a pipeline with context parallelism, a psum of the
``[B, P]`` sums over ``seq``). The loss is TRL's (docs/post-training.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spmd.models import context

LOSSES = ("sigmoid", "ipo")


class Reference(nnx.Variable):
    """A weight of the frozen reference model: not an ``nnx.Param``, so it gets no gradient and no
    optimizer state, yet it keeps the parameter's logical dims, so it shards like it and is checkpointed
    and restored (onto any mesh) with the rest of the model's variables."""


def frozen_copy(module: nnx.Module) -> nnx.Module:
    """A copy of ``module`` whose parameters are :class:`Reference` variables with the same values and dims."""
    copy = nnx.clone(module)
    for _, node in nnx.iter_graph(copy):
        if isinstance(node, nnx.Module):
            for name, value in list(vars(node).items()):
                if isinstance(value, nnx.Param):
                    setattr(node, name, Reference(value.get_value(), **value.get_metadata()))
    return copy


def with_reference(model: nnx.Module) -> nnx.Module:
    """``model`` with ``model.reference``: a :func:`frozen_copy` of it as it is now. Its parameters are
    unchanged (the same tree as without the copy: weights load into it and out of it as they are);
    ``W[...]`` and ``W_reference[...]`` are laid out alike by the rule set, and the copy costs one more
    set of weights, no gradients and no optimizer state."""
    model.reference = frozen_copy(model)  # type: ignore[attr-defined]  # any module, not a declared attribute
    return model


def token_logps(model, batch: dict[str, jax.Array]) -> jax.Array:
    """``log p(targets[b, l] | inputs[b, :l])`` of ``model`` (an ``spmd.models.GPT``) over packed rows, f32
    ``[B, L]``; under context parallelism in the model's sequence order (the sums below are order-free)."""
    x_BLD, _ = model.hidden_and_stats(batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
    targets_BL = batch["targets"]
    order = context.sequence_order(targets_BL.shape[1])
    if order is not None:
        targets_BL = targets_BL[:, order]
    logits_BLV = model.logits(x_BLD).astype(jnp.float32)
    return -optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)


def in_model_order(batch: dict[str, jax.Array], key: str) -> jax.Array:
    """``batch[key]`` (``[B, L]``) in the model's sequence order (as :func:`token_logps` returns its values); in a
    region manual over ``seq`` (a pipeline's head) the keys arrive as this device's shard, in that order already."""
    if context.length_is_manual():
        return batch[key]
    order = context.sequence_order(batch[key].shape[1])
    return batch[key] if order is None else batch[key][:, order]


def pair_logps(logp_BL: jax.Array, batch: dict[str, jax.Array], *, pairs_per_row: int
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(chosen[B, P], rejected[B, P], chosen_tokens[B, P], rejected_tokens[B, P])``: each pair's summed
    response log-probabilities and its response lengths (0 in a slot of the row that holds no pair). In a
    region manual over ``seq`` each device sums its shard of the rows and the sums are added over ``seq``."""
    seg_BL = in_model_order(batch, "segment_ids")
    resp_BL = in_model_order(batch, "response").astype(jnp.float32)
    # a slot per pair; padding (id L + 1) has no response, so whichever slot it lands in it adds nothing
    onehot_BLP = jax.nn.one_hot((seg_BL - 1) // 2, pairs_per_row, dtype=jnp.float32)
    chosen_BL = ((seg_BL - 1) % 2 == 0).astype(jnp.float32) * resp_BL
    rejected_BL = resp_BL - chosen_BL

    def sums(w_BL):
        return tuple(context.sum_over_length(jnp.einsum("bl,blp->bp", a_BL, onehot_BLP)) for a_BL in (w_BL * logp_BL, w_BL))

    (c_BP, nc_BP), (r_BP, nr_BP) = sums(chosen_BL), sums(rejected_BL)
    return c_BP, r_BP, nc_BP, nr_BP


def dpo_losses(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array, *,
               beta: float, loss: str = "sigmoid", label_smoothing: float = 0.0,
               chosen_tokens: jax.Array | None = None, rejected_tokens: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses, chosen_rewards, rejected_rewards)`` per pair, from the policy's and the reference's summed
    sequence log-probabilities (any equal shapes); ``loss="ipo"`` needs the response lengths (it compares
    log-ratios per response token, as TRL does). The rewards carry no gradient."""
    if loss not in LOSSES:
        raise ValueError(f"dpo.loss={loss!r} is not one of {LOSSES}")
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if loss == "sigmoid":
        h = beta * (chosen_ratio - rejected_ratio)
        losses = -jax.nn.log_sigmoid(h) * (1 - label_smoothing) - jax.nn.log_sigmoid(-h) * label_smoothing
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo.loss='ipo' compares log-ratios per response token: give chosen_tokens and "
                             "rejected_tokens")
        h = chosen_ratio / jnp.maximum(chosen_tokens, 1.0) - rejected_ratio / jnp.maximum(rejected_tokens, 1.0)
        losses = (h - 1 / (2 * beta)) ** 2
    return losses, jax.lax.stop_gradient(beta * chosen_ratio), jax.lax.stop_gradient(beta * rejected_ratio)
