"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V): their tables (bubble = the formula, below 1F1B's;
in-flight inputs; validation catching W misplaced; ZB-V's V placement and its sends) and the engine's
B/W split (loss and gradients equal one device's, on a tiny stack and on the GPT over data x pipe x
tensor; W recomputes nothing: the step executes 1F1B's matmul FLOPs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pipeline import BATCH, CFG, LENGTH, assert_matches_reference, case

import meshes
from spmd.pipeline import LayerOrder, PipelineConfig, get_schedule, send_plan
from spmd.pipeline.engine import _build_tables, run_schedule
from spmd.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule, minimum_sends
from spmd.pipeline.sends import branch_ticks, hlo_sent_bytes

ZB = ("zb-h1", "zb-h2")
SIZES = [(S, M) for S in (2, 4) for M in (S, 2 * S, 4 * S)]
TOL = 1e-5


def ticks_formula(S: int, M: int) -> int:
    """Both tables: 3M ops per stage, the last stage starts at tick S-1; with M < S stage 0 also waits
    S - M ticks for its first gradient."""
    return 3 * M + S - 1 + max(0, S - M)


@pytest.mark.parametrize("name", ZB)
@pytest.mark.parametrize("S, M", SIZES + [(3, 7), (4, 3), (8, 1)])
def test_bubble_is_the_papers_formula_and_below_1f1b(name, S, M):
    sch = get_schedule(name, S, M)
    sch.validate()
    assert sch.split_backward and sch.busy == 3 * M * S
    assert sch.n_ticks == ticks_formula(S, M)
    if M >= S:  # the paper's ZB-H1 bubble with T_F = T_B = T_W: (S-1) idle ticks per stage
        assert sch.bubble_fraction == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
    assert sch.bubble_fraction < get_schedule("1f1b", S, M).bubble_fraction
    # every op one tick: the engine's scan runs fewer chunk-forward units than 1F1B's
    assert sch.lockstep_time() < get_schedule("1f1b", S, M).lockstep_time()
    fo = sch.forward_only()  # evaluation: the forwards in the same order
    fo.validate()
    assert not fo.has_backward and not fo.split_backward and fo.busy == M * S


@pytest.mark.parametrize("S, M", SIZES + [(3, 5), (8, 9), (4, 2)])
def test_zb_h2_overlapped_bubble(S, M):
    """With steps overlapping (each stage starting the next step as soon as it is done) ZB-H2 never idles
    from M >= 2S; below that its stages' spans exceed 3M by 2S-1-M ticks. ZB-H1's stage 0 spans the
    whole table, so overlapping gains it nothing."""
    h2, h1 = get_schedule("zb-h2", S, M), get_schedule("zb-h1", S, M)
    extra = max(0, 2 * S - 1 - M)
    assert h2.overlapped_bubble_fraction == pytest.approx(extra / (3 * M + extra), abs=1e-12)
    assert h1.overlapped_bubble_fraction == pytest.approx(h1.bubble_fraction, abs=1e-12)


@pytest.mark.parametrize("S, M", SIZES + [(3, 7), (8, 16), (4, 3)])
def test_in_flight_zb_h1_peak_equals_1f1b_zb_h2_up_to_2s(S, M):
    """An input is held until its W. ZB-H1's peak per stage is 1F1B's peak (min(S, M)) on every
    stage; 1F1B's later stages hold fewer (S - s + 1), ZB-H1's hold their deferred W's inputs, so the
    arrays are not equal, only their max. ZB-H2 holds up to min(2S, M)."""
    one, h1, h2 = (get_schedule(n, S, M) for n in ("1f1b", "zb-h1", "zb-h2"))
    assert h1.max_in_flight == one.max_in_flight == min(S, M)
    assert list(h1.in_flight()) == [min(S, M)] * S
    assert h2.max_in_flight == min(2 * S, M)
    # the engine's buffers: chunk inputs until W, output gradients until B, per-layer dy's from B to W
    n_x, n_g = h1.stash_sizes()
    assert n_x <= S and n_g == 1 and 1 <= h1.weight_stash_size() <= S
    assert one.weight_stash_size() == 0
    _, nx, ng, nw = _build_tables(h1)
    assert (nx, ng, nw) == (n_x, n_g, h1.weight_stash_size())


@pytest.mark.parametrize("S, M", SIZES + [(1, 3), (3, 6), (5, 10), (8, 16)])
def test_zb_v_bubble_is_its_formula_and_below_zb_h1(S, M):
    """ZB-V (V = 2 chunks per device, every chunk op one tick): device S-1 starts at tick S-1 and then
    never idles through its 6M ops, so the table has ``6M + S - 1`` ticks and bubble ``(S-1)/(6M+S-1)``:
    the same S-1 idle ticks per device as ZB-H1 over twice the ticks (each a chunk, half a stage)."""
    sch = get_schedule("zb-v", S, M, 2)
    sch.validate()
    assert (sch.placement, sch.n_virtual, sch.split_backward, sch.busy) == ("v", 2, True, 6 * M * S)
    assert sch.n_ticks == 6 * M + S - 1
    assert sch.bubble_fraction == pytest.approx((S - 1) / (6 * M + S - 1), abs=1e-12)
    if S > 1:  # and the engine's scan, in forwards of a one-chunk stage (twice a ZB-V chunk's)
        assert sch.bubble_fraction < get_schedule("zb-h1", S, M).bubble_fraction
        assert sch.lockstep_time() / 2 < get_schedule("zb-h1", S, M).lockstep_time()
        assert sch.lockstep_time() <= get_schedule("interleaved", S, M, 2).lockstep_time()
    fo = sch.forward_only()
    fo.validate()
    assert fo.placement == "v" and fo.busy == 2 * M * S


@pytest.mark.parametrize("S, M", SIZES + [(3, 6), (8, 16)])
def test_zb_v_in_flight_equals_1f1b(S, M):
    """Units: one ZB-V chunk input (with the activations of its L/(2S) layers) is half a 1F1B stage
    input (L/S layers), so a device holding 2k chunk inputs holds what a 1F1B stage holding k does.
    ZB-V holds at most 2S chunk inputs on any device, ``in_flight() / V`` <= S, 1F1B's peak (stage 0),
    and reaches it: at most S microbatches are in flight, each with both chunks on each device."""
    zbv, one = get_schedule("zb-v", S, M, 2), get_schedule("1f1b", S, M)
    assert zbv.in_flight().max() == 2 * S and zbv.in_flight().min() >= 2 * S - 1
    assert zbv.max_in_flight / zbv.n_virtual == one.max_in_flight == S
    n_x, n_g = zbv.stash_sizes()
    assert n_x <= 2 * S and 1 <= zbv.weight_stash_size() <= 2 * S
    _, nx, ng, nw = _build_tables(zbv)
    assert (nx, ng, nw) == (n_x, n_g, zbv.weight_stash_size())


def test_zb_v_places_chunks_in_a_v_and_sends_over_neighbours():
    S, M = 4, 8
    sch = get_schedule("zb-v", S, M, 2)
    assert [sch.stage_of(c) for c in range(2 * S)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [sch.chunk(v, s) for s in range(S) for v in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert list(LayerOrder(S, 2, "v").natural_index(16)) == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    plan = send_plan(sch)
    fwd = {p for pairs in plan.forward for p in pairs}
    bwd = {p for pairs in plan.backward for p in pairs}
    assert fwd == bwd == {(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)}  # first arm up, second down, no (3, 3)
    # the turn (chunk 3 -> 4 on stage 3) is handed over locally: M*(C-2) sends each way, the minimum
    assert plan.count == minimum_sends(sch) == 2 * M * (2 * S - 2)
    branches, index = plan.branches()
    for up, down in branches:  # each channel a shift: every stage sends and receives at most once
        assert all(b == a + 1 for a, b in up) and all(b == a - 1 for a, b in down)
    assert (index > 0).sum() == sum(1 for u, d in zip(plan.up, plan.down) if u or d)
    # some tick gives a stage two forwards, one from each side: why the engine sends by channel
    assert any({b for _, b in u} & {b for _, b in d} for u, d in zip(plan.up, plan.down))
    ticks = branch_ticks(sch)  # the compute switch: the head's forward (last chunk) runs on stage 0
    assert list(ticks[:, 2]) == [M, 0, 0, 0] and list(ticks[:, 1]) == [M, 2 * M, 2 * M, 2 * M]
    x = np.arange(16 * 3).reshape(16, 3)
    order = LayerOrder(S, 2, "v")
    assert np.array_equal(order.to_natural(order.to_stored(x)), x)
    assert np.array_equal(order.convert(LayerOrder(S, 2).convert(x, order), LayerOrder(S, 2)), x)


def test_timeline_and_gantt_show_w():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sch = get_schedule("zb-h1", 2, 3)
    lines = str(sch).splitlines()
    assert lines[0] == "zb-h1: S=2 M=3 V=1, 10 ticks, bubble 0.100"
    assert lines[1].split() == ["s0:", "F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "B2", "W2"]
    assert lines[2].split() == ["s1:", ".", "F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]
    ax = sch.gantt()
    colours = {tuple(np.round(c.get_facecolor()[0], 3)) for c in ax.collections}
    assert len(colours) == 3 and sum(len(c.get_paths()) for c in ax.collections) == sch.busy
    plt.close(ax.figure)


def _moved(sch: Schedule, kind: int, m: int, s: int, to_tick: int) -> Schedule:
    a = sch.actions.copy()
    t = int(np.nonzero((a[:, s, 0] == kind) & (a[:, s, 1] == m))[0][0])
    if to_tick < 0:
        a[t, s] = (IDLE, -1, -1)
    else:
        a = np.concatenate([a, np.full((1, *a.shape[1:]), -1, np.int32)])
        a[-1, :, 0] = IDLE
        a[to_tick, s], a[t, s] = a[t, s].copy(), a[to_tick, s].copy()
    return Schedule(sch.name, sch.n_stages, sch.n_microbatches, sch.n_virtual, a)


def test_validate_catches_misplaced_weight_ops():
    sch = get_schedule("zb-h1", 4, 8)
    sch.validate()
    tb = int(np.nonzero((sch.actions[:, 3, 0] == BACKWARD) & (sch.actions[:, 3, 1] == 2))[0][0])
    with pytest.raises(ValueError, match=rf"W2 of chunk 3 at tick {tb} does not follow its B \(tick "):
        _moved(sch, WEIGHT, 2, 3, tb).validate()  # swapped with its own B
    with pytest.raises(ValueError, match=r"W5 of chunk 1 is missing"):
        _moved(sch, WEIGHT, 5, 1, -1).validate()
    assert _moved(sch, WEIGHT, 5, 1, sch.n_ticks).split_backward  # moved into a new last tick: still valid
    _moved(sch, WEIGHT, 5, 1, sch.n_ticks).validate()
    with pytest.raises(ValueError, match=r"F0 of chunk 1 at tick 0 runs before F0 of chunk 0"):
        _moved(sch, FORWARD, 0, 1, 0).validate()


@pytest.mark.parametrize("args, kwargs, match", [
    (("zb-h3", 2, 4), {}, r"unknown pipeline schedule 'zb-h3'; valid: .*zb-h1, zb-h2"),
    (("zb-h1", 2, 4, 2), {}, r"schedule 'zb-h1' has one chunk per stage; got virtual stages V=2"),
    (("zb-h2", 2, 0), {}, r"microbatches M >= 1, got 0"),
    (("zb-h1", 0, 4), {}, r"stages S >= 1, got 0"),
    (("zb-h2", 4, 8), {"n_layers": 6}, r"6 layers do not split into S\*V = 4\*1 = 4 equal chunks"),
    (("zb-v", 4, 8), {}, r"schedule 'zb-v' runs V=2 chunks per stage \(placed in a V\); got virtual stages V=1"),
    (("zb-v", 4, 6, 2), {}, r"'zb-v' needs microbatches M=6 to be a multiple of stages S=4 \(M >= S\)"),
    (("zb-v", 4, 8, 2), {"n_layers": 12}, r"12 layers do not split into S\*V = 4\*2 = 8 equal chunks"),
])
def test_bad_inputs_name_the_numbers(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_schedule(*args, **kwargs)


def test_pipeline_config_accepts_zero_bubble():
    assert PipelineConfig("zb-h1", 8).make_schedule(4, n_layers=8).name == "zb-h1"
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule 'interleaved', got 'zb-h2'"):
        PipelineConfig("zb-h2", 8, 2)
    zbv = PipelineConfig("zb-v", 8, 2)
    assert zbv.make_schedule(4, n_layers=8).placement == "v"
    assert zbv.layer_order(4) == LayerOrder(4, 2, "v") and zbv.layer_order(1).natural
    with pytest.raises(ValueError, match=r"'zb-v' runs 2 chunks per stage: set pipeline.virtual_stages=2, got 1"):
        PipelineConfig("zb-v", 8)
    with pytest.raises(ValueError, match=r"placement 'v' with virtual=3"):
        LayerOrder(4, 3, "v")


# ---- the engine: a tiny stack (2 layers per stage) against the same stack on one device ----
D, ROWS, LEN = 8, 2, 2


def stage_fn(p, x):  # applies p's layers in order (the engine also calls it on one-layer slices)
    return jax.lax.scan(lambda x, pl: (jnp.tanh(x @ pl["w"] + pl["b"]), None), x, p)[0]


def head_fn(h, y, tg):
    d = y @ h - tg
    return jnp.mean(d * d), {"y_mean": jnp.mean(y)}


def inputs(S: int, M: int):
    rng = np.random.default_rng(S * 100 + M)
    L = 2 * S
    params = {"w": rng.normal(size=(L, D, D)).astype(np.float32) / 3, "b": rng.normal(size=(L, D)).astype(np.float32)}
    head = rng.normal(size=(D, D)).astype(np.float32) / 3
    x, tg = (rng.normal(size=(M, ROWS, LEN, D)).astype(np.float32) for _ in range(2))
    return params, head, x, tg


def reference_loss(params, head, x, tg):
    return jnp.mean(jnp.stack([head_fn(head, stage_fn(params, x[m]), tg[m])[0] for m in range(x.shape[0])]))


@functools.cache
def compiled(name: str, S: int, M: int):
    mesh = meshes.make_mesh({"pipe": S}, devices=jax.devices()[:S])
    sch = get_schedule(name, S, M, 2 if name == "zb-v" else 1)

    def loss(p, h, x, tg):
        return run_schedule(stage_fn, head_fn, p, h, x, tg, schedule=sch, mesh=mesh)[0]

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def max_rel_err(a, b) -> float:
    errs = jax.tree.map(lambda u, v: float(np.linalg.norm(np.asarray(u) - np.asarray(v)) / np.linalg.norm(v)), a, b)
    return max(jax.tree.leaves(errs))


FAST = [("zb-h1", 2, 4), ("zb-h2", 2, 4), ("zb-h1", 4, 4), ("zb-v", 2, 2), ("zb-v", 4, 4)]
SLOW = [("zb-h1", 4, 16), ("zb-h2", 4, 8), ("zb-v", 4, 16)]  # the slow tier's; every other size: the sweep
ENGINE = FAST + [pytest.param(n, S, M, marks=pytest.mark.slow if (n, S, M) in SLOW else pytest.mark.sweep)
                 for n in (*ZB, "zb-v") for S, M in SIZES if (n, S, M) not in FAST]


@pytest.mark.parametrize("name, S, M", ENGINE)
def test_engine_b_w_split_matches_one_device(name, S, M):
    params, head, x, tg = inputs(S, M)
    loss, grads = compiled(name, S, M)(params, head, x, tg)
    ref_loss, ref_grads = jax.value_and_grad(reference_loss, argnums=(0, 1, 2))(params, head, x, tg)
    assert float(loss) == pytest.approx(float(ref_loss), rel=TOL)
    assert max_rel_err(grads, ref_grads) < TOL, jax.tree.map(lambda u, v: float(np.abs(u - v).max()), grads, ref_grads)
    if (name, S, M) == FAST[0]:  # negative control: the stages' layers swapped, same compiled step
        swapped = jax.tree.map(lambda a: np.roll(a, a.shape[0] // S, axis=0), params)
        bad_loss, bad = compiled(name, S, M)(swapped, head, x, tg)
        assert abs(float(bad_loss) - float(ref_loss)) > 100 * TOL * abs(float(ref_loss))
        assert max_rel_err(jax.tree.map(lambda a: np.roll(a, -(a.shape[0] // S), axis=0), bad[0]),
                           ref_grads[0]) > 100 * TOL


@pytest.mark.parametrize("schedule", [ZB[0], *(pytest.param(s, marks=pytest.mark.sweep) for s in (*ZB[1:], "zb-v"))])
def test_gpt_data_pipe_tensor_matches_one_device(schedule):
    """data=2 x pipe=2 x tensor=2 (dp_tp), M=4: the GPT's loss and every gradient equal one device's."""
    V = 2 if schedule == "zb-v" else 1
    c = case((("data", 2), ("pipe", 2), ("tensor", 2)), "dp_tp", schedule, 4, V)
    spec = c.shardings["blocks"]["block"]["mlp"]["w_gate_up"].spec
    assert spec == jax.sharding.PartitionSpec("pipe", None, None, "tensor")
    assert_matches_reference(*c())
    # B sends the input gradient, W sends nothing: the compiled step moves 1F1B's minimum over pipe
    sched = get_schedule(schedule, 2, 4, V)
    act = (BATCH // 4 // 2) * LENGTH * CFG.d_model * 4  # one microbatch's rows on one data shard, f32
    table = sched.sent_bytes(act)
    crossings = 2 if schedule == "zb-v" else 1  # ZB-V's chunks 0 1 1 0 over the stages: its turn sends nothing
    assert table.executed == table.minimum == 2 * 4 * crossings * act
    sent = hlo_sent_bytes(c.compiled, sched, c.mesh)
    assert sent["executed"] == table.executed
    # the GPT stores its stack in natural order: for ZB-V it is permuted into the V (and the gradients
    # back) over pipe on every step, outside the tick loop (a stack stored in the V, as the trainer's is, is not)
    assert (sent["unattributed"] > 0) == (schedule == "zb-v")


def test_zb_h1_executes_1f1b_matmul_flops():
    """W reuses B's residuals and B skips the weight gradient: per device, the compiled ZB-H1 step runs
    1F1B's matmul FLOPs (from the HLO: loop bodies times their trip counts, each branch of the tick switch
    on the ticks its stage takes it), not the 5/4 of a W that recomputes its chunk."""
    from benchmarks.pipeline import executed_dot_flops

    flops = {name: executed_dot_flops(c.compiled, get_schedule(name, 2, 4))
             for name in ("1f1b", "zb-h1") for c in [case((("data", 2), ("pipe", 2), ("tensor", 2)), "dp_tp", name, 4, 1)]}
    assert (flops["1f1b"] > 0).all() and (flops["zb-h1"] <= 1.02 * flops["1f1b"]).all(), flops


def test_engine_refuses_an_invalid_table_before_tracing():
    """A zero-bubble table with one W op removed would train with wrong gradients: the engine validates it."""
    bad = _moved(get_schedule("zb-h1", 2, 4), WEIGHT, 1, 0, -1)
    x = np.zeros((4, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"W1 of chunk 0 is missing from the schedule"):
        run_schedule(lambda p, x: x, lambda h, y, t: (y.mean(), {}), {"w": np.zeros((2, 1))}, {}, x, x[..., 0],
                     schedule=bad, mesh=meshes.make_mesh({"pipe": 2}, devices=jax.devices()[:2]))
