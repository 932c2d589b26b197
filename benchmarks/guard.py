"""Guard: what checking each proposed update costs the train step, and how fast an absurd dry run is refused.

The train step of ``trainers.build`` on the fsdp_tp layout (data 2 x fsdp 2 x
tensor 2, the gpt-small shape; a tiny GPT with ``--quick``), with a guard window, compiled twice:
with the update checks off and on (``max_update_ratio=1``, ``max_param_growth=10``: one more
fused pass over gradients, moments and params, three norms). Rows: the step's temporaries
(compiled memory analysis, per device) and its time (interleaved rounds, medians). Goals: the
same temporaries (<= 1.01 x), step time <= 1.05 x.

Also ``spmd-train gpt-small --tiny --dry-run --devices 100000`` in a fresh process: its wall time and
peak RSS (goals < 30 s, < 2 GiB; before the refusal it ran 6 minutes past 10 GB).

    python -m benchmarks.guard [--quick] [--output PATH]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

from benchmarks import common
from benchmarks.common import Row

TEMP_GOAL, TIME_GOAL, DRY_S_GOAL, DRY_GIB_GOAL = 1.01, 1.05, 30.0, 2.0
# The command's peak RSS, read by a small parent: a child forked from this process would count its pages.
MEASURE = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)")


def run(options: common.Options, command: str = "python -m benchmarks.guard") -> list[Row]:
    from trainers.setup import build

    common.setup_devices(options.real_devices)
    started = common.load()
    cfg, batch, length = common.gpt_config(options.quick)
    rounds, steps = (2, 2) if options.quick else (7, 5)
    layout = "fsdp_tp" if len(jax.devices()) >= 8 else "single"
    mesh = common.layout_mesh(layout)
    rules = common.LAYOUTS[layout][1] if layout != "single" else "none"
    setups, data = {}, None
    for name, limits in (("off", []), ("on", ["run.max_update_ratio=1.0", "run.max_param_growth=10.0"])):
        # the run's own step (clipping, AdamW, the guard's window and spike check), without / with the update check
        run = build(common.run_config(cfg, rules, batch, length, "run.spike_factor=10.0", "run.spike_window=32",
                                        *limits), mesh=mesh)
        data = data or common.make_batch(cfg.vocab_size, batch, length, run.batch_sharding)
        step, state = run.train_step, run.stepped.state
        temp = step.lower(state, data).compile().memory_analysis().temp_size_in_bytes
        setups[name] = {"step": step, "state": step(state, data)[0], "temp": temp}

    def timed_round(name: str):
        def one() -> float:
            s = setups[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                s["state"], metrics = s["step"](s["state"], data)
            jax.block_until_ready(metrics)
            return (time.perf_counter() - t0) / steps
        return one

    times = common.interleaved(rounds, {n: timed_round(n) for n in setups})
    off_s, on_s = statistics.median(times["off"]), statistics.median(times["on"])
    off_t, on_t = setups["off"]["temp"], setups["on"]["temp"]

    cmd = [sys.executable, "-m", "trainers.launch.cli", "gpt-small", "--tiny", "--dry-run", "--devices", "100000",
           "--mesh", "data=-1"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, timeout=600)
    dry_s = time.perf_counter() - t0
    dry_gib = int(proc.stderr.strip().splitlines()[-1]) / 2**20  # KiB
    refused = proc.returncode == 2 and "--no-compile" in proc.stderr
    rows = [
        Row("update check: step temporaries per device", common.fmt_bytes(on_t), f"{common.fmt_bytes(off_t)} without",
            on_t / max(off_t, 1), f"<= {TEMP_GOAL}", on_t <= TEMP_GOAL * off_t, "the proposed update is fused into reductions"),
        Row("update check: step time", f"{on_s * 1e3:.2f} ms", f"{off_s * 1e3:.2f} ms without", on_s / off_s,
            f"<= {TIME_GOAL}", on_s <= TIME_GOAL * off_s, f"medians of {rounds} interleaved rounds x {steps} steps"),
        Row("dry run of 100,000 devices: answer", f"{dry_s:.1f} s, {dry_gib:.2f} GiB peak RSS",
            f"{DRY_S_GOAL:.0f} s, {DRY_GIB_GOAL:.0f} GiB", dry_s / DRY_S_GOAL, "< 1 (both)",
            refused and dry_s < DRY_S_GOAL and dry_gib < DRY_GIB_GOAL,
            "refused (exit 2), pointing at spmd-plan --no-compile" if refused else f"exit {proc.returncode}"),
    ]
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, vocab={cfg.vocab_size}, f32; batch {batch} x "
              f"{length}; AdamW with clipping; layout {layout} on {len(jax.devices())} {jax.devices()[0].platform} device(s)"]
    common.report("guard", "Guard: the update check's cost, an absurd dry run's refusal", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.guard") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
