"""``spmd-plan TARGET --devices N --hardware H``: which layout to run, decided before the pod.

TARGET is a recipe (the built-in GPT) or a task (``package.module:attribute``, as for
``spmd-train``). The planner enumerates layouts, estimates each analytically (no compile,
milliseconds each), drops those that cannot be built or do not fit, and ranks the rest by
estimated step time:

- **candidates**: every factorisation of N over ``data x pipe x fsdp x tensor``, with each rule set
  that uses exactly the non-pipe axes (``dp``, ``fsdp``, ``tp``, ``dp_tp``, ``fsdp_tp``), remat on
  and off. ``pipe`` (every rule set splits the stacked ``layers`` dim over it) takes the divisors of
  N that also divide ``n_layers``; each pipe size > 1 runs the ``1f1b`` schedule, and ``interleaved``
  with V=2 where ``n_layers`` splits into ``2 x pipe`` chunks, with M in ``{pipe, 2 pipe, 4 pipe}``
  microbatches that divide the batch. A :class:`Layout` is a frozen record of all of it.
- **pruning**: divisibility (heads, kv_heads, d_ff, vocab by ``tensor``; d_model by ``fsdp``;
  layers by ``pipe``; the microbatch by ``data x fsdp``, each pipeline microbatch too:
  :mod:`trainers.planning.diagnose`), and per-device memory above ``headroom x HBM``.
- **memory estimate** (per device; :mod:`trainers.planning.costs`): parameters and optimizer state exactly (shard shapes from the
  rule set, optimizer moments from ``jax.eval_shape(tx.init)``); gradients (f32, sharded like
  the parameters, twice with gradient accumulation); activations from a per-layer count of the
  tensors the backward pass keeps under the model's remat policy (:mod:`spmd.remat`: all of them
  under ``none`` and ``save_all_but_gathered``; the block input per layer plus one block's worth
  under ``full``, ``save_block_input`` and ``offload``, whose kept values sit on the host; that plus
  the projections' outputs under ``save_dots``) and the f32 logits; FSDP's gathered weights of one layer. With a pipe
  axis of S stages each device holds 1/S of the block parameters (the rule set's ``layers -> pipe``);
  activations: 1F1B / interleaved keep a stash of stage inputs (``x[B/M, L, D]``, as many slots as
  the schedule table holds at once, about S: :func:`spmd.pipeline.build_tables`) plus one chunk's
  recompute for one microbatch; GPipe keeps every microbatch's residuals (M, like no pipeline).
- **time estimate** (roofline; :func:`roofline`): compute = model FLOPs per device (x4/3 with
  ``full`` remat; ``save_dots`` / ``offload`` add attention's forward once more) / peak; memory = HBM traffic (weights read 3x per step, optimizer read/write, activations
  written and read) / HBM bandwidth; communication = per mesh axis, the ring algorithm's bytes on
  the wire / that axis's network bandwidth (fast network inside a node or slice, slow network
  across: :func:`trainers.hardware.networks`). **Overlap assumption**: none. Step time =
  max(compute, memory) + communication, an upper bound; ``step_s_overlap`` = max of all three is
  the perfect-overlap lower bound. Real runs land between, usually nearer the lower bound for FSDP
  (XLA prefetches gathers) and nearer the upper one for tensor parallelism (its all-reduces sit on
  the critical path). **Pipeline**: compute is divided by ``1 - bubble`` (the schedule table's
  ``bubble_fraction``: ``(S-1)/(M+S-1)`` for 1F1B, ``(S-1)/(VM+S-1)`` interleaved) and x4/3 for
  the 1F1B engines' recompute of each chunk in its backward; the pipe axis carries one
  ``x[B/M, L, D]`` collective-permute forward and one backward per tick (per tick of the table for
  1F1B / interleaved, per tick of the forward and the backward scan for GPipe), and interleaved
  moves ``(S-1)/S`` of the block parameters (and their gradients) to its chunk order each step.

**Any other task** (``plan(cfg, devices, hardware, task=...)``) is read once, abstractly
(:func:`trainers.planning.profile.profile_task`), and every ``data x fsdp x tensor`` factorisation with its
matching rule set is estimated from that profile (:mod:`trainers.planning.costs`'s ``task_*``): no pipe
axis (a task's pipelining is its own code) and no remat toggle (the model decides); state bytes
exactly from each variable's shard shape as :func:`spmd.variables.decide` gives it on that mesh;
activations from the values autodiff keeps for the backward pass at the device's rows (an
estimate that errs high); FLOPs the task's ``flops_per_example`` or 3 x the jaxpr's forward
matmuls, split over the batch axes and, for matmuls against tensor-sharded weights, over their
axes; communication from how each parameter is sharded (FSDP gathers and reduce-scatters,
data-parallel all-reduces, tensor-style all-reduces of the activations those matmuls leave).

``--verify`` confirms the chosen layout with a real dry-run compile (:mod:`trainers.planning.dryrun`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from collections.abc import Iterator

import spmd
from meshes import AXES
from spmd import remat as remat_lib
from spmd.models import param_count
from spmd.pipeline import NAMES as PIPELINE_SCHEDULES
from spmd.pipeline import PipelineConfig
from trainers.config import Config, override
from trainers.planning.diagnose import Issue, diagnose
from trainers.planning.costs import RULE_AXES, MemoryEstimate, Roofline, Traffic, comm_estimate, memory_estimate, roofline, task_comm_estimate, task_memory_estimate, task_roofline
from trainers.hardware import Hardware, get_hardware
from trainers.planning.profile import TaskProfile, profile_task
from trainers.task import Task, load_task

@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a config: mesh axis sizes (outermost first), rule set, remat (``True`` /
    ``False``: ``model.remat``; a :mod:`spmd.remat` policy name: ``model.remat_policy``; None: not
    a choice, a task's model decides), and with a ``pipe`` axis > 1 the pipeline schedule,
    microbatches M and virtual stages V."""

    mesh: tuple[tuple[str, int], ...]
    rules: str
    remat: bool | str | None
    schedule: str = "none"
    microbatches: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name, size in self.mesh:
            if name not in AXES or size < 1:
                raise ValueError(f"Layout mesh entry {name}={size}: axes are {AXES}, sizes >= 1")
        spmd.get_rules(self.rules)
        if self.remat is not None:
            remat_lib.resolve(self.remat)
        self.pipeline  # validates schedule, microbatches and virtual stages
        if (self.pipe > 1) != (self.schedule != "none"):
            raise ValueError(f"Layout with pipe={self.pipe} and pipeline schedule {self.schedule!r}: a pipe axis > 1 "
                             f"needs a schedule ({', '.join(PIPELINE_SCHEDULES)}), and schedule 'none' needs pipe=1")

    @property
    def pipe(self) -> int:
        return self.sizes.get("pipe", 1)

    @property
    def pipeline(self) -> PipelineConfig:
        return PipelineConfig(self.schedule, self.microbatches, self.virtual_stages)

    def _pipeline_sets(self) -> list[str]:
        return [f"pipeline.schedule={self.schedule}", f"pipeline.microbatches={self.microbatches}",
                f"pipeline.virtual_stages={self.virtual_stages}"]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_arg(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.mesh if s > 1) or "data=1"

    def _remat_sets(self) -> list[str]:
        if self.remat is None:
            return []
        if isinstance(self.remat, str):
            return [f"model.remat_policy={self.remat}"]
        return [f"model.remat={str(self.remat).lower()}", "model.remat_policy="]  # a policy in the base would win

    def overrides(self) -> list[str]:
        remat = self._remat_sets()
        return [f"mesh.axes={self.mesh_arg}", f"rules={self.rules}", *remat, *self._pipeline_sets()]

    def apply(self, cfg: Config) -> Config:
        """``cfg`` run with this layout."""
        return override(cfg, self.overrides())

    def command(self, base: Config | None = None) -> str:
        """The ``spmd-train`` flags of this layout (pipeline settings when it pipelines, or when ``base`` does)."""
        out = f"--mesh {self.mesh_arg} --rules {self.rules}"
        if isinstance(self.remat, str):
            out += f" --set model.remat_policy={self.remat}"
        elif self.remat is not None:
            out += f" --set model.remat={str(self.remat).lower()}"
            if base is not None and base.model.remat_policy:
                out += " --set model.remat_policy="
        if self.pipe > 1:
            out += "".join(f" --set {s}" for s in self._pipeline_sets())
        elif base is not None and base.pipeline.enabled:
            out += " --set pipeline.schedule=none --set pipeline.virtual_stages=1"
        return out

    def __str__(self) -> str:
        pp = ""
        if self.pipe > 1:
            pp = f" {self.schedule} M={self.microbatches}" + (f" V={self.virtual_stages}" if self.virtual_stages > 1 else "")
        remat = f" remat={self.remat}" if isinstance(self.remat, str) else " remat" if self.remat else ""
        return f"{self.mesh_arg} {self.rules}{pp}{remat}"


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


