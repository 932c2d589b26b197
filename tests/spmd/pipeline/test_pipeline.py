"""Pipelined GPT = single-device GPT: loss and every gradient, for each schedule, S and M; also
composed with DP x TP and with FSDP. Plus what the compiled step communicates and how much memory it keeps."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.shared_init import gpt_params

import meshes
import spmd
from spmd.manual import manual_batch_axes
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig, get_schedule
from spmd.pipeline.sends import hlo_sent_bytes

TOL = 1e-5
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, d_ff=64)  # 8 layers: S*V in {2, 4, 8} divide
BATCH, LENGTH = 16, 8


def tokens(seed: int = 0, cfg: GPTConfig = CFG, batch: int = BATCH, length: int = LENGTH):
    t = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def mesh_of(sizes: dict[str, int]):
    n = int(np.prod(list(sizes.values()))) if sizes else 1
    return meshes.make_mesh(sizes, devices=jax.devices()[:n]) if n > 1 else meshes.single_device_mesh()


class Case:
    """Params and one compiled ``value_and_grad`` of the model loss for a mesh, rules and pipeline."""

    def __init__(self, sizes, rules, pipeline, cfg=CFG, batch=BATCH, length=LENGTH):
        self.mesh, self.rules = mesh_of(sizes), spmd.get_rules(rules)
        # one initialisation per cfg (the one-device reference's), placed on this mesh's shardings
        self.graphdef, self.params, self.shardings = gpt_params(cfg, self.rules, self.mesh)
        graphdef, rules, mesh = self.graphdef, self.rules, self.mesh

        def loss(params, x, y):
            with spmd.use_rules(rules, mesh):
                return nnx.merge(graphdef, params).loss(x, y, pipeline=pipeline)[0]

        bs = spmd.batch_sharding(self.rules, self.mesh)
        self.batch_sharding = bs
        abstract = jax.ShapeDtypeStruct((batch, length), np.int32, sharding=bs)
        self.compiled = jax.jit(jax.value_and_grad(loss), in_shardings=(self.shardings, bs, bs)).lower(
            self.params, abstract, abstract).compile()

    def __call__(self, params=None, seed=0):
        x, y = (jax.device_put(a, self.batch_sharding) for a in tokens(seed))
        out = self.compiled(self.params if params is None else params, x, y)
        return jax.tree.map(np.asarray, out)


@functools.cache
def case(sizes: tuple = (), rules: str = "none", schedule: str = "none", m: int = 1, v: int = 1) -> Case:
    return Case(dict(sizes), rules, PipelineConfig(schedule, m, v) if schedule != "none" else None)


def reference():
    return case()()


def rel_errs(a, b) -> dict[str, float]:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(
        lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)), a, b))[0]
    return {spmd.sharding.path_str(p): e for p, e in flat}


def assert_matches_reference(loss, grads):
    ref_loss, ref_grads = reference()
    assert loss == pytest.approx(ref_loss, rel=TOL)
    errs = rel_errs(grads, ref_grads)
    assert {"embed", "head", "final_norm/scale", "blocks/block/mlp/w_gate_up"} <= set(errs)
    bad = {k: e for k, e in errs.items() if e > TOL}
    assert not bad, f"gradients differ from the single-device model: {bad}"


FAST = [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2)]
SLOW = [(s, S, M, V) for s, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)) for S in (2, 4) for M in (S, 2 * S)
        if (s, S, M, V) not in FAST] + [("zb-v", 2, 4, 2), ("zb-v", 4, 4, 2)]  # ZB-V: the stack converted to its V


TIERED = [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-v", 4, 4, 2)]  # the slow tier's; the rest: the sweep


@pytest.mark.parametrize("schedule, S, M, V", FAST + [
    pytest.param(*c, marks=pytest.mark.slow if c in TIERED else pytest.mark.sweep) for c in SLOW])
def test_pipeline_matches_single_device(schedule, S, M, V):
    loss, grads = case((("pipe", S),), "none", schedule, M, V)()
    assert_matches_reference(loss, grads)


@pytest.mark.parametrize("schedule, V", [("1f1b", 1), pytest.param("gpipe", 1, marks=pytest.mark.sweep),
                                         pytest.param("interleaved", 2, marks=pytest.mark.sweep)])
def test_pipeline_composes_with_dp_and_tp(schedule, V):
    c = case((("data", 2), ("pipe", 2), ("tensor", 2)), "dp_tp", schedule, 4, V)
    # the stored layout really is sharded three ways: layers over pipe, mlp over tensor
    spec = c.shardings["blocks"]["block"]["mlp"]["w_gate_up"].spec
    assert spec == jax.sharding.PartitionSpec("pipe", None, None, "tensor")
    loss, grads = c()
    assert_matches_reference(loss, grads)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.sweep), "1f1b"])
def test_eight_stages_one_layer_each(schedule):
    """pipe=8: every device holds one layer; the first and last stage are 7 hops apart."""
    loss, grads = case((("pipe", 8),), "none", schedule, 8, 1)()
    assert_matches_reference(loss, grads)


def test_gpipe_with_stage_remat_matches_and_keeps_less():
    """``remat=True`` rematerialises each stage in the backward: same numbers, fewer temp bytes."""
    plain, remat = case((("pipe", 2),), "none", "gpipe", 4, 1), Case({"pipe": 2}, "none", PipelineConfig("gpipe", 4, 1, remat=True))
    assert_matches_reference(*remat())
    assert spmd.inspection.memory(remat.compiled).temp < spmd.inspection.memory(plain.compiled).temp


def test_negative_control_wrong_stage_order_is_caught():
    """Swapping the two stages' layers (same compiled pipeline) must break the comparison."""
    c = case((("pipe", 2),), "none", "1f1b", 4, 1)
    swap = lambda a: np.concatenate([a[4:], a[:4]]) if a.shape[:1] == (8,) else a  # noqa: E731
    params = jax.tree.map(swap, jax.tree.map(np.asarray, c.params))
    params["head"] = np.asarray(c.params["head"])
    loss, grads = c(jax.device_put(params, c.shardings))
    ref_loss, ref_grads = reference()
    assert abs(loss - ref_loss) / ref_loss > TOL
    errs = rel_errs(jax.tree.map(swap, grads), ref_grads)
    assert max(errs.values()) > 100 * TOL


