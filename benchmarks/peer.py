"""Peer: this code's gpt-small training step against MaxText's on the same model, layout and devices.

Runs when ``SPMD_MAXTEXT_VENV`` names a MaxText venv made by the peer harness's ``setup.sh`` (its
``mt_run.py`` is looked up beside the venv, or in ``SPMD_MAXTEXT_HARNESS``); otherwise its one row
says "skipped: no MaxText environment". Each round runs fresh processes one at a time, order
alternating: this checkout (``spmd-train gpt-small``, the default stack, then ``model.scan_layers=
scanned``) and MaxText (layers unrolled, no remat), 8 simulated CPU devices, on fsdp=8 and
data=2 x fsdp=2 x tensor=2. Per run: median CPU seconds and wall time per step after 5 warm-up steps,
time to first step, peak RSS. Rows: medians of per-round ratios (IQR in the note). Goals: CPU per
step <= 0.7 x MaxText with the default stack, <= 0.9 x scanned; peak RSS <= 1.0 x (``SPMD_PEER_ROUNDS``: rounds, default 8).

    SPMD_MAXTEXT_VENV=/path/mtvenv python -m benchmarks.peer [--quick] [--output PATH]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common
from benchmarks.common import Row

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"fsdp8": ("fsdp=8", "fsdp"), "d2f2t2": ("data=2,fsdp=2,tensor=2", "fsdp_tp")}
GOALS = {"default": 0.7, "scanned": 0.9, "rss": 1.0}
WARM = 5
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
       "JAX_ENABLE_COMPILATION_CACHE": "false"}
# This checkout's side: the same stamps as the harness's mt_run.py (after each step is dispatched).
CHILD = f"""
import json, os, sys, time
t_launch = float(os.environ["T_LAUNCH"])
layout, steps, out, run_dir, extra = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
import meshes
meshes.simulate_cpu_devices(8)
from trainers import override, recipe, train
mesh, rules = {repr(LAYOUTS)}[layout]
cfg = override(recipe("gpt-small"), [f"mesh.axes={{mesh}}", f"rules={{rules}}", f"run.steps={{steps}}",
    "run.eval_every=1000000", "run.eval_batches=0", "run.log_every=1", "run.progress=false", "run.tensorboard=false",
    "checkpoint.every_steps=1000000", "data.corpus=synthetic", f"run.run_dir={{run_dir}}", "lr.warmup_steps=1", *extra])
stamps, done = [], {{}}
def vm(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
def step_hook(step):
    stamps.append((step, time.perf_counter(), time.process_time()))
    if step == steps:
        done["hwm_last_step"] = vm("VmHWM")
def batch_hook(index, batch):
    if stamps and "t_first_step_done" not in done:
        done["t_first_step_done"] = time.time()
    return batch
train(cfg, step_hook=step_hook, batch_hook=batch_hook)
json.dump({{"t_launch": t_launch, "stamps": stamps, **done}}, open(out, "w"))
"""


def metrics(d: dict) -> dict[str, float]:
    """Per-step medians after :data:`WARM` steps, time to first step and peak RSS of one run's JSON."""
    pairs = [(a, b) for a, b in zip(d["stamps"], d["stamps"][1:]) if a[0] >= WARM]
    return {"cpu": statistics.median(b[2] - a[2] for a, b in pairs),
            "wall": statistics.median(b[1] - a[1] for a, b in pairs),
            "first": d["t_first_step_done"] - d["t_launch"], "rss": d["hwm_last_step"]}


def one_run(system: str, layout: str, steps: int, work: Path, venv: Path, harness: Path) -> dict[str, float]:
    out = work / f"{system}_{layout}_{time.monotonic_ns()}.json"
    run_dir = work / out.stem
    env = {**os.environ, **ENV, "T_LAUNCH": repr(time.time())}
    if system == "maxtext":
        cmd = [str(venv / "bin" / "python"), str(harness / "mt_run.py"), layout, str(steps), str(out), str(run_dir),
               "scan_noremat"]
        env["DECOUPLE_GCLOUD"] = "TRUE"
    else:
        extra = ["model.scan_layers=scanned"] if system == "scanned" else []
        cmd = [sys.executable, "-c", CHILD, layout, str(steps), str(out), str(run_dir), *extra]
        env["PYTHONPATH"] = str(REPO)
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=env, cwd=run_dir, capture_output=True, text=True, timeout=1800)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"{system} on {layout} failed (exit {proc.returncode}): {proc.stderr[-500:]}")
    return metrics(json.loads(out.read_text()))


