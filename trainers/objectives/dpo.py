"""The DPO objective: the built-in GPT trained on preference pairs against a frozen reference.

    spmd-train gpt-small --set run.objective=dpo --set data.corpus=jsonl --set data.path=pairs.jsonl \\
        --set data.fields=prompt,chosen,rejected --set dpo.beta=0.1

Without LoRA the model carries a frozen copy of itself (:func:`spmd.models.dpo.with_reference`, sharded
and checkpointed with it); with LoRA the reference is the same model with its adapters switched off
(:func:`base_logps` through the seam ``dpo_loss_fn(cfg, reference=fn)``), so no copy is made. Metrics are
named as TRL names them. See docs/post-training.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models import context
from spmd.models.dpo import dpo_losses, in_model_order, pair_logps, token_logps
from spmd.models.lora import without_adapters
from spmd.models.piped_dpo import pipelined_dpo_loss
from spmd.pipeline import PipelineConfig
from trainers.config import Config
from trainers.data import pairs as pairs_lib
from trainers.data.config import DOCUMENT_CORPORA
from trainers.objectives.config import DPOConfig

ReferenceFn = Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]  # (model, batch) -> reference log p [B, L]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def dpo_loss_fn(cfg: DPOConfig, reference: ReferenceFn | None = None, pipeline: PipelineConfig | None = None
                ) -> Callable:
    """The DPO loss of a model with a frozen copy (``reference=None``: :func:`spmd.models.dpo.with_reference`) or of one whose
    reference log-probabilities ``reference(model, batch)`` gives: ``(loss, metrics)`` of
    :func:`dpo_objective` over packed pair rows (:mod:`trainers.data.pairs`). Under an enabled ``pipeline``
    the policy's and the reference's blocks run as one pipeline (:mod:`spmd.models.piped_dpo`); the
    reference is then the frozen copy or :func:`base_logps` (LoRA), no other function."""
    piped = pipeline is not None and pipeline.enabled
    if piped and reference not in (None, base_logps):
        raise ValueError(f"a DPO reference function {getattr(reference, '__name__', reference)!r} runs only "
                         f"unpipelined, got pipeline.schedule={pipeline.schedule!r}: under a pipeline the reference "
                         "is the model's frozen copy (reference=None) or its base (reference=base_logps)")

    def objective(policy_BL: jax.Array, ref_BL: jax.Array, keys: dict[str, jax.Array]):
        return dpo_objective(policy_BL, ref_BL, keys, cfg)

    def loss_fn(model: nnx.Module, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None):
        if piped:
            return pipelined_dpo_loss(model, batch, pipeline, objective,
                                      reference="copy" if reference is None else "base")
        if reference is None:
            if not hasattr(model, "reference"):
                raise TypeError(f"the DPO loss without a reference function needs a model with a frozen copy of "
                                f"itself (spmd.models.dpo.with_reference), got a {type(model).__name__} without one")
            policy_BL, ref_BL = token_logps(model, batch), token_logps(model.reference, batch)
        else:
            policy_BL, ref_BL = token_logps(model, batch), reference(model, batch)
        return dpo_objective(policy_BL, ref_BL, batch, cfg)

    loss_fn.pipelined = piped  # type: ignore[attr-defined]  # runs its own shard_map
    loss_fn.weighted = True  # type: ignore[attr-defined]  # eval folds its row mask into the weights
    # two passes' log-probability gathers in the accumulation loop's manual region abort XLA's partitioner
    loss_fn.manual_unsafe = "the DPO loss (its log-probability gathers do not partition in a manual region)"  # type: ignore[attr-defined]
    return loss_fn


def base_logps(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """The reference of a LoRA model: the per-token log-probabilities ``[B, L]`` of its frozen base, the
    model run with every adapter's ``b`` zero (:func:`spmd.models.lora.without_adapters`; no second copy)."""
    return token_logps(without_adapters(model), batch)


