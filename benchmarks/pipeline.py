"""Pipeline parallelism: useful-work fraction of each schedule vs theory, step time vs microbatches.

Runs only if ``spmd.pipeline`` exists (otherwise the section says "pipeline: not available").

1. **Schedules** (tables, no devices): for S stages and M microbatches the useful fraction of
   (tick, stage) slots, ``1 - bubble_fraction``, against the textbook value
   ``1 - (S-1)/(V*M + S-1)`` (GPipe and 1F1B: V=1; interleaved: V virtual stages per device).
   The note gives the most microbatch inputs a stage holds at once (GPipe: M; 1F1B: <= S).
2. **Steps**: the GPT train step with its block stack pipelined over ``pipe`` = S devices
   (``GPT.loss(..., pipeline=PipelineConfig(...))``), compiled and timed for several M at the same
   global batch. Ideal time scales as ``(V*M + S-1) / (V*M)`` (ticks x work per tick); the ratio
   column is the measured time at M over the time at the smallest M, against that ideal. On
   simulated CPU devices all stages share the host's cores, so an idle stage frees cores for
   the busy ones and the bubble barely shows in time: the rows are reported, not judged there.
3. **Zero bubble** (tables, and steps): ZB-H1 / ZB-H2 useful fraction against
   ``1 - (S-1)/(3M+S-1)`` (every op, F, B or W, one tick), ZB-H1's bubble against 1F1B's, and the
   measured step time of ZB-H1 against 1F1B on the same setup (reported, not judged: on shared CPU
   cores time follows total work, not the bubble), and the matmul FLOPs each device executes per
   step, from the compiled HLO (:func:`executed_dot_flops`), against 1F1B's: W reuses B's residuals,
   so F 1 + B 2 + W 1 = 4 chunk forwards per microbatch, 1F1B's 4 (goal <= 1.02).
   ZB-V (2 chunks per device in a V) against ``1 - (S-1)/(6M+S-1)``, in ticks of a chunk op.
4. **Comms** (also shown by ``benchmarks.comms``): bytes sent over ``pipe`` per step, summed over
   the stages, against the minimum ``2 M (C-1)`` activations ``[B/M, L, D]`` (C = S V chunks: each
   microbatch's activation crosses every chunk boundary forward once, its gradient backward once).
5. **FSDP gathers under bf16** (fsdp=2 x pipe=2 x tensor=2): the stage weight matrices' all-gathers over ``fsdp``
   in bf16 against the same step gathering them in f32, compiled in the same run.

``--quick``: M in {S, 2S} for the tables; the steps at M = S only: 1F1B alone for the step-time
rows, ZB-H1 against it, ZB-V's sends, and the FSDP gathers under 1F1B (not GPipe) with one layer per stage;
the steps that are only compiled (sends, gathers) on a state set up abstract (shapes and shardings).

    python -m benchmarks.pipeline [--quick] [--output PATH]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

import meshes
import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes

STAGES = 4


def timed_round(setups: dict, states: dict, key, steps: int):
    """A timing round for :func:`common.interleaved`: ``steps`` steps of ``setups[key]`` from
    ``states[key]`` (updated in place), seconds per step."""
    def fn() -> float:
        s, state = setups[key], states[key]
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = s.step(state, s.batch)
        jax.block_until_ready(state)
        states[key] = state
        return (time.perf_counter() - t0) / steps
    return fn


def available() -> bool:
    return importlib.util.find_spec("spmd.pipeline") is not None


def schedule_rows(S: int, Ms: Sequence[int]) -> list[Row]:
    from spmd.pipeline import get_schedule

    rows = []
    for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for M in Ms:
            sched = get_schedule(name, S, M, V)
            useful = 1 - sched.bubble_fraction
            theory = 1 - (S - 1) / (V * M + S - 1)
            rows.append(Row(f"schedule {name} S={S} M={M}" + (f" V={V}" if V > 1 else ""), f"{useful:.4f}",
                            f"{theory:.4f} = 1 - (S-1)/({'V*' if V > 1 else ''}M+S-1)", useful / theory, "1.00",
                            abs(useful / theory - 1) < 1e-9,
                            f"{sched.n_ticks} ticks; max in-flight microbatches per stage {sched.max_in_flight}"))
    return rows


def zero_bubble_rows(S: int, Ms: Sequence[int]) -> list[Row]:
    """ZB-H1 / ZB-H2 tables against the paper's bubble, and ZB-H1's bubble against 1F1B's."""
    from spmd.pipeline import get_schedule

    rows = []
    for M in Ms:
        one = get_schedule("1f1b", S, M)
        for name in ("zb-h1", "zb-h2"):
            sched = get_schedule(name, S, M)
            useful, theory = 1 - sched.bubble_fraction, 1 - (S - 1) / (3 * M + S - 1)
            rows.append(Row(f"schedule {name} S={S} M={M}", f"{useful:.4f}", f"{theory:.4f} = 1 - (S-1)/(3M+S-1)",
                            useful / theory, "1.00", abs(useful / theory - 1) < 1e-9,
                            f"{sched.n_ticks} ticks; max in-flight {sched.max_in_flight} (1f1b {one.max_in_flight}); "
                            f"bubble with overlapped steps {sched.overlapped_bubble_fraction:.4f}; lockstep time "
                            f"{sched.lockstep_time():.0f} chunk forwards (1f1b {one.lockstep_time():.0f})"))
        h1 = get_schedule("zb-h1", S, M)
        target = (M + S - 1) / (3 * M + S - 1)
        rows.append(Row(f"bubble zb-h1 vs 1f1b S={S} M={M}", f"{h1.bubble_fraction:.4f}",
                        f"{one.bubble_fraction:.4f} 1f1b", h1.bubble_fraction / one.bubble_fraction,
                        f"= (M+S-1)/(3M+S-1) = {target:.3f}", abs(h1.bubble_fraction / one.bubble_fraction - target) < 1e-9,
                        "from the tables; tends to 1/3 as M grows"))
        rows.append(zb_v_row(S, M))
    return rows


