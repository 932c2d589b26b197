"""Analytic collectives of the built-in GPT's train step: one :class:`Traffic` row per kind and axes.

Per parameter ``W``, from the axes its rule shards it over and the axes that split the tokens
(the batch axes and ``seq``): gathered over the axes that do both but ``expert`` (``W[D_fsdp] -> W[D]``,
FSDP) with its gradient reduce-scattered back, and its gradient shard all-reduced over the others. Tensor
parallelism: 2 all-reduces of ``x[B_local, L_seq, D]`` per layer per direction (reduce-scatter +
all-gather under the ``*_sp`` presets); pipeline sends from the schedule table (the busiest
stage); context parallelism's K/V exchange over ``seq``; MoE's dispatch/combine all-to-alls over
``expert``. Formulas: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import spmd
from meshes import AXES
from spmd.models.lora import LoRASpec, is_adapter
from spmd.models.moe import expert_rows
from spmd.models.router import capacity
from spmd.rules import axes_of
from spmd.sharding import fit_spec
from trainers.checks import batch_axes
from trainers.config import Config
from trainers.model_variables import ParamInfo, param_infos, shard_divisors
from trainers.planning.hardware import Hardware, axis_levels, collective_seconds, networks
from trainers.planning.pipeline_costs import carried_models, pipeline_sends

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
RECOMPUTES_BLOCK = ("full", "save_block_input")  # spmd.remat policies that run each block's forward twice


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One kind of collective on one set of axes: per device per step."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int  # total over the step (count x full buffer)
    network: str  # "ici" | "dcn"
    seconds: float

    @classmethod
    def timed(cls, kind: str, axes: tuple[str, ...], count: float, nbytes: float, sizes: dict[str, int], hw: Hardware,
              dcn_axes: tuple[str, ...] = ()) -> Traffic:
        """``count`` collectives of ``nbytes`` in all over ``axes``, timed as hierarchical rings over the
        network levels they cross (:func:`trainers.planning.hardware.axis_levels`; "dcn" when one leaves the fast network)."""
        dcn = any(networks(sizes, hw, dcn_axes).get(a) == "dcn" for a in axes)
        levels = axis_levels(sizes, axes, hw, dcn_axes)
        return cls(kind, axes, int(count), int(nbytes), "dcn" if dcn else "ici",
                   collective_seconds(hw, kind, nbytes, math.prod(sizes.get(a, 1) for a in axes), dcn=dcn,
                                      levels=levels, count=count))


def token_axes(rules: spmd.Rules, sizes: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the tokens: the batch axes and the axes of activation ``length``."""
    length = rules.spec(("length",), kind="activations", mesh_sizes=sizes)
    out = batch_axes(rules, sizes) + (axes_of(length[0]) if len(length) else ())
    return tuple(a for a in AXES if a in out)


