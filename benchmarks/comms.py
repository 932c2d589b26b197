"""Communication: bytes each parallel layout's compiled GPT step moves, against the layout's minimum.

For each layout (dp8, fsdp8, dp2_tp4, fsdp_tp = data 2 x fsdp 2 x tensor 2) the minimal train
step (``common.minimal_step``: value_and_grad -> AdamW -> apply) is compiled and its collectives
are read from the optimised HLO with ``spmd.hlo.collectives``: kind, mesh axes, executions per
step (a collective inside the layer scan runs once per layer) and bytes per device (the full
buffer: an all-gather's gathered result, an all-reduce's reduced array). They are grouped by the
role they play, and each role is compared with what the layout needs at least, per device per
step, in the same buffer convention:

- **gradient reduction** over the batch axes (data, fsdp): one reduction of the gradient as
  each device uses it (``W``: the parameter bytes per device with the fsdp split undone). DP:
  one all-reduce of ``W``; FSDP: a reduce-scatter of ``W`` over fsdp (and an all-reduce of the
  ``W / fsdp`` shard over data). The CPU backend has no reduce-scatter pass: it emits an
  all-reduce of the full ``W`` and each device then dynamic-slices its shard, which moves the
  same buffer but twice the ring wire bytes of a reduce-scatter (2 (n-1)/n W instead of
  (n-1)/n W). The table counts it as the reduce-scatter it stands for and says so.
- **weight all-gathers** over fsdp (ZeRO-3): every weight gathered in the forward and again in
  the backward pass, ``2 W``.
- **tensor-parallel activations** (Megatron): per layer two all-reduces of the
  ``[B_local, L, D]`` activation in the forward pass (attention output, MLP down projection)
  and two in the backward pass (the input gradients of the column-parallel q/k/v and gate/up
  matmuls), ``4 n_layers B_local L D`` bytes.
- **pipeline**: activation bytes per tick, when ``spmd.pipeline`` exists (see
  ``benchmarks.pipeline``); otherwise the table says "pipeline: not available".

Every byte above the minimum is explained in the note column (the scalar loss, the
vocab-parallel embedding and head, the cross-entropy statistics, XLA's per-matmul backward
all-reduces); "unexplained" is whatever is left, and should be 0. The goal is ratio 1.00 (met at
<= 1.01; fewer bytes than the formula also meet it, with the reason noted).

    python -m benchmarks.comms [--quick] [--output PATH]
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

import jax
import numpy as np

import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes

GOAL = 1.01
BATCH_AXES = ("data", "fsdp")


def gathered_bytes(tree: object, axis: str, mesh: jax.sharding.Mesh) -> int:
    """Bytes per device of a sharded pytree with the split over ``axis`` undone (what a gather yields)."""
    size = dict(zip(mesh.axis_names, mesh.devices.shape)).get(axis, 1)
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        spec = [a for entry in x.sharding.spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)]
        total += int(np.prod(shard)) * x.dtype.itemsize * (size if axis in spec else 1)
    return total


def _in_scan(op: spmd.hlo.Collective) -> bool:
    return "/while/body/" in op.op_name


def _row(layout: str, role: str, ops: Sequence[spmd.hlo.Collective], theory: int, formula: str,
         notes: list[tuple[str, int]], *, below: str = "") -> Row:
    measured = sum(o.total_bytes for o in ops)
    kinds = sorted({f"{o.kind} over {','.join(o.axes)}" for o in ops}) or ["none"]
    explained = sum(b for _, b in notes)
    unexplained = measured - theory - explained
    parts = [f"+{fmt_bytes(b)}: {why}" for why, b in notes if b]
    if below and measured < theory:
        parts.append(below)  # the deficit is the explanation; nothing is left over
        unexplained = 0
    parts.append(f"unexplained: {fmt_bytes(unexplained)}")
    ratio = measured / theory if theory else float("nan")
    met = (measured <= theory * GOAL) if theory else (measured == 0)
    return Row(f"{layout}: {role} ({'; '.join(kinds)}; {sum(o.count for o in ops)} per step)",
               fmt_bytes(measured), f"{fmt_bytes(theory)} = {formula}", ratio, "1.00", met, "; ".join(parts))


def layout_rows(name: str, cfg, batch: int, length: int) -> list[Row]:
    """Compile the step of one layout and compare each role's collective bytes with its minimum."""
    sizes, rules = common.LAYOUTS[name]
    setup = common.gpt_setup(cfg, common.layout_mesh(name), rules, batch, length)
    mesh, params = setup.mesh, setup.sharded.state["params"]
    ops = spmd.hlo.collectives(setup.compiled, mesh)
    axis = dict(zip(mesh.axis_names, mesh.devices.shape))
    fsdp, tensor = axis.get("fsdp", 1), axis.get("tensor", 1)
    w = gathered_bytes(params, "fsdp", mesh)
    cpu_rs = jax.devices()[0].platform == "cpu" and not any(o.kind == "reduce-scatter" for o in ops)
    rows: list[Row] = []
    used: set[int] = set()

    grad = [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and set(o.axes) <= set(BATCH_AXES)
            and o.backward]
    used |= {id(o) for o in grad}
    if fsdp > 1:
        formula = "reduce-scatter of the gradients W over fsdp" + (" (+ all-reduce of W/fsdp over data)"
                                                                   if axis.get("data", 1) > 1 else "")
        role = "gradient reduction" + (" (reduce-scatter emitted as all-reduce + dynamic-slice)" if cpu_rs else "")
    else:
        formula, role = "all-reduce of the gradients W", "gradient reduction"
    notes = [("the scalar loss (a mean over batch-sharded rows), merged into the gradients' tuple all-reduce",
              4 * sum(1 for o in grad if not _in_scan(o)))]
    row = _row(name, role, grad, w, formula, notes)
    if cpu_rs and fsdp > 1:
        row = Row(row.what, row.measured, row.limit, row.ratio, row.goal, row.met,
                  row.note + "; CPU backend: an all-reduce moves 2x the ring wire bytes of a reduce-scatter "
                  "(GPU/TPU backends emit reduce-scatter)")
    rows.append(row)

    if fsdp > 1:
        gathers = [o for o in ops if o.kind == "all-gather" and o.axes == ("fsdp",)]
        used |= {id(o) for o in gathers}
        bwd = sum(o.total_bytes for o in gathers if o.backward)
        rows.append(_row(name, "weight all-gathers", gathers, 2 * w, "2 W (ZeRO-3: forward and backward)", [],
                         below=f"below: the backward gathers {fmt_bytes(bwd)}, it reuses the forward's gathered "
                               "weights (scan residuals in temp memory) instead of gathering again"))

    if tensor > 1:
        tp = [o for o in ops if o.kind == "all-reduce" and o.axes == ("tensor",)]
        used |= {id(o) for o in tp}
        b_local = batch // (axis.get("data", 1) * fsdp)
        itemsize = np.dtype(cfg.compute_dtype).itemsize
        bld, bl = b_local * length * cfg.d_model * itemsize, b_local * length * 4
        n = cfg.n_layers
        notes = [
            ("backward: XLA all-reduces the input gradient of each column-parallel matmul (q, k, v; gate, up) "
             "instead of summing first, 5 not 2 [B,L,D] per layer", 3 * n * bld),
            ("vocab-parallel embedding lookup (partial [B,L,D] sums)", bld),
            ("vocab-parallel head: its input gradient [B,L,D]", bld),
            ("cross-entropy over vocab-sharded logits: max, sum of exp, target logit ([B,L] each)", 3 * bl),
        ]
        rows.append(_row(name, "tensor-parallel activations", tp, 4 * n * bld,
                         f"4 x {n} layers x B_local*L*D ({b_local}x{length}x{cfg.d_model}x{itemsize} B)", notes))

    other = [o for o in ops if id(o) not in used]
    if other:
        rows.append(_row(name, "other collectives", other, 0, "0 (no role in this layout)", []))
    return rows


