"""Scaling: compile time and per-device memory as the simulated device count grows 1 -> 2 -> 4 -> 8.

The device count of a process is fixed once the jax backend starts, so each count runs in its
own subprocess (``python -m benchmarks.scaling --worker N``), which simulates N CPU devices,
compiles the minimal GPT train step of the same (small) model under DP (``data=N``) and FSDP
(``fsdp=N``) with the persistent compilation cache off, and prints one JSON line. The parent
gathers the lines into rows:

- **compile time** against the 1-device compile of the same layout, in CPU seconds of the
  worker (all its threads: less sensitive to other load on the machine than wall time, which
  the note shows). An SPMD program is compiled once for all devices, so it should stay about
  flat; goal <= 2.0x.
- **state bytes per device** (params + AdamW state, ``spmd.inspection.tree_bytes_per_device``) against the
  ideal: unchanged for DP, the 1-device bytes / N for FSDP. Goal <= 1.05.

``--quick`` runs the counts 1 and 2 only, with one block, and hands the workers the caller's ``XLA_FLAGS`` but the device count
(the test suite's ``--xla_backend_optimization_level=0``: the compile times are then not LLVM's full ones); there
the state is set up abstract (shapes and shardings: its bytes per device are the same, no init program compiled).

    python -m benchmarks.scaling [--quick] [--output PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common
from benchmarks.common import Row, fmt_bytes

COUNTS = (1, 2, 4, 8)
QUICK_COUNTS = (1, 2)
COMPILE_GOAL = 2.0
MEMORY_GOAL = 1.05
ROOT = Path(__file__).resolve().parent.parent


def worker(n: int, quick: bool) -> dict:
    """Runs in the subprocess: compile the DP and FSDP steps on n simulated devices."""
    import meshes

    meshes.simulate_cpu_devices(n)
    import jax

    import spmd

    jax.config.update("jax_enable_compilation_cache", False)
    cfg, batch, length = common.gpt_config(quick=True, one_block=quick)  # small: the suite runs 4 workers x 2 compiles
    out = {"devices": n, "layouts": {}}
    for name, axis, rules in (("dp", "data", "dp"), ("fsdp", "fsdp", "fsdp")):
        mesh = meshes.make_mesh({axis: n}) if n > 1 else meshes.single_device_mesh()
        setup = common.gpt_setup(cfg, mesh, rules, batch, length, abstract=quick)  # quick: no state materialised
        mem = spmd.inspection.memory(setup.compiled)
        params, opt_state = setup.state
        out["layouts"][name] = {
            "compile_s": setup.compile_s,
            "compile_cpu_s": setup.compile_cpu_s,
            "state_bytes": spmd.inspection.tree_bytes_per_device(params) + spmd.inspection.tree_bytes_per_device(opt_state),
            "temp_bytes": mem.temp,
        }
    return out


def gather(counts: Sequence[int], quick: bool) -> list[dict]:
    results = []
    for n in counts:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not common._COUNT_FLAG.match(f)]
        if quick and flags:  # the smoke test keeps the caller's other XLA flags (the tests skip LLVM's optimisation)
            env["XLA_FLAGS"] = " ".join(flags)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "benchmarks.scaling", "--worker", str(n)] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"scaling worker for {n} devices failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        results.append(json.loads(lines[-1]))
        print(f"{n} device(s): done", flush=True)
    return results


def rows_of(results: Sequence[dict]) -> list[Row]:
    base = {r["devices"]: r for r in results}[min(r["devices"] for r in results)]
    rows = []
    for name in ("dp", "fsdp"):
        b = base["layouts"][name]
        for r in results:
            n, m = r["devices"], r["layouts"][name]
            ratio = m["compile_cpu_s"] / b["compile_cpu_s"]
            rows.append(Row(f"{name} x{n}: compile time (CPU seconds)", f"{m['compile_cpu_s']:.2f} s",
                            f"{b['compile_cpu_s']:.2f} s on {base['devices']} device(s)", ratio, f"<= {COMPILE_GOAL}",
                            ratio <= COMPILE_GOAL, f"wall {m['compile_s']:.2f} s (vs {b['compile_s']:.2f} s); "
                            f"temp {fmt_bytes(m['temp_bytes'])} per device"))
            ideal = b["state_bytes"] / (n / base["devices"] if name == "fsdp" else 1)
            ratio = m["state_bytes"] / ideal
            rows.append(Row(f"{name} x{n}: state bytes per device", fmt_bytes(m["state_bytes"]),
                            f"{fmt_bytes(ideal)} = {'1-device / N' if name == 'fsdp' else 'unchanged (replicated)'}",
                            ratio, f"<= {MEMORY_GOAL}", ratio <= MEMORY_GOAL,
                            "replicated optimizer counters do not divide" if name == "fsdp" and n > 1 else ""))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.scaling") -> list[Row]:
    started = common.load()
    counts = QUICK_COUNTS if options.quick else COUNTS
    rows = rows_of(gather(counts, options.quick))
    cfg, batch, length = common.gpt_config(quick=True, one_block=options.quick)
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, f32, AdamW; batch {batch} x {length}; "
              f"device counts {', '.join(map(str, counts))}, one subprocess each, compilation cache off"]
    common.setup_devices(options.real_devices)  # the machine description starts this process's backend
    common.report("scaling", "Scaling: compile time and per-device state vs device count", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.scaling") -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--worker", type=int, default=0, help="internal: run one device count, print JSON")
    args = p.parse_args(argv)
    if args.worker:
        if args.worker < 1:
            raise ValueError(f"--worker {args.worker}: the device count must be >= 1")
        print(json.dumps(worker(args.worker, args.quick)), flush=True)
        return 0
    run(common.options(args), command=" ".join([command, *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
