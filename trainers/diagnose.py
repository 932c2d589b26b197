"""Sharding diagnostics: when a layout fails or wastes memory, say which parameter and dim, and the fix.

Each check returns :class:`Issue` records that name the parameter path, the logical dim, the
sizes involved and a suggested fix, e.g.::

    blocks/block/mlp/w_gate dim mlp=688 does not divide by tensor=8: use model.d_ff a multiple of 8, or rules fsdp

Checks:

- :func:`check_divisibility`: a parameter dim whose size does not divide by the product of the
  mesh axes its rule maps it to (the error ``spmd.spec_for`` raises at state creation, found here
  before any compile, for every parameter at once);
- :func:`check_batch`: the global batch (per microbatch) does not divide by the batch axes;
- :func:`check_pipeline`: a pipelined run (``pipeline.schedule != "none"``) whose layers do not
  split into ``pipe x virtual_stages`` equal chunks, whose batch does not split into
  ``pipeline.microbatches`` (nor each pipeline microbatch over the batch axes), or an interleaved
  schedule whose microbatches are not a multiple of ``pipe``. :class:`trainers.config.Config`
  runs it when built, so a bad ``--set`` fails before any compile;
- :func:`check_replicated`: a large parameter left replicated although the rule set shards
  parameters (each device holds a full copy);
- :func:`check_collectives`: all-to-alls in a compiled step (GSPMD resharding between layouts
  that disagree, usually a missing ``constrain``), traced to the jax operation that emitted them;
- :func:`parse_remat_warnings`: XLA's "Involuntary full rematerialization" warnings (the
  partitioner could not convert between two shardings without materialising the whole tensor),
  read from the compiler's log, which :func:`capture_stderr` collects around a compile.
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

import spmd
from spmd.models import GPT, GPTConfig
from spmd.pipeline import PipelineConfig

# Which config field sets the size of each logical dim (for "use X a multiple of N" fixes).
CONFIG_FIELD = {
    "mlp": "model.d_ff", "heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "vocab": "model.vocab_size",
    "embed": "model.d_model", "layers": "model.n_layers", "head_dim": "model.head_dim", "batch": "data.global_batch",
}


@dataclasses.dataclass(frozen=True)
class Issue:
    """One diagnosed problem: what (kind), where (path, dim), and the suggested fix."""

    kind: str  # "indivisible" | "batch" | "pipeline" | "replicated" | "all-to-all" | "remat"
    path: str
    dim: str | None
    message: str
    fix: str
    fatal: bool = False  # the layout cannot be built at all

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}" if self.fix else self.message


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    path: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...] | None
    itemsize: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=32)
def param_infos(model: GPTConfig) -> tuple[ParamInfo, ...]:
    """Path, shape, logical dims and item size of every parameter, from an abstract model (no allocation)."""
    from flax import nnx

    abstract = nnx.eval_shape(lambda: GPT(model, rngs=nnx.Rngs(0)))
    _, params, _ = nnx.split(abstract, nnx.Param, ...)
    dims = spmd.logical_dims(params)
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]:
        name = spmd.path_str(path)
        out.append(ParamInfo(name, tuple(x.shape), dims.get(name), np.dtype(x.dtype).itemsize))
    return tuple(out)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def shard_divisors(info: ParamInfo, rules: spmd.Rules, sizes: Mapping[str, int], kind: str = "params") -> list[int]:
    """Per dim, the product of the mesh axes the rule set shards it over."""
    if info.dims is None:
        return [1] * len(info.shape)
    spec = rules.spec(info.dims, kind=kind, mesh_sizes=sizes, what=info.path)
    entries = list(spec) + [None] * (len(info.shape) - len(spec))
    return [math.prod(sizes[a] for a in _axes(e)) for e in entries]


def _alternative(dim: str, axes: Sequence[str]) -> str:
    if "tensor" in axes:
        return "rules fsdp (shards embed, not this dim)"
    return "rules dp_tp or a smaller fsdp axis"


def check_divisibility(params: Sequence[ParamInfo], rules: spmd.Rules | str, sizes: Mapping[str, int]) -> list[Issue]:
    """Every parameter dim that does not divide by its mesh axes (state creation would fail)."""
    rules = spmd.get_rules(rules)
    issues = []
    for info in params:
        if info.dims is None:
            continue
        spec = rules.spec(info.dims, kind="params", mesh_sizes=sizes, what=info.path)
        entries = list(spec) + [None] * (len(info.shape) - len(spec))
        for size, dim, entry in zip(info.shape, info.dims, entries):
            axes = _axes(entry)
            n = math.prod(sizes[a] for a in axes)
            if n > 1 and size % n:
                where = " x ".join(f"{a}={sizes[a]}" for a in axes)
                field = CONFIG_FIELD.get(dim or "", f"the {dim} size")
                issues.append(Issue(
                    "indivisible", info.path, dim,
                    f"{info.path} dim {dim}={size} does not divide by {where}",
                    f"use {field} a multiple of {n}, or {_alternative(dim or '', axes)}", fatal=True))
    return issues


def check_batch(global_batch: int, grad_accum: int, rules: spmd.Rules | str, sizes: Mapping[str, int]) -> list[Issue]:
    """The per-microbatch batch must split evenly over the batch axes of the activation rules."""
    rules = spmd.get_rules(rules)
    spec = rules.spec(("batch",), kind="activations", mesh_sizes=sizes)
    axes = _axes(spec[0]) if len(spec) else ()
    n = math.prod(sizes[a] for a in axes)
    micro = global_batch // max(grad_accum, 1)
    if n > 1 and micro % n:
        where = " x ".join(f"{a}={sizes[a]}" for a in axes)
        return [Issue("batch", "batch", "batch",
                      f"batch of {micro} per microbatch (data.global_batch={global_batch} / run.grad_accum={grad_accum}) "
                      f"does not divide by {where}",
                      f"use data.global_batch a multiple of {n * grad_accum}, or fewer batch-sharding devices", fatal=True)]
    return []


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
    if pipeline.schedule == "interleaved" and M % S:
        issues.append(Issue(
            "pipeline", "pipeline", None,
            f"interleaved schedule needs pipeline.microbatches={M} to be a multiple of pipe={S}",
            f"use pipeline.microbatches a multiple of {S}", fatal=True))
    spec = spmd.get_rules(rules).spec(("batch",), kind="activations",
                                      mesh_sizes={a: s if s > 0 else 2 for a, s in sizes.items()})
    axes = _axes(spec[0]) if len(spec) else ()
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


def check_replicated(params: Sequence[ParamInfo], rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                     fraction: float = 0.05) -> list[Issue]:
    """Parameters of more than ``fraction`` of all parameter bytes held whole on every device,
    under a layout that shards parameters (a mesh axis > 1 that the parameter rules use)."""
    rules = spmd.get_rules(rules)
    param_axes = {a for _, axes in rules.params for a in _axes(axes) if sizes.get(a, 1) > 1}
    if not param_axes:
        return []  # pure data parallelism replicates everything by design
    total = sum(p.size * p.itemsize for p in params)
    issues = []
    for info in params:
        nbytes = info.size * info.itemsize
        if math.prod(shard_divisors(info, rules, sizes)) == 1 and nbytes > fraction * total:
            issues.append(Issue(
                "replicated", info.path, None,
                f"{info.path} {info.shape} ({nbytes / 2**20:.1f} MiB, {nbytes / total:.0%} of the parameters) is replicated "
                f"on every device under rules {rules.name!r} (dims {info.dims})",
                f"map one of its dims to {' or '.join(sorted(param_axes))} (e.g. rules.replace(params={{...}}))"))
    return issues


def check_collectives(ops: Sequence[spmd.Collective]) -> list[Issue]:
    """All-to-alls in a compiled step: a reshard between disagreeing layouts, traced to its jax op."""
    issues = []
    for op in ops:
        if op.kind == "all-to-all":
            where = op.op_name or op.name
            issues.append(Issue(
                "all-to-all", where, None,
                f"unexpected all-to-all over {','.join(op.axes)} ({op.bytes:,} bytes x {op.count}) from {where}",
                "the activation layouts on either side disagree: add spmd.constrain(x, dims) at this op, "
                "or use a rule set that keeps the dim on one axis"))
    return issues


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


def diagnose(model: GPTConfig, rules: spmd.Rules | str, sizes: Mapping[str, int], *, global_batch: int,
             grad_accum: int = 1, pipeline: PipelineConfig | None = None) -> list[Issue]:
    """The static checks (no compile) of one layout: divisibility, batch split, pipeline split, large replicated params."""
    params = param_infos(model)
    piped = check_pipeline(model, pipeline, rules, sizes, global_batch=global_batch, grad_accum=grad_accum) \
        if pipeline is not None else []
    return (check_divisibility(params, rules, sizes) + check_batch(global_batch, grad_accum, rules, sizes) + piped
            + check_replicated(params, rules, sizes))
