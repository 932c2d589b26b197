"""Compile the planner's top picks (abstract state, as the dry run does) and keep those that fit.

    compile_layouts(cfg, layouts, devices=256, hardware="h100") -> [DryRunReport, ...]

Each layout's train step is compiled by :func:`trainers.planning.dryrun.dry_run` for ``devices``
devices: in this process when its backend has (or can still be given) that many, else all of them in
one fresh process with that many simulated CPU devices (:mod:`trainers.planning.fresh_process`). A
pick fits when its report does: for a GPU/TPU target the accelerator memory model on the compiled
shapes, for a CPU target the compiled program (:class:`trainers.planning.report.DryRunReport`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

import meshes
from trainers.config import Config
from trainers.hardware import Hardware, get_hardware
from trainers.planning.dryrun import dry_run
from trainers.planning.fresh_process import call_with_devices, check_simulated, import_root
from trainers.planning.report import DryRunReport
from trainers.task import Task


def compile_layouts(cfg: Config, layouts: Sequence, devices: int, hardware: str | Hardware = "h100", *,
                    headroom: float | None = None, task: Task | str | None = None) -> list[DryRunReport]:
    """The dry run of ``cfg`` under each of ``layouts`` (:class:`trainers.planning.planner.Layout`), in order."""
    hw = get_hardware(hardware)
    configs = [layout.apply(cfg) for layout in layouts]
    if not configs:
        return []
    if not (meshes.backend_started() and jax.device_count() == devices):  # simulated: bounded
        check_simulated(devices, "compiling the picks")
    if not meshes.backend_started():
        meshes.simulate_cpu_devices(devices)
    if jax.device_count() == devices:
        return dry_runs(configs, task, devices, hw, headroom)
    if isinstance(task, Task):
        raise ValueError(f"compiling layouts for {devices} devices on a backend that started with "
                         f"{jax.device_count()} runs in a subprocess, which must rebuild task {task.name!r}: pass its "
                         "'package.module:attribute' name instead of the Task object")
    root = import_root(task) if task is not None else None
    return call_with_devices(f"{__name__}:dry_runs", [configs, task, devices, hw, headroom], {}, devices, path=root)


def dry_runs(configs: list[Config], task: Task | str | None, devices: int, hw: Hardware,
             headroom: float) -> list[DryRunReport]:
    """One dry run per config, in this process (whose backend has ``devices`` devices)."""
    return [dry_run(c, task, devices=devices, hardware=hw, headroom=headroom) for c in configs]


def confirm_picks(cfg: Config, ranked: Sequence, k: int, devices: int, hw: Hardware, headroom: float,
                  task: Task | str | None) -> dict:
    """Compile ``ranked`` estimates' layouts in rank order, a batch at a time, until ``k`` fit or 3k were
    compiled: ``{"compiled": dry runs in rank order, "confirmed": the estimates whose dry run fits}``."""
    reports, confirmed, i = [], [], 0
    while len(confirmed) < k and i < len(ranked) and len(reports) < 3 * k:
        batch = ranked[i:i + min(k - len(confirmed), 3 * k - len(reports))]
        i += len(batch)
        for e, report in zip(batch, compile_layouts(cfg, [e.layout for e in batch], devices, hw, headroom=headroom,
                                                    task=task)):
            reports.append(report)
            if report.fits:
                confirmed.append(e)
    return {"compiled": tuple(reports), "confirmed": tuple(confirmed)}