def dpo_objective(policy_BL: jax.Array, ref_BL: jax.Array, batch: dict[str, jax.Array], cfg: DPOConfig
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)`` from per-token log-probabilities of the policy and the reference (held constant):
    ``mean(weights * per-pair value)`` with one weight per pair, the mean over the global batch's pairs
    once the step has normalised the weights (eval: once the loop divides by ``loss_weight``)."""
    ref_BL = jax.lax.stop_gradient(ref_BL)
    P = cfg.pairs_per_row
    chosen, rejected, n_chosen, n_rejected = pair_logps(policy_BL, batch, pairs_per_row=P)
    ref_chosen, ref_rejected, _, _ = pair_logps(ref_BL, batch, pairs_per_row=P)
    losses, r_chosen, r_rejected = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                                              loss=cfg.loss, label_smoothing=cfg.label_smoothing,
                                              chosen_tokens=n_chosen, rejected_tokens=n_rejected)
    w_BP = pair_weights(batch, P)
    # B x L: what the normalised weights of the global batch sum to (each device holds 1/seq of the length when
    # a pipeline's head is manual over seq: every one of them then computes the rows' whole value)
    n = batch["weights"].size * (context.seq_shards() if context.length_is_manual() else 1)

    def avg(x):
        return jnp.sum(w_BP * x) / n

    metrics = {"rewards/chosen": avg(r_chosen), "rewards/rejected": avg(r_rejected),
               "rewards/accuracies": avg((r_chosen > r_rejected).astype(jnp.float32)),
               "rewards/margins": avg(r_chosen - r_rejected),
               "logps/chosen": avg(jax.lax.stop_gradient(chosen)),
               "logps/rejected": avg(jax.lax.stop_gradient(rejected)),
               "loss_weight": jnp.mean(batch["weights"].astype(jnp.float32))}
    return avg(losses), metrics


def pair_weights(batch: dict[str, jax.Array], pairs_per_row: int) -> jax.Array:
    """Each pair slot's weight ``[B, P]``: the (normalised) weight its row carries on the pair's one weighted token."""
    seg_BL = in_model_order(batch, "segment_ids")
    w_BL = in_model_order(batch, "weights").astype(jnp.float32)
    return context.sum_over_length(
        jnp.einsum("bl,blp->bp", w_BL, jax.nn.one_hot((seg_BL - 1) // 2, pairs_per_row, dtype=jnp.float32)))


def pair_row_shapes(length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """One packed pair row's keys besides ``inputs`` and ``targets`` (:mod:`trainers.data.pairs`), as shapes."""
    i32, f32 = jnp.int32, jnp.float32
    return {k: jax.ShapeDtypeStruct((length,), t) for k, t in
            (("segment_ids", i32), ("positions", i32), ("weights", f32), ("response", f32))}


def reference_from_params(state: Any) -> Any:
    """A fresh state whose params were loaded (``checkpoint.init_from``): the reference set to a copy of them."""
    reference = jax.tree.map(jnp.copy, state.params)
    return state.replace(model_state={**state.model_state, "reference": reference})


def check_dpo(cfg: Config) -> None:
    """What ``run.objective=dpo`` needs of the config, refused before anything is built."""
    if cfg.data.corpus not in DOCUMENT_CORPORA:
        raise ValueError(f"run.objective=dpo reads preference pairs from a document corpus ({', '.join(DOCUMENT_CORPORA)}"
                         f"), got data.corpus={cfg.data.corpus!r}; set data.corpus and data.fields=prompt,chosen,rejected")
    pairs_lib.check_fields(cfg.data.field_names)


def pair_data(cfg: Config, split: str) -> pairs_lib.PairStream:
    """The checked pair stream of one split of ``cfg.data`` (train: shuffled and repeated)."""
    return pairs_lib.pair_stream(cfg.data, split, pairs_per_row=cfg.dpo.pairs_per_row, train=split == "train")
