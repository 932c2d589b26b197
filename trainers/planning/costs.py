"""Analytic per-device cost of a layout: memory, collective traffic and a roofline step time.

No compile, milliseconds per layout: what :mod:`trainers.planning.planner` ranks layouts by and what
:mod:`trainers.planning.dryrun` prints beside the compiled numbers. The formulas (parameters and optimizer
state exactly from the rule set's shard shapes; gradients, activations under each remat policy,
pipeline stashes, context and expert parallelism; collectives in :mod:`trainers.planning.traffic`;
max(compute, memory) + communication) are described in docs/planning.md.

The built-in GPT (a ``Config`` alone) is estimated from its config with the formulas below; any
other task from its :class:`trainers.planning.profile.TaskProfile` (``task_memory_estimate``,
``task_comm_estimate``, ``task_roofline``): state exactly from its variables' shard shapes,
activations and FLOPs from its loss's jaxpr, collectives from how each parameter is sharded.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

import spmd
from spmd.models import flops_per_step, flops_per_token
from spmd.models.router import capacity
from spmd.rules import axes_of
from trainers.config import Config
from trainers.hardware import Hardware
from trainers.optim import make_optimizer
from trainers.planning.diagnose import ParamInfo, diagnose, param_infos, shard_divisors
from trainers.planning.profile import TaskProfile, at
from trainers.planning.traffic import DTYPE_BYTES as _DTYPE_BYTES
from trainers.planning.traffic import RECOMPUTES_BLOCK, Traffic, comm_estimate, pipeline_schedule, token_axes
from trainers.validate import Issue, batch_axes

# spmd.remat policies by what a block keeps on the device for the backward pass (else: its input only)
KEEPS_ALL = ("none", "save_all_but_gathered")  # every intermediate; the weights too under none
KEEPS_DOTS = ("save_dots",)  # the projections' outputs (offload keeps them on the host)
RECOMPUTES_ATTENTION = ("save_dots", "offload")  # attention's scores and weighted sum again (no projection)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes."""

    params: int
    optimizer: int
    grads: int
    activations: int
    batch: int
    other: int = 0  # model variables that are not parameters (batch statistics, RNG streams)

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.other

    @property
    def total(self) -> int:
        return self.state + self.grads + self.activations + self.batch


@dataclasses.dataclass(frozen=True)
class Roofline:
    flops_per_device: float  # executed (remat recompute included)
    compute_s: float
    memory_s: float
    comm_s: float
    step_s: float  # no overlap: max(compute, memory) + comm
    step_s_overlap: float  # perfect overlap: max(compute, memory, comm)
    mfu: float  # model FLOPs / (step_s x devices x peak)
    dominant: str


