"""The planner: enumeration, pruning, a known answer, and rejections confirmed by real compiles.

Known answer: GPT-2 small (114M params, f32 master weights + Adam = 1.8 GB of state) on 8
devices of 2 GB each. Data parallelism holds the whole state on every device and cannot fit;
FSDP shards it and does, so the planner must pick an FSDP layout. Negative control: on real
80 GB H100s data parallelism fits again.

Pipeline known answer: a 16-layer model whose heads (one) rule out tensor parallelism, on devices
that hold about half of its state: data parallelism cannot fit, layouts that split the layers over
``pipe`` (or shard over ``fsdp``) must, and every pipe layout's compute time carries exactly its
schedule's bubble, ``(S-1)/(M+S-1)`` for 1F1B and ``(S-1)/(VM+S-1)`` interleaved.

Rejections are checked against the compiler: with an artificial device of a few hundred KiB,
every layout the planner rejects for memory must need more than the budget in the compiled
dry run, and the chosen one must fit there.
"""

import collections
import math
import re

import pytest

import spmd
from spmd.models import flops_per_step
from spmd.pipeline import get_schedule
from trainers import override, recipe
from trainers.checks import Issue
from trainers.checks.compiled import check_collectives, parse_remat_warnings
from trainers.checks.params import check_divisibility, check_replicated
from trainers.launch.plan import main
from trainers.model_variables import param_infos
from trainers.planning.blockers import blockers, group_reasons, workable_counts
from trainers.planning.costs import gpt_work, memory_estimate
from trainers.planning.dryrun import dry_run
from trainers.planning.hardware import custom, get_hardware
from trainers.planning.planner import REMAT_LADDER, Layout, candidates, estimate_layout, plan

SMALL_HBM = custom("h100", hbm_bytes=1.4e9, name="h100-1.4gb")


def test_candidates_are_distinct_factorisations_with_matching_rules():
    layouts = candidates(8)
    # 20 data x fsdp x tensor layouts, and the 10 of them with tensor > 1 again under the *_sp rule sets
    assert len(layouts) == len(set(layouts)) == 30 and all(layout.pipe == 1 for layout in layouts)
    sp = {(x.mesh, x.remat) for x in layouts if x.rules.endswith("_sp")}
    assert len(sp) == 10 and sp == {(x.mesh, x.remat) for x in layouts if x.rules in ("dp_tp", "fsdp_tp")}
    for layout in layouts:
        sizes = layout.sizes
        assert sizes["data"] * sizes["fsdp"] * sizes["tensor"] == 8 and "seq" not in sizes and "expert" not in sizes
        used = {a for a, s in sizes.items() if s > 1}
        assert {"dp": {"data"}, "tp": {"tensor"}, "dp_tp": {"data", "tensor"}}.get(layout.rules.removesuffix("_sp"),
                                                                                     used) == used
        assert ("fsdp" in layout.rules) == ("fsdp" in used) and ("tp" in layout.rules) == ("tensor" in used)
    assert {str(layout) for layout in candidates(1)} == {"data=1 dp", "data=1 dp remat"}
    with pytest.raises(ValueError, match="devices must be a positive integer, got 0"):
        candidates(0)
    with pytest.raises(ValueError, match="n_layers must be a positive integer or None, got 0"):
        candidates(8, n_layers=0, batch=8)
    with pytest.raises(ValueError, match="pipe=2 and pipeline schedule 'none'"):
        Layout((("data", 4), ("pipe", 2)), "dp", False)


