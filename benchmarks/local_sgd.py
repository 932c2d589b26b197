"""Local SGD / DiLoCo on the main job: eval loss and bytes sent over ``data`` against synchronous DP.

gpt-small (its model, data, AdamW, schedule, batches) on data=2 x fsdp=4 (8 simulated devices, two groups
of 4): DP, then local SGD with H = 10 and 50 with the default outer step (``auto``: plain model averaging
below H = 100) and with DiLoCo's Nesterov (lr 0.7, momentum 0.9), the same steps. Per run: eval losses, and
bytes per device over ``data`` (collectives whose axes include it, from the compiled HLO: DP's step x steps;
local SGD's run summary). H = 10 Nesterov also runs as 2 processes x 4 devices (``spmd-launch``). Goals: the
default at H = 10 within 1.05 x DP's eval loss, bytes <= 1.1 / H of DP's; the rest as measured. Writes benchmarks/local_sgd.json (the curves, for
notebook 09; ``--reuse`` trains only runs missing there). ``--quick``: the tiny shapes, 20 steps, no H = 50 or
Nesterov runs, no 2-process run, nothing written to local_sgd.json.

    python -m benchmarks.local_sgd [--quick] [--output PATH] [--steps N] [--reuse]
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common
from trainers.config import Config, override
from trainers.launch.local import launch
from trainers.local_sgd import data_bytes
from trainers.logger import read_metrics
from trainers.loop import train
from trainers.recipes import recipe
from trainers.setup import build

MESH = "data=2,fsdp=4"
JSON = Path(__file__).resolve().with_name("local_sgd.json")
REPO = Path(__file__).resolve().parent.parent
EVERY = (10, 50)


def base_args(steps: int, quick: bool) -> list[str]:
    """``spmd-train`` arguments of the main job on this benchmark's mesh (the tiny shapes when quick)."""
    return ["gpt-small", *(["--tiny"] if quick else []), "--mesh", MESH, "--steps", str(steps),
            "--set", f"run.eval_every={max(steps // 6, 1)}", "--set", "run.eval_batches=4", "--set", "run.log_every=10",
            "--set", "checkpoint.every_steps=100000", "--set", "run.progress=false", "--set", "run.tensorboard=false"]