def zb_v_row(S: int, M: int) -> Row:
    """ZB-V's table against its bubble ``(S-1)/(6M+S-1)`` (2 chunks per device, each op one chunk-tick);
    the note compares its peak chunk inputs held, halved (a chunk is half a stage), with 1F1B's."""
    from spmd.pipeline import get_schedule

    sched, one, h1 = get_schedule("zb-v", S, M, 2), get_schedule("1f1b", S, M), get_schedule("zb-h1", S, M)
    useful, theory = 1 - sched.bubble_fraction, 1 - (S - 1) / (6 * M + S - 1)
    return Row(f"schedule zb-v S={S} M={M} V=2", f"{useful:.4f}", f"{theory:.4f} = 1 - (S-1)/(6M+S-1)",
               useful / theory, "1.00", abs(useful / theory - 1) < 1e-9,
               f"{sched.n_ticks} ticks of a chunk (half a stage); bubble {sched.bubble_fraction:.4f} (zb-h1 "
               f"{h1.bubble_fraction:.4f}); max in-flight {sched.max_in_flight} chunk inputs = "
               f"{sched.max_in_flight / 2:g} stage inputs (1f1b {one.max_in_flight}); lockstep time "
               f"{sched.lockstep_time() / 2:.0f} stage forwards (zb-h1 {h1.lockstep_time():.0f})")


