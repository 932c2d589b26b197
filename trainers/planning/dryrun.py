"""Dry run: compile the real train step for N devices on any machine, and say whether it fits and how fast.

    dry_run(cfg, task=None, devices=256, hardware="h100") -> DryRunReport
    spmd-train TARGET --dry-run --devices 256 --hardware h100

The state is abstract (nothing allocated); the report puts analytic and compiled memory side by side,
with collectives per mesh axis and a roofline step time. See docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import jax

import meshes
import spmd
from spmd.models import param_count
from trainers.checks import Compiled, Issue, batch_axes, check
from trainers.config import Config
from trainers.local_sgd import data_bytes
from trainers.planning.costs import Traffic, layout_costs, layout_roofline, model_flops, rows_per_device
from trainers.planning.diagnose import capture_stderr
from trainers.planning.fresh_process import call_with_devices, check_simulated, import_root
from trainers.planning.hardware import Hardware, get_hardware
from trainers.planning.pipeline_costs import pipeline_schedule
from trainers.planning.profile import batch_shapes, profile_task
from trainers.planning.report import DryRunReport, is_cpu_target, layer_stack, target_platform
from trainers.setup import build
from trainers.step import accumulation_note
from trainers.task import Task, lm_task, load_task


def dry_run(cfg: Config, task: Task | str | None = None, *, devices: int | None = None,
            hardware: str | Hardware = "h100", headroom: float | None = None) -> DryRunReport:
    """Compile the train step of ``task`` (default: ``cfg``'s built-in GPT) under ``cfg`` for ``devices``
    devices (default: this backend's) and report; ``headroom`` defaults to the hardware's."""
    hw = get_hardware(hardware)
    headroom = hw.headroom if headroom is None else headroom
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if task is not None and not isinstance(task, (str, Task)):
        raise TypeError(f"task must be a trainers.Task, its 'package.module:attribute' name or None, "
                        f"got {type(task).__name__}")
    if devices is None:
        devices = jax.device_count()
    cfg.mesh.sizes(devices)  # bad mesh sizes fail here, before any subprocess
    if not (meshes.backend_started() and jax.device_count() == devices):  # simulated: bounded
        check_simulated(devices)
    if not meshes.backend_started():
        meshes.simulate_cpu_devices(devices)
    if jax.device_count() != devices:
        if isinstance(task, Task):
            raise ValueError(f"a dry run for {devices} devices on a backend that started with {jax.device_count()} "
                             f"runs in a subprocess, which must rebuild task {task.name!r}: pass its "
                             "'package.module:attribute' name instead of the Task object, or devices="
                             f"{jax.device_count()}")
        kwargs = {"devices": devices, "hardware": hw, "headroom": headroom}
        root = import_root(task) if task is not None else None  # the child imports the task from where we did
        return call_with_devices(f"{__name__}:dry_run", [cfg, task], kwargs, devices, path=root)
    return _dry_run_here(cfg, load_task(task) if isinstance(task, str) else task, devices, hw, headroom)


def _dry_run_here(cfg: Config, task: Task | None, devices: int, hw: Hardware, headroom: float) -> DryRunReport:
    sizes, dcn_axes = cfg.mesh.sizes(devices), cfg.mesh.dcn_axes(devices)
    rules = spmd.get_rules(cfg.rules)
    pipe, p = sizes.get("pipe", 1), cfg.pipeline
    piped = pipe > 1 and p.enabled
    if task is None:  # the blocks compiled as the target runs them, whatever this backend would pick
        model = dataclasses.replace(cfg.model, scan_layers=cfg.model.stack_form(target_platform(hw)))
        cfg, stack = dataclasses.replace(cfg, model=model), layer_stack(cfg.model, hw)
    run = lm_task(cfg) if task is None else task
    profile = None if task is None else profile_task(task, cfg)  # None: the built-in GPT's formulas
    costs = layout_costs(cfg, sizes, hw, profile=profile, dcn_axes=dcn_axes)
    issues = list(costs.issues)
    if profile is None:
        n_params, flops = param_count(cfg.model), model_flops(cfg)
        name = cfg.run.name
    else:
        issues += check(cfg, stages=("config",), task=task, select=("pipelined_task",))
        if profile.note:
            issues.append(Issue("profile", "loss", None, profile.note, "", stage="compiled"))
        n_params, flops = profile.variables.param_count, profile.model_flops(cfg.data.global_batch)
        name = cfg.run.name if cfg.run.name == task.name else f"{cfg.run.name} (task {task.name})"
    common: dict[str, Any] = dict(name=name, devices=devices, mesh=tuple(sizes.items()), dcn_axes=dcn_axes, rules=rules.name,
                                  hardware=hw, headroom=headroom, params=n_params, model_flops=flops,
                                  pipeline=f"{p.schedule} S={pipe} M={p.microbatches} V={p.virtual_stages}" if piped else "",
                                  bubble=pipeline_schedule(cfg, pipe).bubble_fraction if piped else 0.0,
                                  layer_stack=stack if task is None else "")
    backend = f"{jax.devices()[0].platform} ({devices} {'simulated ' if jax.devices()[0].platform == 'cpu' else ''}devices)"
    if any(i.fatal for i in issues):
        return DryRunReport(**common, analytic=None, compiled=None, state_bytes=0, batch_bytes=0, issues=tuple(issues),
                            backend=backend)

    # not cfg.mesh.build: the ICI x DCN sizes as one spec, since this process holds every planned slice
    mesh = meshes.make_mesh(meshes.MeshSpec.of(sizes), devices=jax.devices()[:devices], axis_type=cfg.mesh.axis_type)
    setup = build(cfg, run, mesh, abstract=True)  # the run's own step (trainers.setup), on shapes only
    step, state = cast(jax.stages.Wrapped, setup.train_step), setup.stepped.abstract  # jitted: lowered below
    note = accumulation_note(setup.sharded, setup.state_rules, mesh, cfg.data.global_batch,
                             grad_accum=cfg.run.grad_accum, fsdp_gather=cfg.run.fsdp_gather, loss_fn=run.loss)
    if note:
        issues.append(Issue("accumulate", "batch", "batch", note, "", stage="compiled"))
    if profile is None:
        batch = setup.abstract_batch()
    else:
        batch = batch_shapes(profile.example, cfg.data.global_batch, setup.batch_sharding)
    local = getattr(setup.strategy, "local", None)  # local SGD: its inner step on every group's state
    t0 = time.perf_counter()
    with capture_stderr() as log:
        if local is None:
            compiled = step.lower(state, batch).compile()
        else:
            steps = local.compile_steps(batch)
            compiled, state = steps["inner"], setup.strategy.abstract
    compile_s = time.perf_counter() - t0
    per_shard = 1 if local is None else local.groups // sizes.get("data", 1)  # groups mapped on each device
    if local is not None:
        issues.append(local_sgd_note(local, steps, mesh, per_shard))

    ops = spmd.hlo.collectives(compiled, mesh)
    if piped:  # a stage's own collectives (tensor all-reduces, ...) run only on the ticks it runs their op
        ops = branch_weighted(ops, compiled, pipeline_schedule(cfg, pipe))
    table = spmd.hlo.summarize(ops)
    sent = {}
    if piped:  # the sends sit in switch branches: weigh each by how often the schedule table takes it
        try:
            sent = pipe_sends(compiled, cfg, mesh, ops)
            table[("collective-permute", ("pipe",))] = {"count": sent["count"], "bytes": sent["busiest"]}
        except ValueError as e:
            issues.append(Issue("pipeline", "pipe", None, f"the compiled step's sends over pipe could not be matched "
                                f"to the schedule table ({e}); their bytes count every switch branch on every tick", "",
                                stage="compiled"))
    traffic = [Traffic.timed(kind, axes, row["count"], row["bytes"], sizes, hw, dcn_axes)
               for (kind, axes), row in table.items() if row["count"]]
    analytic = costs.memory
    split = None if profile is None else (
        spmd.inspection.memory(compiled).temp, analytic.activations,
        profile.activations(cfg.data.global_batch // cfg.run.grad_accum), analytic.grads + analytic.state,
        rows_per_device(cfg, sizes), batch_axes(rules, sizes))
    issues += check(cfg, stages=("compiled",), compiled=Compiled(ops, log[0] if log else "", split))
    state_bytes, batch_bytes = compiled_arg_bytes(compiled, (state, batch))
    return DryRunReport(
        **common, analytic=analytic, compiled=spmd.inspection.memory(compiled), state_bytes=state_bytes,
        batch_bytes=batch_bytes, model_bytes=state_bytes + batch_bytes + per_shard * (analytic.grads + analytic.activations),
        verdict="compiled" if is_cpu_target(hw) else "accelerator", collectives=tuple(ops), traffic=tuple(traffic),
        analytic_traffic=costs.traffic, roofline=layout_roofline(cfg, sizes, hw, analytic, traffic, profile=profile),
        issues=tuple(issues), compile_s=compile_s, backend=backend, pipe_sent=sent.get("pipeline", 0))


def local_sgd_note(local: Any, steps: dict[str, Any], mesh: Any, per_shard: int) -> Issue:
    """What local SGD sends over ``data``: nothing per inner step, the outer all-reduce every H steps."""
    inner, outer = (data_bytes(steps[k], mesh) for k in ("inner", "outer"))
    h, g = local.cfg.every, local.groups
    return Issue("local_sgd", "params", None, f"local SGD ({g} replica groups, H={h}): the inner step sends {inner} bytes "
                 f"per device over data; the outer step, every {h} steps, {outer} ({outer / h:.0f} per step); the "
                 f"state holds {per_shard} group(s) per device plus the outer params and "
                 "optimizer state", "", stage="compiled")


def branch_weighted(ops: list[spmd.hlo.Collective], compiled, schedule) -> list[spmd.hlo.Collective]:
    """``ops`` with those in the table engine's compute switch counted as the busiest stage runs them
    (:func:`spmd.pipeline.hlo_branch_counts`: the ticks it takes each op's branch), not on every tick of
    every branch; the pipe sends are weighed separately (:func:`pipe_sends`)."""
    counts = spmd.pipeline.hlo_branch_counts(compiled, schedule)
    mine = [op for op in ops if op.in_branch and op.name in counts
            and not (op.kind == "collective-permute" and op.axes == ("pipe",))]
    if not mine:
        return ops
    load = [sum(op.bytes * counts[op.name][s] for op in mine) for s in range(schedule.n_stages)]
    busiest = load.index(max(load))
    ids = {id(op) for op in mine}
    return [dataclasses.replace(op, count=counts[op.name][busiest], in_branch=False) if id(op) in ids else op
            for op in ops]


def compiled_arg_bytes(compiled, args: tuple) -> list[int]:
    """Per-device bytes of each of ``args`` (abstract arrays) as the compiled program shards them: their
    shapes under ``compiled.input_shardings`` (the accelerator holds the same shards; no CPU temporaries)."""
    shardings = compiled.input_shardings[0]
    out = []
    for arg, sharding in zip(args, shardings):
        leaves, tree = jax.tree.flatten(arg)
        placed = jax.tree.leaves(sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if len(placed) != len(leaves):  # not the structure expected: the shardings the state was built with
            out.append(spmd.inspection.tree_bytes_per_device(arg))
            continue
        out.append(spmd.inspection.tree_bytes_per_device(jax.tree.unflatten(tree, [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, placed)])))
    return out


def pipe_sends(compiled, cfg: Config, mesh, ops: list[spmd.hlo.Collective]) -> dict[str, int]:
    """The compiled step's sends over ``pipe`` per step: ``pipeline`` (summed over the stage pairs of one
    pipeline, :func:`spmd.pipeline.hlo_sent_bytes`: each switch branch weighed by how often the schedule
    table takes it), and per device the busiest stage's ``count`` and ``busiest`` bytes (the branches'
    bytes in the table's per-stage proportion, plus every permute outside a branch on each execution)."""
    schedule = pipeline_schedule(cfg, mesh.shape["pipe"])
    found = spmd.pipeline.hlo_sent_bytes(compiled, schedule, mesh)
    per_stage = schedule.sent_bytes(1).per_stage  # activations each stage sends per pipeline run
    share = max(per_stage) / max(sum(per_stage), 1)
    branch = [op for op in ops if op.kind == "collective-permute" and op.axes == ("pipe",) and op.in_branch]
    certain = [op for op in ops if op.kind == "collective-permute" and op.axes == ("pipe",) and not op.in_branch]
    busiest = found["executed"] * share
    count = round(busiest / branch[0].bytes) if branch else 0
    return {"pipeline": found["executed"] + found["unattributed"], "count": count + sum(op.count for op in certain),
            "busiest": int(busiest) + sum(op.total_bytes for op in certain)}
