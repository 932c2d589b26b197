"""The registered rules of the checks pass, stage by stage, in the order they run.

    config      local_sgd, pipeline_on_mesh, pipelined_task
    layout      heads, task, divisibility, batch, pipeline, context_experts, replicated
    data        batch_ids
    checkpoint  hf_overrides
    compiled    activation_split, collectives, remat

Each rule reads a :class:`~trainers.checks.registry.Context` and calls one check function.
"""

from __future__ import annotations

import spmd
from trainers.checks import compiled, config, layout, params
from trainers.checks.issue import Issue
from trainers.checks.registry import Context, rule
from trainers.model_variables import param_infos

# -- config: the config alone (trainers.Config runs this stage when it is built)


@rule("config", needs=("cfg",))
def local_sgd(ctx: Context) -> list[Issue]:
    return config.check_local_sgd(ctx.cfg)


@rule("config", needs=("cfg",))
def pipeline_on_mesh(ctx: Context) -> list[Issue]:
    return config.check_pipeline_on_mesh(ctx.cfg)


@rule("config", needs=("cfg", "task"))
def pipelined_task(ctx: Context) -> list[Issue]:
    return config.check_pipelined_task(ctx.cfg, ctx.task)


# -- layout: the config (or a model) on a mesh's axis sizes, no compile


@rule("layout", needs=("sizes", "rules"))
def heads(ctx: Context) -> list[Issue]:
    return layout.check_heads(ctx.gpt, ctx.rules, ctx.sizes) if ctx.gpt is not None else []


@rule("layout", needs=("sizes", "rules", "task", "cfg"))
def task(ctx: Context) -> list[Issue]:
    """The task's own layout checks (``Task.checks``)."""
    checks = ctx.task.checks
    return list(checks(ctx.cfg, spmd.get_rules(ctx.rules), dict(ctx.sizes))) if checks is not None else []


@rule("layout", needs=("sizes", "rules"))
def divisibility(ctx: Context) -> list[Issue]:
    if ctx.gpt is not None:
        return params.check_divisibility(param_infos(ctx.gpt), ctx.rules, ctx.sizes)
    return ctx.decided[1] if ctx.variables is not None else []


@rule("layout", needs=("sizes", "rules", "global_batch"))
def batch(ctx: Context) -> list[Issue]:
    local = ctx.cfg.local_sgd if ctx.cfg is not None else None  # G replica groups split the batch as data would
    groups = local.groups if local is not None and local.enabled else 0
    return layout.check_batch(ctx.global_batch, ctx.grad_accum, ctx.rules, ctx.sizes, groups=groups)


@rule("layout", needs=("sizes", "rules", "pipeline", "global_batch"))
def pipeline(ctx: Context) -> list[Issue]:
    if ctx.gpt is None:
        return []
    return layout.check_pipeline(ctx.gpt, ctx.pipeline, ctx.rules, ctx.sizes, global_batch=ctx.global_batch,
                                 grad_accum=ctx.grad_accum)


@rule("layout", needs=("sizes", "rules"))
def context_experts(ctx: Context) -> list[Issue]:
    if ctx.gpt is None:
        return []
    return layout.check_context_and_experts(ctx.gpt, ctx.rules, ctx.sizes, seq_len=ctx.seq_len)


@rule("layout", needs=("sizes", "rules"))
def replicated(ctx: Context) -> list[Issue]:
    if ctx.gpt is not None:
        return params.check_replicated(param_infos(ctx.gpt), ctx.rules, ctx.sizes)
    if ctx.variables is None or ctx.decided[0] is None:
        return []  # a layout that cannot be built has nothing to replicate
    return params.check_replicated(ctx.variables.infos, ctx.rules, ctx.sizes, decisions=ctx.decided[0])


# -- data: a batch against the task


@rule("data", needs=("task", "batch"))
def batch_ids(ctx: Context) -> list[Issue]:
    """A batch's token ids inside ``Task.vocab_size`` (:func:`trainers.data.checks.check_batch_ids`)."""
    from trainers.data.checks import check_batch_ids

    if ctx.task.vocab_size is None:
        return []
    try:
        check_batch_ids(ctx.batch, ctx.task.vocab_size, ctx.task.token_keys, where=f"task {ctx.task.name!r}")
    except ValueError as e:
        return [Issue("data", "batch", None, str(e), "", fatal=True, stage="data", key="Task.vocab_size")]
    return []


# -- checkpoint: the start the config names


@rule("checkpoint", needs=("cfg", "sets"))
def hf_overrides(ctx: Context) -> list[Issue]:
    """``--set model.*`` that contradict an ``hf:PATH`` start (:func:`trainers.pretrained.check_overrides`)."""
    from trainers.pretrained import check_overrides

    try:
        check_overrides(ctx.cfg, list(ctx.sets))
    except ValueError as e:
        return [Issue("checkpoint", "checkpoint.init_from", None, str(e), "", fatal=True, stage="checkpoint")]
    return []


# -- compiled: what the compiled step shows


@rule("compiled", needs=("compiled",))
def activation_split(ctx: Context) -> list[Issue]:
    figures = ctx.compiled.activations
    return compiled.check_activation_split(*figures) if figures is not None else []


@rule("compiled", needs=("compiled",))
def collectives(ctx: Context) -> list[Issue]:
    return compiled.check_collectives(ctx.compiled.ops)


@rule("compiled", needs=("compiled",))
def remat(ctx: Context) -> list[Issue]:
    return compiled.parse_remat_warnings(ctx.compiled.log)