def test_pipe_candidates_divide_layers_and_batch():
    layouts = candidates(8, n_layers=4, batch=16)
    piped = [x for x in layouts if x.pipe > 1]
    assert len(layouts) == len(set(layouts)) and len(layouts) - len(piped) == 30
    assert {x.pipe for x in piped} == {2, 4}  # 8 does not divide 4 layers
    for x in piped:
        assert math.prod(x.sizes.values()) == 8 and 16 % x.microbatches == 0
        assert x.microbatches in (x.pipe, 2 * x.pipe, 4 * x.pipe)
        assert x.virtual_stages == (2 if x.schedule in ("interleaved", "zb-v") else 1)
        assert x.schedule == "1f1b" or x.virtual_stages == 1 or 4 % (2 * x.pipe) == 0  # V=2 where 2*pipe divides
    # every schedule spmd.pipeline.NAMES lists (the zero-bubble ones too), no special cases
    assert {x.schedule for x in piped} == set(spmd.pipeline.NAMES)
    single = {n for n in spmd.pipeline.NAMES if n not in ("interleaved", "zb-v")}  # one chunk per stage (4 layers)
    assert {(x.schedule, x.microbatches) for x in piped if x.pipe == 4} == {(n, m) for n in single for m in (4, 8, 16)}
    assert {(x.schedule, x.microbatches) for x in piped if x.pipe == 2 and x.sizes["data"] == 4 and not x.remat} == {
        (n, m) for n in spmd.pipeline.NAMES for m in (2, 4, 8)}
    x = next(x for x in piped if x.schedule == "interleaved")
    assert {"pipeline.schedule=interleaved", f"pipeline.microbatches={x.microbatches}",
            "pipeline.virtual_stages=2"} <= set(x.overrides())
    assert "--set pipeline.schedule=interleaved" in x.command() and "pipe=2" in x.command()
    assert "pipeline" not in candidates(8)[0].command()  # negative control
    assert x.apply(deep_model()) == override(deep_model(), x.overrides())  # built directly = the CLI overrides


def deep_model():
    """16 layers, one head (no tensor parallelism), blocks ~90% of the parameters."""
    return override(recipe("gpt-small", tiny=True), ["model.n_layers=16", "model.n_heads=1", "model.d_ff=66",
                                                     "data.global_batch=32"])


def test_known_answer_deep_model_needs_its_layers_split():
    cfg = deep_model()
    dp8 = memory_estimate(Layout((("data", 8),), "dp", False).apply(cfg), {"data": 8})
    layout8 = Layout((("pipe", 8),), "dp", False, "1f1b", 32)
    p8 = memory_estimate(layout8.apply(cfg), layout8.sizes)
    assert p8.total < dp8.state / 2
    # budget: between what pipe=8 needs in all and the replicated state alone
    hw = custom("cpu", hbm_bytes=(p8.total + dp8.state) / 2 / 0.9, name="small")
    result = plan(cfg, 8, hw)
    assert result.ranked, result.format()
    for e in result.ranked:  # whatever fits splits the layers or shards the state
        assert e.layout.pipe > 1 or e.layout.sizes["fsdp"] > 1, e.layout
    unsplit = [e for e in result.rejected if e.layout.pipe == 1 and e.layout.sizes["fsdp"] == 1]
    assert unsplit and all(not e.fits for e in unsplit)
    assert all(e.memory.state > e.budget for e in unsplit if e.layout.rules == "dp")
    piped = [e for e in result.ranked if e.layout.pipe > 1]
    assert piped and any(e.layout.pipe == 8 and e.layout.sizes["data"] == 1 for e in piped)
    # 1/pipe of the block parameters per device
    assert p8.params < dp8.params / 4
    # the 1F1B stash holds about S microbatch inputs, GPipe M: GPipe needs more activation memory
    layout = Layout((("pipe", 8),), "dp", False, "1f1b", 32)
    gpipe = memory_estimate(Layout((("pipe", 8),), "dp", False, "gpipe", 32).apply(cfg), layout.sizes)
    assert memory_estimate(layout.apply(cfg), layout.sizes).activations < gpipe.activations
    # negative control: devices that hold the whole state take data parallelism again
    roomy = plan(cfg, 8, custom("cpu", hbm_bytes=dp8.total * 2, name="roomy"))
    assert any(e.layout.rules == "dp" and e.layout.sizes["data"] == 8 for e in roomy.ranked)


