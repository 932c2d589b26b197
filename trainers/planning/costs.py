"""Analytic per-device cost of a layout: memory, collective traffic and a roofline step time.

No compile, milliseconds per layout: what :mod:`trainers.planning.planner` ranks layouts by and what
:mod:`trainers.planning.dryrun` prints beside the compiled numbers. The formulas (parameters and optimizer
state exactly from the rule set's shard shapes; gradients, activations under each remat policy,
pipeline stashes (:mod:`trainers.planning.pipeline_costs`), context and expert parallelism; collectives
in :mod:`trainers.planning.traffic`; max(compute, memory) + communication) are described in docs/planning.md.

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
from jax.sharding import PartitionSpec as P

import spmd
from spmd.models import flops_per_step
from spmd.models.counts import adapter_params, matmul_params
from spmd.models.moe import expert_rows
from spmd.rules import axes_of
from trainers.checks import Issue, batch_axes, check
from trainers.config import Config
from trainers.faults.guard import window_bytes
from trainers.model_variables import ParamInfo, shard_divisors
from trainers.optim import make_optimizer
from trainers.planning import pipeline_costs
from trainers.planning.hardware import Hardware
from trainers.planning.perf import Work, step_time
from trainers.planning.pipeline_costs import pipeline_bubble, pipeline_schedule, stash_sizes, weight_stash_size
from trainers.planning.profile import TaskProfile, at
from trainers.planning.traffic import DTYPE_BYTES as _DTYPE_BYTES
from trainers.planning.traffic import RECOMPUTES_BLOCK, Traffic, comm_estimate, sharded_params, token_axes, trained

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
    guard: int = 0  # the guard's window (trainers.faults.guard.window_bytes)

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.other + self.guard

    @property
    def total(self) -> int:
        return self.state + self.grads + self.activations + self.batch


@dataclasses.dataclass(frozen=True)
class Roofline:
    flops_per_device: float  # executed (remat recompute included)
    compute_s: float  # matmuls and attention at their achievable fractions of peak (stretched by a bubble)
    memory_s: float  # memory-bound work (norms, activations, loss, optimizer) at the achievable HBM bandwidth
    comm_s: float  # every collective in series
    step_s: float  # compute + memory-bound work + the exposed communication (trainers.planning.perf)
    step_s_overlap: float  # perfect overlap: max(compute + memory, comm)
    mfu: float  # model FLOPs / (step_s x devices x peak)
    dominant: str
    exposed_s: float = 0.0  # the communication not hidden under compute
    attention_s: float = 0.0  # the attention part of compute_s


def memory_estimate(cfg: Config, sizes: dict[str, int]) -> MemoryEstimate:
    """Analytic per-device bytes of ``cfg``'s train step on a mesh of these axis sizes."""
    m, rules, data = cfg.model, spmd.get_rules(cfg.rules), cfg.data
    shards = sharded_params(m, cfg.rules, sizes, cfg.lora.spec)
    infos = [x.info for x in shards]
    local = sum(x.local_ceil * x.info.itemsize for x in shards)
    train = trained(shards, cfg.lora.spec)  # LoRA: the adapters alone have gradients and optimizer state
    local_trained = sum(x.local_ceil * x.info.itemsize for x in train)
    f32 = {x.info.path: jax.ShapeDtypeStruct(x.info.shape, "float32") for x in train}
    optimizer = int(round(_optimizer_copies(cfg.optimizer, f32) * local_trained))
    grads = local_trained  # one f32 copy, with accumulation too: the accumulator (docs/planning.md)
    dt = _DTYPE_BYTES[m.dtype]
    t = sizes.get("tensor", 1) if any(a == "mlp" for a, _ in rules.activations) else 1
    b = rows_per_device(cfg, sizes)
    s = sizes.get("seq", 1) if "seq" in token_axes(rules, sizes) else 1  # context parallelism: L/seq per device
    L, D, F, H, G, K, V = data.seq_len // s, m.d_model, m.ff, m.n_heads, m.kv_heads, m.k, m.vocab_size
    qkv = (H + 2 * max(G, t)) * K / t  # fused q/k/v per shard: t > G copies each KV head to the shards sharing it
    # as the accelerator holds them (compute dtype, fused attention): a block keeps its input and the two
    # norms' inputs and outputs [4 D], q/k/v, the attention output and its f32 log-sum-exp per head, the
    # MLP's gate, up and product [3 F] (the activation is recomputed from the gate); the [B, H, L, L] probabilities only where no blockwise
    # path runs (spmd.models.attention: "naive" at L <= one block; context parallelism always blocks)
    blockwise = s > 1 or m.attention == "blockwise" or (m.attention in ("auto", "cudnn") and L > m.attention_block)
    scores = 4 * H / t if blockwise else (4 + dt) * H * L / t
    mlp = 3 * F / t
    if m.n_experts:  # MoE layers: x[E, C, D] dispatched and combined, the experts' [E, C, 2F] and [E, C, F] per slot
        slots, rows = (r / max(b * L, 1) for r in expert_rows(b * L, m.n_experts, m.experts_per_token, m.capacity_factor, sizes.get("expert", 1)))
        moe = slots * 2 * D + rows * 3 * m.expert_ff / t + 4 * m.n_shared_experts * m.expert_ff / t + 8 * m.n_experts
        n_moe = m.n_layers // m.moe_every
        mlp = ((m.n_layers - n_moe) * mlp + n_moe * moe) / m.n_layers  # the mean over the layers
    residual = rules.spec(("residual_length",), kind="activations", mesh_sizes=sizes)
    r = sizes.get("tensor", 1) if len(residual) and "tensor" in axes_of(residual[0]) else 1  # *_sp: D split too
    per_token_layer = dt * (4 * D / r + qkv + H * K / t + mlp) + scores
    in_flight = (4 + dt) * H / t * min(L, m.attention_block) ** 2 * max(b, 1) if blockwise else 0
    piped = sizes.get("pipe", 1) > 1 and cfg.pipeline.enabled  # a pipeline's stages exchange K/V by all-gather
    if s > 1 and (m.context_exchange == "allgather" or piped):  # the whole K and V of one layer
        in_flight += 2 * b * data.seq_len * max(G // t, 1) * K * dt
    positions = min(m.loss_chunk, L) if m.loss_chunk else L  # chunked cross-entropy: one chunk's logits at a time
    vt = t if any(a == "vocab" for a, _ in rules.activations) else 1

    def kept(rows: float, n_layers: int) -> float:  # what the backward keeps of n_layers layers on `rows` rows
        block = rows * L * per_token_layer
        if m.policy in KEEPS_ALL:
            return n_layers * block
        per_layer = rows * L * D / r * dt  # the block input
        if m.policy in KEEPS_DOTS:  # + q, k, v, the output projection, gate, up: the down projection's output
            per_layer += rows * L * dt * (qkv + D / r + 2 * F / t)  # only feeds the residual add (no residual)
        return n_layers * per_layer + block  # + one block's worth while it is recomputed

    def logits(rows: float) -> float:  # f32 logits and their gradient (one loss chunk), the head's input and grad
        return 2 * rows * positions * V / vt * 4 + 2 * rows * L * D * dt + in_flight

    S, pipe = sizes.get("pipe", 1), cfg.pipeline
    if S > 1 and pipe.enabled:  # one stage input x[B/M, L, D]; DPO's carries the policy's and the reference's
        M, x_in = pipe.microbatches, b / pipe.microbatches * L * D * dt * pipeline_costs.carried_models(cfg)
        if pipe.schedule == "gpipe":  # autodiff through the tick scan: every microbatch's residuals
            layers = M * x_in + kept(b / M, m.n_layers // S) if pipe.remat else kept(b, m.n_layers // S)
            acts = layers + 2 * M * x_in + logits(b)
        else:  # stash + gradient slots of the table, one chunk's recompute, dx[M, B/M, L, D], one head
            n_x, n_g = stash_sizes(cfg, S)
            chunk = m.n_layers // (S * pipe.virtual_stages)
            acts = (n_x + n_g + 2 + M) * x_in + kept(b / M, chunk) + logits(b / M)
            acts += weight_stash_size(cfg, S) * chunk * (b / M * L * per_token_layer + x_in)  # W reads ~ acts + dy
    else:
        acts = kept(b, m.n_layers) + logits(b)
    # FSDP/TP: one layer's weights gathered in the compute dtype (two in flight when prefetched); gradient
    # accumulation with run.fsdp_gather=per_step: every weight gathered for the step, the accumulator unsharded
    gathered = 0
    if sizes.get("fsdp", 1) > 1 and cfg.run.grad_accum > 1 and cfg.run.fsdp_gather == "per_step":
        unsharded = [p.size // math.prod(shard_divisors(p, rules, {**sizes, "fsdp": 1})) for p in infos]
        gathered = sum(n * dt for n in unsharded)
        trained_paths = {x.info.path for x in train}
        grads = local_trained + sum(n * p.itemsize for n, p in zip(unsharded, infos) if p.path in trained_paths)
    elif sizes.get("fsdp", 1) > 1 and S > 1 and pipe.enabled:  # the stage's layers gathered once before the
        # tick loop in their own dtype, and their gradient accumulated unsharded until after it (spmd/pipeline/layout.py)
        gathered = 2 * sum(x.info.size // S * x.info.itemsize // x.compute_divisor for x in shards if x.info.dims and x.info.dims[0] == "layers")
    elif sizes.get("fsdp", 1) > 1:
        gathered = 2 * sum(x.info.size // x.info.shape[0] * dt // x.compute_divisor for x in shards if x.info.dims and x.info.dims[0] == "layers")
    batch = 2 * b * cfg.run.grad_accum * data.seq_len * 4
    reference = local if cfg.run.objective == "dpo" and not cfg.lora.enabled else 0  # DPO's frozen copy (LoRA: none)
    return MemoryEstimate(local, optimizer, grads, int(acts + gathered), batch, other=reference,
                          guard=window_bytes(cfg.run.spike_window))


def _optimizer_copies(opt_cfg, params) -> float:
    """Bytes of the optimizer state's parameter-shaped leaves per parameter byte (abstract ``params``; 2 for
    Adam's moments), from ``jax.eval_shape(tx.init)`` (once per optimizer config and parameter shapes)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    key = (opt_cfg, tuple((jax.tree_util.keystr(k), tuple(x.shape), str(x.dtype)) for k, x in leaves))
    try:
        hit = _COPIES.get(key)
    except TypeError:  # an unhashable optimizer config: no cache
        hit, key = None, None
    if hit is None:
        hit = _optimizer_copies_traced(opt_cfg, params)
        if key is not None:
            _COPIES[key] = hit
    return hit


_COPIES: dict = {}


def _optimizer_copies_traced(opt_cfg, params) -> float:
    state = jax.eval_shape(make_optimizer(opt_cfg, 1e-3).init, params)
    big = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if len(x.shape) >= 1)
    return big / max(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)), 1)


def model_flops(cfg: Config) -> float:
    """Model FLOPs of one step of the built-in GPT (:func:`spmd.models.flops_per_step`): with LoRA the base
    computes no weight gradients; DPO adds the reference's forward (as :func:`trainers.task.lm_task` counts)."""
    return flops_per_step(cfg.model, cfg.data.global_batch, cfg.data.seq_len, lora=cfg.lora.spec,
                          reference=cfg.run.objective == "dpo")


def gpt_work(cfg: Config, sizes: dict[str, int]) -> Work:
    """What one device of this layout executes per step (:class:`trainers.planning.perf.Work`): matmul
    FLOPs (x (1 + 1/3) per recomputed forward), causal fused attention (forward 2, backward 5 matmuls of
    half an ``L x L`` each, + 2 when recomputed), and the HBM bytes of the memory-bound work."""
    m, rules, data, run = cfg.model, spmd.get_rules(cfg.rules), cfg.data, cfg.run
    n = math.prod(sizes.values())
    S, t = sizes.get("pipe", 1), sizes.get("tensor", 1)
    piped = S > 1 and cfg.pipeline.enabled
    whole = m.policy in RECOMPUTES_BLOCK or (piped and cfg.pipeline.remat)
    table = pipeline_schedule(cfg, S) if piped else None  # the table engine recomputes in its backward (B, split)
    recompute = (1 if whole else 0) + (0 if table is None or table.name == "gpipe" else 1)
    tokens = data.global_batch * data.seq_len
    model = model_flops(cfg)  # LoRA: no weight gradients of the base; DPO: + the reference's forward
    attn_model = 12 * m.n_layers * m.n_heads * m.k * data.seq_len * tokens
    forward = 2 * (matmul_params(m) + (adapter_params(m, cfg.lora.spec) if cfg.lora.enabled else 0)) * tokens
    reference = 2 if cfg.run.objective == "dpo" else 0  # its attention forward, fused: 2 of the 12
    matmul = (model - attn_model * (12 + 2 * reference) / 12 + recompute * forward) / n
    again = 2 * (recompute + (1 if not whole and m.policy in RECOMPUTES_ATTENTION else 0))
    attention = (7 + again + reference) / 12 * attn_model / n
    # memory-bound bytes per token per layer, forward: 2 norms and 2 residual adds over D, RoPE on q and k,
    # SwiGLU over F (columns split over tensor); the backward twice that, a recomputed forward once more
    s = sizes.get("seq", 1) if "seq" in token_axes(rules, sizes) else 1
    local_tokens = rows_per_device(cfg, sizes) * run.grad_accum * data.seq_len // s
    qkv = (m.n_heads + 2 * m.kv_heads) * m.k / t
    fwd = _DTYPE_BYTES[m.dtype] * (12 * m.d_model + 2 * qkv + 3 * m.ff / t)
    vt = t if any(a == "vocab" for a, _ in rules.activations) else 1
    layers = m.n_layers // (S if piped else 1)
    hbm = local_tokens * (layers * fwd * (3 + recompute) + 6 * 4 * m.vocab_size / vt)
    local_params = sum(x.local for x in trained(sharded_params(m, cfg.rules, sizes, cfg.lora.spec), cfg.lora.spec))
    hbm += local_params * (32 + 8 * (run.grad_accum - 1))  # AdamW update; accumulator reads and writes
    once = run.grad_accum > 1 and run.fsdp_gather == "per_step"
    passes = 1 if once or piped else (2 if m.policy == "none" else 3)  # as comm_estimate counts the gathers
    return Work(matmul, attention, hbm, model, layers, passes, 1 if once else run.grad_accum, pipeline_bubble(cfg, S))


def roofline(cfg: Config, n_devices: int, hw: Hardware, mem: MemoryEstimate, traffic: list[Traffic], *,
             pipe: int = 1, sizes: dict[str, int] | None = None) -> Roofline:
    """Step time and MFU of ``cfg`` (:mod:`trainers.planning.perf`) on a mesh of these axis ``sizes``
    (default: ``n_devices`` over data, ``pipe`` over pipe); a pipeline's bubble stretches the compute."""
    if sizes is None:
        sizes = {"data": n_devices // pipe, "pipe": pipe}
    return _roofline(gpt_work(cfg, sizes), cfg.model.dtype, n_devices, hw, traffic)


def _roofline(work: Work, dtype: str, n_devices: int, hw: Hardware, traffic: list[Traffic]) -> Roofline:
    """:class:`Roofline` of ``work`` from :func:`trainers.planning.perf.step_time`."""
    t = step_time(work, hw, dtype, traffic)
    peak = hw.peak(dtype)
    return Roofline(work.matmul_flops + work.attention_flops, t.compute_s, t.elementwise_s, t.comm_s, t.step_s, t.overlap_s,
                    work.model_flops / (t.step_s * n_devices * peak) if t.step_s > 0 else 0.0, t.dominant,
                    t.exposed_s, t.attention_s)


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


def _decided(profile: TaskProfile, cfg: Config, sizes: dict[str, int]) -> list[tuple[ParamInfo, P, int]]:
    """``(info, spec, bytes per device)`` of every variable, parameters first, as the run shards them."""
    variables = profile.variables
    decisions = variables.decisions(cfg.rules, sizes)
    return [(info, d.spec, _local_bytes(info, d.spec, sizes))
            for info, d in zip(variables.infos + variables.other_infos, decisions)]


def task_memory_estimate(profile: TaskProfile, cfg: Config, sizes: dict[str, int]) -> MemoryEstimate:
    """Per-device bytes of any task's train step: parameters, optimizer state (moments sharded like the
    parameters, copies from ``jax.eval_shape(tx.init)``) and other model variables exactly from the
    variables' shard shapes; gradients like the parameters (one copy with accumulation too); activations:
    the bytes autodiff keeps for the backward pass at this device's rows (:mod:`trainers.planning.profile`:
    an estimate that errs high, all the more under tensor-style layouts, whose split activations it
    does not credit; 0 when the loss could not be traced); the batch's rows."""
    decided = _decided(profile, cfg, sizes)
    n = len(profile.variables.infos)
    params, other = sum(x[2] for x in decided[:n]), sum(x[2] for x in decided[n:])
    optimizer = int(round(_optimizer_copies(cfg.optimizer, nnx.to_pure_dict(profile.variables.params)) * params))
    grads = params
    b = rows_per_device(cfg, sizes)
    return MemoryEstimate(params, optimizer, grads, profile.activations(b),
                          profile.example_bytes * b * cfg.run.grad_accum, other, window_bytes(cfg.run.spike_window))


def _tensor_matmuls(profile: TaskProfile, decided, sizes: dict[str, int], batch: tuple[str, ...]):
    """``(matmul, operand side, sharded dim, axes)`` of each matmul against a weight split over mesh axes
    that do not split the batch (tensor-style), the weight recognised by its shape."""
    sharded: dict[tuple[int, ...], tuple[int, tuple[str, ...]]] = {}
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


def task_comm_estimate(profile: TaskProfile, cfg: Config, sizes: dict[str, int], hw: Hardware, dcn_axes: tuple[str, ...] = ()) -> list[Traffic]:
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

    for _info, spec, local in decided[:len(profile.variables.infos)]:
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


def task_roofline(profile: TaskProfile, cfg: Config, sizes: dict[str, int], hw: Hardware, mem: MemoryEstimate, traffic: list[Traffic]) -> Roofline:
    """Any task's step time and MFU: the model FLOPs (the task's figure or 3 x the jaxpr's forward) split
    over the batch axes, and the FLOPs of matmuls against tensor-style weights also over their axes
    (a mesh axis that splits neither repeats the work); peak FLOP/s of the matmuls' dtype."""
    decided = _decided(profile, cfg, sizes)
    batch = batch_axes(cfg.rules, sizes)
    rows = cfg.data.global_batch
    total = sum(at(m.flops, rows) for m in profile.matmuls)
    saved = sum(at(mm.flops, rows) * (1 - 1 / math.prod(sizes[a] for a in axes)) for mm, _, _, axes in _tensor_matmuls(profile, decided, sizes, batch))
    model_flops = profile.model_flops(rows)
    executed = model_flops / math.prod(sizes[a] for a in batch) * (1 - saved / total if total else 1)
    # memory-bound work: the kept activations written and read back, the AdamW update over f32 state
    work = Work(executed, 0.0, 2 * mem.activations + 8 * mem.params, model_flops)
    return _roofline(work, profile.compute_dtype, math.prod(sizes.values()), hw, traffic)


# One layout, the built-in GPT or any task: what the planner ranks and the dry run prints

@dataclasses.dataclass(frozen=True)
class Costs:
    """A layout's static diagnostics and, when it can be built, its three estimates (else None / ())."""

    issues: tuple[Issue, ...]
    memory: MemoryEstimate | None = None
    traffic: tuple[Traffic, ...] = ()
    roofline: Roofline | None = None


def layout_costs(cfg: Config, sizes: dict[str, int], hw: Hardware, *, profile: TaskProfile | None = None, dcn_axes: tuple[str, ...] = (),
                 issues: tuple[Issue, ...] | None = None) -> Costs:
    """``cfg`` on a mesh of these axis sizes: the static checks (the layout stage of :func:`trainers.checks.check`; ``issues``: their
    result for this mesh and rule set, already known), then memory, collectives and roofline, from the built-in GPT's formulas or from a task's ``profile``."""
    if issues is None:
        issues = tuple(check(cfg, stages=("layout",), mesh_shape=sizes, model=None if profile is None else profile.variables))
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
        return roofline(cfg, math.prod(sizes.values()), hw, mem, traffic, pipe=sizes.get("pipe", 1), sizes=sizes)
    return task_roofline(profile, cfg, sizes, hw, mem, traffic)
