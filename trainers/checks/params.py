"""Every parameter of a model on a layout: dims that do not divide by their mesh axes, large replicated ones.

    check_divisibility(param_infos(cfg.model), "dp_tp", {"data": 2, "tensor": 8})
      -> [Issue: blocks/block/mlp/w_gate_up dim mlp=688 does not divide by tensor=8: use model.d_ff a multiple of 8, ...]

Layout-stage checks over :class:`~trainers.model_variables.ParamInfo` records (the built-in GPT's or any
model's, read abstractly). See docs/planning.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import spmd
from spmd.rules import axes_of
from spmd.sharding import fit_spec
from spmd.units import fmt_bytes
from spmd.variables import Decision
from trainers.checks.issue import CONFIG_FIELD, Issue
from trainers.model_variables import ModelVariables, ParamInfo, shard_divisors


def _alternative(dim: str, axes: Sequence[str]) -> str:
    if "tensor" in axes:
        return "rules fsdp (shards embed, not this dim)"
    return "rules dp_tp or a smaller fsdp axis"


def check_divisibility(params: Sequence[ParamInfo], rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                       fields: Mapping[str, str] = CONFIG_FIELD) -> list[Issue]:
    """Every parameter dim that does not divide by its mesh axes (state creation would fail).

    The fix names the config field that sets the dim's size where ``fields`` has one (the built-in
    GPT's ``model.*``); for any other model it names the parameter's dim and the mesh axes.
    """
    rules = spmd.get_rules(rules)
    issues = []
    for info in params:
        if info.dims is None:
            continue
        spec = fit_spec(rules.spec(info.dims, kind="params", mesh_sizes=sizes, what=info.path), info.shape,
                        info.dims, sizes)
        entries = list(spec) + [None] * (len(info.shape) - len(spec))
        for i, (size, dim, entry) in enumerate(zip(info.shape, info.dims, entries)):
            axes = axes_of(entry)
            n = math.prod(sizes[a] for a in axes)
            if n > 1 and size % n:
                where = " x ".join(f"{a}={sizes[a]}" for a in axes)
                if dim in fields:
                    fix = f"use {fields[dim]} a multiple of {n}, or {_alternative(dim or '', axes)}"
                else:
                    fix = (f"make dim {i} ({dim}) of {info.path} a multiple of {n} in the model, or keep {dim} off "
                           f"mesh axis {' x '.join(axes)} (rules that do not shard {dim}, or a smaller {' x '.join(axes)})")
                issues.append(Issue("indivisible", info.path, dim, f"{info.path} dim {dim}={size} does not divide by {where}",
                                    fix, fatal=True, stage="layout", key=fields.get(dim or "", info.path)))
    return issues


def check_layout(variables: ModelVariables, rules: spmd.Rules | str, sizes: Mapping[str, int]
                 ) -> tuple[list[Decision] | None, list[Issue]]:
    """Any model's variables on a layout: ``(decisions, issues)``; decisions are None when it cannot be built.

    Dims from annotations and path rules are checked for every variable at once
    (:func:`check_divisibility`, fixes naming the dim and the mesh axes); anything else
    :func:`spmd.variables.decide` refuses (a path rule's ``PartitionSpec`` that does not divide, an
    unknown dim, one axis for two dims) becomes a fatal issue with its message.
    """
    issues = check_divisibility(variables.infos + variables.other_infos, rules, sizes, fields={})
    if issues:
        return None, issues
    try:
        return variables.decisions(rules, sizes), []
    except spmd.rules.RulesError as e:
        return None, [Issue("rules", "variables", None, str(e), "", fatal=True, stage="layout")]


def check_replicated(params: Sequence[ParamInfo], rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                     fraction: float = 0.05, decisions: Sequence[Decision] | None = None) -> list[Issue]:
    """Parameters of more than ``fraction`` of all parameter bytes held whole on every device,
    under a layout that shards parameters (a mesh axis > 1 that the parameter rules use).

    Whether a parameter is sharded comes from its logical dims, or from ``decisions`` when given
    (any model: annotations, path rules and the FSDP default, :meth:`ModelVariables.decisions`).
    """
    rules = spmd.get_rules(rules)
    param_axes = {a for _, axes in rules.params for a in axes_of(axes) if sizes.get(a, 1) > 1}
    if not param_axes:
        return []  # pure data parallelism replicates everything by design
    specs = {d.path: d.spec for d in decisions} if decisions is not None else None
    total = sum(p.nbytes for p in params)
    issues = []
    for info in params:
        nbytes = info.nbytes
        if specs is not None:
            replicated = not any(sizes.get(a, 1) > 1 for e in specs[info.path] for a in axes_of(e))
        else:
            replicated = math.prod(shard_divisors(info, rules, sizes)) == 1
        if replicated and nbytes > fraction * total:
            why = f"dims {info.dims}" if info.dims is not None else info.source
            issues.append(Issue(
                "replicated", info.path, None,
                f"{info.path} {info.shape} ({fmt_bytes(nbytes)}, {nbytes / total:.0%} of the parameters) is replicated "
                f"on every device under rules {rules.name!r} ({why})",
                f"map one of its dims to {' or '.join(sorted(param_axes))} (e.g. rules.replace(params={{...}}), "
                "an annotation or a path rule)", stage="layout"))
    return issues