def test_pipe_layouts_carry_their_bubble_and_permutes():
    cfg = deep_model()
    peak = custom("h100").peak(cfg.model.dtype)
    flops = flops_per_step(cfg.model, cfg.data.global_batch, cfg.data.seq_len) / 8
    seen, unstretched = set(), collections.defaultdict(set)
    for layout in candidates(8, n_layers=16, batch=32):
        if layout.pipe == 1 or layout.remat:
            continue
        e = estimate_layout(cfg, layout, "h100")
        if not e.buildable:  # tensor > 1 with one head
            continue
        S, M, V = layout.pipe, layout.microbatches, layout.virtual_stages
        sched = get_schedule(layout.schedule, S, M, V)
        # the engine advances tick by tick, each tick as long as its slowest op: the idle share of that time
        table = 1 - M * V * sum(sched.op_costs().values()) / sched.lockstep_time()
        assert table >= sched.bubble_fraction - 1e-12  # never below the table's idle slots
        # any schedule: compute is stretched by 1 / (1 - the engine's bubble), the only thing M changes
        unstretched[(layout.schedule, S, layout.sizes["fsdp"])].add(round(e.roofline.compute_s * (1 - table), 18))
        if layout.schedule not in ("1f1b", "interleaved"):
            continue
        bubble = table
        # compute = matmul FLOPs x4/3 (each chunk recomputed in its backward) / (peak x matmul_eff), causal fused
        # attention (7/12 of the counted 12, + 2/12 recomputed) at attention_eff, / (1 - bubble)
        hw, m = get_hardware("h100"), cfg.model
        attn = 12 * m.n_layers * m.n_heads * m.k * cfg.data.seq_len ** 2 * cfg.data.global_batch / 8
        expect = ((flops - attn) * 4 / 3 / hw.matmul_eff + attn * 9 / 12 / hw.attention_eff) / peak / (1 - bubble)
        assert e.roofline.compute_s == pytest.approx(expect, rel=1e-9), layout
        # the busiest stage's sends from the schedule table (no regrouping of interleaved weights any more)
        (permute,) = [x for x in e.traffic if x.kind == "collective-permute"]
        rows = 32 // (layout.sizes["data"] * layout.sizes["fsdp"]) // M  # per device per microbatch
        per_stage = get_schedule(layout.schedule, S, M, V).sent_bytes(rows * 16 * 32 * 4).per_stage
        assert permute.axes == ("pipe",) and permute.bytes == max(per_stage) == permute.count * rows * 16 * 32 * 4
        # each microbatch leaves a chunk c = v S + s forward when c < C-1, backward when c > 0 (C = S V)
        C = S * V
        busiest = max(sum((c < C - 1) + (c > 0) for c in range(s, C, S)) for s in range(S)) * M
        assert permute.count == busiest < 2 * (V * M + S - 1)  # below one send each way per tick
        seen.add((S, M, V))
    assert {(2, 2, 1), (8, 32, 1), (4, 8, 2)} <= seen
    assert {k[0] for k in unstretched} == set(spmd.pipeline.NAMES) and all(len(v) == 1 for v in unstretched.values())
    # negative control: more microbatches, smaller bubble, less compute time
    few, many = (estimate_layout(cfg, Layout((("pipe", 8),), "dp", False, "1f1b", m), "h100") for m in (8, 32))
    assert many.roofline.compute_s < few.roofline.compute_s


def test_stash_sizes_are_the_schedule_tables_buffers():
    """1F1B holds about S stage inputs whatever M is; interleaved V=2 more; GPipe every microbatch."""
    assert get_schedule("1f1b", 4, 8).stash_sizes() == get_schedule("1f1b", 4, 32).stash_sizes() == (4, 1)
    assert get_schedule("interleaved", 2, 4, 2).stash_sizes() == (4, 2)
    assert get_schedule("gpipe", 4, 8).stash_sizes() == (8, 8)
    assert get_schedule("1f1b", 1, 4).stash_sizes() == (1, 1)  # nothing crosses a stage: one slot each still


