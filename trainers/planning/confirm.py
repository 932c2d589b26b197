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
    headroom = hw.headroom if headroom is None else headroom
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
    try:
        return call_with_devices(f"{__name__}:dry_runs", [configs, task, devices, hw, headroom], {}, devices, path=root)
    except RuntimeError as e:  # the child itself died (a crash, not an exception): one child per config
        if len(configs) == 1:
            return [failed_report(configs[0], devices, hw, headroom, _last_line(str(e)))]
    return [r for c in configs for r in compile_layouts(c, [_Fixed()], devices, hw, headroom=headroom, task=task)]


class _Fixed:
    """A layout that leaves a config as it is (:func:`compile_layouts` of one config)."""

    def apply(self, cfg: Config) -> Config:
        return cfg


def dry_runs(configs: list[Config], task: Task | str | None, devices: int, hw: Hardware,
             headroom: float) -> list[DryRunReport]:
    """One dry run per config, in this process (whose backend has ``devices`` devices); a config whose
    build or compile raises gets a report with the error's first line (:func:`failed_report`)."""
    out = []
    for c in configs:
        try:
            out.append(dry_run(c, task, devices=devices, hardware=hw, headroom=headroom))
        except Exception as e:  # noqa: BLE001 - one failing candidate must not end the plan
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            out.append(failed_report(c, devices, hw, headroom, f"{type(e).__name__}: {first}".rstrip(": ")))
    return out


def failed_report(cfg: Config, devices: int, hw: Hardware, headroom: float, error: str) -> DryRunReport:
    """The report of a dry run that raised: nothing compiled (it never fits), ``error`` says why."""
    try:
        mesh = tuple(cfg.mesh.sizes(devices).items())
    except ValueError:
        mesh = ()
    return DryRunReport(name=cfg.run.name, devices=devices, mesh=mesh, dcn_axes=(), rules=cfg.rules, hardware=hw,
                        headroom=headroom, params=0, model_flops=0.0, analytic=None, compiled=None, state_bytes=0,
                        batch_bytes=0, error=error)


def _last_line(text: str) -> str:
    """The last non-empty line of a child's error output (a crash's message)."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), text)


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
