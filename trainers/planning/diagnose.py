"""Sharding diagnostics: when a layout fails or wastes memory, say which parameter and dim, and the fix.

    blocks/block/mlp/w_gate_up dim mlp=688 does not divide by tensor=8: use model.d_ff a multiple of 8, or rules fsdp

Each ``check_*`` function returns :class:`Issue` records. See docs/planning.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

import spmd
from meshes import AXES
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from spmd.rules import axes_of
from spmd.sharding import abstract_module, fit_spec
from spmd.units import fmt_bytes
from spmd.variables import Decision, PathRules, decide
from trainers.task import lm_model
from trainers.validate import CONFIG_FIELD, Issue, check_batch, check_heads, check_pipeline


# Which config field sets the size of each logical dim of the built-in GPT (for "use X a multiple of N" fixes).
@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One variable of a model: path, shape, logical dims (from its annotation or a path rule; None
    when it has none), bytes per element of its stored form, its kind and where its dims came from."""

    path: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...] | None
    itemsize: int
    kind: str = "Param"
    source: str = "annotation"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


class _AxisSizes:
    """What ``spmd.variables.decide`` reads of a mesh, its axis names and sizes, without devices:
    the planning layer decides layouts for meshes larger than this machine."""

    def __init__(self, sizes: Mapping[str, int]):
        self.axis_names = tuple(sizes)
        self.devices = np.broadcast_to(np.uint8(0), tuple(max(int(s), 1) for s in sizes.values()))


def _storage(x) -> tuple[tuple[int, ...], int]:
    """Shape and item size of a variable as the train state stores it (RNG keys as uint32 key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return tuple(data.shape), np.dtype(data.dtype).itemsize
    return tuple(x.shape), np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class ModelVariables:
    """Every variable of a model, abstract (shapes, dtypes, metadata; nothing allocated): what the
    planning layer reads of any task's model. ``params`` / ``other`` are the abstract ``nnx.State``
    of the ``nnx.Param`` variables and of every other kind (batch statistics, RNG streams, ...)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    other: nnx.State
    path_rules: tuple
    infos: tuple[ParamInfo, ...]  # the parameters, in tree order
    other_infos: tuple[ParamInfo, ...]

    @property
    def param_count(self) -> int:
        return sum(p.size for p in self.infos)

    def decisions(self, rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                  on_indivisible: str = "error") -> list[Decision]:
        """How every variable (parameters first) is sharded on a mesh of these axis sizes: the same
        :func:`spmd.variables.decide` the run's state builder calls (raises ``spmd.rules.RulesError``)."""
        mesh = _AxisSizes({a: sizes.get(a, 1) for a in AXES})
        return (decide(self.params, rules, mesh, path_rules=self.path_rules, on_indivisible=on_indivisible)
                + decide(self.other, rules, mesh, path_rules=self.path_rules, on_indivisible=on_indivisible))


def model_variables(make, path_rules: PathRules = ()) -> ModelVariables:
    """The :class:`ModelVariables` of ``make()`` (a function returning an ``nnx.Module``), traced abstractly."""
    graphdef, params, other = nnx.split(abstract_module(make), nnx.Param, ...)
    path_rules = tuple(path_rules)
    unit = _AxisSizes({a: 1 for a in AXES})

    def infos(state) -> tuple[ParamInfo, ...]:
        leaves = {spmd.sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
        out = []
        for d in decide(state, "none", unit, path_rules=path_rules):
            shape, itemsize = _storage(leaves[d.path])
            out.append(ParamInfo(d.path, shape, d.dims, itemsize, d.kind, d.source))
        return tuple(out)

    return ModelVariables(graphdef, params, other, path_rules, infos(params), infos(other))


@functools.lru_cache(maxsize=32)
def _gpt_variables(model: GPTConfig) -> ModelVariables:
    return model_variables(lambda: lm_model(model)(nnx.Rngs(0)))


def param_infos(model: GPTConfig | ModelVariables) -> tuple[ParamInfo, ...]:
    """Path, shape, logical dims and item size of every parameter of the built-in GPT of a
    ``GPTConfig``, or of any model's :class:`ModelVariables` (from an abstract model, no allocation)."""
    return (_gpt_variables(model) if isinstance(model, GPTConfig) else model).infos


def shard_divisors(info: ParamInfo, rules: spmd.Rules, sizes: Mapping[str, int], kind: str = "params") -> list[int]:
    """Per dim, the product of the mesh axes the rule set shards it over."""
    if info.dims is None:
        return [1] * len(info.shape)
    spec = fit_spec(rules.spec(info.dims, kind=kind, mesh_sizes=sizes, what=info.path), info.shape, info.dims, sizes)
    entries = list(spec) + [None] * (len(info.shape) - len(spec))
    return [math.prod(sizes[a] for a in axes_of(e)) for e in entries]


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
                                    fix, fatal=True))
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
        return None, [Issue("rules", "variables", None, str(e), "", fatal=True)]


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
                "an annotation or a path rule)"))
    return issues