def test_known_answer_too_big_for_dp_picks_fsdp():
    cfg = recipe("gpt-125m")
    result = plan(cfg, 8, SMALL_HBM)
    best = result.best
    assert best.layout.sizes["fsdp"] > 1 or best.layout.pipe > 1, best.layout
    assert best.fits and best.memory.total <= best.budget
    assert any(e.layout.rules in ("fsdp", "fsdp_tp") and e.layout.pipe == 1 for e in result.ranked)
    dp = [e for e in result.rejected if e.layout.rules == "dp" and e.layout.pipe == 1]
    # the state alone does not fit, with or without a seq axis (context parallelism shards no state)
    assert len([e for e in dp if "seq" not in e.layout.sizes]) == len(REMAT_LADDER)  # every policy tried, none fits
    assert all(e.memory.state > e.budget for e in dp)
    assert len(dp) > 2 and any("seq" in e.layout.sizes for e in dp)
    assert all(e.fits for e in result.ranked) and all(not e.fits for e in result.rejected)
    steps = [e.roofline.step_s for e in result.ranked]
    assert steps == sorted(steps)
    # negative control: with 80 GB per device data parallelism fits
    roomy = plan(cfg, 8, "h100")
    assert any(e.layout.rules == "dp" for e in roomy.ranked)


def test_rejected_layouts_really_exceed_the_budget_when_compiled():
    cfg = recipe("gpt-small", tiny=True)
    tiny = custom("cpu", hbm_bytes=7e5, name="tiny")  # a CPU target: the compiled program is the verdict
    result = plan(cfg, 8, tiny, confirm=1)
    over = [e for e in result.rejected if e.memory is not None]
    # data parallelism replicates the state, with or without context parallelism (seq splits only activations);
    # GPipe keeps every microbatch's residuals
    assert {e.layout.rules for e in over} == {"dp"} and any("seq" in e.layout.sizes for e in over)
    over = [e for e in over if "seq" not in e.layout.sizes]  # the compiles below: the layouts without seq
    assert {"data=8 dp", "data=8 dp remat"} <= {str(e.layout) for e in over}  # (and GPipe's where the model says so)
    for e in over:
        if e.layout.remat:
            continue
        report = dry_run(e.layout.apply(cfg), devices=8, hardware=tiny)
        assert report.compiled.total > report.budget and not report.fits, (e.layout, report.compiled)
    # the printed top choice was compiled and fits (negative control for the rejections above)
    (chosen,) = result.compiled[:1]
    assert result.confirmed[0] is result.best is result.ranked[0] and chosen.fits
    assert chosen.compiled.total <= chosen.budget and chosen.verdict == "compiled"
    text = result.format(top=1)
    assert str(result.best.layout) in text and spmd.units.fmt_bytes(chosen.peak_bytes) in text
    assert "memory above the budget" in text and "closest over the budget:" in text


