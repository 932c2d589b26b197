"""``spmd-plan RECIPE --devices N --hardware H``: which layout to run, decided before the pod.

The planner enumerates layouts, estimates each analytically (no compile, milliseconds each),
drops those that cannot be built or do not fit, and ranks the rest by estimated step time:

- **candidates**: every factorisation of N over ``data x fsdp x tensor``, with each rule set that
  uses exactly those axes (``dp``, ``fsdp``, ``tp``, ``dp_tp``, ``fsdp_tp``), remat on and off.
  A :class:`Layout` is a frozen record; a pipeline axis (``pipe`` with microbatches and a
  schedule) is one more field and one more loop in :func:`candidates` once ``spmd`` has a pipeline.
- **pruning**: divisibility (heads, kv_heads, d_ff, vocab by ``tensor``; d_model by ``fsdp``; the
  microbatch by ``data x fsdp``: :mod:`trainers.diagnose`), and per-device memory above
  ``headroom x HBM``.
- **memory estimate** (per device): parameters and optimizer state exactly (shard shapes from the
  rule set, optimizer moments from ``jax.eval_shape(tx.init)``); gradients (f32, sharded like
  the parameters, twice with gradient accumulation); activations from a per-layer count of the
  tensors the backward pass keeps (all of them without remat, the block input per layer plus one
  block's worth with remat) and the f32 logits; FSDP's gathered weights of one layer.
- **time estimate** (roofline; :func:`roofline`): compute = model FLOPs per device (x4/3 with
  remat) / peak; memory = HBM traffic (weights read 3x per step, optimizer read/write, activations
  written and read) / HBM bandwidth; communication = per mesh axis, the ring algorithm's bytes on
  the wire / that axis's network bandwidth (fast network inside a node or slice, slow network
  across: :func:`trainers.hardware.networks`). **Overlap assumption**: none. Step time =
  max(compute, memory) + communication, an upper bound; ``step_s_overlap`` = max of all three is
  the perfect-overlap lower bound. Real runs land between, usually nearer the lower bound for FSDP
  (XLA prefetches gathers) and nearer the upper one for tensor parallelism (its all-reduces sit on
  the critical path).

``--verify`` confirms the chosen layout with a real dry-run compile (:mod:`trainers.dryrun`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Iterator

import jax

import spmd
from meshes import AXES
from spmd.models import flops_per_step, param_count
from trainers.config import Config, override
from trainers.diagnose import Issue, diagnose, param_infos, shard_divisors
from trainers.hardware import Hardware, collective_seconds, get_hardware, networks

# rule set -> (mesh axes it needs > 1, axes it may also use): one candidate per distinct layout
RULE_AXES = {"dp": (("data",), ()), "fsdp": (("fsdp",), ("data",)), "tp": (("tensor",), ()),
             "dp_tp": (("data", "tensor"), ()), "fsdp_tp": (("fsdp", "tensor"), ("data",))}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a config: mesh axis sizes (outermost first), rule set, remat."""

    mesh: tuple[tuple[str, int], ...]
    rules: str
    remat: bool

    def __post_init__(self) -> None:
        for name, size in self.mesh:
            if name not in AXES or size < 1:
                raise ValueError(f"Layout mesh entry {name}={size}: axes are {AXES}, sizes >= 1")
        spmd.get_rules(self.rules)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_arg(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.mesh if s > 1) or "data=1"

    def overrides(self) -> list[str]:
        return [f"mesh.axes={self.mesh_arg}", f"rules={self.rules}", f"model.remat={str(self.remat).lower()}"]

    def apply(self, cfg: Config) -> Config:
        """``cfg`` run with this layout."""
        return override(cfg, self.overrides())

    def command(self) -> str:
        return f"--mesh {self.mesh_arg} --rules {self.rules} --set model.remat={str(self.remat).lower()}"

    def __str__(self) -> str:
        return f"{self.mesh_arg} {self.rules}{' remat' if self.remat else ''}"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes."""

    params: int
    optimizer: int
    grads: int
    activations: int
    batch: int

    @property
    def state(self) -> int:
        return self.params + self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.grads + self.activations + self.batch


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One kind of collective on one set of axes: per device per step."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int  # total over the step (count x full buffer)
    network: str  # "ici" | "dcn"
    seconds: float


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
    optimizer = int(round(_optimizer_copies(cfg) * local))
    grads = local * (2 if cfg.run.grad_accum > 1 else 1)
    dt = _DTYPE_BYTES[m.dtype]
    n_batch = math.prod(shard_divisors_for(("batch",), rules, sizes))
    t = sizes.get("tensor", 1) if any(a == "mlp" for a, _ in rules.activations) else 1
    b = max(data.global_batch // cfg.run.grad_accum // n_batch, 1)
    L, D, F, H, G, K, V = data.seq_len, m.d_model, m.ff, m.n_heads, m.kv_heads, m.k, m.vocab_size
    qkv = (H + 2 * G) * K / t
    per_token_layer = dt * (6 * D + 2 * qkv + H * K / t + 4 * F / t) + 4 * (qkv + 3 * D) + (4 + dt) * H * L / t
    block = b * L * per_token_layer
    layers = (m.n_layers * b * L * D * dt + block) if m.remat else m.n_layers * block
    vt = t if any(a == "vocab" for a, _ in rules.activations) else 1
    logits = 3 * b * L * V / vt * 4 + 2 * b * L * D * 4
    # FSDP/TP: one layer's weights gathered in the compute dtype (two in flight when prefetched)
    gathered = 0
    if sizes.get("fsdp", 1) > 1:
        gathered = 2 * sum(p.size // p.shape[0] * dt // math.prod(shard_divisors(p, rules, sizes, "activations"))
                           for p in infos if p.dims and p.dims[0] == "layers")
    batch = 2 * b * cfg.run.grad_accum * L * 4
    return MemoryEstimate(local, optimizer, grads, int(layers + logits + gathered), batch)


def shard_divisors_for(dims: tuple[str, ...], rules: spmd.Rules, sizes: dict[str, int]) -> list[int]:
    spec = rules.spec(dims, kind="activations", mesh_sizes=sizes)
    out = []
    for entry in list(spec) + [None] * (len(dims) - len(spec)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(math.prod(sizes[a] for a in axes))
    return out


def _optimizer_copies(cfg: Config) -> float:
    """Optimizer state bytes per parameter byte (2 for Adam's moments), from jax.eval_shape(tx.init)."""
    return _copies(cfg.optimizer, cfg.model)


def _copies(opt_cfg, model) -> float:
    from trainers.optim import make_optimizer

    infos = param_infos(model)
    params = {p.path: jax.ShapeDtypeStruct(p.shape, "float32") for p in infos}
    state = jax.eval_shape(make_optimizer(opt_cfg, 1e-3).init, params)
    big = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if len(x.shape) >= 1)
    return big / sum(p.size * p.itemsize for p in infos)