def ratio_row(what: str, ours: list[dict], theirs: list[dict], key: str, goal: float | None, label: str) -> Row:
    ratios = [a[key] / b[key] for a, b in zip(ours, theirs)]
    med = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    scale, unit = (1e3, "ms") if key in ("cpu", "wall") else (1.0, "s") if key == "first" else (2**-20, "MiB")
    mine, peer = statistics.median(r[key] for r in ours) * scale, statistics.median(r[key] for r in theirs) * scale
    return Row(what, f"{mine:.1f} {unit} ({label})", f"{peer:.1f} {unit} MaxText", med,
               f"<= {goal}" if goal else "reported", med <= goal if goal else None,
               f"median of {len(ratios)} per-round ratios, IQR {q[0]:.2f}-{q[2]:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")


def run(options: common.Options, command: str = "python -m benchmarks.peer") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    venv = Path(os.environ.get("SPMD_MAXTEXT_VENV", "") or "/nonexistent")
    harness = Path(os.environ.get("SPMD_MAXTEXT_HARNESS", "") or venv.parent)
    if not (venv / "bin" / "python").exists() or not (harness / "mt_run.py").exists():
        rows = [Row("spmd / MaxText: CPU seconds per step", "-", "-", float("nan"), f"<= {GOALS['default']}", None,
                    "skipped: no MaxText environment (set SPMD_MAXTEXT_VENV to the harness's MaxText venv)")]
        common.report("peer", "Peer: spmd vs MaxText, same model and layout", rows, options, command, started_load=started)
        return rows
    rounds, steps = (1, WARM + 4) if options.quick else (int(os.environ.get("SPMD_PEER_ROUNDS", "8")), 41)
    layouts = list(LAYOUTS)[:1] if options.quick else list(LAYOUTS)
    systems = ("default", "scanned", "maxtext")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="spmd-peer-") as tmp:
        for layout in layouts:
            got: dict[str, list[dict]] = {s: [] for s in systems}
            for r in range(rounds):
                for s in systems if r % 2 == 0 else systems[::-1]:
                    got[s].append(one_run(s, layout, steps, Path(tmp), venv, harness))
                print(f"{layout} round {r}: " + ", ".join(f"{s} {got[s][-1]['cpu'] * 1e3:.1f} ms CPU" for s in systems),
                      flush=True)
            for form in ("default", "scanned"):
                rows.append(ratio_row(f"{layout}: CPU seconds per step, {form} stack / MaxText", got[form],
                                      got["maxtext"], "cpu", GOALS[form], form))
            for key, what in (("wall", "step wall time"), ("first", "time to first step"), ("rss", "peak RSS")):
                rows.append(ratio_row(f"{layout}: {what}, default stack / MaxText", got["default"], got["maxtext"],
                                      key, GOALS.get(key), "default"))
    before = [f"- gpt-small (d_model 128, 4 layers, f32, AdamW, remat none: the scanned stack's backward loop redoes the "
              "elementwise ops, no matmul or collective: spmd.remat.wrap), global batch 16 x 128, synthetic data, "
              f"{steps}-step fresh processes, {rounds} interleaved rounds; MaxText 0.2.5 scan_layers=false, "
              f"remat_policy=none from {venv}; this checkout with {sys.executable}. The machine is shared: ratios "
              "come from runs one at a time, order alternating."]
    common.report("peer", "Peer: spmd vs MaxText, same model and layout", rows, options, command, before=before,
                  started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.peer") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