def zero_bubble_step_rows(quick: bool) -> list[Row]:
    """Measured step time of ZB-H1 against 1F1B (same GPT, pipe = STAGES, same global batch)."""
    M = STAGES if quick else 2 * STAGES
    rounds, steps = (1, 2) if quick else (3, 4)
    setups = {name: pipeline_setup(name, M, quick) for name in ("1f1b", "zb-h1")}
    states = {name: s.state for name, s in setups.items()}

    def round_of(name):
        return timed_round(setups, states, name, steps)

    for name in setups:  # warm up
        round_of(name)()
    times = common.interleaved(rounds, {name: round_of(name) for name in setups})
    zb, one = (statistics.median(times[n]) for n in ("zb-h1", "1f1b"))
    from spmd.pipeline import get_schedule

    lock = get_schedule("zb-h1", STAGES, M).lockstep_time() / get_schedule("1f1b", STAGES, M).lockstep_time()
    temp = {n: spmd.inspection.memory(s.compiled).temp for n, s in setups.items()}
    flops = {n: executed_dot_flops(s.compiled, get_schedule(n, STAGES, M)) for n, s in setups.items()}
    ratio = float(flops["zb-h1"].max() / flops["1f1b"].max())
    return [Row(f"pp{STAGES} zb-h1 vs 1f1b M={M}: step time", f"{zb * 1e3:.1f} ms", f"{one * 1e3:.1f} ms 1f1b",
                zb / one, "-", None,
                f"simulated CPU devices share cores, so time follows total work: zb runs F 1 + B 2 + W 1 = 4 chunk "
                f"forwards per microbatch, 1f1b's matmul FLOPs (next row), but 3 ops per microbatch over "
                f"{get_schedule('zb-h1', STAGES, M).n_ticks} ticks against 2 over {get_schedule('1f1b', STAGES, M).n_ticks}, "
                f"and on these small blocks per-op and per-tick overhead weighs more than FLOPs; one device per stage "
                f"would follow the lockstep time, ratio {lock:.3f}; temp bytes per device {fmt_bytes(temp['zb-h1'])} vs "
                f"{fmt_bytes(temp['1f1b'])}"),
            Row(f"pp{STAGES} zb-h1 vs 1f1b M={M}: executed matmul FLOPs per device", f"{flops['zb-h1'].max() / 1e6:.2f} MFLOP",
                f"{flops['1f1b'].max() / 1e6:.2f} MFLOP 1f1b", ratio, "<= 1.02", ratio <= 1.02,
                "busiest device (the last stage: the head), from the compiled HLO: loop bodies times their trip "
                "counts, each branch of the tick switch on the ticks its stage takes it; per stage "
                + ", ".join(f"{a / b:.3f}" for a, b in zip(flops["zb-h1"], flops["1f1b"], strict=True)))]


def executed_dot_flops(compiled, schedule) -> np.ndarray:
    """``[S]``: the matmul FLOPs each stage's device executes per step, from the compiled HLO, loop
    bodies times their trip counts (:func:`benchmarks.mfu.computation_dots`); a computation under the
    table engine's compute switch counts only on the ticks its stage takes that branch
    (:func:`spmd.pipeline.sends.branch_ticks`), not on every tick as :func:`benchmarks.mfu.dot_flops` does."""
    from benchmarks.mfu import computation_dots
    from spmd.pipeline.sends import compute_branches

    comps = {c.name: c for c in spmd.hlo.computations(compiled)}
    T = schedule.n_ticks
    ticks, under = compute_branches(comps, schedule)
    out = np.zeros(schedule.n_stages)
    for name, comp in comps.items():
        flops = sum(f for f, _ in computation_dots(comp)) if comp.count else 0.0
        if name in under:
            out += flops * comp.count / T * ticks[:, sorted(under[name])].sum(1)
        else:
            out += flops * comp.count
    return out


def pipeline_setup(name: str, M: int, quick: bool, abstract: bool = False) -> common.GPTSetup:
    """The compiled GPT step with its stack pipelined over ``pipe`` = STAGES devices (``abstract``: the state
    as shapes and shardings, for a step that is only compiled)."""
    import dataclasses

    from spmd.pipeline import PipelineConfig

    cfg, batch, length = common.gpt_config(quick=True)  # small blocks: the schedule, not the matmuls, is measured
    V = 2 if name in ("interleaved", "zb-v") else 1
    cfg = dataclasses.replace(cfg, n_layers=STAGES * V * (1 if quick else 2))
    mesh = meshes.make_mesh({"pipe": STAGES}, devices=jax.devices()[:STAGES])
    batch = 4 * STAGES  # the same global batch for every M (M <= 4 S: at least one row per microbatch)
    return common.gpt_setup(cfg, mesh, "dp", batch, length,
                            pipeline=PipelineConfig(name, microbatches=M, virtual_stages=V), abstract=abstract)