def pipeline_rows() -> tuple[list[Row], str]:
    """Rows for the pipeline layout if ``spmd.pipeline`` exists, else a line saying it does not."""
    if importlib.util.find_spec("spmd.pipeline") is None:
        return [], "pipeline: not available (no spmd.pipeline module)"
    from benchmarks import pipeline

    return pipeline.comms_rows()


def run(options: common.Options, command: str = "python -m benchmarks.comms") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    cfg, batch, length = common.gpt_config(options.quick)
    need = max(int(np.prod(list(s.values()))) for s, _ in common.LAYOUTS.values())
    rows: list[Row] = []
    if len(jax.devices()) < need:
        pipe_line = f"skipped: the layouts need {need} devices, {len(jax.devices())} present"
    else:
        for name in common.LAYOUTS:
            rows += layout_rows(name, cfg, batch, length)
            print(f"{name}: done", flush=True)
        pipe_rows, pipe_line = pipeline_rows()
        rows += pipe_rows
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, "
              f"kv_heads={cfg.kv_heads}, d_ff={cfg.ff}, vocab={cfg.vocab_size}, {cfg.dtype}; batch {batch} x {length}; "
              "AdamW; bytes per device per step, buffer sizes as `spmd.hlo.collectives` counts them",
              "- W = parameter (= gradient) bytes per device with the fsdp split undone; B_local = batch rows "
              "per device"]
    common.report("comms", "Communication: collective bytes per step vs the layout's minimum", rows, options,
                  command, before=before, after=[pipe_line], started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.comms") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