def memory_estimate(cfg: Config, sizes: dict[str, int]) -> MemoryEstimate:
    """Analytic per-device bytes of ``cfg``'s train step on a mesh of these axis sizes."""
    m, rules, data = cfg.model, spmd.get_rules(cfg.rules), cfg.data
    infos = param_infos(m)
    local = sum(math.ceil(p.size / math.prod(shard_divisors(p, rules, sizes))) * p.itemsize for p in infos)
    f32 = {p.path: jax.ShapeDtypeStruct(p.shape, "float32") for p in infos}
    optimizer = int(round(_optimizer_copies(cfg.optimizer, f32) * local))
    grads = local * (2 if cfg.run.grad_accum > 1 else 1)
    dt = _DTYPE_BYTES[m.dtype]
    t = sizes.get("tensor", 1) if any(a == "mlp" for a, _ in rules.activations) else 1
    b = rows_per_device(cfg, sizes)
    s = sizes.get("seq", 1) if "seq" in token_axes(rules, sizes) else 1  # context parallelism: L/seq per device
    L, D, F, H, G, K, V = data.seq_len // s, m.d_model, m.ff, m.n_heads, m.kv_heads, m.k, m.vocab_size
    qkv = (H + 2 * max(G, t)) * K / t  # fused q/k/v per shard: t > G copies each KV head to the shards sharing it
    # attention keeps the [B, H, L, L] probabilities (f32 scores + compute-dtype probs) unless a blockwise
    # path runs (spmd.models.attention: "blockwise", or "auto" past one block; context parallelism always):
    # then one f32 log-sum-exp per row and head, and one block of scores in flight while a block is computed
    blockwise = s > 1 or m.attention == "blockwise" or (m.attention in ("auto", "cudnn") and L > m.attention_block)
    scores = 4 * H / t if blockwise else (4 + dt) * H * L / t
    mlp = 4 * F / t
    if m.n_experts:  # MoE layers: x[E, C, D] dispatched and combined, the experts' [E, C, 2F] and [E, C, F] per slot
        slots = m.n_experts * capacity(b * L, m.n_experts, m.experts_per_token, m.capacity_factor) / max(b * L, 1)
        moe = slots * (2 * D + 3 * m.expert_ff / t) + 4 * m.n_shared_experts * m.expert_ff / t + 8 * m.n_experts
        n_moe = m.n_layers // m.moe_every
        mlp = ((m.n_layers - n_moe) * mlp + n_moe * moe) / m.n_layers  # the mean over the layers
    per_token_layer = dt * (6 * D + 2 * qkv + H * K / t + mlp) + 4 * (qkv + 3 * D) + scores
    in_flight = (4 + dt) * H / t * min(L, m.attention_block) ** 2 * max(b, 1) if blockwise else 0
    if s > 1 and m.context_exchange == "allgather":  # the whole K and V of one layer
        in_flight += 2 * b * data.seq_len * max(G // t, 1) * K * dt
    positions = min(m.loss_chunk, L) if m.loss_chunk else L  # chunked cross-entropy: one chunk's logits at a time
    vt = t if any(a == "vocab" for a, _ in rules.activations) else 1

    def kept(rows: float, n_layers: int) -> float:  # what the backward keeps of n_layers layers on `rows` rows
        block = rows * L * per_token_layer
        if m.policy in KEEPS_ALL:
            return n_layers * block
        per_layer = rows * L * D * dt  # the block input
        if m.policy in KEEPS_DOTS:  # + q, k, v, attention out, gate, up, down
            per_layer += rows * L * dt * (qkv + 2 * D + 2 * F / t)
        return n_layers * per_layer + block  # + one block's worth while it is recomputed

    def logits(rows: float) -> float:
        return 3 * rows * positions * V / vt * 4 + 2 * rows * L * D * 4 + in_flight

    S, pipe = sizes.get("pipe", 1), cfg.pipeline
    if S > 1 and pipe.enabled:
        M, x_in = pipe.microbatches, b / pipe.microbatches * L * D * dt  # one stage input x[B/M, L, D]
        if pipe.schedule == "gpipe":  # autodiff through the tick scan: every microbatch's residuals
            layers = M * x_in + kept(b / M, m.n_layers // S) if pipe.remat else kept(b, m.n_layers // S)
            acts = layers + 2 * M * x_in + logits(b)
        else:  # stash + gradient slots of the table, one chunk's recompute, dx[M, B/M, L, D], one head
            n_x, n_g = pipeline_schedule(cfg, S).stash_sizes()
            acts = (n_x + n_g + 2 + M) * x_in + kept(b / M, m.n_layers // (S * pipe.virtual_stages)) + logits(b / M)
    else:
        acts = kept(b, m.n_layers) + logits(b)
    # FSDP/TP: one layer's weights gathered in the compute dtype (two in flight when prefetched); gradient
    # accumulation with run.fsdp_gather=per_step: every weight gathered for the step, the accumulator unsharded
    gathered = 0
    if sizes.get("fsdp", 1) > 1 and cfg.run.grad_accum > 1 and cfg.run.fsdp_gather == "per_step":
        unsharded = [p.size // math.prod(shard_divisors(p, rules, {**sizes, "fsdp": 1})) for p in infos]
        gathered = sum(n * dt for n in unsharded)
        grads = local + sum(n * p.itemsize for n, p in zip(unsharded, infos))
    elif sizes.get("fsdp", 1) > 1:
        gathered = 2 * sum(p.size // p.shape[0] * dt // math.prod(shard_divisors(p, rules, sizes, "activations"))
                           for p in infos if p.dims and p.dims[0] == "layers")
    batch = 2 * b * cfg.run.grad_accum * data.seq_len * 4
    return MemoryEstimate(local, optimizer, grads, int(acts + gathered), batch)


def pipeline_bubble(cfg: Config, pipe: int) -> float:
    """Idle fraction of the pipeline's schedule table (0 without a pipeline or with pipe=1)."""
    if pipe <= 1 or not cfg.pipeline.enabled:
        return 0.0
    return pipeline_schedule(cfg, pipe).bubble_fraction


def _optimizer_copies(opt_cfg, params) -> float:
    """Bytes of the optimizer state's parameter-shaped leaves per parameter byte (abstract ``params``; 2 for
    Adam's moments), from ``jax.eval_shape(tx.init)``."""
    state = jax.eval_shape(make_optimizer(opt_cfg, 1e-3).init, params)
    big = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if len(x.shape) >= 1)
    return big / max(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)), 1)


def roofline(cfg: Config, n_devices: int, hw: Hardware, mem: MemoryEstimate, traffic: list[Traffic], *,
             pipe: int = 1) -> Roofline:
    """Step time and MFU of ``cfg`` from its memory estimate and collectives (see module docstring);
    on a ``pipe`` axis > 1 the compute time is stretched by ``1 / (1 - bubble)`` of the schedule."""
    m, piped = cfg.model, pipe > 1 and cfg.pipeline.enabled
    model_flops = flops_per_step(m, cfg.data.global_batch, cfg.data.seq_len)
    whole = m.policy in RECOMPUTES_BLOCK or (piped and cfg.pipeline.remat)
    recompute = (1 if whole else 0) + (1 if piped and cfg.pipeline.schedule != "gpipe" else 0)
    extra = recompute / 3
    if not whole and m.policy in RECOMPUTES_ATTENTION:
        extra += 4 * m.n_layers * m.n_heads * m.k * cfg.data.seq_len / flops_per_token(m, cfg.data.seq_len)
    executed = model_flops / n_devices * (1 + extra)
    return _roofline(model_flops, executed, m.dtype, n_devices, hw, mem, traffic, pipeline_bubble(cfg, pipe))


def _roofline(model_flops: float, executed: float, dtype: str, n_devices: int, hw: Hardware, mem: MemoryEstimate,
              traffic: list[Traffic], bubble: float = 0.0) -> Roofline:
    """compute = executed FLOPs per device / peak (/ (1 - bubble)); memory = HBM traffic / bandwidth;
    communication = the collectives' times; see the module docstring."""
    peak = hw.peak(dtype)
    compute = executed / peak / (1 - bubble)
    weights = 3 * mem.params * _DTYPE_BYTES[dtype] / 4
    hbm = weights + mem.params * (3 + 2 * mem.optimizer / max(mem.params, 1)) + 2 * mem.activations
    memory = hbm / hw.hbm_bw
    comm = sum(x.seconds for x in traffic)
    step = max(compute, memory) + comm
    costs = {"compute": compute, "memory": memory}
    for x in traffic:
        key = f"{x.kind} {','.join(x.axes)} ({x.network})"
        costs[key] = costs.get(key, 0.0) + x.seconds
    dominant = max(costs, key=costs.get)
    return Roofline(executed, compute, memory, comm, step, max(compute, memory, comm),
                    model_flops / (step * n_devices * peak) if step > 0 else 0.0, dominant)


# Any task (trainers.planning.profile.TaskProfile): the same three estimates, read off its variables and jaxpr

def rows_per_device(cfg: Config, sizes: dict[str, int]) -> int:
    """Rows of one microbatch each device holds."""
    n = math.prod(sizes[a] for a in batch_axes(cfg.rules, sizes))
    return max(cfg.data.global_batch // cfg.run.grad_accum // n, 1)


def _local_bytes(info: ParamInfo, spec, sizes: dict[str, int]) -> int:
    shape = list(info.shape)
    for i, entry in enumerate(spec):
        shape[i] = math.ceil(shape[i] / math.prod(sizes.get(a, 1) for a in axes_of(entry)))
    return math.prod(shape) * info.itemsize


def _decided(profile: TaskProfile, cfg: Config, sizes: dict[str, int]) -> list[tuple[ParamInfo, object, int]]:
    """``(info, spec, bytes per device)`` of every variable, parameters first, as the run shards them."""
    variables = profile.variables
    decisions = variables.decisions(cfg.rules, sizes)
    return [(info, d.spec, _local_bytes(info, d.spec, sizes))
            for info, d in zip(variables.infos + variables.other_infos, decisions)]


def task_memory_estimate(profile: TaskProfile, cfg: Config, sizes: dict[str, int]) -> MemoryEstimate:
    """Per-device bytes of any task's train step: parameters, optimizer state (moments sharded like the
    parameters, copies from ``jax.eval_shape(tx.init)``) and other model variables exactly from the
    variables' shard shapes; gradients like the parameters (twice with accumulation); activations:
    the bytes autodiff keeps for the backward pass at this device's rows (:mod:`trainers.planning.profile`:
    an estimate that errs high, all the more under tensor-style layouts, whose split activations it
    does not credit; 0 when the loss could not be traced); the batch's rows."""
    decided = _decided(profile, cfg, sizes)
    n = len(profile.variables.infos)
    params, other = sum(x[2] for x in decided[:n]), sum(x[2] for x in decided[n:])
    optimizer = int(round(_optimizer_copies(cfg.optimizer, nnx.to_pure_dict(profile.variables.params)) * params))
    grads = params * (2 if cfg.run.grad_accum > 1 else 1)
    b = rows_per_device(cfg, sizes)
    return MemoryEstimate(params, optimizer, grads, profile.activations(b),
                          profile.example_bytes * b * cfg.run.grad_accum, other)


def _tensor_matmuls(profile: TaskProfile, decided, sizes: dict[str, int], batch: tuple[str, ...]):
    """``(matmul, operand side, sharded dim, axes)`` of each matmul against a weight split over mesh axes
    that do not split the batch (tensor-style), the weight recognised by its shape."""
    sharded = {}
    for info, spec, _ in decided[:len(profile.variables.infos)]:
        for k, entry in enumerate(spec):
            axes = tuple(a for a in axes_of(entry) if sizes.get(a, 1) > 1 and a not in batch)
            if axes:
                sharded.setdefault(info.shape, (k, axes))
                break
    out = []
    for mm in profile.matmuls:
        for side in (0, 1):
            if mm.fixed[side] and mm.shapes[side] in sharded:
                out.append((mm, side, *sharded[mm.shapes[side]]))
                break
    return out


def task_comm_estimate(profile: TaskProfile, cfg: Config, sizes: dict[str, int], hw: Hardware,
                       dcn_axes: tuple[str, ...] = ()) -> list[Traffic]:
    """Any task's collectives per device per step, from how each parameter is sharded:

    - sharded over batch axes (FSDP): all-gathered over them in the forward and the backward pass,
      its gradient reduce-scattered onto the shards; the gradient of each shard (or of a replicated
      parameter) all-reduced over the remaining batch axes;
    - sharded over other axes (tensor-style), for each matmul against it in the forward pass
      (weights recognised by their shape in the jaxpr): a weight split on a contracting dim leaves
      partial sums, all-reduced in the forward pass (the output's bytes); one split on an output dim
      needs its input's gradient all-reduced in the backward pass (the input's bytes).

    Approximate in the same ways as the GPT estimate (ring bandwidth, no latency, collectives per
    parameter before XLA combines them) and in one more: a tensor-style layout the model does not
    constrain may be partitioned otherwise by GSPMD; the dry run shows what the compiler chose.
    """
    decided = _decided(profile, cfg, sizes)
    batch = batch_axes(cfg.rules, sizes)
    totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}

    def add(kind: str, axes: tuple[str, ...], count: int, nbytes: float) -> None:
        if axes and nbytes > 0:
            row = totals.setdefault((kind, axes), [0, 0.0])
            row[0] += count
            row[1] += count * nbytes

    for info, spec, local in decided[:len(profile.variables.infos)]:
        on = {a for e in spec for a in axes_of(e) if sizes.get(a, 1) > 1}
        gather = tuple(a for a in batch if a in on)
        if gather:
            full = local * math.prod(sizes[a] for a in gather)
            add("all-gather", gather, 2, full)
            add("reduce-scatter", gather, 1, full)
        add("all-reduce", tuple(a for a in batch if a not in on), 1, local)
    b = rows_per_device(cfg, sizes)
    for mm, side, k, axes in _tensor_matmuls(profile, decided, sizes, batch):
        if k in mm.contracting[side]:
            add("all-reduce", axes, 1, at(mm.out_bytes, b))
        else:
            add("all-reduce", axes, 1, at(mm.rhs_bytes if side == 0 else mm.lhs_bytes, b))
    return [Traffic.timed(kind, axes, count, nbytes, sizes, hw, dcn_axes) for (kind, axes), (count, nbytes) in totals.items()]


def task_roofline(profile: TaskProfile, cfg: Config, sizes: dict[str, int], hw: Hardware, mem: MemoryEstimate,
                  traffic: list[Traffic]) -> Roofline:
    """Any task's step time and MFU: the model FLOPs (the task's figure or 3 x the jaxpr's forward) split
    over the batch axes, and the FLOPs of matmuls against tensor-style weights also over their axes
    (a mesh axis that splits neither repeats the work); peak FLOP/s of the matmuls' dtype."""
    decided = _decided(profile, cfg, sizes)
    batch = batch_axes(cfg.rules, sizes)
    rows = cfg.data.global_batch
    total = sum(at(m.flops, rows) for m in profile.matmuls)
    saved = sum(at(mm.flops, rows) * (1 - 1 / math.prod(sizes[a] for a in axes))
                for mm, _, _, axes in _tensor_matmuls(profile, decided, sizes, batch))
    model_flops = profile.model_flops(rows)
    executed = model_flops / math.prod(sizes[a] for a in batch) * (1 - saved / total if total else 1)
    return _roofline(model_flops, executed, profile.compute_dtype, math.prod(sizes.values()), hw, mem, traffic)


# One layout, the built-in GPT or any task: what the planner ranks and the dry run prints

@dataclasses.dataclass(frozen=True)
class Costs:
    """A layout's static diagnostics and, when it can be built, its three estimates (else None / ())."""

    issues: tuple[Issue, ...]
    memory: MemoryEstimate | None = None
    traffic: tuple[Traffic, ...] = ()
    roofline: Roofline | None = None


def layout_costs(cfg: Config, sizes: dict[str, int], hw: Hardware, *, profile: TaskProfile | None = None,
                 dcn_axes: tuple[str, ...] = ()) -> Costs:
    """``cfg`` on a mesh of these axis sizes: the static diagnostics (:func:`diagnose`), then memory,
    collectives and roofline, from the built-in GPT's formulas or from a task's ``profile``."""
    issues = tuple(diagnose(cfg.model if profile is None else profile.variables, cfg.rules, sizes,
                            global_batch=cfg.data.global_batch, grad_accum=cfg.run.grad_accum, pipeline=cfg.pipeline,
                            seq_len=cfg.data.seq_len))
    if any(i.fatal for i in issues):
        return Costs(issues)
    if profile is None:
        mem, traffic = memory_estimate(cfg, sizes), comm_estimate(cfg, sizes, hw, dcn_axes)
    else:
        mem, traffic = task_memory_estimate(profile, cfg, sizes), task_comm_estimate(profile, cfg, sizes, hw, dcn_axes)
    return Costs(issues, mem, tuple(traffic), layout_roofline(cfg, sizes, hw, mem, traffic, profile=profile))


def layout_roofline(cfg: Config, sizes: dict[str, int], hw: Hardware, mem: MemoryEstimate, traffic: list[Traffic], *,
                    profile: TaskProfile | None = None) -> Roofline:
    """:func:`roofline` (the built-in GPT) or :func:`task_roofline` of ``cfg`` on these axis sizes, timing
    ``traffic`` (the analytic collectives, or the compiled step's)."""
    if profile is None:
        return roofline(cfg, math.prod(sizes.values()), hw, mem, traffic, pipe=sizes.get("pipe", 1))
    return task_roofline(profile, cfg, sizes, hw, mem, traffic)
