"""Local SGD / DiLoCo on the main job: eval loss and bytes sent over ``data`` against synchronous DP.

gpt-small (the README's main job: its model, data, AdamW, schedule and batches) on data=2 x fsdp=4 (8
simulated devices, two replica groups of 4): synchronous data parallelism, then local SGD with H = 10 and
H = 50 (DiLoCo's outer Nesterov: lr 0.7, momentum 0.9), the same number of steps. Per run: the eval loss
over the run and at its end, and the bytes per device sent over ``data`` (every collective whose axes
include it, from the compiled programs' HLO: DP's train step times the steps; local SGD's run summary,
which counts its inner steps (none), outer steps and the few metric scalars fetched at log steps).
H = 10 also runs as 2 processes x 4 devices with ``spmd-launch`` (one replica group per process) against
its 1-process run. Goals: H = 10 eval loss <= 1.05 x DP's and bytes over data <= 1.1 / H of DP's; H = 50
as measured. The full run writes benchmarks/local_sgd.json (the curves; notebooks/09_local_sgd.ipynb).

    python -m benchmarks.local_sgd [--quick] [--output PATH] [--steps N]
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import spmd
from benchmarks import common
from trainers.config import Config, override
from trainers.launch.local import launch
from trainers.local_sgd import data_bytes
from trainers.logger import read_metrics
from trainers.loop import train
from trainers.lr import make_lr_schedule
from trainers.optim import make_optimizer
from trainers.recipes import recipe
from trainers.state import create_state
from trainers.step import make_train_step
from trainers.task import lm_task

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
    mesh, rules, task = cfg.mesh.build(), spmd.get_rules(cfg.rules), lm_task(cfg)
    tx = make_optimizer(cfg.optimizer, make_lr_schedule(cfg.lr, cfg.run.steps))
    sharded = create_state(lambda: task.model(nnx.Rngs(0)), tx, rules, mesh, abstract=True)
    bs = spmd.batch_sharding(rules, mesh, dims=("batch",))
    step = make_train_step(sharded, tx, rules, mesh, bs, loss_fn=task.loss, donate=False)
    shape = (cfg.data.global_batch, cfg.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bs) for k in ("inputs", "targets")}
    return data_bytes(step.lower(sharded.abstract, batch).compile(), mesh)


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
    code = launch([sys.executable, "-m", "trainers", *args, "--set", "local_sgd.every=10", "--run-dir", run_dir],
                  processes=2, devices_per_process=4, env=env, out=out)
    return code, out.getvalue()[-3000:], time.perf_counter() - t0


def run(options: common.Options, command: str, steps: int | None = None) -> None:
    common.setup_devices(options.real_devices)
    started = common.load()
    steps = steps or (30 if options.quick else 300)
    root = tempfile.mkdtemp(prefix="local_sgd-")
    results: dict[str, Any] = {}
    for every in (0, *EVERY):
        name = "dp" if every == 0 else f"H={every}"
        cfg = config(steps, options.quick, os.path.join(root, name), every)
        t0 = time.perf_counter()
        result = train(cfg)
        per_step = dp_bytes_per_step(cfg) if every == 0 else 0
        total = per_step * steps if every == 0 else result.summary["data_bytes"]
        results[name] = {"every": every, "eval_loss": result.eval_losses[steps], "data_bytes": total,
                         "seconds": time.perf_counter() - t0, "curve": curve(cfg.run.directory, per_step),
                         "data_bytes_outer": result.summary.get("data_bytes_outer", 0.0), "dp_bytes_per_step": per_step}
        print(f"{name}: eval loss {results[name]['eval_loss']:.4f}, {common.fmt_bytes(total)} over data, "
              f"{results[name]['seconds']:.0f} s", flush=True)
    dp = results["dp"]
    rows = []
    for every in EVERY:
        r = results[f"H={every}"]
        ratio = r["eval_loss"] / dp["eval_loss"]
        rows.append(common.Row(f"H={every} eval loss after {steps} steps", f"{r['eval_loss']:.4f}",
                               f"DP {dp['eval_loss']:.4f}", ratio, "<= 1.05" if every == 10 else "reported",
                               ratio <= 1.05 if every == 10 else None, f"{r['seconds']:.0f} s vs DP {dp['seconds']:.0f} s"))
        ratio = r["data_bytes"] / dp["data_bytes"]
        rows.append(common.Row(f"H={every} bytes over data per device, {steps} steps", common.fmt_bytes(r["data_bytes"]),
                               f"DP {common.fmt_bytes(dp['data_bytes'])}", ratio, f"<= {1.1 / every:.3f} (1.1/H)",
                               ratio <= 1.1 / every, f"outer all-reduce {common.fmt_bytes(r['data_bytes_outer'])}; "
                               f"DP step {common.fmt_bytes(dp['dp_bytes_per_step'])}"))
    after = []
    if not options.quick:
        code, tail, seconds = two_processes(base_args(steps, False), os.path.join(root, "H=10-2proc"))
        one = results["H=10"]["eval_loss"]
        if code == 0:
            two = [r["loss"] for r in read_metrics(os.path.join(root, "H=10-2proc")) if r["split"] == "eval"][-1]
            rows.append(common.Row("H=10, 2 processes x 4 devices (spmd-launch): eval loss", f"{two:.4f}",
                                   f"1 process {one:.4f}", two / one, "1 +- 1e-4", abs(two / one - 1) <= 1e-4,
                                   f"one replica group per process; {seconds:.0f} s"))
        else:
            after.append(f"2-process run failed (exit {code}):\n```\n{tail}\n```")
        JSON.write_text(json.dumps({"steps": steps, "mesh": MESH, "runs": results}, indent=1) + "\n")
    after.append("Bytes are per device as an accelerator runs the programs (spmd.hlo.collectives), every collective "
                 "whose axes include data; eval is not counted in any mode.")
    common.report("local_sgd", "Local SGD / DiLoCo: eval loss and bytes over data against synchronous DP", rows,
                  options, command, after=after, started_load=started)


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.local_sgd") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = None
    if "--steps" in argv:
        i = argv.index("--steps")
        steps = int(argv[i + 1])
        del argv[i:i + 2]
    return common.run_main(lambda options, cmd: run(options, cmd, steps), __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
