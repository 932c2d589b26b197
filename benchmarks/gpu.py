"""GPU: bf16 MFU of the GPT recipes gpt-125m and gpt-350m on one GPU (skipped without a GPU).

For each recipe the model (bf16 compute, f32 params and AdamW state, remat per block) is trained
with the minimal step on one GPU. The batch is chosen to fill the GPU: the largest power-of-two
batch whose compiled step (XLA ``memory_analysis``: arguments + outputs - aliased + temporaries)
fits in 85 % of the device's memory limit. Then

    MFU = flops_per_step (6 N + attention, remat recomputation not counted) / step time / peak,

with the peak from ``trainers.metrics.peak_flops_per_device`` (the vendor's dense bf16 figure, e.g.
989 TFLOP/s for an H100/H200 SXM). Goal >= 50 %.

Published references for this size class (GPT-2 small/medium shapes): nanoGPT (Karpathy,
github.com/karpathy/nanoGPT README and llm.c GPT-2 124M reproduction, 2024) reports about 40-50 %
MFU on A100/H100 for 124M with torch.compile and flash attention; MaxText (github.com/google/maxtext,
README performance tables) reports 50-60 %+ MFU for far larger models on TPU v5p/H100, where
small models are harder to keep busy. This benchmark runs XLA's own attention (no fused flash
kernel), so the figure to beat is the lower end of that range.

Without a GPU it prints "no GPU: skipped" and writes that into its section. The suite simulates
CPU devices by default: on a GPU host pass ``--real-devices``. The reference figures above are
quoted from those projects' published reports, not measured here.

    python -m benchmarks.gpu [--quick] [--real-devices] [--output PATH]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import jax

import meshes
import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes
from spmd.models import flops_per_step, param_count

GOAL = 0.50
FILL = 0.85
RECIPES = ("gpt-125m", "gpt-350m")
REFERENCE = "nanoGPT/llm.c GPT-2 124M: ~40-50 % MFU on A100/H100 (torch.compile + flash attention)"


def fits(setup: common.GPTSetup, limit: int) -> bool:
    return spmd.inspection.memory(setup.compiled).total <= FILL * limit


def measure(name: str, quick: bool) -> Row:
    from trainers import recipe
    from trainers.metrics import peak_flops_per_device

    cfg = recipe(name)
    model, length = cfg.model, cfg.data.seq_len
    if quick:
        model = dataclasses.replace(model, n_layers=2)
    device = jax.devices("gpu")[0]
    mesh = meshes.single_device_mesh(device)
    limit = int((device.memory_stats() or {}).get("bytes_limit", 16 * 2**30))
    best, batch = None, 8
    while batch <= (16 if quick else 512):
        try:
            setup = common.gpt_setup(model, mesh, "none", batch, length)
        except Exception as exc:  # an out-of-memory at compile time ends the search
            if "RESOURCE_EXHAUSTED" not in str(exc) and "memory" not in str(exc).lower():
                raise
            break
        if not fits(setup, limit):
            break
        best, batch = setup, batch * 2
    if best is None:
        raise RuntimeError(f"{name}: even batch 8 x {length} does not fit in {fmt_bytes(limit)}")
    setup, batch = best, best.batch["inputs"].shape[0]
    state = setup.state
    for _ in range(2):
        state, _ = setup.step(state, setup.batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(3 if quick else 5):
        t0 = time.perf_counter()
        for _ in range(2 if quick else 10):
            state, _ = setup.step(state, setup.batch)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / (2 if quick else 10))
    step_s = statistics.median(times)
    peak, source = peak_flops_per_device(device, "bfloat16")
    achieved = flops_per_step(model, batch, length) / step_s
    mfu = achieved / peak
    return Row(f"{name}{' (2 layers, quick)' if quick else ''}: {param_count(model) / 1e6:.0f}M params, batch {batch} x "
               f"{length}, bf16", f"{achieved / 1e12:.1f} TFLOP/s ({step_s * 1e3:.1f} ms/step)",
               f"{peak / 1e12:.0f} TFLOP/s bf16 dense peak ({source})", mfu, f">= {GOAL:.0%} on H100", mfu >= GOAL,
               f"memory {fmt_bytes(spmd.inspection.memory(setup.compiled).total)} of {fmt_bytes(limit)}; reference: {REFERENCE}")


def run(options: common.Options, command: str = "python -m benchmarks.gpu") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        line = "no GPU: skipped" + ("" if options.real_devices else " (simulated CPU devices; on a GPU host run with --real-devices)")
        common.report("gpu", "GPU: bf16 MFU of gpt-125m and gpt-350m", [], options, command, after=[line],
                      started_load=started)
        return []
    rows = [measure(name, options.quick) for name in RECIPES]
    common.report("gpu", "GPU: bf16 MFU of gpt-125m and gpt-350m", rows, options, command, started_load=started,
                  after=[f"reference: {REFERENCE}; MaxText reports 50-60 %+ MFU for larger models on H100/TPU v5p"])
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.gpu") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