def test_printed_top_choices_all_fit_when_compiled_for_an_accelerator(capsys):
    """spmd-plan --top 1: the pick printed was compiled, and fits by the accelerator memory model on its shapes."""
    assert main(["gpt-small", "--tiny", "--devices", "8", "--hardware", "h100", "--top", "1", "--verify"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("dominant cost"):out.index("chosen:")]
    assert "each pick's accelerator memory model on the compiled shapes fits" in table
    assert len([line for line in table.splitlines() if line.lstrip().startswith("1 ")]) == 1
    assert "2 " not in [line.lstrip()[:2] for line in table.splitlines()]  # --top 1: one pick
    assert "the chosen pick's dry run:" in out and "verdict from the accelerator memory model" in out
    assert "fits:" in out and "does NOT fit" not in out


def test_impossible_device_counts_name_the_blocker_and_the_nearest_counts():
    """No compile: the constraints that rule out every factorisation, and the nearest counts that work."""
    pod = override(recipe("gpt-350m"), ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32",
                                         "data.global_batch=1024", "data.seq_len=2048"])
    found = blockers(pod, 7168)
    assert any(b.startswith("global batch 1024 cannot split over more than 1024 devices on the batch axes")
               for b in found), found
    seven = next(b for b in found if b.startswith("7 divides the device count 7168 but none of"))
    assert "n_layers 32 (pipe" in seven and "tensor of 1, 2, 4, 8, 16, 32" in seven and "seq_len 2048" in seven
    assert workable_counts(pod, 7168) == ((4096,), (8192,))
    assert blockers(pod, 4096) == [] and blockers(pod, 256) == []  # negative control
    # a small impossible count through the planner: 0 of K, the reasons grouped and counted, the budget right
    cfg = recipe("gpt-small", tiny=True)
    result = plan(cfg, 24, "h100")
    assert not result.ranked and result.budget == pytest.approx(0.9 * get_hardware("h100").hbm_bytes)
    assert any(b.startswith("3 divides the device count 24 but none of") for b in result.blockers), result.blockers
    below, above = result.nearest
    assert below and above and below[0] < 24 < above[0]
    assert plan(cfg, below[0], "h100").ranked and plan(cfg, above[0], "h100").ranked  # they really work
    text = result.format()
    assert text.startswith(f"0 of {len(result.rejected):,} layouts of 24 devices fit h100")
    assert f"budget {spmd.units.fmt_bytes(result.budget)}" in text and "0 B" not in text.splitlines()[0]
    assert f"nearest device counts with a layout that fits: {below[0]} below, {above[0]} above" in text
    groups = {g: n for g, n, _ in group_reasons(next(i for i in e.issues if i.fatal) for e in result.rejected)}
    assert sum(groups.values()) == len(result.rejected) and "n_heads / n_kv_heads vs tensor" in groups
    for g, n in groups.items():
        assert re.search(rf"{re.escape(g)}\s+{n:,}\s", text), g
    with pytest.raises(ValueError, match="3 divides the device count 24"):
        result.best


