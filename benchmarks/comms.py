"""Communication: bytes each parallel layout's compiled GPT step moves, against the layout's minimum.

Each layout's minimal train step (``common.minimal_step``: value_and_grad -> AdamW -> apply) is
compiled and its collectives read with ``spmd.hlo.collectives``, as an accelerator runs the
program: the CPU backend's rewrites (a reduce-scatter emitted as all-reduce + dynamic-slice, bf16
all-reduces and all-gathers promoted to f32) are recognised, and the note says what the CPU
program emits where it differs. Bytes are per device per step, the full buffer (an all-gather's
gathered result, a reduce-scatter's unscattered input); the sequence-parallel rows compare ring
wire bytes (``Collective.wire_bytes``), where a reduce-scatter + all-gather pair equals one
all-reduce. Each row's limit column carries the one-line formula for its minimum:

- gradient reduction over the batch axes: ``W`` (parameter bytes per device with the fsdp split
  undone; at the compute dtype for the bf16 rows); FSDP: a reduce-scatter of W over fsdp, plus an
  all-reduce of the W/fsdp shard over data where data > 1;
- weight all-gathers (ZeRO-3): W per gather pass (the backward reuses the forward's weights);
- tensor-parallel activations (Megatron, vocab-parallel embedding and head):
  ``(4 n_layers + 2) B_local L D`` + 3 ``[B_local, L]`` cross-entropy statistics;
- pipeline sends (1F1B, interleaved; M = 4, 8, 16): ``2 M (C-1)`` activations ``[B/M, L, D]``
  (``spmd.pipeline.sent_bytes``; C = S V chunks), summed over the stages of one pipeline;
- gradient accumulation (trainer step, k microbatches): DP one reduction of W per step whatever
  k; FSDP per-microbatch (ZeRO-3: k reduce-scatters and k gathers) and per-step (one of each).

``--quick``: the tiny model (one block) on dp8 and fsdp_tp only, the interleaved pipeline at M = 4 only
(``benchmarks.pipeline --quick`` has 1F1B's sends), no accumulation rows; the states set up abstract (only the
steps are compiled).

    python -m benchmarks.comms [--quick] [--output PATH]
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import jax
import numpy as np

import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes

GOALS = {"gradient reduction": 1.01, "weight all-gathers": 1.01, "tensor-parallel activations": 1.05,
         "sequence-parallel activations": 1.05, "pipeline": 1.1, "accumulation": 1.01}
BATCH_AXES = ("data", "fsdp")
# name -> (layout of common.LAYOUTS for the mesh, rule preset, compute dtype): the rows beyond the base layouts
EXTRA = {"fsdp8_bf16": ("fsdp8", "fsdp", "bfloat16"), "dp2_tp4_sp": ("dp2_tp4", "dp_tp_sp", None),
         "fsdp_tp_sp": ("fsdp_tp", "fsdp_tp_sp", None)}
SCALAR = 16  # collectives of at most this many bytes carry scalars (the loss, norms), not tensors


def gathered_bytes(tree: object, axis: str, mesh: jax.sharding.Mesh, dtype_of: Callable | None = None) -> int:
    """Bytes per device of a sharded pytree with the split over ``axis`` undone (what a gather yields);
    ``dtype_of(x)``: the itemsize to count a leaf at (default its own)."""
    size = dict(zip(mesh.axis_names, mesh.devices.shape)).get(axis, 1)
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        spec = [a for entry in x.sharding.spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)]
        itemsize = dtype_of(x) if dtype_of is not None else x.dtype.itemsize
        total += int(np.prod(shard)) * itemsize * (size if axis in spec else 1)
    return total


def compute_itemsize(cfg) -> Callable:
    """Matrices (ndim >= 2) are used in the compute dtype, vectors (norm scales) in f32."""
    item = np.dtype(cfg.compute_dtype).itemsize
    return lambda x: item if x.ndim >= 2 else x.dtype.itemsize


def _in_scan(op: spmd.hlo.Collective) -> bool:
    return "/while/body/" in op.op_name


def cpu_note(ops: Sequence[spmd.hlo.Collective]) -> str:
    diff = [o for o in ops if o.differs]
    if not diff:
        return ""
    emitted = spmd.hlo.summarize(diff, "emitted")
    notes = sorted({n for o in diff for n in o.cpu_note.split("; ") if n and not n.startswith("one of")})
    return ("CPU program: " + ", ".join(f"{k} over {','.join(a)} {fmt_bytes(r['bytes'])}" for (k, a), r in emitted.items())
            + f" ({'; '.join(notes)})")


def role_row(what: str, role: str, ops: Sequence[spmd.hlo.Collective], theory: float, formula: str,
             notes: Sequence[tuple[str, float]] = (), *, wire: bool = False, below: str = "") -> Row:
    """One role's bytes against its minimum; ``notes``: (reason, bytes) explaining bytes above it."""
    measured = sum(o.count * (o.wire_bytes if wire else o.bytes) for o in ops)
    kinds = sorted({f"{o.kind} over {','.join(o.axes)}" for o in ops}) or ["none"]
    goal = GOALS[role if role in GOALS else role.split(" (")[0].split(":")[0]]
    unexplained = measured - theory - sum(b for _, b in notes)
    parts = [f"+{fmt_bytes(b)}: {why}" for why, b in notes if b]
    if below and measured < theory:
        parts.append(below)
        unexplained = 0
    parts.append(f"unexplained: {fmt_bytes(max(unexplained, 0))}")
    parts.append(cpu_note(ops))
    ratio = measured / theory if theory else float("nan")
    met = measured <= theory * goal if theory else measured == 0
    label = f"{what}: {role} ({'; '.join(kinds)}; {sum(o.count for o in ops)} per step{'; wire bytes' if wire else ''})"
    return Row(label, fmt_bytes(measured), f"{fmt_bytes(theory)} = {formula}", ratio, f"<= {goal}", met,
               "; ".join(p for p in parts if p))


