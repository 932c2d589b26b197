"""Memory: per-device bytes of the training state of each layout vs the ZeRO formulas.

For f32 parameters and AdamW, a replicated layout holds 16 bytes per parameter on every device
(4 parameters + 4 gradients + 8 for the two moments; Rajbhandari et al., "ZeRO", 2020, with an
f32 master copy). A layout that shards the state N ways holds 16 P / N: FSDP over N devices
(ZeRO-3), tensor parallelism over N (each weight split N ways), or both (N = fsdp x tensor).
Data parallelism alone does not divide it.

For each layout (dp8, fsdp8, dp2_tp4, fsdp_tp) the minimal GPT train step is compiled and

- **state**: ``spmd.inspection.tree_bytes_per_device`` of params + optimizer state (12 B/param) + the
  gradients, which take the parameters' sharding (4 B/param, counted as one more copy of the
  params' shards: they live in the step's temporaries, not in its arguments); ratio to 16 P / N,
  goal <= 1.05. The note explains the excess (norm scales that TP leaves replicated, optimizer
  step counters);
- **compiled arguments**: XLA's ``memory_analysis().argument_size_in_bytes`` against the
  persistent state + this device's batch shard (must agree exactly: a check that the tree
  measure is what the compiled step really takes);
- **activations**: XLA's temp bytes (activations, gradients, gathered weights and scratch),
  reported with the gradient bytes inside them.

``--quick``: the tiny model (one block) on dp8 and fsdp_tp only, the state set up abstract (shapes and shardings: the
step is only compiled).

    python -m benchmarks.memory [--quick] [--output PATH]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import jax

import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes
from spmd.models import param_count

GOAL = 1.05
BYTES_PER_PARAM = 16  # f32 params 4 + grads 4 + Adam moments 8


def shards(name: str) -> int:
    """N in 16 P / N: how many ways the layout splits the state (fsdp x tensor)."""
    sizes = common.LAYOUTS[name][0]
    return sizes.get("fsdp", 1) * sizes.get("tensor", 1)


def layout_rows(name: str, cfg, batch: int, length: int, abstract: bool = False) -> list[Row]:
    setup = common.gpt_setup(cfg, common.layout_mesh(name), common.LAYOUTS[name][1], batch, length, donate=False,
                             abstract=abstract)
    params, opt_state = setup.state
    n_params = param_count(cfg)
    param_b = spmd.inspection.tree_bytes_per_device(params)
    opt_b = spmd.inspection.tree_bytes_per_device(opt_state)
    state = 2 * param_b + opt_b  # params + grads (same sharding) + optimizer state
    n = shards(name)
    formula = BYTES_PER_PARAM * n_params / n
    mem = spmd.inspection.memory(setup.compiled)
    batch_b = spmd.inspection.tree_bytes_per_device(setup.batch)
    # where the excess comes from: leaves that are not split N ways
    whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    moments_whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_state))
    small = moments_whole - 2 * whole  # optimizer counters (step counts), replicated
    replicated_params = param_b - whole / n  # bytes beyond an even N-way split (e.g. norm scales under TP)
    parts = [f"excess {fmt_bytes(state - formula)}:"]
    if replicated_params > 0:
        parts.append(f"params not split {n} ways (norm scales, replicated over tensor) {fmt_bytes(replicated_params)} "
                     "x 4 (params, grads, 2 moments);")
    parts.append(f"optimizer step counters {fmt_bytes(small)} (replicated)")
    note = " ".join(parts)
    rows = [Row(f"{name}: params + grads + AdamW state per device", fmt_bytes(state),
                f"{fmt_bytes(formula)} = 16 B x {n_params:,} params / {n}", state / formula, f"<= {GOAL}",
                state / formula <= GOAL, note)]
    persistent = param_b + opt_b + batch_b
    rows.append(Row(f"{name}: compiled step arguments (XLA)", fmt_bytes(mem.argument),
                    f"{fmt_bytes(persistent)} = params + optimizer state + batch shard", mem.argument / persistent,
                    "1.00", mem.argument == persistent, "exact agreement shows the tree measure is what the step takes"))
    rows.append(Row(f"{name}: temporaries (activations, grads, gathered weights)", fmt_bytes(mem.temp),
                    f"gradients alone: {fmt_bytes(param_b)}", math.nan, "reported", None,
                    f"outputs {fmt_bytes(mem.output)} (a new state: not donated here)"
                    + ("; includes the all-gathered weights the forward scan keeps for the backward"
                       if common.LAYOUTS[name][0].get("fsdp", 1) > 1 else "")))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.memory") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    cfg, batch, length = common.gpt_config(options.quick, one_block=True)
    need = max(math.prod(s.values()) for s, _ in common.LAYOUTS.values())
    rows: list[Row] = []
    after = []
    if len(jax.devices()) < need:
        after.append(f"skipped: the layouts need {need} devices, {len(jax.devices())} present")
    else:
        # quick (the test suite's smoke run): no split, and the layout that splits over fsdp and tensor
        for name in ("dp8", "fsdp_tp") if options.quick else common.LAYOUTS:
            rows += layout_rows(name, cfg, batch, length, abstract=options.quick)
            print(f"{name}: done", flush=True)
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, d_ff={cfg.ff}, vocab={cfg.vocab_size}, "
              f"{param_count(cfg):,} params, f32, AdamW; batch {batch} x {length}",
              "- N = fsdp x tensor (the ways a layout splits the state); ZeRO: 16 B/param replicated, 16/N sharded"]
    common.report("memory", "Memory: per-device training state vs the ZeRO formulas", rows, options, command,
                  before=before, after=after, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.memory") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