def comms_row(name: str, M: int, setup: common.GPTSetup) -> Row:
    """Bytes the compiled step sends over ``pipe`` (``hlo_sent_bytes``: each switch branch weighed by how
    often the table takes it) against the minimum ``2 x M x (C-1)`` activations (``Schedule.sent_bytes``;
    ZB-V ``2 x M x (C-2)``: its turn stays on one device)."""
    from spmd.pipeline import get_schedule
    from spmd.pipeline.sends import hlo_sent_bytes

    V = 2 if name in ("interleaved", "zb-v") else 1
    sched = get_schedule(name, STAGES, M, V)
    cfg, (batch, length) = setup.cfg, setup.batch["inputs"].shape
    act = (batch // M) * length * cfg.d_model * np.dtype(cfg.compute_dtype).itemsize
    table, found = sched.sent_bytes(act), hlo_sent_bytes(setup.compiled, sched, setup.mesh)
    measured = found["executed"] + found["unattributed"]
    other = [o for o in spmd.hlo.collectives(setup.compiled, setup.mesh)
             if "pipe" in o.axes and o.kind != "collective-permute" and o.count > 1]
    note = (f"summed over the stages; table {fmt_bytes(table.executed)}, busiest stage "
            f"{fmt_bytes(max(table.per_stage))}; unattributed permutes {fmt_bytes(found['unattributed'])}; "
            f"per-tick collectives over pipe besides the sends: {len(other)}")
    return Row(f"pp{STAGES} {name} M={M}: sends over pipe", fmt_bytes(measured),
               f"{fmt_bytes(table.minimum)} = 2 x M x (C-{2 if name == 'zb-v' else 1}) x [B/M,L,D], C = {sched.n_chunks}",
               measured / table.minimum, "1.00", measured <= table.minimum * 1.01 and not other, note)


def fsdp_gather_rows(quick: bool, schedule: str = "1f1b") -> list[Row]:
    """bf16 compute on fsdp=2 x pipe=2 x tensor=2 (rules fsdp_tp), ``schedule`` M=4: the all-gather bytes over ``fsdp``
    per step with the stage weight matrices gathered in bf16, against the same step gathering them in f32
    (as before), compiled in this run; the stage matrices' share is ``sum |W| / S`` elements per device in
    the manual view (a stage's layers, ``tensor`` automatic)."""
    import dataclasses

    from spmd.pipeline import PipelineConfig, layout

    S = 2
    cfg, _, length = common.gpt_config(quick=True)
    cfg = dataclasses.replace(cfg, n_layers=S if quick else 2 * S, dtype="bfloat16")
    mesh = meshes.make_mesh({"fsdp": 2, "pipe": S, "tensor": 2}, devices=jax.devices()[:8])
    pipeline = PipelineConfig(schedule, microbatches=4)

    def gathered() -> tuple[int, common.GPTSetup]:
        setup = common.gpt_setup(cfg, mesh, "fsdp_tp", 16, length, pipeline=pipeline, abstract=quick)
        ops = spmd.hlo.collectives(setup.compiled, setup.mesh)
        return sum(o.bytes * o.count for o in ops if o.kind == "all-gather" and "fsdp" in o.axes), setup

    narrow, setup = gathered()
    own = layout.gather_dtypes
    layout.gather_dtypes = lambda leaves, dtype: ()  # every gather in the parameters' dtype (f32): before
    try:
        wide, _ = gathered()
    finally:
        layout.gather_dtypes = own
    stage = [a for a in jax.tree.leaves(setup.state[0]["blocks"]) if a.ndim >= 3 and "fsdp" in str(a.sharding.spec)]
    f32 = sum(a.size // S * 4 for a in stage)  # the stage matrices gathered per device, f32
    expected = wide - f32 // 2
    stage_now = narrow - (wide - f32)
    what = f"pp{S} fsdp2 tp2 {schedule} M=4 bf16"
    return [Row(f"{what}: stage weight gathers over fsdp, bf16 vs f32 (before)", fmt_bytes(stage_now),
                f"{fmt_bytes(f32)} f32", stage_now / f32, "0.50", abs(stage_now / f32 - 0.5) < 1e-9,
                f"{len(stage)} stage matrices (rank >= 3), sum |W| / S elements per device; the rest (norm scales, "
                "embedding, head) as before; the loss and gradients equal the f32-gather step's (tests/spmd/pipeline/test_pipeline.py)"),
            Row(f"{what}: all-gather over fsdp per device", fmt_bytes(narrow),
                f"{fmt_bytes(expected)} = the bf16 count (f32 step {fmt_bytes(wide)} - half its stage matrices)",
                narrow / expected, "1.00", narrow == expected,
                "the bf16 values move as their 16 bits (no float all-gather for XLA:CPU to promote), so the CPU "
                "program emits these bytes too" + ("; gpipe differentiates the gather: its gradient is reduce-scattered "
                                                   "in f32" if schedule == "gpipe" else ""))]


def step_rows(quick: bool) -> list[Row]:
    """Step time and per-device temp (activation) memory per schedule for M in {S, 2S, 4S}."""
    Ms = (STAGES,) if quick else (STAGES, 2 * STAGES, 4 * STAGES)
    names = ("1f1b",) if quick else ("gpipe", "1f1b", "interleaved")
    cases = [(n, m) for n in names for m in Ms]
    rounds, steps = (1, 2) if quick else (3, 4)
    setups = {case: pipeline_setup(*case, quick) for case in cases}
    states = {case: s.state for case, s in setups.items()}

    def round_of(case):
        return timed_round(setups, states, case, steps)

    for case in cases:  # warm up
        round_of(case)()
    times = common.interleaved(rounds, {f"{n}/{m}": round_of((n, m)) for n, m in cases})
    rows = []
    for name in names:
        V = 2 if name == "interleaved" else 1
        base_m = Ms[0]
        base = statistics.median(times[f"{name}/{base_m}"])
        for m in Ms:
            t = statistics.median(times[f"{name}/{m}"])
            ideal = ((V * m + STAGES - 1) / (V * m)) / ((V * base_m + STAGES - 1) / (V * base_m))
            rows.append(Row(f"pp{STAGES} {name} M={m}: step time", f"{t * 1e3:.1f} ms",
                            f"{base * 1e3:.1f} ms at M={base_m} x ideal {ideal:.3f}", (t / base) / ideal, "1.00",
                            None, "simulated CPU devices share cores: reported, not judged"))
        for m in Ms:
            temp = spmd.inspection.memory(setups[(name, m)].compiled).temp
            if (gp := setups.get(("gpipe", m))) is not None:
                ref = spmd.inspection.memory(gp.compiled).temp
                rows.append(Row(f"pp{STAGES} {name} M={m}: temp bytes per device", fmt_bytes(temp),
                                f"{fmt_bytes(ref)} gpipe at M={m}", temp / ref, "-", None,
                                "compiled memory_analysis temp; same global batch for every M: gpipe keeps "
                                "residuals of all M microbatches, 1f1b/interleaved a stash of <= S stage inputs"))
            else:
                rows.append(Row(f"pp{STAGES} {name} M={m}: temp bytes per device", fmt_bytes(temp), "-",
                                float("nan"), "-", None, "compiled memory_analysis temp"))
        rows.append(comms_row(name, Ms[-1], setups[(name, Ms[-1])]))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.pipeline") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    if not available():
        line = "pipeline: not available (no spmd.pipeline module)"
        common.report("pipeline", "Pipeline schedules", [], options, command, after=[line], started_load=started)
        return []
    Ms = (STAGES, 2 * STAGES) if options.quick else (STAGES, 2 * STAGES, 4 * STAGES)
    rows = schedule_rows(STAGES, Ms) + zero_bubble_rows(STAGES, Ms)
    after, failure = [], None
    if len(jax.devices()) < STAGES:
        after.append(f"steps: skipped (need {STAGES} devices, {len(jax.devices())} present)")
    else:
        try:
            rows += step_rows(options.quick)
            rows += zero_bubble_step_rows(options.quick)
            zb_v = STAGES if options.quick else 2 * STAGES
            rows.append(comms_row("zb-v", zb_v, pipeline_setup("zb-v", zb_v, options.quick, abstract=options.quick)))
            if len(jax.devices()) >= 8:  # quick: 1f1b's gathers only (gpipe's compile the same rows again)
                rows += fsdp_gather_rows(options.quick) + ([] if options.quick else fsdp_gather_rows(False, "gpipe"))
        except Exception as exc:  # report the engine's failure next to the schedule rows, then fail the command
            after.append(f"steps: failed: {type(exc).__name__}: {str(exc)[:300]}")
            failure = exc
    cfg, batch, length = common.gpt_config(quick=True)
    before = [f"- S = {STAGES} stages over the pipe axis; steps: GPT d_model={cfg.d_model}, {STAGES} x V layers "
              f"(x2 in full mode), batch {4 * STAGES} x {length}, AdamW, dp rules + layers over pipe; "
              "M microbatches at the same global batch"]
    common.report("pipeline", "Pipeline schedules: useful work vs theory, step time vs M", rows, options, command,
                  before=before, after=after, started_load=started)
    if failure is not None:
        raise RuntimeError("the pipeline step rows failed (reported in RESULTS.md)") from failure
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.pipeline") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
