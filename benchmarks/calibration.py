"""Calibration: the planner's analytic estimate of published training runs against their figures.

Analytic only (no compile, no device): every run of ``trainers.planning.calibration.RUNS`` (torchtitan's
and MaxText's performance tables) is priced in its published layout by the model the planner ranks with
(``trainers.planning.costs.layout_costs``). Per run, one row each for

- **tokens/s per device**: the estimate against the published figure, goal within [0.8, 1.25];
- **memory per device**: the estimate against the device's HBM (the run did run), goal <= 1; the note
  says whether it also leaves the planner's default 10% headroom;
- **planner rank** (full mode only): the published layout's place among the planner's fitting
  candidates and its step over the best one, goal rank <= 5 or step within 10% of the best.

Runs, sources and the model's constants: docs/calibration.md.

    python -m benchmarks.calibration [--quick] [--output PATH]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks import common
from benchmarks.common import Row
from trainers.planning import calibration as cal

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


def run(options: common.Options, command: str = "python -m benchmarks.calibration") -> list[Row]:
    common.setup_devices(options.real_devices)  # the machine line alike across sections (nothing runs on them)
    started = common.load()
    rows: list[Row] = []
    for r in cal.RUNS:
        rows += run_rows(r, cal.estimate(r), None if options.quick else cal.rank(r))
        print(f"{r.name}: done", flush=True)
    before = ["Analytic (no compile): `trainers.planning.calibration`, recomputed by tests/test_calibration.py; runs, "
              "sources and the model's constants in docs/calibration.md."
              + (" Quick mode: no planner ranks." if options.quick else "")]
    common.report("calibration", "Calibration: planner estimates vs published training runs", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.calibration") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