def check_collectives(ops: Sequence[spmd.hlo.Collective]) -> list[Issue]:
    """All-to-alls in a compiled step that no ``jax.lax.all_to_all`` asked for: a reshard between
    disagreeing layouts, traced to its jax op (one issue per op and axes, however many times it runs)."""
    grouped: dict[tuple[str, tuple[str, ...]], list] = {}
    for op in ops:  # an explicit jax all_to_all (MoE dispatch/combine in a shard_map) is meant
        if op.kind == "all-to-all" and not op.op_name.endswith("all_to_all"):
            row = grouped.setdefault((op.op_name or op.name, op.axes), [0, 0, set()])
            row[0] += op.count
            row[1] += op.total_bytes
            row[2].add(op.bytes)
    issues = []
    for (where, axes), (count, total, sizes) in grouped.items():
        each = f"{next(iter(sizes)):,} bytes x {count}" if len(sizes) == 1 else f"{total:,} bytes in {count}"
        issues.append(Issue(
            "all-to-all", where, None,
            f"unexpected all-to-all over {','.join(axes)} ({each}) from {where}",
            "the activation layouts on either side disagree: add spmd.constrain(x, dims) at this op, "
            "or use a rule set that keeps the dim on one axis"))
    return issues


def check_activation_split(compiled_temp: int, split: int, whole: int, fixed: int, rows: int,
                           batch_axes: Sequence[str]) -> list[Issue]:
    """Compiled temporaries that look like every device holds the whole batch's activations.

    ``split`` / ``whole``: the activations estimated for this device's ``rows`` and for the whole
    (micro)batch; ``fixed``: temporaries that do not scale with the batch (gradients, the update's
    copy of the state). Flagged when the batch is split (``batch_axes``), the compiled temporaries
    reach half of ``whole``, and the gap between ``whole`` and ``split`` is too large for ``fixed``
    to explain. The usual cause: a model without activation constraints under FSDP, where GSPMD
    lays activations out like the weights (split on ``embed``) instead of on the batch.
    """
    if not batch_axes or whole <= split or compiled_temp < whole / 2 or whole - split < 2 * fixed:
        return []
    axes = " x ".join(batch_axes)
    return [Issue(
        "activations", "activations", "batch",
        f"compiled temporaries {fmt_bytes(compiled_temp)} per device are near the activations of the whole batch "
        f"({fmt_bytes(whole)}), not of this device's {rows} rows ({fmt_bytes(split)}): the activations are "
        f"probably not split over {axes}",
        f"constrain them to the batch, spmd.constrain(x, ('batch', ...)) at each block's input and output, or use "
        f"rules that shard no weight dim over {axes} (e.g. dp)")]


_REMAT = re.compile(r"Involuntary full rematerialization[^\n]*?from sharding (?P<src>.+?) to (?P<dst>.+?) without[^\n]*")