def comm_estimate(cfg: Config, sizes: dict[str, int], hw: Hardware, dcn_axes: tuple[str, ...] = ()) -> list[Traffic]:
    """Analytic collectives of one step, per device: gradient reductions, FSDP gathers, TP all-reduces."""
    m, rules, data = cfg.model, spmd.get_rules(cfg.rules), cfg.data
    net = networks(sizes, hw, dcn_axes)
    infos = param_infos(m)
    dt = _DTYPE_BYTES[m.dtype]
    d, f, t = sizes.get("data", 1), sizes.get("fsdp", 1), sizes.get("tensor", 1)
    tp_local = sum(p.size // math.prod(shard_divisors(p, rules, {**sizes, "data": 1, "fsdp": 1})) for p in infos)
    out = []

    def add(kind, axis, count, nbytes, group):
        if group > 1 and nbytes > 0:
            dcn = net[axis] == "dcn"
            out.append(Traffic(kind, (axis,), count, int(count * nbytes), net[axis],
                               count * collective_seconds(hw, kind, nbytes, group, dcn=dcn)))

    passes = 3 if m.remat else 2
    add("all-gather", "fsdp", passes, tp_local * dt, f)  # weights, forward + backward (+ remat recompute)
    add("reduce-scatter", "fsdp", 1, tp_local * 4, f)  # f32 gradients onto their shards
    add("all-reduce", "data", 1, tp_local // f * 4, d)  # gradients of each shard across replicas
    b = data.global_batch // math.prod(shard_divisors_for(("batch",), rules, sizes))
    per_layer = (6 if m.remat else 4) * m.n_layers  # attn-out + mlp-out, forward and backward (+ recompute)
    add("all-reduce", "tensor", per_layer, b * data.seq_len * m.d_model * dt, t)
    return out


def roofline(cfg: Config, n_devices: int, hw: Hardware, mem: MemoryEstimate, traffic: list[Traffic]) -> Roofline:
    """Step time and MFU of ``cfg`` from its memory estimate and collectives (see module docstring)."""
    m = cfg.model
    model_flops = flops_per_step(m, cfg.data.global_batch, cfg.data.seq_len)
    executed = model_flops / n_devices * (4 / 3 if m.remat else 1)
    peak = hw.peak(m.dtype)
    compute = executed / peak
    weights = 3 * mem.params * _DTYPE_BYTES[m.dtype] / 4
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
                    model_flops / (step * n_devices * peak), dominant)


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: MemoryEstimate | None
    traffic: tuple[Traffic, ...]
    roofline: Roofline | None
    budget: float
    issues: tuple[Issue, ...]

    @property
    def buildable(self) -> bool:
        return not any(i.fatal for i in self.issues)

    @property
    def fits(self) -> bool:
        return self.buildable and self.memory is not None and self.memory.total <= self.budget

    @property
    def reason(self) -> str:
        if not self.buildable:
            return str(next(i for i in self.issues if i.fatal))
        if not self.fits:
            return f"needs {_gib(self.memory.total)} per device > budget {_gib(self.budget)}"
        return f"dominant cost: {self.roofline.dominant}"


def estimate(cfg: Config, layout: Layout, hardware: str | Hardware, *, headroom: float = 0.9) -> Estimate:
    """The analytic estimate of ``cfg`` run with ``layout`` on ``hardware``."""
    hw = get_hardware(hardware)
    run = layout.apply(cfg)
    sizes = {a: layout.sizes.get(a, 1) for a in ("data", "pipe", "fsdp", "seq", "expert", "tensor")}
    budget = headroom * hw.hbm_bytes
    issues = diagnose(run.model, run.rules, sizes, global_batch=run.data.global_batch, grad_accum=run.run.grad_accum)
    if any(i.fatal for i in issues):
        return Estimate(layout, None, (), None, budget, tuple(issues))
    mem = memory_estimate(run, sizes)
    traffic = comm_estimate(run, sizes, hw)
    return Estimate(layout, mem, tuple(traffic), roofline(run, math.prod(sizes.values()), hw, mem, traffic),
                    budget, tuple(issues))


def _factorisations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for a in range(1, n + 1):
        if n % a == 0:
            for rest in _factorisations(n // a, k - 1):
                yield (a,) + rest


def candidates(devices: int, *, remat: tuple[bool, ...] = (False, True)) -> list[Layout]:
    """Every (data, fsdp, tensor) factorisation of ``devices`` with each rule set using exactly those axes."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    out = []
    for (d, f, t), (rules, (need, may)), r in itertools.product(_factorisations(devices, 3), RULE_AXES.items(), remat):
        used = {a for a, s in {"data": d, "fsdp": f, "tensor": t}.items() if s > 1}
        if devices > 1 and not (set(need) <= used <= set(need) | set(may)):
            continue
        if devices == 1 and rules != "dp":
            continue
        out.append(Layout((("data", d), ("fsdp", f), ("tensor", t)), rules, r))
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    devices: int
    hardware: Hardware
    ranked: tuple[Estimate, ...]  # fitting layouts, fastest first
    rejected: tuple[Estimate, ...]

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            raise ValueError(f"no layout of {self.devices} devices fits {self.hardware.name}; closest: "
                             + "; ".join(f"{e.layout}: {e.reason}" for e in self.rejected[:3]))
        return self.ranked[0]

    def format(self, top: int = 5) -> str:
        hw = self.hardware
        lines = [f"{len(self.ranked)} of {len(self.ranked) + len(self.rejected)} layouts of {self.devices} devices fit "
                 f"{hw.name} ({_gib(hw.hbm_bytes)} HBM, budget {_gib(self.ranked[0].budget if self.ranked else 0)})", "",
                 f"{'#':>2}  {'layout':<32}{'mem/device':>12}{'fits':>6}{'step':>11}{'overlap':>10}{'MFU':>7}  dominant cost"]
        for i, e in enumerate(self.ranked[:top], 1):
            r = e.roofline
            lines.append(f"{i:>2}  {str(e.layout):<32}{_gib(e.memory.total):>12}{'yes':>6}{_ms(r.step_s):>11}"
                         f"{_ms(r.step_s_overlap):>10}{r.mfu:>7.1%}  {r.dominant}")
        shown = [e for e in self.rejected if e.memory is not None][:3] + [e for e in self.rejected if e.memory is None][:3]
        if shown:
            lines += ["", "rejected (examples):"] + [f"    {str(e.layout):<32}{e.reason}" for e in shown]
        if self.ranked:
            lines += ["", f"chosen: {self.best.layout.command()}"]
        return "\n".join(lines)


def plan(cfg: Config, devices: int, hardware: str | Hardware, *, headroom: float = 0.9) -> Plan:
    """Estimate every candidate layout; the fitting ones ranked by estimated step time."""
    hw = get_hardware(hardware)
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    estimates = [estimate(cfg, layout, hw, headroom=headroom) for layout in candidates(devices)]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.roofline.step_s, e.memory.total))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total if e.memory else math.inf)
    return Plan(devices, hw, tuple(ranked), tuple(rejected))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    from trainers.recipes import RECIPES, recipe

    p = argparse.ArgumentParser(prog="spmd-plan", description="Rank layouts of a recipe for N devices of a hardware.")
    p.add_argument("recipe", help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--devices", type=int, required=True, help="number of devices (GPUs, TPU chips)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, tpu-v4, tpu-v5e, tpu-v5p, cpu")
    p.add_argument("--tiny", action="store_true", help="the recipe's tiny variant")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=5, help="how many layouts to show")
    p.add_argument("--headroom", type=float, default=0.9, help="fraction of HBM a layout may use")
    p.add_argument("--verify", action="store_true", help="confirm the chosen layout with a dry-run compile")
    args = p.parse_args(argv)
    try:
        cfg = override(recipe(args.recipe, tiny=args.tiny), args.overrides)
        result = plan(cfg, args.devices, args.hardware, headroom=args.headroom)
        print(f"{args.recipe}: {param_count(cfg.model):,} params, global batch {cfg.data.global_batch} x "
              f"{cfg.data.seq_len} tokens")
        print(result.format(args.top))
        best = result.best
    except ValueError as e:
        print(f"spmd-plan: error: {e}", file=sys.stderr)
        return 2
    print(f"spmd-train {args.recipe}{' --tiny' if args.tiny else ''} {best.layout.command()}"
          + "".join(f" --set {s}" for s in args.overrides))
    if args.verify:
        from trainers.dryrun import dry_run

        report = dry_run(best.layout.apply(cfg), devices=args.devices, hardware=result.hardware,
                         headroom=args.headroom)
        print("\nverified with a dry-run compile:\n" + report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