def estimate(cfg: Config, layout: Layout, hardware: str | Hardware, *, headroom: float = 0.9,
             task: Task | TaskProfile | None = None) -> Estimate:
    """The analytic estimate of ``cfg`` run with ``layout`` on ``hardware``: the built-in GPT's
    formulas, or with ``task`` (a Task or its :class:`~trainers.planning.profile.TaskProfile`) any model's."""
    hw = get_hardware(hardware)
    sizes = {a: layout.sizes.get(a, 1) for a in ("data", "pipe", "fsdp", "seq", "expert", "tensor")}
    budget = headroom * hw.hbm_bytes
    try:
        run = layout.apply(cfg)
    except ValueError as e:  # the config's own checks (e.g. a pipeline microbatch that does not split)
        return Estimate(layout, None, (), None, budget, (Issue("config", "config", None, str(e), "", fatal=True),))
    if task is not None:
        profile = task if isinstance(task, TaskProfile) else profile_task(task, cfg)
        issues = diagnose(profile.variables, run.rules, sizes, global_batch=run.data.global_batch,
                          grad_accum=run.run.grad_accum)
        if any(i.fatal for i in issues):
            return Estimate(layout, None, (), None, budget, tuple(issues))
        mem = task_memory_estimate(profile, run, sizes)
        traffic = task_comm_estimate(profile, run, sizes, hw)
        return Estimate(layout, mem, tuple(traffic), task_roofline(profile, run, sizes, hw, mem, traffic), budget,
                        tuple(issues))
    issues = diagnose(run.model, run.rules, sizes, global_batch=run.data.global_batch, grad_accum=run.run.grad_accum,
                      pipeline=run.pipeline)
    if any(i.fatal for i in issues):
        return Estimate(layout, None, (), None, budget, tuple(issues))
    mem = memory_estimate(run, sizes)
    traffic = comm_estimate(run, sizes, hw)
    return Estimate(layout, mem, tuple(traffic), roofline(run, math.prod(sizes.values()), hw, mem, traffic,
                                                          pipe=sizes["pipe"]), budget, tuple(issues))


