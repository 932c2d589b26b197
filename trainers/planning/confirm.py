"""Compile the planner's top picks (abstract state, as the dry run does) and keep those that fit.

    compile_layouts(cfg, layouts, devices=256, hardware="h100") -> [DryRunReport, ...]

Each layout's train step is compiled by :func:`trainers.planning.dryrun.dry_run` for ``devices``
devices: in this process when it has (or is set up to simulate) that many, else all of them in one fresh
process with that many simulated CPU devices (:mod:`trainers.planning.fresh_process`), where a
compile that aborts ends only that process (the picks are then compiled one per process). A
pick fits when its report does: for a GPU/TPU target the accelerator memory model on the compiled
shapes, for a CPU target the compiled program (:class:`trainers.planning.report.DryRunReport`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
from collections.abc import Sequence

import jax

import meshes
from trainers.config import Config
from trainers.planning.dryrun import dry_run
from trainers.planning.fresh_process import call_with_devices, check_simulated, decode, encode, import_root
from trainers.planning.hardware import Hardware, get_hardware
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
    if _here(devices):  # else a child: a compile that aborts ends only it
        return dry_runs(configs, task, devices, hw, headroom)
    if isinstance(task, Task):
        raise ValueError(f"compiling layouts for {devices} devices runs in a subprocess here (this process does "
                         f"not have that many), which must rebuild task {task.name!r}: pass its "
                         "'package.module:attribute' name instead of the Task object")
    root = import_root(task) if task is not None else None
    reports: list[DryRunReport] = []
    with tempfile.TemporaryDirectory() as tmp:
        while len(reports) < len(configs):  # a child that dies: keep what it finished, drop the config it died on
            todo, progress = configs[len(reports):], os.path.join(tmp, f"{len(reports)}.jsonl")
            try:
                return reports + call_with_devices(f"{__name__}:dry_runs", [todo, task, devices, hw, headroom],
                                                   {"progress": progress}, devices, path=root)
            except RuntimeError as e:
                reports += _finished(progress)
                reports.append(failed_report(configs[len(reports)], devices, hw, headroom, _crash_line(str(e))))
    return reports


def _here(devices: int) -> bool:
    """Whether this process has ``devices`` devices, or is set up to simulate that many when jax starts."""
    if meshes.backend_started():
        return jax.device_count() == devices
    counts = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return bool(counts) and int(counts[-1]) == devices and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"


def _finished(progress: str) -> list[DryRunReport]:
    """The reports a child wrote to ``progress`` before it died."""
    if not os.path.exists(progress):
        return []
    with open(progress) as f:
        return [decode(json.loads(line)) for line in f if line.strip()]


def dry_runs(configs: list[Config], task: Task | str | None, devices: int, hw: Hardware, headroom: float, *,
             progress: str | None = None) -> list[DryRunReport]:
    """One dry run per config, in this process (whose backend has ``devices`` devices); a config whose
    build or compile raises gets a report with the error's first line (:func:`failed_report`). With
    ``progress``, each report is also appended to that file as it is done (a JSON line)."""
    out = []
    for c in configs:
        try:
            out.append(dry_run(c, task, devices=devices, hardware=hw, headroom=headroom))
        except Exception as e:  # noqa: BLE001 - one failing candidate must not end the plan
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            out.append(failed_report(c, devices, hw, headroom, f"{type(e).__name__}: {first}".rstrip(": ")))
        if progress is not None:
            with open(progress, "a") as f:
                f.write(json.dumps(encode(out[-1])) + "\n")
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


def confirm_picks(cfg: Config, ranked: Sequence, k: int, devices: int, hw: Hardware, headroom: float,
                  task: Task | str | None) -> dict:
    """Compile ``ranked`` estimates' layouts in rank order, a batch at a time, until ``k`` fit or 3k were
    compiled: ``{"compiled": dry runs in rank order, "confirmed": the estimates whose dry run fits}``."""
    reports: list[DryRunReport] = []
    confirmed: list = []
    i = 0
    while len(confirmed) < k and i < len(ranked) and len(reports) < 3 * k:
        batch = ranked[i:i + min(k - len(confirmed), 3 * k - len(reports))]
        i += len(batch)
        for e, report in zip(batch, compile_layouts(cfg, [e.layout for e in batch], devices, hw, headroom=headroom,
                                                    task=task)):
            reports.append(report)
            if report.fits:
                confirmed.append(e)
    return {"compiled": tuple(reports), "confirmed": tuple(confirmed)}


def _crash_line(text: str) -> str:
    """Why a child died, from its error (a header line, then its stderr): XLA's failed check or fatal log
    line, else the last line it wrote, else the signal that killed it."""
    head, _, rest = text.partition("\n")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    fatal = [line for line in lines if "Check failed" in line or re.match(r"F\d{4} ", line)]
    if fatal or lines:
        return (fatal or lines)[0 if fatal else -1]
    code = re.search(r"\(exit (-?\d+)\)", head)
    if code and int(code.group(1)) < 0:
        return f"the compiling process was killed by {signal.Signals(-int(code.group(1))).name}, with no message"
    return head.rstrip(":")