def failed_row(what: str, goal: str, exc: BaseException) -> Row:
    return Row(what, "-", "-", float("nan"), goal, False, f"failed: {type(exc).__name__}: {str(exc)[:240]}")


def layout_rows(name: str, cfg, batch: int, length: int, *, rules: str | None = None, mesh_of: str | None = None,
                reference: dict | None = None, abstract: bool = False) -> list[Row]:
    """Compile the step of one layout and compare each role's collective bytes with its minimum."""
    rules = rules or common.LAYOUTS[name][1]
    setup = common.gpt_setup(cfg, common.layout_mesh(mesh_of or name), rules, batch, length, abstract=abstract)
    mesh, params = setup.mesh, setup.state[0]
    ops = spmd.hlo.collectives(setup.compiled, mesh)
    axis = dict(zip(mesh.axis_names, mesh.devices.shape))
    fsdp, tensor, data = axis.get("fsdp", 1), axis.get("tensor", 1), axis.get("data", 1)
    bf16 = cfg.dtype != "float32"
    w = gathered_bytes(params, "fsdp", mesh, compute_itemsize(cfg) if bf16 else None)
    wn = "W_c (matrices at the compute dtype)" if bf16 else "W"
    rows, used = [], set()

    grad = [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and set(o.axes) <= set(BATCH_AXES)]
    used |= {id(o) for o in grad}
    theory, formula = w, f"all-reduce of the gradients {wn}"
    if fsdp > 1:
        theory = w + (w // fsdp if data > 1 else 0)
        formula = f"reduce-scatter of {wn} over fsdp" + (f" + all-reduce of {wn}/fsdp over data" if data > 1 else "")
    scalars = sum(o.total_bytes for o in grad if o.bytes <= SCALAR)
    rows.append(role_row(name, "gradient reduction", grad, theory, formula,
                         [("the scalar loss (a mean over batch-sharded rows)", scalars)]))
    if fsdp > 1:
        gathers = [o for o in ops if o.kind == "all-gather" and o.axes == ("fsdp",)]
        used |= {id(o) for o in gathers}
        bwd = sum(o.total_bytes for o in gathers if o.backward)
        rows.append(role_row(name, "weight all-gathers", gathers, w, f"{wn} x 1 gather pass",
                             [("the backward gathers again", bwd)]))
    if tensor > 1:
        sp = [o for o in ops if o.axes == ("tensor",) and o.kind in ("reduce-scatter", "all-gather")]
        tp = [o for o in ops if o.axes == ("tensor",) and o.kind == "all-reduce"]
        used |= {id(o) for o in tp + sp}
        b_local = batch // (data * fsdp)
        itemsize = np.dtype(cfg.compute_dtype).itemsize
        bld, bl, n = b_local * length * cfg.d_model * itemsize, b_local * length * 4, cfg.n_layers
        theory = (4 * n + 2) * bld + 3 * bl
        formula = f"(4 x {n} layers + 2) x B_local*L*D ({b_local}x{length}x{cfg.d_model}x{itemsize} B) + 3 x [B_local,L] f32"
        if rules.endswith("_sp"):
            ref = (reference or {}).get(mesh_of or name)
            if ref is None:
                rows.append(Row(f"{name}: sequence-parallel activations", "-", "-", float("nan"), "<= 1.05", False,
                                f"no all-reduce layout {mesh_of} measured to compare with"))
            else:
                rows.append(role_row(name, "sequence-parallel activations", tp + sp, ref,
                                     f"wire bytes of {mesh_of}'s tensor collectives (an all-reduce = reduce-scatter + "
                                     "all-gather)", wire=True))
        else:
            if reference is not None:
                reference[name] = sum(o.count * o.wire_bytes for o in tp + sp)
            rows.append(role_row(name, "tensor-parallel activations", tp + sp, theory, formula))
    other = [o for o in ops if id(o) not in used]
    if other:
        rows.append(role_row(name, "other collectives", other, 0, "0 (no role in this layout)"))
    return rows


def pipeline_rows(Ms: Sequence[int] = (4, 8, 16), names: Sequence[str] = ("1f1b", "interleaved"),
                  abstract: bool = False) -> list[Row]:
    """Sends over ``pipe`` of the pipelined step (4 stages) against ``spmd.pipeline.sent_bytes``'s minimum."""
    from benchmarks import pipeline

    rows = []
    for name in names:
        for M in Ms:
            what = f"pp{pipeline.STAGES} {name} M={M}: sends over pipe"
            try:
                from spmd.pipeline import get_schedule
                from spmd.pipeline.sends import hlo_sent_bytes

                setup = pipeline.pipeline_setup(name, M, quick=True, abstract=abstract)
                V = 2 if name == "interleaved" else 1
                sched = get_schedule(name, pipeline.STAGES, M, V)
                cfg, (batch, length) = setup.cfg, setup.batch["inputs"].shape
                act = (batch // M) * length * cfg.d_model * np.dtype(cfg.compute_dtype).itemsize
                table = sched.sent_bytes(act)
                found = hlo_sent_bytes(setup.compiled, sched, setup.mesh)
                measured = found["executed"] + found.get("unattributed", 0)
                rows.append(Row(what, fmt_bytes(measured), f"{fmt_bytes(table.minimum)} = 2 x M x (C-1) x [B/M,L,D] "
                                f"(C = {sched.n_chunks} chunks, {fmt_bytes(act)} each)", measured / table.minimum,
                                f"<= {GOALS['pipeline']}", measured <= table.minimum * GOALS["pipeline"],
                                f"summed over the stages of one pipeline; schedule table: {fmt_bytes(table.executed)}; "
                                f"unattributed permutes {fmt_bytes(found.get('unattributed', 0))}"))
            except Exception as exc:  # the engine is young: report, do not hide the other rows
                rows.append(failed_row(what, f"<= {GOALS['pipeline']}", exc))
    return rows


def accumulation_rows(cfg, batch: int, length: int) -> list[Row]:
    """The trainer step with k microbatches: reductions over the batch axes per step, FSDP gathers, memory."""
    from trainers.setup import build

    rows = []
    cases = [("dp8", 1, None), ("dp8", 4, None), ("fsdp8", 4, "per_microbatch"), ("fsdp8", 4, "per_step")]
    for name, k, mode in cases:
        what = f"{name} k={k}" + (f" fsdp_gather={mode}" if mode else "")
        try:
            mesh, rules = common.layout_mesh(name), spmd.get_rules(common.LAYOUTS[name][1])
            run_cfg = common.run_config(cfg, rules.name, batch, length, f"run.grad_accum={k}",
                                        *([f"run.fsdp_gather={mode}"] if mode else []))
            run = build(run_cfg, mesh=mesh)  # the run's own step
            sharded, sharding = run.stepped, run.batch_sharding
            compiled = run.train_step.lower(sharded.abstract, common.make_batch(cfg.vocab_size, batch, length,
                                                                                  sharding)).compile()
            ops = spmd.hlo.collectives(compiled, mesh)
            w = gathered_bytes(sharded.state.params, "fsdp", mesh)
            red = [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and set(o.axes) <= set(BATCH_AXES)]
            passes = k if mode == "per_microbatch" else 1
            scalars = sum(o.total_bytes for o in red if o.bytes <= SCALAR)
            rows.append(role_row(what, "accumulation: gradient reduction", red, passes * w,
                                 f"{passes} x W ({'one per microbatch' if passes > 1 else 'one per step'})",
                                 [("scalars (loss, norms)", scalars)]))
            if mode:
                gathers = [o for o in ops if o.kind == "all-gather" and o.axes == ("fsdp",)]
                rows.append(role_row(what, "accumulation: weight all-gathers", gathers, passes * w,
                                     f"{passes} x W ({'per microbatch' if passes > 1 else 'once per step'})"))
            mem = spmd.inspection.memory(compiled)
            rows.append(Row(f"{what}: memory per device", fmt_bytes(mem.total), "-", float("nan"), "reported", None,
                            f"temp {fmt_bytes(mem.temp)}, arguments {fmt_bytes(mem.argument)} (compiled memory_analysis)"))
        except Exception as exc:
            rows.append(failed_row(f"{what}: accumulation", f"<= {GOALS['accumulation']}", exc))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.comms") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    cfg, batch, length = common.gpt_config(options.quick, one_block=True)
    need = max(int(np.prod(list(s.values()))) for s, _ in common.LAYOUTS.values())
    rows: list[Row] = []
    after = []
    if len(jax.devices()) < need:
        after.append(f"skipped: the layouts need {need} devices, {len(jax.devices())} present")
    else:
        reference: dict[str, float] = {}
        # quick (the test suite's smoke run): data parallelism and the layout that has every role (fsdp, tensor)
        for name in ("dp8", "fsdp_tp") if options.quick else common.LAYOUTS:
            rows += layout_rows(name, cfg, batch, length, reference=reference, abstract=options.quick)
            print(f"{name}: done", flush=True)
        for name, (mesh_of, rules, dtype) in ({} if options.quick else EXTRA).items():  # quick: the base layouts
            if rules not in spmd.rules.RULE_SETS:
                rows.append(Row(f"{name}: {rules}", "-", "-", float("nan"), "<= 1.05", False,
                                f"rule preset {rules!r} does not exist"))
                continue
            try:
                c = dataclasses.replace(cfg, dtype=dtype) if dtype else cfg
                rows += layout_rows(name, c, batch, length, rules=rules, mesh_of=mesh_of, reference=reference)
            except Exception as exc:
                rows.append(failed_row(f"{name}: {rules}", "<= 1.05", exc))
            print(f"{name}: done", flush=True)
        rows += pipeline_rows((4,), ("interleaved",), abstract=True) if options.quick else pipeline_rows((4, 8, 16))
        print("pipeline: done", flush=True)
        if not options.quick:  # quick mode (the test suite's) leaves out the accumulation steps' compiles
            # 32 rows: 4 microbatches of 8, one row per device each (the once-per-step loop needs the rows of a
            # microbatch to divide over the batch axes; it falls back to per-microbatch reductions otherwise)
            rows += accumulation_rows(cfg, max(batch, 32), length)
    before = [f"- model: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, "
              f"kv_heads={cfg.kv_heads}, d_ff={cfg.ff}, vocab={cfg.vocab_size}, {cfg.dtype} (bf16 rows: compute "
              f"bfloat16); batch {batch} x {length}; AdamW; bytes per device per step as an accelerator runs the "
              "program (`spmd.hlo.collectives`); the note says what the CPU program emits where it differs",
              "- W = parameter (= gradient) bytes per device with the fsdp split undone; B_local = batch rows per "
              "device; pipeline rows: the quick-sized model over pipe=4 (`benchmarks.pipeline`)"]
    common.report("comms", "Communication: collective bytes per step vs the layout's minimum", rows, options,
                  command, before=before, after=after, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.comms") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