def test_collective_permutes_send_only_what_the_table_sends():
    """1F1B S=2 M=4: every permute carries one activation, only on ticks the table sends (a switch
    on the tick picks the pairs): 2*M*(S-1) activations per step, the minimum, not one each way per tick."""
    S, M = 2, 4
    c = case((("pipe", S),), "none", "1f1b", M, 1)
    sched = get_schedule("1f1b", S, M)
    permutes = [x for x in spmd.hlo.collectives(c.compiled, c.mesh) if x.kind == "collective-permute"]
    act_bytes = (BATCH // M) * LENGTH * CFG.d_model * 4
    assert permutes, spmd.hlo.format_collectives(permutes)
    for p in permutes:
        assert p.axes == ("pipe",) and p.bytes == act_bytes and p.count == sched.n_ticks
    table = sched.sent_bytes(act_bytes)
    assert table.executed == table.minimum == 2 * M * (S - 1) * act_bytes
    assert hlo_sent_bytes(c.compiled, sched, c.mesh) == {"executed": table.executed, "unattributed": 0}
    # control: the per-instruction count (each branch at every tick) is what the old engine sent
    assert sum(p.total_bytes for p in permutes) >= 2 * sched.n_ticks * act_bytes > table.executed
    # nothing else crosses pipe but the stage-gradient/head-gradient reductions (no per-tick traffic)
    others = [x for x in spmd.hlo.collectives(c.compiled, c.mesh) if x.kind != "collective-permute"]
    assert all(x.count == 1 for x in others), spmd.hlo.format_collectives(others)


def test_gpipe_sends_only_microbatches():
    """GPipe S=2 M=4 (autodiff over the tick scans): the forward permutes run only on ticks that carry a
    microbatch (M of the M + S - 1), the backward's transposes likewise: 2*M*(S-1) activations, the table's."""
    from spmd.pipeline.sends import gpipe_sends

    S, M = 2, 4
    c = case((("pipe", S),), "none", "gpipe", M, 1)
    table = get_schedule("gpipe", S, M).sent_bytes((BATCH // M) * LENGTH * CFG.d_model * 4)
    assert hlo_sent_bytes(c.compiled, get_schedule("gpipe", S, M), c.mesh) == {"executed": 0,
                                                                                "unattributed": table.minimum}
    # S=4, M=16: fill and drain ticks send from fewer stages, the last from none; M (S-1) sends a pass
    runs = gpipe_sends(4, 16)
    assert sum((end - first) * len(pairs) for first, end, pairs in runs) == 16 * 3 and runs[-1] == (18, 19, ())
    assert runs[0] == (0, 1, ((0, 1),)) and runs[2] == (2, 16, ((0, 1), (1, 2), (2, 3)))


def test_data_parallel_gradient_is_reduced_once_per_step():
    """data=2 x pipe=2, 1F1B: each device accumulates its partial gradients over every tick, and the
    gradient all-reduce over ``data`` runs once per step (not once per tick), with the same numbers."""
    S, M = 2, 4
    c = case((("data", 2), ("pipe", 2)), "dp", "1f1b", M, 1)
    ops = spmd.hlo.collectives(c.compiled, c.mesh)
    over_data = [x for x in ops if "data" in x.axes]
    assert over_data and all(x.kind == "all-reduce" for x in over_data), spmd.hlo.format_collectives(ops)
    assert sum(x.count for x in over_data) == 1, spmd.hlo.format_collectives(ops)
    # control: the trip counts are read (the per-tick permutes count once per tick), so a reduction
    # inside the schedule's loop would have shown up with count == ticks above
    ticks = get_schedule("1f1b", S, M).n_ticks
    permutes = [x for x in ops if x.kind == "collective-permute"]
    assert permutes and all(x.count == ticks > 1 and x.trip_count_known for x in permutes)
    assert_matches_reference(*c())


FSDP_CASES = [((("fsdp", 2), ("pipe", 2), ("tensor", 2)), "fsdp_tp", "1f1b", ("pipe", "fsdp", None, "tensor")),
              pytest.param((("fsdp", 2), ("pipe", 2)), "fsdp", "gpipe", ("pipe", "fsdp"), marks=pytest.mark.sweep)]


@pytest.mark.parametrize("sizes, rules, schedule, w_up_spec", FSDP_CASES)
def test_pipeline_composes_with_fsdp(sizes, rules, schedule, w_up_spec):
    c = case(sizes, rules, schedule, 4, 1)
    # stored layout W[layers_pipe, D_fsdp, 2, F_tensor]: the pipeline gathers it over fsdp inside
    assert c.shardings["blocks"]["block"]["mlp"]["w_gate_up"].spec == jax.sharding.PartitionSpec(*w_up_spec)
    assert_matches_reference(*c())


def test_fsdp_weights_gathered_and_gradients_reduced_once_per_step():
    """fsdp=2 x pipe=2 x tensor=2, fsdp_tp, 1F1B M=4: every collective over ``fsdp`` runs once per
    step (weights gathered before the tick loop, gradients reduce-scattered after it), at most one
    gather and one reduction per parameter, not one per tick."""
    S, M = 2, 4
    c = case((("fsdp", 2), ("pipe", 2), ("tensor", 2)), "fsdp_tp", "1f1b", M, 1)
    ops = spmd.hlo.collectives(c.compiled, c.mesh)
    over_fsdp = [x for x in ops if "fsdp" in x.axes]
    n_params = len(jax.tree.leaves(c.params))
    gathers = [x for x in over_fsdp if x.kind == "all-gather"]
    reductions = [x for x in over_fsdp if x.kind in ("all-reduce", "reduce-scatter")]
    assert gathers and reductions, spmd.hlo.format_collectives(ops)
    assert all(x.count == 1 for x in over_fsdp), spmd.hlo.format_collectives(over_fsdp)
    assert len(gathers) <= n_params and len(reductions) <= n_params, spmd.hlo.format_collectives(over_fsdp)
    # control: loop trip counts are read (permutes run once per tick), so per-tick traffic would show
    ticks = get_schedule("1f1b", S, M).n_ticks
    permutes = [x for x in ops if x.kind == "collective-permute"]
    assert permutes and all(x.count == ticks > 1 and x.trip_count_known for x in permutes)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.sweep)])  # one schedule in the tiers