def test_pod_scale_tables_stay_aligned():
    ops = [spmd.hlo.Collective("all-gather", ("data", "fsdp"), 74511, 3 * 2**50 // 74511, 8192),
           spmd.hlo.Collective("all-reduce", ("tensor",), 981, 12, 8),
           spmd.hlo.Collective("reduce-scatter", ("fsdp",), 1, 5 * 2**40, 64)]
    lines = spmd.hlo.format_collectives(ops).splitlines()
    assert "74,511" in lines[1] and "3.00 PiB" in lines[1] and "5.00 TiB" in lines[3]
    ends = {line.index(c) + len(c) for line, c in zip(lines, ("count", "74,511", "981", "1"))
            if c in line}
    assert len(ends) == 1  # the count column is right-aligned: every cell ends at the same column
    assert {line.index("B") for line in lines[1:]} == {line.index("bytes/device") + len("bytes/device") - 1
                                                       for line in lines[:1]}
    table = spmd.units.format_table([("a", "n"), ("long name", spmd.units.fmt_count(1234567))], "<>")
    assert table.splitlines() == ["a                  n", "long name  1,234,567"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        spmd.units.format_table([("a", "b", "c")], "<>")


def test_indivisible_dims_are_traced_to_the_parameter_with_a_fix():
    cfg = override(recipe("gpt-small", tiny=True), ["model.d_ff=682"])
    sizes = {"data": 2, "fsdp": 1, "tensor": 4}
    issues = check_divisibility(param_infos(cfg.model), "dp_tp", sizes)
    by_path = {i.path: str(i) for i in issues}
    assert by_path["blocks/block/mlp/w_gate_up"].startswith(
        "blocks/block/mlp/w_gate_up dim mlp=682 does not divide by tensor=4: use model.d_ff a multiple of 4, or rules fsdp")
    assert {"blocks/block/mlp/w_down"} <= set(by_path) and all(i.fatal for i in issues)
    # the same layout really fails where the state would be created
    import jax

    with pytest.raises(spmd.rules.RulesError, match="does not divide"):
        spmd.sharding.spec_for((2, 32, 682), ("layers", "embed", "mlp"), "dp_tp",
                      jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2))
    # negative control: d_ff=512 divides
    ok = override(cfg, ["model.d_ff=512"])
    assert check_divisibility(param_infos(ok.model), "dp_tp", sizes) == []
    e = estimate_layout(cfg, Layout((("data", 2), ("fsdp", 1), ("tensor", 4)), "dp_tp", False), "h100")
    assert not e.buildable and "mlp=682" in e.reason


def test_batch_that_does_not_split_is_rejected():
    cfg = override(recipe("gpt-small", tiny=True), ["data.global_batch=4"])
    e = estimate_layout(cfg, Layout((("data", 8), ("fsdp", 1), ("tensor", 1)), "dp", False), "h100")
    assert not e.buildable and "does not divide by data=8" in e.reason and "multiple of 8" in e.reason


def test_large_replicated_params_and_all_to_alls_and_remat_warnings():
    infos = param_infos(recipe("gpt-small", tiny=True).model)
    sizes = {"data": 1, "fsdp": 8, "tensor": 1}
    leaky = spmd.rules.FSDP.replace(name="fsdp_mlp_only", params={"embed": None, "mlp": "fsdp"})  # only the MLP sharded
    flagged = {i.path for i in check_replicated(infos, leaky, sizes)}
    assert {"embed", "head"} <= flagged and not any("mlp" in p for p in flagged)
    assert check_replicated(infos, "fsdp", sizes) == [] and check_replicated(infos, "dp", {"data": 8}) == []

    ops = [spmd.hlo.Collective("all-reduce", ("data",), 1, 64, 8),
           spmd.hlo.Collective("all-to-all", ("tensor",), 2, 4096, 4, op_name="jit(step)/jvp(GPT)/attn/reshape")]
    issues = check_collectives(ops)
    assert len(issues) == 1 and "jit(step)/jvp(GPT)/attn/reshape" in str(issues[0]) and "spmd.constrain" in str(issues[0])
    moe = spmd.hlo.Collective("all-to-all", ("expert",), 4, 4096, 2, op_name="jit(step)/jvp()/shard_map/all_to_all")
    assert check_collectives([moe]) == [] and len(check_collectives(ops + [moe])) == 1  # an explicit all_to_all is meant

    log = ('W0101 spmd_partitioner.cc:630] [spmd] Involuntary full rematerialization. The compiler was not able to go '
           'from sharding {devices=[1,8]<=[8]} to {devices=[8,1]<=[8]} without doing a full rematerialization of the '
           'tensor for HLO operation: %transpose.1 = f32[64,32]{1,0} transpose(%p), dimensions={1,0}, '
           'metadata={op_name="jit(step)/transpose" source_file="model.py" source_line=42}. You probably want to '
           'enrich the sharding annotations to prevent this from happening.\nother line\n')
    (warning,) = parse_remat_warnings(log)
    assert isinstance(warning, Issue) and warning.path == "jit(step)/transpose"
    assert "{devices=[1,8]<=[8]} to {devices=[8,1]<=[8]}" in warning.message and "model.py:42" in warning.message
    assert parse_remat_warnings("nothing to see\n") == []


def test_plan_cli(capsys):
    assert main(["gpt-125m", "--devices", "8", "--hardware", "h100", "--top", "3", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "layouts of 8 devices fit h100" in out and "dominant cost" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("spmd-train gpt-125m --mesh ") and "--rules " in last
    assert main(["gpt-125m", "--devices", "8", "--hardware", "b300"]) == 2
    assert "unknown hardware 'b300'" in capsys.readouterr().err
    big = custom("h100", hbm_bytes=1e6, name="nothing-fits")
    with pytest.raises(ValueError, match="no layout of 8 devices fits nothing-fits"):
        plan(recipe("gpt-125m"), 8, big).best
    assert main(["gpt-small", "--tiny", "--devices", "24", "--no-compile"]) == 2  # no layout: the blockers, exit 2
    captured = capsys.readouterr()
    assert "3 divides the device count 24" in captured.out and "nearest device counts" in captured.err


def _rows(e, kind, axes):
    return [x for x in e.traffic if x.kind == kind and x.axes == axes]


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_seq_layout_bytes_are_the_context_exchange(exchange):
    """data=4 x seq=2: per attention layer the ring sends seq-1 K/V [2, B, L/seq, G, K] forward, seq-1 more
    and seq dK/dV (f32) backward; all-gather moves K and V whole per pass and reduce-scatters dK, dV."""
    cfg = override(recipe("gpt-small", tiny=True), ["data.seq_len=64", f"model.context_exchange={exchange}"])
    m, s = cfg.model, 2
    e = estimate_layout(cfg, Layout((("data", 4), ("seq", s)), "dp", False), "h100")
    assert e.buildable, e.reason
    kv = 2 * (8 // 4) * (64 // s) * m.kv_heads * m.k  # elements of [2, B, L/seq, G, K]
    if exchange == "ring":
        (row,) = _rows(e, "collective-permute", ("seq",))
        assert row.count == m.n_layers * (2 * (s - 1) + s) and row.bytes == m.n_layers * (2 * (s - 1) + s) * kv * 4
    else:
        (gather,), (scatter,) = _rows(e, "all-gather", ("seq",)), _rows(e, "reduce-scatter", ("seq",))
        assert (gather.count, gather.bytes) == (4 * m.n_layers, 4 * m.n_layers * kv // 2 * s * 4)
        assert (scatter.count, scatter.bytes) == (2 * m.n_layers, 2 * m.n_layers * kv // 2 * s * 4)
    # the parameters are replicated over seq: their gradients are summed over data and seq together
    (grads,) = _rows(e, "all-reduce", ("data", "seq"))
    assert grads.bytes == e.memory.params
    # activations per device: the length is split over seq (negative control: data=4 alone, 4 devices)
    whole = memory_estimate(cfg, {"data": 4})
    assert 0.3 * whole.activations < e.memory.activations < 0.6 * whole.activations
    assert not _rows(estimate_layout(cfg, Layout((("data", 8),), "dp", False), "h100"), "collective-permute", ("seq",))


@pytest.mark.parametrize("cf, slots", [(0.0, 64), (1.25, 40)])  # dropless: C = T = 64 tokens; else ceil(cf T k / E)
def test_expert_layout_bytes_are_the_dispatch_and_combine(cf, slots):
    cfg = override(recipe("gpt-small", tiny=True), ["data.seq_len=64", "model.n_experts=4",
                                                    f"model.capacity_factor={cf}", "model.moe_exchange=padded"])
    m = cfg.model
    e = estimate_layout(cfg, Layout((("data", 2), ("expert", 4)), "dp_ep", False), "h100")
    assert e.buildable, e.reason
    (a2a,) = _rows(e, "all-to-all", ("expert",))
    rows = m.n_experts * slots  # dropless over expert = 4 = E, k = 2: T x min(k, E/ep) = T rows to each device
    ids = 0 if cf else m.n_layers  # dropless: each row's local expert id beside the forward dispatch (int32)
    assert a2a.count == 4 * m.n_layers + ids and a2a.bytes == 4 * m.n_layers * rows * m.d_model * 4 + ids * rows * 4
    # the experts stay on their shards (nothing gathered over expert); the other weights' gradients
    # are summed over every token axis, the experts' over data only
    assert not _rows(e, "all-gather", ("expert",)) and not _rows(e, "reduce-scatter", ("expert",))
    if not cf:  # the ragged exchange (auto off CPU) moves the routed rows, T x k, after the [ep, ep] row counts
        auto = override(cfg, ["model.moe_exchange=auto"])
        (ragged,) = _rows(estimate_layout(auto, Layout((("data", 2), ("expert", 4)), "dp_ep", False), "h100"),
                          "all-to-all", ("expert",))
        routed = slots * m.experts_per_token
        assert ragged.bytes == 4 * m.n_layers * routed * m.d_model * 4 + ids * routed * 4 and ragged.bytes < a2a.bytes
        cpu = estimate_layout(auto, Layout((("data", 2), ("expert", 4)), "dp_ep", False), "cpu")
        assert _rows(cpu, "all-to-all", ("expert",))[0].bytes == a2a.bytes  # CPU: padded
    infos = param_infos(m)
    experts = sum(p.nbytes for p in infos if p.dims and "expert" in p.dims)
    assert _rows(e, "all-reduce", ("data",))[0].bytes == experts // 4
    assert _rows(e, "all-reduce", ("data", "expert"))[0].bytes == sum(p.nbytes for p in infos) - experts
    assert e.memory.params == sum(p.nbytes for p in infos) - experts * 3 // 4  # E/4 experts per device
    # refused where the rule set cannot give expert parallelism, or the experts do not split
    bad = estimate_layout(cfg, Layout((("data", 2), ("expert", 4)), "dp", False), "h100")
    assert not bad.buildable and "expert" in bad.reason
    odd = override(cfg, ["model.n_experts=6"])
    assert not estimate_layout(odd, Layout((("data", 2), ("expert", 4)), "dp_ep", False), "h100").buildable


def test_planner_lists_seq_layouts_for_a_long_sequence():
    cfg = override(recipe("gpt-small", tiny=True), ["data.seq_len=4096", "data.global_batch=8"])
    layouts = candidates(8, n_layers=cfg.model.n_layers, batch=8, seq_len=4096)
    assert {x.sizes.get("seq", 1) for x in layouts} == {1, 2, 4, 8}
    assert any(x.pipe > 1 for x in layouts if x.sizes.get("seq", 1) > 1)  # context parallelism in a pipeline too
    assert {x.sizes.get("seq", 1) for x in candidates(8, seq_len=12)} == {1, 2}  # 12 splits in 2 x 2 only
    result = plan(cfg, 8, "h100")
    seq = [e for e in result.ranked if e.layout.sizes.get("seq", 1) > 1]
    # the ring's permutes over seq; under a pipeline the stages gather K/V over seq instead
    assert seq and all(_rows(e, "all-gather" if e.layout.pipe > 1 else "collective-permute", ("seq",)) for e in seq)
    assert any(e.layout.pipe > 1 for e in seq)
    assert "seq=" in result.format(top=len(result.ranked))
    moe = candidates(8, n_experts=4)
    assert {x.rules for x in moe if x.sizes.get("expert", 1) > 1} == {"dp_ep", "fsdp_ep", "fsdp_tp_ep"}
    assert {x.sizes.get("expert", 1) for x in moe} == {1, 2, 4}  # 4 experts do not split 8 ways


def test_zero_bubble_layouts_hold_the_weight_stash_and_no_second_recompute():
    cfg = deep_model()
    mesh = (("data", 2), ("pipe", 4))
    one, zb = (estimate_layout(cfg, Layout(mesh, "dp", False, name, 8), "h100") for name in ("1f1b", "zb-h1"))
    zb_cfg = Layout(mesh, "dp", False, "zb-h1", 8).apply(cfg)
    stash = get_schedule("zb-h1", 4, 8).weight_stash_size()
    x_in = 32 // 2 // 8 * zb_cfg.data.seq_len * zb_cfg.model.d_model * 4  # x[B/M, L, D] per device, f32
    # per slot, for the 16 / 4 layers of a chunk: what W reads of B (the layers' activations, several x_in
    # each) and the per-layer output gradients
    assert stash > 0 and zb.memory.activations - one.memory.activations > stash * 4 * 3 * x_in
    # each op as the engine runs it (F 1, B 2, W 1 chunk forwards: W recomputes nothing) tick by tick:
    # the same matmuls as 1F1B, whose lockstep (every tick with a backward costs 3) is slower
    layouts = [Layout(mesh, "dp", False, name, 8) for name in ("1f1b", "zb-h1")]
    assert len({gpt_work(x.apply(cfg), x.sizes).matmul_flops for x in layouts}) == 1
    assert zb.roofline.compute_s < one.roofline.compute_s
    assert get_schedule("zb-h1", 4, 8).lockstep_time() < get_schedule("1f1b", 4, 8).lockstep_time()
