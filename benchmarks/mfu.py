"""MFU: the single-device GPT train step's model FLOP/s against this machine's measured GEMM peak.

- **peak**: a jitted f32 ``(n, n) @ (n, n)`` matmul through XLA on the same device, timed in the
  same run, interleaved with the model's steps (so both see the same machine load); the peak is
  the best round (2 n^3 / seconds), as a peak should be.
- **model FLOP/s**: ``spmd.models.flops_per_step`` (PaLM's 6 N + attention, analytic: what the
  model must compute) over the median step time of the minimal train step on one device.
- **MFU** = model FLOP/s / peak. Goal >= 0.50 (what well-tuned large-model training reaches on
  accelerators; a 2-core CPU running a small model is not expected to).
- **wasted work**: the matmul FLOPs XLA actually runs, read from the optimised HLO (every ``dot``:
  2 x output elements x contracted size, multiplied by the trip count of the loops around it,
  since XLA's ``cost_analysis`` counts a ``while`` body once), against the analytic count. A ratio
  above 1 means the compiled step multiplies more than the model needs; the note names the
  jax operations with the largest matmul FLOPs so the excess can be traced. XLA's own
  ``cost_analysis`` total (loop bodies once, elementwise work included) is shown for reference.

    python -m benchmarks.mfu [--quick] [--output PATH]
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from benchmarks import common
from benchmarks.common import Row
from spmd.models import flops_per_step

GOAL = 0.50
_SHAPED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]\S*\s+(\w[\w\-]*)\((.*)")
_OPERAND = re.compile(r"\s*(?:\w+\[([\d,]*)\]\S*\s+)?%?([\w.\-]+)")
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def dot_flops(compiled_text: str, unknown_trips: float = 1.0) -> tuple[float, dict[str, float]]:
    """(total matmul FLOPs per execution of the program, {jax op name: FLOPs}), loops multiplied; a loop
    whose trip count is known only at run time (e.g. grouped expert blocks) counts ``unknown_trips`` times."""
    total, by_op = 0.0, defaultdict(float)
    for comp in spmd.hlo.computations(compiled_text):  # each with its executions per step (loop trips)
        times = comp.count * (1 if comp.trip_count_known else unknown_trips)
        for flops, key in computation_dots(comp) if times else ():
            total += flops * times
            by_op[key] += flops * times
    return total, dict(by_op)


def computation_dots(comp: spmd.hlo.Computation) -> list[tuple[float, str]]:
    """(FLOPs, "fwd|bwd <jax op name>") of each matmul (``dot``) of one computation, per execution of it."""
    shapes: dict[str, list[int]] = {}
    out = []
    for line in comp.lines:
        m = _SHAPED.match(line)
        if not m:
            continue
        name, dims, op, rest = m.groups()
        shapes[name] = [int(d) for d in dims.split(",") if d]
        if op != "dot":
            continue
        lhs_dims, lhs_name = _OPERAND.match(rest).groups()  # "f32[4,8]{1,0} %x" or "%x"
        lhs = [int(d) for d in lhs_dims.split(",") if d] if lhs_dims is not None else shapes.get(lhs_name)
        if lhs is None:
            raise ValueError(f"dot operand {lhs_name!r} has no shape in computation {comp.name!r}: {line.strip()[:200]}")
        contract = _LHS_CONTRACT.search(line)
        k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
        meta = _OP_NAME.search(line)
        key = meta.group(1).split("/")[-2] if meta and meta.group(1).count("/") >= 1 else "?"
        out.append((2.0 * math.prod(shapes[name]) * k, ("bwd " if meta and "transpose(" in meta.group(1) else "fwd ") + key))
    return out


def run(options: common.Options, command: str = "python -m benchmarks.mfu") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    cfg, batch, length = common.gpt_config(options.quick)
    rounds, steps, n = (2, 2, 512) if options.quick else (5, 5, 1024)
    setup = common.gpt_setup(cfg, common.layout_mesh("single"), "none", batch, length)
    device = setup.mesh.devices.flat[0]
    rng = np.random.default_rng(0)
    a, b = (jax.device_put(jnp.asarray(rng.standard_normal((n, n)), jnp.float32), device) for _ in range(2))
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    holder = {"state": setup.state}

    def model_round() -> float:
        state = holder["state"]
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = setup.step(state, setup.batch)
        jax.block_until_ready(state)
        holder["state"] = state
        return (time.perf_counter() - t0) / steps

    def matmul_round() -> float:
        return min(common.timed(lambda: matmul(a, b)) for _ in range(3))

    model_round()  # warm-up
    times = common.interleaved(rounds, {"model": model_round, "matmul": matmul_round})
    step_s = statistics.median(times["model"])
    peak = 2.0 * n**3 / min(times["matmul"])
    peak_median = 2.0 * n**3 / statistics.median(times["matmul"])
    model_flops = flops_per_step(cfg, batch, length)
    achieved = model_flops / step_s
    xla_dots, by_op = dot_flops(setup.compiled.as_text())
    xla_cost = spmd.inspection.compiled_flops(setup.compiled)
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:4]
    rows = [
        Row("MFU: model FLOP/s of the 1-device GPT step", f"{achieved / 1e9:.2f} GFLOP/s",
            f"{peak / 1e9:.2f} GFLOP/s f32 GEMM peak ({n}^3, best round; median {peak_median / 1e9:.2f})",
            achieved / peak, f">= {GOAL}", achieved / peak >= GOAL,
            f"step {step_s * 1e3:.1f} ms (median of {rounds} rounds x {steps}); model {model_flops / 1e9:.3f} GFLOP/step"),
        Row("matmul FLOPs XLA runs (HLO dots, loop trips counted) vs analytic", f"{xla_dots / 1e9:.3f} GFLOP",
            f"{model_flops / 1e9:.3f} GFLOP = flops_per_step (6N + attention)", xla_dots / model_flops, "1.00 +- 0.05",
            abs(xla_dots / model_flops - 1) <= 0.05,
            "largest: " + "; ".join(f"{k} {v / 1e9:.3f}" for k, v in top)),
        Row("XLA cost_analysis flops (while body counted once)", f"{xla_cost / 1e9:.3f} GFLOP",
            f"{model_flops / 1e9:.3f} GFLOP analytic", xla_cost / model_flops, "reported", None,
            f"undercounts the {cfg.n_layers}-layer scan (one body), adds elementwise work"),
    ]
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, d_ff={cfg.ff}, "
              f"vocab={cfg.vocab_size}, f32; batch {batch} x {length}; AdamW; one device ({device.device_kind}) of "
              f"{len(jax.devices())} {device.platform} device(s)",
              f"- timing: {rounds} interleaved rounds (model: {steps} steps; matmul: best of 3), after compile + warm-up"]
    common.report("mfu", "MFU: single-device GPT step vs measured f32 GEMM peak", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.mfu") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