def _factorisations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for a in range(1, n + 1):
        if n % a == 0:
            for rest in _factorisations(n // a, k - 1):
                yield (a,) + rest


def pipeline_options(pipe: int, n_layers: int, batch: int) -> list[tuple[str, int, int]]:
    """``(schedule, M, V)`` tried on a pipe axis of this size: 1f1b, and interleaved V=2 where the layers
    split into ``2 x pipe`` chunks, each with M in ``{pipe, 2 pipe, 4 pipe}`` dividing ``batch``."""
    if pipe == 1:
        return [("none", 1, 1)]
    out = []
    for M in (pipe, 2 * pipe, 4 * pipe):
        if batch % M:
            continue
        out.append(("1f1b", M, 1))
        if n_layers % (2 * pipe) == 0:
            out.append(("interleaved", M, 2))
    return out


def candidates(devices: int, *, remat: tuple[bool | str | None, ...] = (False, True), n_layers: int | None = None,
               batch: int | None = None) -> list[Layout]:
    """Every (data, pipe, fsdp, tensor) factorisation of ``devices`` with each rule set using exactly the
    non-pipe axes; pipe > 1 only with ``n_layers`` (a divisor of it) and ``batch`` (M must divide it)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    for name, value in (("n_layers", n_layers), ("batch", batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    out = []
    for d, p, f, t in _factorisations(devices, 4):
        if p > 1 and (n_layers is None or batch is None or n_layers % p):
            continue
        rest = devices // p
        used = {a for a, size in {"data": d, "fsdp": f, "tensor": t}.items() if size > 1}
        for (rules, (need, may)), r in itertools.product(RULE_AXES.items(), remat):
            if rest > 1 and not (set(need) <= used <= set(need) | set(may)):
                continue
            if rest == 1 and rules != "dp":
                continue
            for schedule, M, V in pipeline_options(p, n_layers or 1, batch or 1):
                out.append(Layout((("data", d), ("pipe", p), ("fsdp", f), ("tensor", t)), rules, r, schedule, M, V))
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
                 f"{'#':>2}  {'layout':<40}{'mem/device':>12}{'fits':>6}{'step':>11}{'overlap':>10}{'MFU':>7}  dominant cost"]
        for i, e in enumerate(self.ranked[:top], 1):
            r = e.roofline
            lines.append(f"{i:>2}  {str(e.layout):<40}{_gib(e.memory.total):>12}{'yes':>6}{_ms(r.step_s):>11}"
                         f"{_ms(r.step_s_overlap):>10}{r.mfu:>7.1%}  {r.dominant}")
        shown = [e for e in self.rejected if e.memory is not None][:3] + [e for e in self.rejected if e.memory is None][:3]
        if shown:
            lines += ["", "rejected (examples):"] + [f"    {str(e.layout):<40}{e.reason}" for e in shown]
        if self.ranked:
            lines += ["", f"chosen: {self.best.layout.command()}"]
        return "\n".join(lines)


def plan(cfg: Config, devices: int, hardware: str | Hardware, *, headroom: float = 0.9,
         task: Task | str | TaskProfile | None = None) -> Plan:
    """Estimate every candidate layout; the fitting ones ranked by estimated step time.

    ``task`` (a Task, its ``"package.module:attribute"`` name or its profile; None: ``cfg``'s
    built-in GPT) is profiled once and estimated on ``data x fsdp x tensor`` layouts (see the
    module docstring)."""
    hw = get_hardware(hardware)
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    if task is None:
        profile = None
        layouts = candidates(devices, n_layers=cfg.model.n_layers, batch=cfg.data.global_batch // cfg.run.grad_accum)
    else:
        profile = task if isinstance(task, TaskProfile) else profile_task(
            load_task(task) if isinstance(task, str) else task, cfg)
        layouts = candidates(devices, remat=(None,))
    estimates = [estimate(cfg, layout, hw, headroom=headroom, task=profile) for layout in layouts]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.roofline.step_s, e.memory.total))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total if e.memory else math.inf)
    return Plan(devices, hw, tuple(ranked), tuple(rejected))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    from trainers.launch.cli import base_config, is_task_target, load_target
    from trainers.recipes import RECIPES

    p = argparse.ArgumentParser(prog="spmd-plan", description="Rank layouts of a recipe or task for N devices of a hardware.")
    p.add_argument("target", metavar="TARGET",
                   help=f"a recipe ({', '.join(RECIPES)}) or a task as package.module:attribute")
    p.add_argument("--devices", type=int, required=True, help="number of devices (GPUs, TPU chips)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, tpu-v4, tpu-v5e, tpu-v5p, cpu")
    p.add_argument("--tiny", action="store_true", help="the recipe's tiny variant (a task's: 2 steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=5, help="how many layouts to show")
    p.add_argument("--headroom", type=float, default=0.9, help="fraction of HBM a layout may use")
    p.add_argument("--verify", action="store_true", help="confirm the chosen layout with a dry-run compile")
    args = p.parse_args(argv)
    is_task = is_task_target(args.target)
    try:
        task = load_target(args.target) if is_task else None
        cfg = override(base_config(args.target, task, tiny=args.tiny), args.overrides)
        profile = profile_task(task, cfg) if is_task else None
        result = plan(cfg, args.devices, args.hardware, headroom=args.headroom, task=profile)
        if profile is None:
            print(f"{args.target}: {param_count(cfg.model):,} params, global batch {cfg.data.global_batch} x "
                  f"{cfg.data.seq_len} tokens")
        else:
            print(f"{args.target} (task {task.name}): {profile.variables.param_count:,} params, global batch "
                  f"{cfg.data.global_batch}, {profile.model_flops(1):.3e} FLOPs per example"
                  + (f"; {profile.note}" if profile.note else ""))
        print(result.format(args.top))
        best = result.best
    except ValueError as e:
        print(f"spmd-plan: error: {e}", file=sys.stderr)
        return 2
    print(f"spmd-train {args.target}{' --tiny' if args.tiny else ''} {best.layout.command(cfg)}"
          + "".join(f" --set {s}" for s in args.overrides))
    if args.verify:
        from trainers.planning.dryrun import dry_run

        report = dry_run(best.layout.apply(cfg), args.target if is_task else None, devices=args.devices,
                         hardware=result.hardware, headroom=args.headroom)
        print("\nverified with a dry-run compile:\n" + report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