def param_axes(info: ParamInfo, rules: spmd.Rules, sizes: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes (size > 1) the rule set shards parameter ``info`` over."""
    if info.dims is None:
        return ()
    spec = fit_spec(rules.spec(info.dims, kind="params", mesh_sizes=sizes, what=info.path), info.shape, info.dims, sizes)
    return tuple(a for e in spec for a in axes_of(e) if sizes.get(a, 1) > 1)


@dataclasses.dataclass(frozen=True)
class Sharded:
    """One parameter of the built-in GPT on a layout: elements per device and the axes it is sharded over."""

    info: ParamInfo
    local: int  # elements per device (rounded down, as the collectives move them)
    local_ceil: int  # elements per device of the largest shard (what memory holds)
    axes: tuple[str, ...]
    compute_divisor: int  # the activations rule set's split (the weight as a layer's compute lays it out)


def sharded_params(model, rules_name: str, sizes: dict[str, int], lora: LoRASpec | None = None) -> tuple[Sharded, ...]:
    """:class:`Sharded` for every parameter of ``model`` (a GPTConfig, with ``lora``'s adapters) under rule set
    ``rules_name`` (cached: the planner asks for the same layout's parameters from the memory, traffic and
    time models)."""
    return _sharded(model, rules_name, tuple(sizes.items()), lora)


def updated(info: ParamInfo, lora: LoRASpec | None) -> bool:
    """Whether a step updates this parameter: every one, or with LoRA only the adapters (the base is frozen:
    XLA drops its zero gradients, accumulator included, and it has no optimizer state or reduction)."""
    return lora is None or is_adapter(info.path)


def trained(shards: tuple[Sharded, ...], lora: LoRASpec | None) -> tuple[Sharded, ...]:
    """The parameters a step updates (:func:`updated`)."""
    return tuple(x for x in shards if updated(x.info, lora))


@functools.lru_cache(maxsize=256)
def _sharded(model, rules_name: str, items: tuple[tuple[str, int], ...], lora: LoRASpec | None) -> tuple[Sharded, ...]:
    rules, sizes = spmd.get_rules(rules_name), dict(items)
    out = []
    for p in param_infos(model, lora):
        div = math.prod(shard_divisors(p, rules, sizes))
        compute = math.prod(shard_divisors(p, rules, sizes, "activations")) if p.dims else 1
        out.append(Sharded(p, p.size // div, math.ceil(p.size / div), param_axes(p, rules, sizes), compute))
    return tuple(out)


def moe_exchange(setting: str, hw: Hardware) -> str:
    """How a dropless MoE's rows move on ``hw`` (``GPTConfig.moe_exchange``; ``auto``: padded on CPU)."""
    return setting if setting != "auto" else ("padded" if hw.name == "cpu" else "ragged")


def comm_estimate(cfg: Config, sizes: dict[str, int], hw: Hardware, dcn_axes: tuple[str, ...] = ()) -> list[Traffic]:
    """Analytic collectives of one step of the built-in GPT, per device (see the module docstring)."""
    m, rules, data, run = cfg.model, spmd.get_rules(cfg.rules), cfg.data, cfg.run
    dt, k = DTYPE_BYTES[m.dtype], run.grad_accum
    S, t, pipe = sizes.get("pipe", 1), sizes.get("tensor", 1), cfg.pipeline
    piped = S > 1 and pipe.enabled
    tokens = token_axes(rules, sizes)
    totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    def add(kind: str, axes: tuple[str, ...], count: float, nbytes: float) -> None:  # nbytes per collective
        axes = tuple(a for a in AXES if a in axes and sizes.get(a, 1) > 1)
        if axes and count > 0 and nbytes > 0:
            row = totals.setdefault((kind, axes), [0, 0.0])
            row[0], row[1] = row[0] + count, row[1] + count * nbytes

    # gradients and FSDP: per_step gathers once and reduce-scatters once; per microbatch otherwise
    once = k > 1 and run.fsdp_gather == "per_step"
    passes = 1 if once or piped else (2 if m.policy == "none" else 3)  # the pipeline gathers before its loop
    micro = 1 if once else k
    grads: dict[tuple[str, tuple[str, ...]], list[float]] = {}  # all parameters' bytes per collective, as XLA combines them
    lora = cfg.lora.spec
    for x in sharded_params(m, cfg.rules, sizes, lora):
        p, on, local = x.info, x.axes, x.local
        reduced = updated(p, lora)  # a frozen base weight is gathered, never reduced
        gather = tuple(a for a in tokens if a in on and a != "expert")  # experts stay put: tokens travel
        if gather:
            full = local * math.prod(sizes[a] for a in gather)
            matrix = len(p.shape) - (p.dims[0] == "layers") >= 2  # matrices are gathered in the compute dtype
            grads.setdefault(("all-gather", gather), [passes * micro, 0])[1] += full * (dt if matrix else p.itemsize)
            if reduced:
                grads.setdefault(("reduce-scatter", gather), [micro, 0])[1] += full * p.itemsize
        if reduced:
            grads.setdefault(("all-reduce", tuple(a for a in tokens if a not in on)), [1, 0])[1] += local * p.itemsize
        # (an expert's gradient is whole on its shard: every token routed to it arrived by the all-to-all)
    for (kind, axes), (count, nbytes) in grads.items():
        add(kind, axes, count, nbytes)

    b = data.global_batch // math.prod(sizes[a] for a in batch_axes(rules, sizes)) // k  # rows per microbatch
    s = sizes.get("seq", 1) if "seq" in tokens else 1
    L, D, K = data.seq_len // s, m.d_model, m.k
    n_layers = m.n_layers // (S if piped else 1)
    n_moe = n_layers // m.moe_every if m.n_experts else 0
    recompute = m.policy in RECOMPUTES_BLOCK or (piped and pipe.schedule != "gpipe")  # 1F1B: each chunk again
    directions = 3 if recompute else 2  # forward (again), backward
    C = capacity(b * L, m.n_experts, m.experts_per_token, m.capacity_factor) if m.n_experts else 0
    ecd = m.n_experts * C * D * dt  # an MoE layer's dispatch buffer x[E, C, D]
    heads = rules.spec(("heads",), kind="params", mesh_sizes=sizes)
    if t > 1 and len(heads) and "tensor" in axes_of(heads[0]):
        mb = pipe.microbatches if piped else 1  # a pipeline reduces each of its microbatches on its own
        bld = b // mb * L * D * dt
        residual = rules.spec(("residual_length",), kind="activations", mesh_sizes=sizes)
        sp = len(residual) > 0 and "tensor" in axes_of(residual[0])  # Megatron-SP
        count = directions * (2 * n_layers - n_moe + (n_moe if m.n_shared_experts else 0)) * k * mb  # attention + MLPs
        for kind in ("reduce-scatter", "all-gather") if sp else ("all-reduce",):
            add(kind, ("tensor",), count, bld)
        if not sp and any(a == "vocab" for a, _ in rules.activations):  # vocab-parallel embedding and head:
            add("all-reduce", ("tensor",), k, b * L * D * dt)  # the lookup's partial rows summed, once per microbatch
            add("all-reduce", ("tensor",), k * mb, bld)  # the head's input gradient
        add("all-reduce", ("tensor",), directions * n_moe * k, ecd)  # the experts' row-parallel w_down output
        if t > m.kv_heads:  # w_kv replicated over tensor (copied per shard): its gradient summed over tensor
            add("all-reduce", ("tensor",), 1, n_layers * D * 2 * m.kv_heads * K * 4 // sizes.get("fsdp", 1))
    if piped:
        x_in = b // pipe.microbatches * L * D * dt * carried_models(cfg)  # a stage input x[B/M, L/seq, D] (DPO: 2)
        add("collective-permute", ("pipe",), pipeline_sends(cfg, S) * k, x_in)
    if s > 1:  # context parallelism: K/V [2, B, L/seq, G, K] per attention layer
        kv = 2 * b * L * max(m.kv_heads // t, 1) * K
        forward = directions - 1
        if m.context_exchange == "ring" and not piped:  # seq-1 hops forward (again) and backward, dK/dV home
            # in seq hops (a pipeline's stages gather K/V: spmd.models.context.attend)
            add("collective-permute", ("seq",), (s - 1) * (forward + 1) * n_layers * k, kv * dt)
            add("collective-permute", ("seq",), s * n_layers * k, kv * 4)
        else:  # K and V gathered whole in each pass, dK and dV reduce-scattered
            add("all-gather", ("seq",), 2 * (forward + 1) * n_layers * k, kv // 2 * s * dt)
            add("reduce-scatter", ("seq",), 2 * n_layers * k, kv // 2 * s * 4)
    if n_moe and sizes.get("expert", 1) > 1:  # dispatch + combine, forward (again) and backward
        rows = expert_rows(b * L, m.n_experts, m.experts_per_token, m.capacity_factor, sizes["expert"])[0]
        ragged = not m.capacity_factor and moe_exchange(m.moe_exchange, hw) == "ragged"
        if ragged:  # the routed rows only (T * k, balanced routing), after the [ep, ep] row counts
            rows = b * L * m.experts_per_token
            add("all-gather", ("expert",), (directions - 1) * n_moe * k, 4 * sizes["expert"] ** 2)
        add("all-to-all", ("expert",), 2 * directions * n_moe * k, rows * D * dt)  # x[E, C, D]; dropless x[ep, R, D]
        if not m.capacity_factor:  # dropless: each row's local expert id [ep, R] int32 beside each forward dispatch
            add("all-to-all", ("expert",), (directions - 1) * n_moe * k, rows * 4)
    return [Traffic.timed(kind, axes, count, nbytes, sizes, hw, dcn_axes)
            for (kind, axes), (count, nbytes) in totals.items()]