def parse_remat_warnings(log: str) -> list[Issue]:
    """XLA's "Involuntary full rematerialization" warnings in a compiler log, with the jax op they came from."""
    issues = []
    for m in _REMAT.finditer(log):
        line = m.group(0)
        op = re.search(r'op_name="([^"]*)"', line)
        src = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', line)
        where = op.group(1) if op else "an unnamed op"
        at = f" ({src.group(1)}:{src.group(2)})" if src else ""
        issues.append(Issue(
            "remat", where, None,
            f"XLA rematerialised a full tensor to go from sharding {m.group('src')} to {m.group('dst')} at {where}{at}",
            "constrain this activation to one layout on both sides (spmd.constrain), or change the rule for its dims"))
    return issues


@contextlib.contextmanager
def capture_stderr() -> Iterator[list[str]]:
    """Collect what C++ code (XLA) writes to file descriptor 2 inside the block; echoed afterwards.

    Yields a list that holds the captured text (one string) once the block ends.
    """
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            out.append(text)
            if text:
                sys.stderr.write(text)


def check_context_and_experts(model: GPTConfig, rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                              seq_len: int | None, pipeline: PipelineConfig | None = None) -> list[Issue]:
    """Context parallelism (activation ``length`` over ``seq`` > 1): the length a multiple of 2 x seq,
    no pipeline; MoE (``model.n_experts`` > 0): no pipeline, and on an ``expert`` axis > 1 a rule set
    and expert count that give expert parallelism (:func:`spmd.models.moe.expert_layout`). All fatal."""
    from spmd.models.moe import expert_layout

    rules = spmd.get_rules(rules)
    length = rules.spec(("length",), kind="activations", mesh_sizes=sizes)
    seq = sizes.get("seq", 1) if len(length) and "seq" in axes_of(length[0]) else 1
    piped = pipeline is not None and pipeline.enabled and sizes.get("pipe", 1) > 1
    issues = []
    if seq > 1 and seq_len is not None and seq_len % (2 * seq):
        issues.append(Issue("indivisible", "inputs", "length", f"data.seq_len={seq_len} does not split into 2 x "
                            f"seq={seq} load-balanced chunks", f"use data.seq_len a multiple of {2 * seq}, or a "
                            "smaller seq axis", fatal=True))
    if piped and (seq > 1 or model.n_experts):
        what = f"context parallelism (seq={seq})" if seq > 1 else f"MoE (model.n_experts={model.n_experts})"
        issues.append(Issue("pipeline", "pipeline", None, f"{what} does not run under a pipeline",
                            "use pipeline.schedule=none and pipe=1", fatal=True))
    if model.n_experts and sizes.get("expert", 1) > 1:
        try:
            expert_layout(rules, dict(sizes), model.n_experts)
        except ValueError as e:
            issues.append(Issue("rules", "blocks/block/mlp", "expert", str(e), "", fatal=True))
    return issues


def diagnose(model: GPTConfig | ModelVariables, rules: spmd.Rules | str, sizes: Mapping[str, int], *, global_batch: int,
             grad_accum: int = 1, pipeline: PipelineConfig | None = None, seq_len: int | None = None) -> list[Issue]:
    """The static checks (no compile) of one layout: divisibility, batch split, pipeline split, context
    and expert parallelism (the built-in GPT), large replicated params. ``model`` is the built-in GPT's
    config or any model's :class:`ModelVariables`."""
    batch = check_batch(global_batch, grad_accum, rules, sizes)
    if isinstance(model, ModelVariables):
        decisions, issues = check_layout(model, rules, sizes)
        if decisions is None:
            return issues + batch
        return batch + check_replicated(model.infos, rules, sizes, decisions=decisions)
    params = param_infos(model)
    piped = check_pipeline(model, pipeline, rules, sizes, global_batch=global_batch, grad_accum=grad_accum) \
        if pipeline is not None else []
    return (check_heads(model, rules, sizes) + check_divisibility(params, rules, sizes) + batch + piped
            + check_context_and_experts(model, rules, sizes, seq_len=seq_len, pipeline=pipeline)
            + check_replicated(params, rules, sizes))
