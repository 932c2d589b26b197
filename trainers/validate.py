"""Checks the run makes of a config before any compile, as :class:`Issue` records with a fix.

:class:`trainers.config.Config` runs :func:`check_pipeline` when built, so a bad ``--set`` fails at
once; ``trainers.train`` runs :func:`check_batch` on its mesh before building anything; the planning
layer's diagnostics (:mod:`trainers.planning.diagnose`) report the same records.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import spmd
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from spmd.rules import axes_of

# The config key that sets each logical dim of the built-in GPT (and the batch), for messages.
CONFIG_FIELD = {
    "mlp": "model.d_ff", "heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "vocab": "model.vocab_size",
    "embed": "model.d_model", "layers": "model.n_layers", "head_dim": "model.head_dim", "batch": "data.global_batch",
}


@dataclasses.dataclass(frozen=True)
class Issue:
    """One diagnosed problem: what (kind), where (path, dim), and the suggested fix."""

    kind: str  # "indivisible" | "rules" | "batch" | "pipeline" | "replicated" | "all-to-all" | "remat" | "config" | "profile" | "accumulate"
    path: str
    dim: str | None
    message: str
    fix: str
    fatal: bool = False  # the layout cannot be built at all

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}" if self.fix else self.message


def batch_axes(rules: spmd.Rules | str, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes (size > 1) the rule set splits the batch over."""
    spec = spmd.get_rules(rules).spec(("batch",), kind="activations", mesh_sizes=sizes)
    return axes_of(spec[0]) if len(spec) else ()


def check_pipeline(model: GPTConfig, pipeline: PipelineConfig, rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                   global_batch: int, grad_accum: int = 1) -> list[Issue]:
    """What a pipelined run needs of the model, batch and mesh (nothing when ``pipeline.schedule`` is "none").

    With S = ``sizes["pipe"]`` (1 if absent), V virtual stages, M microbatches: ``model.n_layers``
    a multiple of ``S*V``; the batch per gradient-accumulation step a multiple of M; for the
    interleaved schedule M a multiple of S; with S > 1 each pipeline microbatch split evenly over
    the batch axes (the engine cuts microbatches from each device's own rows; no data moves).
    An axis size of -1 (inferred later from the device count) skips the checks that need it.
    All fatal: the engine refuses these inputs.
    """
    if not pipeline.enabled:
        return []
    S, V, M = sizes.get("pipe", 1), pipeline.virtual_stages, pipeline.microbatches
    known = S > 0
    S = S if known else 1
    issues = []
    if model.n_layers % (S * V):
        issues.append(Issue(
            "pipeline", "blocks", "layers",
            f"model.n_layers={model.n_layers} does not split into pipe={S} x pipeline.virtual_stages={V} = {S * V} "
            f"equal chunks of layers", f"use model.n_layers a multiple of {S * V}, or a smaller pipe axis", fatal=True))
    micro = global_batch // max(grad_accum, 1)
    if micro % M:
        issues.append(Issue(
            "pipeline", "batch", "batch",
            f"batch of {micro} (data.global_batch={global_batch} / run.grad_accum={grad_accum}) does not split into "
            f"pipeline.microbatches={M}", f"use data.global_batch a multiple of {M * grad_accum}, or "
            f"pipeline.microbatches a divisor of {micro}", fatal=True))
    if pipeline.schedule in ("interleaved", "zb-v") and M % S:
        issues.append(Issue(
            "pipeline", "pipeline", None,
            f"{pipeline.schedule} schedule needs pipeline.microbatches={M} to be a multiple of pipe={S}",
            f"use pipeline.microbatches a multiple of {S}", fatal=True))
    axes = batch_axes(rules, {a: s if s > 0 else 2 for a, s in sizes.items()})
    if known and S > 1 and not issues and all(sizes[a] > 0 for a in axes):
        n = math.prod(sizes[a] for a in axes)
        if (micro // M) % n:
            where = " x ".join(f"{a}={sizes[a]}" for a in axes)
            issues.append(Issue(
                "pipeline", "batch", "batch",
                f"pipeline microbatch of {micro // M} rows (data.global_batch={global_batch} / run.grad_accum="
                f"{grad_accum} / pipeline.microbatches={M}) does not divide by {where}",
                f"use data.global_batch a multiple of {n * M * grad_accum}, or fewer pipeline.microbatches", fatal=True))
    return issues


def check_batch(global_batch: int, grad_accum: int, rules: spmd.Rules | str, sizes: Mapping[str, int]) -> list[Issue]:
    """The per-microbatch batch must split evenly over the batch axes of the activation rules."""
    axes = batch_axes(rules, sizes)
    n = math.prod(sizes[a] for a in axes)
    micro = global_batch // max(grad_accum, 1)
    if n > 1 and micro % n:
        where = " x ".join(f"{a}={sizes[a]}" for a in axes)
        return [Issue("batch", "batch", "batch",
                      f"batch of {micro} per microbatch (data.global_batch={global_batch} / run.grad_accum={grad_accum}) "
                      f"does not divide by {where}",
                      f"use data.global_batch a multiple of {n * grad_accum}, or fewer batch-sharding devices", fatal=True)]
    return []


def check_heads(model: GPTConfig, rules: spmd.Rules | str, sizes: Mapping[str, int]) -> list[Issue]:
    """Attention's heads over their mesh axes (``tensor`` in the presets), t shards: ``n_kv_heads`` a
    multiple of t (KV heads sharded), or t a multiple of ``n_kv_heads`` dividing ``n_heads`` (each KV
    head replicated over the t / n_kv_heads shards sharing it). Fatal otherwise, naming the valid t."""
    from spmd.models.layers import valid_head_shards

    spec = spmd.get_rules(rules).spec(("heads",), kind="params", mesh_sizes=sizes)
    axes = axes_of(spec[0]) if len(spec) else ()
    t = math.prod(sizes[a] for a in axes)
    h, g = model.n_heads, model.kv_heads
    valid = valid_head_shards(h, g)
    if t <= 1 or t in valid:
        return []
    where = " x ".join(f"{a}={sizes[a]}" for a in axes)
    return [Issue("indivisible", "blocks/block/attn", "heads",
                  f"model.n_heads={h} and model.n_kv_heads={g} cannot shard over {where}: the tensor shards must "
                  f"divide n_kv_heads, or be a multiple of it that divides n_heads",
                  f"use {' x '.join(axes)} of {' or '.join(map(str, valid))}", fatal=True)]


FSDP_GATHER = ("per_microbatch", "per_step")  # run.fsdp_gather: when gradient accumulation gathers FSDP weights


def check_fsdp_gather(value: str) -> None:
    """``run.fsdp_gather`` is one of :data:`FSDP_GATHER`, or a ValueError naming them."""
    if value not in FSDP_GATHER:
        raise ValueError(f"run.fsdp_gather={value!r}; valid: {', '.join(FSDP_GATHER)} "
                         "(per_microbatch: least memory; per_step: fewest bytes over fsdp)")


def name_config_key(error: Exception) -> str:
    """A sharding error about the built-in GPT's parameters, with the config key that sets the dim."""
    found = re.search(r"dim \d+ \('(\w+)'\)", str(error))
    key = CONFIG_FIELD.get(found.group(1)) if found else None
    return f"{error} (that size is {key})" if key else str(error)