def test_fsdp_gathers_move_the_compute_dtype(schedule, monkeypatch):
    """bf16 compute, fsdp=2 x pipe=2 x tensor=2: the stage weight matrices are gathered over fsdp in bf16
    (half the bytes of f32), with the same loss and gradients as gathering them in f32 (the blocks cast
    them to bf16 at use either way). gpipe differentiates the gather: its gradient is reduce-scattered in f32."""
    import dataclasses

    from spmd.pipeline import layout

    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    sizes, pipeline = {"fsdp": 2, "pipe": 2, "tensor": 2}, PipelineConfig(schedule, 4)
    narrow = Case(sizes, "fsdp_tp", pipeline, cfg=cfg)
    monkeypatch.setattr(layout, "gather_dtypes", lambda leaves, dtype: ())  # every gather in f32
    wide = Case(sizes, "fsdp_tp", pipeline, cfg=cfg)

    def gathers(c):
        ops = spmd.hlo.collectives(c.compiled, c.mesh)  # as an accelerator runs them (XLA:CPU promotes bf16)
        return collections.Counter(x.bytes for x in ops if x.kind == "all-gather" and "fsdp" in x.axes for _ in range(x.count))

    (loss_n, grads_n), (loss_w, grads_w) = narrow(), wide()
    assert loss_n == loss_w and max(rel_errs(grads_n, grads_w).values()) < 1e-6
    # the gathers of the stage matrices (W[layers_pipe, D_fsdp, ...], rank >= 3: a stage's L/2 layers, dims
    # other than fsdp whole in the manual view) move 2 bytes per element instead of 4; the rest as before
    stage = [a for a in jax.tree.leaves(narrow.params["blocks"]) if a.ndim >= 3 and "fsdp" in str(a.sharding.spec)]
    n, w = gathers(narrow), gathers(wide)
    assert len(stage) == 5 and sum(w.elements()) - sum(n.elements()) == sum(a.size // 2 * 2 for a in stage), (n, w)
    assert sum(n.elements()) < 0.6 * sum(w.elements())


def test_manual_batch_axes():
    mesh = mesh_of({"data": 2, "pipe": 2, "fsdp": 2})
    assert manual_batch_axes(mesh, spmd.get_rules("dp"), 4) == ("data",)
    # fsdp also shards parameters (embed): manual too, its weights gathered once inside the pipeline,
    # unless the caller keeps parameter-sharding axes automatic
    assert manual_batch_axes(mesh, spmd.get_rules("fsdp"), 4) == ("data", "fsdp")
    assert manual_batch_axes(mesh, spmd.get_rules("fsdp"), 4, shard_params=False) == ("data",)
    assert manual_batch_axes(mesh, spmd.get_rules("fsdp"), 2) == ("data",)  # 2 rows: only data divides
    # rows that do not split over data, no batch rule, no rule set: nothing manual but pipe
    assert manual_batch_axes(mesh, spmd.get_rules("dp"), 3) == ()
    assert manual_batch_axes(mesh, spmd.get_rules("tp"), 4) == ()
    assert manual_batch_axes(mesh, None, 4) == ()


MEM_CFG = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, d_ff=256)
MEM_MB, MEM_LEN = 2, 64  # fixed microbatch size: the global batch grows with M


