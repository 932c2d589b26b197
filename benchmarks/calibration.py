"""Calibration: the planner's analytic estimate of published training runs against their figures.

Analytic only (no compile, no device): every run of ``trainers.planning.calibration.RUNS`` (torchtitan's
and MaxText's performance tables) is priced in its published layout by the model the planner ranks with
(``trainers.planning.costs.layout_costs``). Per run, one row each for

- **tokens/s per device**: the estimate against the published figure, goal within [0.8, 1.25];
- **memory per device**: the estimate against the device's HBM (the run did run), goal <= 1; the note
  says whether it also leaves the planner's default 10% headroom;
- **planner rank** (full mode only): the published layout's place among the planner's fitting
  candidates and its step over the best one, goal rank <= 5 or step within 10% of the best;
- **held-out tokens/s**: the ratio with the compute-efficiency scale refitted without the run's source.

Full mode adds the planner's repros: a pipe x tensor dry run's tensor all-reduces against the analytic
count, the 8B run's pick, and ``spmd-plan`` over 256 devices (wall time, peak RSS).

Runs, sources and the model's constants: docs/calibration.md.

    python -m benchmarks.calibration [--quick] [--output PATH]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks import common
from benchmarks.common import Row
from trainers import override, recipe
from trainers.planning import calibration as cal
from trainers.planning import holdout
from trainers.planning.costs import layout_costs
from trainers.planning.dryrun import dry_run
from trainers.planning.hardware import get_hardware
from trainers.planning.planner import plan

RANK_GOAL = (5, 1.10)  # within the planner's top 5, or within 10% of its best step


def run_rows(run: cal.PublishedRun, point: cal.Point, ranked: tuple[int, float] | None) -> list[Row]:
    """The rows of one published run."""
    lo, hi = cal.RATIO_BOUNDS
    layout = ",".join(f"{a}={n}" for a, n in run.mesh) + f" {run.rules} remat={run.remat}" + (f" accum={run.grad_accum}" if run.grad_accum > 1 else "")
    fig = f"{run.published:g} TFLOP/s/chip" if run.tflops else f"{run.published:g} tokens/s/device"
    mem = point.costs.memory.total
    rows = [
        Row(f"{run.name}: tokens/s/device", f"{point.tokens_per_device:,.0f}",
            f"published {run.tokens_per_device:,.0f} ({fig})", point.ratio, f"[{lo}, {hi}]",
            lo <= point.ratio <= hi, f"{run.devices} {run.hardware}, {layout}, batch {run.batch_per_device}/device"),
        Row(f"{run.name}: memory per device", f"{mem / 1e9:.1f} GB",
            f"budget {point.budget / 1e9:.1f} GB ({point.budget / point.hbm:.0%} of HBM {point.hbm / 1e9:.1f} GB)",
            mem / point.budget, "<= 1", point.fits, "the planner's default budget for this hardware"),
    ]
    if ranked is not None:
        k, rel = ranked
        rows.append(Row(f"{run.name}: planner rank", str(k + 1), "best estimate", rel,
                        f"rank <= {RANK_GOAL[0]} or <= {RANK_GOAL[1]:.2f}", k + 1 <= RANK_GOAL[0] or rel <= RANK_GOAL[1],
                        "step of the published layout / best plan step"))
    return rows


def holdout_rows() -> list[Row]:
    """Per run: the tokens/s ratio with the efficiency scale refitted without its source (trainers.planning.holdout)."""
    lo, hi = cal.RATIO_BOUNDS
    return [Row(f"{h.run.name}: held-out tokens/s ratio", f"{h.held_out:.2f}", f"fitted {h.fitted:.2f}", h.held_out,
                f"[{lo}, {hi}]", lo <= h.held_out <= hi,
                f"{h.source} left out: scale {h.held_out_scale:.2f} (all sources {h.fitted_scale:.2f})")
            for h in holdout.leave_one_source_out()]


def repro_rows() -> list[Row]:
    """The planner's repros: a pipe x tensor dry run's tensor all-reduces against the analytic count, the
    8B run's pick (selective remat at most the published step), and spmd-plan over 256 devices."""
    cfg = override(recipe("gpt-125m"), ["mesh.axes=pipe=2,tensor=4", "rules=tp", "model.remat=false",
                                        "pipeline.schedule=1f1b", "pipeline.microbatches=4", "data.global_batch=8"])
    report = dry_run(cfg, devices=8, hardware="a100")
    (got,) = [x for x in report.traffic if x.kind == "all-reduce" and x.axes == ("tensor",)]
    (want,) = [x for x in report.analytic_traffic if x.kind == "all-reduce" and x.axes == ("tensor",)]
    step = layout_costs(cfg, cfg.mesh.sizes(8), get_hardware("a100")).roofline.step_s
    rows = [Row("gpt-125m pipe=2,tensor=4 1f1b M=4: dry-run tensor all-reduce time", f"{got.seconds * 1e3:.2f} ms",
                f"analytic {want.seconds * 1e3:.2f} ms", got.seconds / want.seconds, "[0.9, 1.1]",
                0.9 <= got.seconds / want.seconds <= 1.1, f"{got.count} ops, {got.bytes / 2**20:.0f} MiB vs {want.count}, "
                f"{want.bytes / 2**20:.0f} MiB; before: every branch on every tick, 23.2 ms (514 ops)"),
            Row("gpt-125m pipe=2,tensor=4 1f1b M=4: dry-run step", f"{report.roofline.step_s * 1e3:.2f} ms",
                f"analytic {step * 1e3:.2f} ms", report.roofline.step_s / step, "[0.9, 1.1]",
                0.9 <= report.roofline.step_s / step <= 1.1, "before: 36.2 ms against an analytic 16.2 ms")]
    run = next(r for r in cal.RUNS if r.name == "llama3-8b fsdp8 h100")
    c = run.config()
    published = c.data.global_batch * c.data.seq_len / run.devices / run.tokens_per_device
    best = plan(c, run.devices, run.hardware, nearest=0).best
    rows.append(Row("llama3-8b on 8 h100-96gb: the planner's pick", f"{best.roofline.step_s:.2f} s", f"published "
                    f"{published:.2f} s", best.roofline.step_s / published, "<= 1, selective remat",
                    best.roofline.step_s <= published and best.layout.remat in ("save_dots", "save_all_but_gathered"),
                    f"{best.layout}; remat on/off only: full remat at 2.61 s"))
    argv = [sys.executable, "-m", "trainers.launch.plan", "gpt-350m", "--devices", "256", "--hardware", "h100",
            "--set", "data.global_batch=512"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest process's peak (KiB on Linux)
    picks = "compiled 3 picks" if done.returncode == 0 else f"exit {done.returncode}"
    rows += [Row("spmd-plan gpt-350m --devices 256: wall time", f"{wall:.1f} s", "60 s", wall / 60, "< 1", wall < 60,
                 f"{picks}; shared 2-core machine (load {common.load()})"),
             Row("spmd-plan gpt-350m --devices 256: peak RSS", f"{rss / 1e9:.2f} GB", "1 GB", rss / 1e9, "< 1",
                 rss < 1e9, "largest of the planner and its compile process")]
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.calibration") -> list[Row]:
    common.setup_devices(options.real_devices)  # the machine line alike across sections (nothing runs on them)
    started = common.load()
    rows: list[Row] = []
    for r in cal.RUNS:
        rows += run_rows(r, cal.estimate(r), None if options.quick else cal.rank(r))
        print(f"{r.name}: done", flush=True)
    rows += holdout_rows()
    if not options.quick:
        rows += repro_rows()
    before = ["Analytic (no compile): `trainers.planning.calibration`, recomputed by tests/planning/test_calibration.py; runs, "
              "sources and the model's constants in docs/calibration.md. Held out: the compute-efficiency scale "
              "refitted without the run's source (`trainers.planning.holdout`)."
              + (" Quick mode: no planner ranks, no repros." if options.quick else "")]
    common.report("calibration", "Calibration: planner estimates vs published training runs", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.calibration") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
