"""What a mesh's axis sizes need of the built-in GPT's config and of the batch: layout-stage checks.

    check_heads(cfg.model, "tp", {"tensor": 8}) -> [Issue("indivisible", ..., fatal=True)] or []

Each returns :class:`~trainers.checks.issue.Issue` records naming the config key and a fix; none
compiles or builds a model. Parameter-by-parameter checks are in :mod:`trainers.checks.params`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import spmd
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from spmd.rules import axes_of
from trainers.checks.issue import Issue


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
            f"equal chunks of layers", f"use model.n_layers a multiple of {S * V}, or a smaller pipe axis", fatal=True,
            stage="layout", key="model.n_layers"))
    micro = global_batch // max(grad_accum, 1)
    if micro % M:
        issues.append(Issue(
            "pipeline", "batch", "batch",
            f"batch of {micro} (data.global_batch={global_batch} / run.grad_accum={grad_accum}) does not split into "
            f"pipeline.microbatches={M}", f"use data.global_batch a multiple of {M * grad_accum}, or "
            f"pipeline.microbatches a divisor of {micro}", fatal=True, stage="layout", key="pipeline.microbatches"))
    if pipeline.schedule in ("interleaved", "zb-v") and M % S:
        issues.append(Issue(
            "pipeline", "pipeline", None,
            f"{pipeline.schedule} schedule needs pipeline.microbatches={M} to be a multiple of pipe={S}",
            f"use pipeline.microbatches a multiple of {S}", fatal=True, stage="layout", key="pipeline.microbatches"))
    axes = batch_axes(rules, {a: s if s > 0 else 2 for a, s in sizes.items()})
    if known and S > 1 and not issues and all(sizes[a] > 0 for a in axes):
        n = math.prod(sizes[a] for a in axes)
        if (micro // M) % n:
            where = " x ".join(f"{a}={sizes[a]}" for a in axes)
            issues.append(Issue(
                "pipeline", "batch", "batch",
                f"pipeline microbatch of {micro // M} rows (data.global_batch={global_batch} / run.grad_accum="
                f"{grad_accum} / pipeline.microbatches={M}) does not divide by {where}",
                f"use data.global_batch a multiple of {n * M * grad_accum}, or fewer pipeline.microbatches", fatal=True,
                stage="layout", key="data.global_batch"))
    return issues


def check_batch(global_batch: int, grad_accum: int, rules: spmd.Rules | str, sizes: Mapping[str, int],
                groups: int = 0) -> list[Issue]:
    """The per-microbatch batch must split evenly over the batch axes of the activation rules; under
    local SGD with ``groups`` (G) replica groups, over G in place of ``data`` (each group its rows)."""
    sizes = {**sizes, "data": groups} if groups else sizes
    axes = batch_axes(rules, sizes)
    n = math.prod(sizes[a] for a in axes)
    micro = global_batch // max(grad_accum, 1)
    if n > 1 and micro % n:
        where = " x ".join(f"local_sgd.groups={groups}" if groups and a == "data" else f"{a}={sizes[a]}" for a in axes)
        return [Issue("batch", "batch", "batch",
                      f"batch of {micro} per microbatch (data.global_batch={global_batch} / run.grad_accum={grad_accum}) "
                      f"does not divide by {where}",
                      f"use data.global_batch a multiple of {n * grad_accum}, or fewer batch-sharding devices", fatal=True,
                      stage="layout", key="data.global_batch")]
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
                  f"use {' x '.join(axes)} of {' or '.join(map(str, valid))}", fatal=True, stage="layout",
                  key="model.n_heads")]


def check_context_and_experts(model: GPTConfig, rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                              seq_len: int | None) -> list[Issue]:
    """Context parallelism (activation ``length`` over ``seq`` > 1): the length a multiple of 2 x seq;
    MoE (``model.n_experts`` > 0) on an ``expert`` axis > 1: a rule set and expert count that give expert
    parallelism (:func:`spmd.models.moe.expert_layout`). All fatal. Both run under every pipeline schedule
    (the pipeline's region is manual over the batch and length axes; :func:`check_pipeline` splits its rows)."""
    from spmd.models.moe import expert_layout

    rules = spmd.get_rules(rules)
    length = rules.spec(("length",), kind="activations", mesh_sizes=sizes)
    seq = sizes.get("seq", 1) if len(length) and "seq" in axes_of(length[0]) else 1
    issues = []
    if seq > 1 and seq_len is not None and seq_len % (2 * seq):
        issues.append(Issue("indivisible", "inputs", "length", f"data.seq_len={seq_len} does not split into 2 x "
                            f"seq={seq} load-balanced chunks", f"use data.seq_len a multiple of {2 * seq}, or a "
                            "smaller seq axis", fatal=True, stage="layout", key="data.seq_len"))
    if model.n_experts and sizes.get("expert", 1) > 1:
        try:
            expert_layout(rules, dict(sizes), model.n_experts)
        except ValueError as e:
            issues.append(Issue("rules", "blocks/block/mlp", "expert", str(e), "", fatal=True, stage="layout",
                                key="model.n_experts"))
    return issues
