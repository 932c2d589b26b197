"""Dry run: compile the real train step for N devices on any machine, and say whether it fits and how fast.

``dry_run(cfg, task=None, devices=256, hardware="h100") -> DryRunReport`` (CLI: ``spmd-train
TARGET --dry-run --devices 256 --hardware h100``, TARGET a recipe or ``package.module:task``)
builds the mesh and rule set exactly as ``trainers.loop.train`` does, creates the train state
*abstractly* with the run's own state builder (``trainers.state.create_state(..., abstract=True)``:
shapes, dtypes and shardings, no memory), and compiles ``trainers.step.make_train_step`` (the same
code the real run executes) with ``.lower(abstract_state, abstract_batch).compile()``. ``task`` is
a :class:`trainers.task.Task`, its ``"package.module:attribute"`` name, or None for the built-in
GPT of ``cfg``; a task's abstract batch is ``[data.global_batch, ...]`` of one row of its train data
(:func:`trainers.planning.profile.example_of`). The report puts side by side, per device:

- parameter / gradient / optimizer / activation bytes from the analytic estimate and from the
  compiled program's memory analysis (arguments = the state and batch; temporaries = gradients,
  activations, gathered weights). The built-in GPT's estimate is its formulas
  (:func:`trainers.planning.costs.memory_estimate`); any other task's is read off its variables and its
  loss's jaxpr (:func:`trainers.planning.costs.task_memory_estimate`: state exact, activations the
  values autodiff keeps for the backward pass, an estimate that errs high);
- whether the compiled footprint fits ``headroom x`` the hardware's HBM;
- every collective per mesh axis with its bytes (:func:`spmd.hlo.collectives`) and its time on
  the target's fast or slow network;
- model FLOPs per step, and a roofline step time and MFU (:func:`trainers.planning.costs.roofline`; no
  compute/communication overlap assumed, the perfect-overlap time alongside);
- sharding diagnostics (:mod:`trainers.planning.diagnose`) traced to parameter paths, with fixes (for a
  task also: compiled temporaries near the whole batch's activations, i.e. activations that are
  not split over the batch axes);
- with ``cfg.pipeline`` enabled on a ``pipe`` axis > 1: the step compiled is the pipelined one
  (the trainer's ``lm_loss_fn(z_loss, cfg.pipeline)``), and the report adds the schedule, its
  bubble fraction (idle share of the schedule table, which stretches the roofline's compute time)
  and the collective-permutes over ``pipe`` (count and bytes, next to the analytic count: one
  ``x[B/M, L, D]`` each way per tick).

**Devices.** The compile runs on N devices of this machine's backend when it has exactly N (a
GPU node compiling for itself), otherwise on N simulated CPU devices: set in-process when jax has
not started yet, or in a subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
``JAX_PLATFORMS=cpu``) when it has started with another count. The subprocess rebuilds the task
from its ``"module:attribute"`` name; a :class:`~trainers.task.Task` object given without one
cannot cross that boundary (pass the name, or the backend's device count).

**What a CPU compile tells about a GPU/TPU compile.** The SPMD partitioner is the same on every
backend, so the sharding of every array, the shard shapes, the state bytes per device and which
collectives run over which mesh axes with how many bytes are what the accelerator compile gets.
Backend passes differ: the CPU backend has no reduce-scatter pass (FSDP's gradient reduce-scatter
shows as an all-reduce + slice, twice the bytes on the wire of the real thing), no async collectives
or latency-hiding scheduler (overlap is assumed, not measured), its own fusion decisions and buffer
assignment (temporaries can differ by tens of percent; bf16 work may be kept in f32), and no
TPU rematerialisation pass for programs over the HBM limit. Timings are a roofline, not a measurement.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

from trainers.config import Config
from trainers.hardware import Hardware, collective_seconds, get_hardware, networks
from trainers.task import Task, lm_task, load_task


@dataclasses.dataclass(frozen=True)
class DryRunReport:
    """What a dry run found; ``format()`` is the human-readable report."""

    name: str
    devices: int
    mesh: tuple[tuple[str, int], ...]
    dcn_axes: tuple[str, ...]
    rules: str
    hardware: Hardware
    headroom: float
    params: int  # parameter count
    model_flops: float  # per step, all devices
    analytic: object | None  # trainers.planning.costs.MemoryEstimate
    compiled: object | None  # spmd.inspection.Memory of the compiled step (per device)
    state_bytes: int  # params + optimizer + counters, per device, from the abstract shard shapes
    batch_bytes: int
    collectives: tuple = ()  # spmd.hlo.Collective
    traffic: tuple = ()  # trainers.planning.costs.Traffic from the compiled collectives
    analytic_traffic: tuple = ()
    roofline: object | None = None  # trainers.planning.costs.Roofline
    issues: tuple = ()  # trainers.planning.diagnose.Issue
    compile_s: float = 0.0
    backend: str = ""
    pipeline: str = ""  # "1f1b S=2 M=4 V=1" when the step is pipelined, else ""
    bubble: float = 0.0  # idle fraction of the pipeline's schedule table

    @property
    def pipe_permutes(self) -> tuple:
        """The compiled step's collective-permutes over the ``pipe`` axis (the pipeline's sends)."""
        return tuple(op for op in self.collectives if op.kind == "collective-permute" and op.axes == ("pipe",))

    @property
    def budget(self) -> float:
        return self.headroom * self.hardware.hbm_bytes

    @property
    def peak_bytes(self) -> int:
        """Per-device footprint: the compiled one when compiled, else the analytic one."""
        if self.compiled is not None:
            return self.compiled.total
        return self.analytic.total if self.analytic is not None else 0

    @property
    def fits(self) -> bool:
        return self.compiled is not None and self.peak_bytes <= self.budget

    def format(self) -> str:
        from spmd.hlo import format_collectives

        hw = self.hardware
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh if s > 1) or "1 device"
        out = [f"dry run: {self.name}, {self.params:,} params, mesh {mesh}"
               + (f" (dcn: {','.join(self.dcn_axes)})" if self.dcn_axes else "") + f", rules {self.rules}",
               f"target {hw.name} x {self.devices}; compiled on {self.backend} in {self.compile_s:.1f} s", ""]
        a, c = self.analytic, self.compiled
        if a is not None:
            rows = [("params", a.params, None), ("optimizer", a.optimizer, None)]
            if a.other:
                rows.append(("model variables (batch stats, RNG, ...)", a.other, None))
            state = "state (params + optimizer" + (" + variables)" if a.other else ")")
            rows += [(state, a.state, c.argument - self.batch_bytes if c else None),
                     ("grads", a.grads, None), ("activations", a.activations, None),
                     ("temporaries (grads + activations + ...)", a.grads + a.activations, c.temp if c else None),
                     ("batch", a.batch, self.batch_bytes if c else None),
                     ("total", a.total, c.total if c else None)]
            out.append(f"{'per device':<42}{'analytic':>14}{'compiled':>14}")
            out += [f"{k:<42}{_b(x):>14}{_b(y) if y is not None else '':>14}" for k, x, y in rows]
            verdict = "fits" if self.fits else "does NOT fit" if c is not None else "not compiled"
            out.append(f"{verdict}: {_b(self.peak_bytes)} of {_b(hw.hbm_bytes)} HBM (budget {self.headroom:.0%} = "
                       f"{_b(self.budget)})")
        if self.pipeline:
            sends = self.pipe_permutes
            expected = [x for x in self.analytic_traffic if x.kind == "collective-permute" and x.axes == ("pipe",)]
            out += ["", f"pipeline: {self.pipeline}, bubble {self.bubble:.1%} of the schedule's slots idle; "
                        f"{sum(op.count for op in sends)} collective-permutes over pipe per step "
                        f"({_b(sum(op.total_bytes for op in sends))}; analytic "
                        f"{sum(x.count for x in expected)}, {_b(sum(x.bytes for x in expected))})"]
        if self.collectives:
            out += ["", "collectives (compiled step, per device per step):", format_collectives(list(self.collectives))]
        if self.traffic:
            out += ["", f"{'communication on ' + hw.name:<42}{'bytes':>14}{'time':>12}"]
            out += [f"{x.kind + ' ' + ','.join(x.axes) + ' (' + x.network + ')':<42}{_b(x.bytes):>14}{_t(x.seconds):>12}"
                    for x in self.traffic]
        r = self.roofline
        if r is not None:
            out += ["", f"model FLOPs per step {self.model_flops:.3e}; per device executed {r.flops_per_device:.3e}",
                    f"roofline on {hw.name}: compute {_t(r.compute_s)}, HBM {_t(r.memory_s)}, "
                    f"communication {_t(r.comm_s)}",
                    f"estimated step {_t(r.step_s)} (no overlap; {_t(r.step_s_overlap)} with perfect "
                    f"overlap), MFU {r.mfu:.1%}, dominant cost: {r.dominant}"]
        if self.issues:
            out += ["", "diagnostics:"] + [f"  - {i}" for i in self.issues]
        return "\n".join(out)


def _t(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _b(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def resolve_mesh(cfg: Config, devices: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """Axis sizes (ICI x DCN, canonical axes, outermost first) of ``cfg.mesh`` on ``devices``, and the DCN axes."""
    from meshes import MeshSpec

    spec = MeshSpec.of(cfg.mesh.axes, cfg.mesh.dcn or None)
    dcn = dict(spec.dcn)
    if any(s == -1 for s in dcn.values()):
        raise ValueError(f"mesh.dcn={cfg.mesh.dcn!r}: a dry run needs explicit DCN sizes (no -1)")
    slices = math.prod(dcn.values()) if dcn else 1
    ici, dcn_sizes = spec.resolve(devices, slices)
    sizes = {a: ici[a] * dcn_sizes.get(a, 1) for a in ici}
    return sizes, tuple(a for a, s in dcn_sizes.items() if s > 1)


def dry_run(cfg: Config, task: Task | str | None = None, *, devices: int | None = None,
            hardware: str | Hardware = "h100", headroom: float = 0.9) -> DryRunReport:
    """Compile the train step of ``task`` (default: ``cfg``'s built-in GPT) under ``cfg`` for ``devices``
    devices (default: this backend's) and report."""
    import meshes

    hw = get_hardware(hardware)
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if task is not None and not isinstance(task, (str, Task)):
        raise TypeError(f"task must be a trainers.Task, its 'package.module:attribute' name or None, "
                        f"got {type(task).__name__}")
    if devices is None:
        import jax

        devices = jax.device_count()
    resolve_mesh(cfg, devices)  # bad mesh sizes fail here, before any subprocess
    if not meshes.backend_started():
        meshes.simulate_cpu_devices(devices)
    import jax

    if jax.device_count() != devices:
        if isinstance(task, Task):
            raise ValueError(f"a dry run for {devices} devices on a backend that started with {jax.device_count()} "
                             f"runs in a subprocess, which must rebuild task {task.name!r}: pass its "
                             "'package.module:attribute' name instead of the Task object, or devices="
                             f"{jax.device_count()}")
        return _in_subprocess(cfg, task, devices, hw, headroom)
    return _dry_run_here(cfg, load_task(task) if isinstance(task, str) else task, devices, hw, headroom)


def _in_subprocess(cfg: Config, target: str | None, devices: int, hw: Hardware, headroom: float) -> DryRunReport:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    root = _import_root(target) if target is not None else None
    if root is not None:  # the child imports the task's module from where this process found it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(_encode([cfg, target, devices, hw, headroom]), f)
        code = f"import sys; from trainers.planning.dryrun import _subprocess_main; sys.exit(_subprocess_main({src!r}, {dst!r}))"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"dry run in a subprocess with {devices} simulated CPU devices failed "
                               f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(dst) as f:
            return _decode(json.load(f))


def _import_root(target: str) -> str | None:
    """The sys.path entry this process imports ``target``'s top-level package (or module) from."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(target.partition(":")[0].split(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.dirname(list(spec.submodule_search_locations)[0])
    return os.path.dirname(spec.origin) if spec.origin else None


# The subprocess hand-off is JSON: dataclasses are named and rebuilt only from this toolkit's own
# modules (no pickle: nothing read back can run code).
_CODEC_MODULES = ("meshes.", "spmd.", "trainers.")


def _encode(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        kind = f"{type(x).__module__}:{type(x).__qualname__}"
        return {"__dataclass__": kind, "fields": {f.name: _encode(getattr(x, f.name))
                                                  for f in dataclasses.fields(x) if f.init}}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError(f"cannot encode a dict with non-string keys: {list(x)[:3]}")
        return {"__dict__": {k: _encode(v) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot encode {type(x).__name__} for the dry-run subprocess")


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(_decode(v) for v in x["__tuple__"])
    if "__dict__" in x:
        return {k: _decode(v) for k, v in x["__dict__"].items()}
    module, _, name = x["__dataclass__"].partition(":")
    if not module.startswith(_CODEC_MODULES):
        raise ValueError(f"refusing to rebuild {x['__dataclass__']!r}: not a type of this toolkit")
    cls = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{x['__dataclass__']!r} is not a dataclass")
    return cls(**{k: _decode(v) for k, v in x["fields"].items()})


def _dry_run_here(cfg: Config, task: Task | None, devices: int, hw: Hardware, headroom: float) -> DryRunReport:
    import jax
    from flax import nnx

    import meshes
    import spmd
    from spmd.models import flops_per_step, param_count
    from trainers.planning import diagnose as dg
    from trainers.planning.costs import Traffic, batch_axes, comm_estimate, memory_estimate, pipeline_bubble, roofline, rows_per_device, task_comm_estimate, task_memory_estimate, task_roofline
    from trainers.optim import make_optimizer
    from trainers.planning.profile import abstract_batch, profile_task
    from trainers.lr import make_schedule
    from trainers.state import create_state
    from trainers.step import make_train_step

    sizes, dcn_axes = resolve_mesh(cfg, devices)
    rules = spmd.get_rules(cfg.rules)
    pipe = sizes.get("pipe", 1)
    piped = pipe > 1 and cfg.pipeline.enabled
    p = cfg.pipeline
    run = lm_task(cfg) if task is None else task
    if task is None:  # the built-in GPT: its config's formulas
        profile = None
        issues = dg.diagnose(cfg.model, rules, sizes, global_batch=cfg.data.global_batch,
                             grad_accum=cfg.run.grad_accum, pipeline=cfg.pipeline)
        n_params, flops = param_count(cfg.model), flops_per_step(cfg.model, cfg.data.global_batch, cfg.data.seq_len)
        name = cfg.run.name
    else:
        profile = profile_task(task, cfg)
        issues = dg.diagnose(profile.variables, rules, sizes, global_batch=cfg.data.global_batch,
                             grad_accum=cfg.run.grad_accum)
        if cfg.pipeline.enabled and not task.pipelined:
            issues.append(dg.Issue("config", "pipeline", None, f"pipeline.schedule={cfg.pipeline.schedule!r} needs a task "
                                   f"whose loss runs its spmd.Stack through spmd.pipeline.pipelined_loss; task "
                                   f"{task.name!r} does not (Task.pipelined=False)", "set pipeline.schedule=none",
                                   fatal=True))
        if profile.note:
            issues.append(dg.Issue("profile", "loss", None, profile.note, ""))
        n_params, flops = profile.variables.param_count, profile.model_flops(cfg.data.global_batch)
        name = cfg.run.name if cfg.run.name == task.name else f"{cfg.run.name} (task {task.name})"
    common = dict(name=name, devices=devices, mesh=tuple(sizes.items()), dcn_axes=dcn_axes, rules=rules.name,
                  hardware=hw, headroom=headroom, params=n_params, model_flops=flops,
                  pipeline=f"{p.schedule} S={pipe} M={p.microbatches} V={p.virtual_stages}" if piped else "",
                  bubble=pipeline_bubble(cfg, pipe))
    backend = f"{jax.devices()[0].platform} ({devices} {'simulated ' if jax.devices()[0].platform == 'cpu' else ''}devices)"
    if any(i.fatal for i in issues):
        return DryRunReport(**common, analytic=None, compiled=None, state_bytes=0, batch_bytes=0, issues=tuple(issues),
                            backend=backend)

    mesh = meshes.make_mesh(meshes.MeshSpec.of(sizes), devices=jax.devices()[:devices], axis_type=cfg.mesh.axis_type)
    schedule = make_schedule(cfg.schedule)
    tx = make_optimizer(cfg.optimizer, schedule)
    sharded = create_state(lambda: run.model(nnx.Rngs(cfg.run.seed)), tx, rules, mesh, seed=cfg.run.seed,
                           path_rules=run.path_rules, abstract=True)
    batch_sharding = spmd.batch_sharding(rules, mesh, dims=("batch",))
    step = make_train_step(sharded, tx, rules, mesh, batch_sharding, schedule=schedule, grad_accum=cfg.run.grad_accum,
                           loss_fn=run.loss)
    if profile is None:
        tokens = jax.ShapeDtypeStruct((cfg.data.global_batch, cfg.data.seq_len), jax.numpy.int32, sharding=batch_sharding)
        batch = {"inputs": tokens, "targets": tokens}
    else:
        batch = abstract_batch(profile.example, cfg.data.global_batch, batch_sharding)
    t0 = time.perf_counter()
    with dg.capture_stderr() as log:
        compiled = step.lower(sharded.abstract, batch).compile()
    compile_s = time.perf_counter() - t0

    ops = spmd.hlo.collectives(compiled, mesh)
    net = networks(sizes, hw, dcn_axes)
    traffic = []
    for (kind, axes), row in spmd.hlo.summarize(ops).items():
        group = math.prod(sizes.get(a, 1) for a in axes)
        dcn = any(net.get(a) == "dcn" for a in axes)
        traffic.append(Traffic(kind, axes, row["count"], row["bytes"], "dcn" if dcn else "ici",
                               collective_seconds(hw, kind, row["bytes"], group, dcn=dcn)))
    if profile is None:
        analytic = memory_estimate(cfg, sizes)
        analytic_traffic = comm_estimate(cfg, sizes, hw, dcn_axes)
        roof = roofline(cfg, devices, hw, analytic, traffic, pipe=pipe)
    else:
        analytic = task_memory_estimate(profile, cfg, sizes)
        analytic_traffic = task_comm_estimate(profile, cfg, sizes, hw, dcn_axes)
        roof = task_roofline(profile, cfg, sizes, hw, analytic, traffic)
        rows = rows_per_device(cfg, sizes)
        issues += dg.check_activation_split(spmd.inspection.memory(compiled).temp, analytic.activations,
                                            profile.activations(cfg.data.global_batch // cfg.run.grad_accum),
                                            analytic.grads + analytic.state, rows, batch_axes(rules, sizes))
    issues += dg.check_collectives(ops) + dg.parse_remat_warnings(log[0] if log else "")
    return DryRunReport(
        **common, analytic=analytic, compiled=spmd.inspection.memory(compiled),
        state_bytes=spmd.inspection.tree_bytes_per_device(sharded.abstract),
        batch_bytes=spmd.inspection.tree_bytes_per_device(batch), collectives=tuple(ops), traffic=tuple(traffic),
        analytic_traffic=tuple(analytic_traffic), roofline=roof, issues=tuple(issues), compile_s=compile_s,
        backend=backend)


def _subprocess_main(src: str, dst: str) -> int:
    with open(src) as f:
        cfg, target, devices, hw, headroom = _decode(json.load(f))
    import meshes

    meshes.simulate_cpu_devices(devices)
    report = _dry_run_here(cfg, load_task(target) if target is not None else None, devices, hw, headroom)
    with open(dst, "w") as f:
        json.dump(_encode(report), f)
    return 0