def config(steps: int, quick: bool, run_dir: str, every: int) -> Config:
    cfg = recipe("gpt-small", tiny=quick)
    return override(cfg, [f"mesh.axes={MESH}", f"run.steps={steps}", f"run.eval_every={max(steps // 6, 1)}",
                          "run.eval_batches=4", "run.log_every=10", "checkpoint.every_steps=100000",
                          "run.progress=false", "run.tensorboard=false", f"run.run_dir={run_dir}",
                          f"local_sgd.every={every}", "lr.warmup_steps=" + str(min(cfg.lr.warmup_steps, steps // 10 or 1))])


def dp_bytes_per_step(cfg: Config) -> int:
    """Bytes per device the ordinary train step sends over ``data`` (its compiled HLO; one compile)."""
    run = build(override(cfg, ["local_sgd.every=0"]), abstract=True)  # the ordinary (data-parallel) step
    mesh, step, batch = run.mesh, run.train_step, run.abstract_batch()
    return data_bytes(step.lower(run.stepped.abstract, batch).compile(), mesh)


def curve(run_dir: str, per_step: int = 0) -> list[tuple[int, float, float]]:
    """``(step, eval loss, cumulative bytes over data)`` at every eval of a run (DP: ``per_step`` x steps)."""
    records = read_metrics(run_dir)
    sent = {r["step"]: r["data_bytes"] for r in records if r["split"] == "train" and "data_bytes" in r}
    out = []
    for r in records:
        if r["split"] == "eval":
            s = r["step"]
            out.append((s, r["loss"], float(per_step * s) if per_step else sent.get(s, float("nan"))))
    return out


def two_processes(args: list[str], run_dir: str) -> tuple[int, str, float]:
    """H = 10 as 2 processes x 4 devices (``spmd-launch``): exit code, output tail, seconds."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out, t0 = io.StringIO(), time.perf_counter()
    sets = [a for s in NESTEROV for a in ("--set", s)]
    code = launch([sys.executable, "-m", "trainers", *args, "--set", "local_sgd.every=10", *sets, "--run-dir", run_dir],
                  processes=2, devices_per_process=4, env=env, out=out)
    return code, out.getvalue()[-3000:], time.perf_counter() - t0


NESTEROV = ("local_sgd.outer_optimizer=nesterov",)  # DiLoCo's outer step: lr 0.7, momentum 0.9
# name -> (H, extra overrides): DP, the default config at H = 10 and 50 (auto: plain model averaging below
# H = 100), and DiLoCo's Nesterov at H = 10 and 50 (the default before it depended on H)
RUNS: dict[str, tuple[int, tuple[str, ...]]] = {
    "dp": (0, ()), "H=10": (10, ()), "H=50": (50, ()), "H=10 nesterov": (10, NESTEROV), "H=50 nesterov": (50, NESTEROV),
    "H=10 bf16": (10, ("local_sgd.outer_dtype=bfloat16",)), "H=10 int8": (10, ("local_sgd.outer_dtype=int8",)),
}


def outer_of(cfg: Config) -> str:
    """The outer optimizer a run's config resolves to ("" for DP): what a reused run must match."""
    return cfg.local_sgd.describe() if cfg.local_sgd.enabled else ""


def measure(name: str, steps: int, quick: bool, root: str) -> dict[str, Any]:
    """Train one of :data:`RUNS` and measure it."""
    every, sets = RUNS[name]
    cfg = override(config(steps, quick, os.path.join(root, name.replace(" ", "_")), every), sets)
    t0 = time.perf_counter()
    result = train(cfg)
    per_step = dp_bytes_per_step(cfg) if every == 0 else 0
    total = per_step * steps if every == 0 else result.summary["data_bytes"]
    out = {"every": every, "sets": list(sets), "outer": outer_of(cfg), "steps": steps, "eval_loss": result.eval_losses[steps],
           "data_bytes": total, "seconds": time.perf_counter() - t0, "curve": curve(cfg.run.directory, per_step),
           "data_bytes_outer": result.summary.get("data_bytes_outer", 0.0), "dp_bytes_per_step": per_step}
    print(f"{name}: eval loss {out['eval_loss']:.4f}, {common.fmt_bytes(total)} over data, {out['seconds']:.0f} s",
          flush=True)
    return out


def run(options: common.Options, command: str, steps: int | None = None, reuse: bool = False) -> None:
    """``reuse``: take runs with the same settings from benchmarks/local_sgd.json instead of training them."""
    common.setup_devices(options.real_devices)
    started = common.load()
    steps = steps or (20 if options.quick else 300)
    root = tempfile.mkdtemp(prefix="local_sgd-")
    stored = json.loads(JSON.read_text()) if reuse and JSON.exists() and not options.quick else {"runs": {}}
    saved = stored["runs"]
    results: dict[str, Any] = {}
    reused: list[str] = []
    # quick (the test suite's smoke run): H = 50 runs the H = 10 runs' code with other numbers, and so does
    # Nesterov with another outer optimizer (its step: tests/trainers/test_local_sgd.py)
    runs = {name: spec for name, spec in RUNS.items()
            if not (options.quick and (spec[0] == 50 or spec[1] == NESTEROV))}
    for name, (every, sets) in runs.items():
        old = saved.get(name, {})
        outer = outer_of(override(config(steps, options.quick, root, every), sets))
        if (old.get("steps", stored.get("steps")) == steps and old.get("every") == every
                and old.get("sets", []) == list(sets) and old.get("outer", "") == outer):
            results[name] = old
            reused.append(name)
            print(f"{name}: reused from {JSON.name}", flush=True)
        else:
            results[name] = measure(name, steps, options.quick, root)
        if not options.quick:  # written as it goes: a later --reuse run trains only what is missing
            JSON.write_text(json.dumps({"steps": steps, "mesh": MESH, "runs": {**saved, **results}}, indent=1) + "\n")
    dp = results["dp"]
    if "dp" in reused:  # bytes come from the compiled step (one compile): counted as this code counts them
        dp_cfg = override(config(steps, options.quick, root, 0), ())
        dp = results["dp"] = {**dp, "dp_bytes_per_step": dp_bytes_per_step(dp_cfg)}
        dp["data_bytes"] = dp["dp_bytes_per_step"] * steps
    rows = []
    for name, r in results.items():
        if name == "dp":
            continue
        every = r["every"]
        main = every == 10 and not r.get("sets")  # the goal: the default config at H = 10 within 5 %
        ratio = r["eval_loss"] / dp["eval_loss"]
        outer = f"outer {r['outer']}" + (f" ({', '.join(r['sets'])})" if r.get("sets") else "")
        rows.append(common.Row(f"{name} eval loss after {steps} steps", f"{r['eval_loss']:.4f}",
                               f"DP {dp['eval_loss']:.4f}", ratio, "<= 1.05" if main else "reported",
                               ratio <= 1.05 if main else None, f"{outer}; {r['seconds']:.0f} s vs DP {dp['seconds']:.0f} s"))
        ratio = r["data_bytes"] / dp["data_bytes"]
        rows.append(common.Row(f"{name} bytes over data per device, {steps} steps", common.fmt_bytes(r["data_bytes"]),
                               f"DP {common.fmt_bytes(dp['data_bytes'])}", ratio, f"<= {1.1 / every:.3f} (1.1/H)",
                               ratio <= 1.1 / every, f"outer step {common.fmt_bytes(r['data_bytes_outer'])}; "
                               f"DP step {common.fmt_bytes(dp['dp_bytes_per_step'])}"))
    f32 = results.get("H=10")
    for name, share in (("H=10 bf16", 0.5), ("H=10 int8", 0.25)):
        r = results.get(name)
        if r is None or f32 is None:
            continue
        ratio = r["data_bytes_outer"] / f32["data_bytes_outer"]
        rows.append(common.Row(f"{name}: outer step bytes over data vs float32", common.fmt_bytes(r["data_bytes_outer"]),
                               f"H=10 {common.fmt_bytes(f32['data_bytes_outer'])}", ratio, f"<= {share * 1.05:.3f}",
                               ratio <= share * 1.05, "all-to-all + all-gather of the encoded pseudo-gradient chunks "
                               "(int8: and one f32 scale per chunk) vs one f32 all-reduce of the params; wire bytes"))
        ratio = r["eval_loss"] / f32["eval_loss"]
        rows.append(common.Row(f"{name}: eval loss after {steps} steps vs float32", f"{r['eval_loss']:.4f}",
                               f"H=10 {f32['eval_loss']:.4f}", ratio, "reported", None,
                               "pseudo-gradients rounded once per outer step each way, summed in f32; no error feedback"))
    after = []
    if not options.quick:
        one = results["H=10 nesterov"]["eval_loss"]  # DiLoCo's outer step: its state crosses processes too
        two = saved.get("H=10 2 processes") if saved.get("H=10 2 processes", {}).get("one") == one else None
        if two is None:
            code, tail, seconds = two_processes(base_args(steps, False), os.path.join(root, "H=10-2proc"))
            if code == 0:
                two = {"one": one, "seconds": seconds, "curve": curve(os.path.join(root, "H=10-2proc"))}
                JSON.write_text(json.dumps({"steps": steps, "mesh": MESH, "runs": {**results, "H=10 2 processes": two}},
                                           indent=1) + "\n")
            else:
                after.append(f"2-process run failed (exit {code}):\n```\n{tail}\n```")
        if two is not None:
            ones, twos = ({s: l for s, l, _ in run["curve"]} for run in (results["H=10 nesterov"], two))
            early = [s for s in ones if s <= 100 and s in twos]
            diff = max(abs(twos[s] / ones[s] - 1) for s in early)
            reused += ["H=10 2 processes"] if "H=10 2 processes" in saved and two is saved["H=10 2 processes"] else []
            rows.append(common.Row(f"H=10 nesterov, 2 processes x 4 devices (spmd-launch): eval loss at steps {early}",
                                   f"max rel. diff {diff:.1e}", "1 process", math.nan, "<= 1e-5", diff <= 1e-5,
                                   "one replica group per process"))
            rows.append(common.Row(f"H=10 nesterov, 2 processes: eval loss after {steps} steps", f"{twos[steps]:.4f}",
                                   f"1 process {one:.4f}", twos[steps] / one, "reported", None,
                                   f"float-order differences grow after ~100 steps; {two['seconds']:.0f} s"))
    if reused:
        after.append(f"Runs {', '.join(reused)}: taken from benchmarks/local_sgd.json (--reuse), trained by an earlier "
                     "run of this benchmark with the same settings; their seconds are that run's.")
    after.append("Bytes are per device as an accelerator runs the programs (spmd.hlo.collectives), every collective "
                 "whose axes include data, at ring wire bytes (an all-reduce 2 (g-1)/g of its buffer, the others "
                 "(g-1)/g); eval is not counted in any mode. DiLoCo's outer Nesterov (lr 0.7, momentum "
                 "0.9) amplifies the mean H-step update about lr / (1 - momentum) = 7-fold once its momentum builds up; "
                 "the default (local_sgd.outer_optimizer=auto) therefore averages the groups' params below H = 100 "
                 "and takes DiLoCo's Nesterov, chosen for H in the hundreds, from H = 100 on.")
    common.report("local_sgd", "Local SGD / DiLoCo: eval loss and bytes over data against synchronous DP", rows,
                  options, command, after=after, started_load=started)


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.local_sgd") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    steps, reuse = None, "--reuse" in argv
    argv = [a for a in argv if a != "--reuse"]
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    return common.run_main(lambda options, cmd: run(options, cmd, steps, reuse), __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