@functools.cache
def temp_bytes(schedule: str, m: int) -> int:
    c = Case({"pipe": 2}, "none", PipelineConfig(schedule, m), cfg=MEM_CFG, batch=MEM_MB * m, length=MEM_LEN)
    return c.compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.sweep
def test_1f1b_memory_flat_in_microbatches_gpipe_grows():
    one = temp_bytes("1f1b", 4), temp_bytes("1f1b", 8)
    gp = temp_bytes("gpipe", 4), temp_bytes("gpipe", 8)
    print(f"temp bytes per device: 1f1b M=4 {one[0]:,} M=8 {one[1]:,}; gpipe M=4 {gp[0]:,} M=8 {gp[1]:,}")
    assert one[1] / one[0] < 1.25
    assert gp[1] / gp[0] > 1.6
    assert gp[1] > 2 * one[1]


def test_bad_inputs():
    c = case((("pipe", 2),), "none", "1f1b", 4, 1)
    graphdef, params, mesh = c.graphdef, c.params, c.mesh
    x, y = tokens()

    def run(pipeline, x=x, y=y):
        with spmd.use_rules("none", mesh):
            return jax.eval_shape(lambda p: nnx.merge(graphdef, p).loss(x, y, pipeline=pipeline), params)

    with pytest.raises(ValueError, match=r"batch of 16 rows does not split into 3 microbatches"):
        run(PipelineConfig("1f1b", 3))
    with pytest.raises(ValueError, match=r"8 layers do not split into S\*V = 2\*3 = 6 equal chunks"):
        run(PipelineConfig("interleaved", 4, 3))
    with pytest.raises(ValueError, match=r"microbatches M=2 to be a multiple of stages S=4"):
        with spmd.use_rules("none", mesh_of({"pipe": 4})):
            jax.eval_shape(lambda p: nnx.merge(graphdef, p).loss(x, y, pipeline=PipelineConfig("interleaved", 2, 2)),
                           params)
