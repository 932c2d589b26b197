"""Mixture of experts: expert parallelism over ``expert`` gives the single-device result; collectives and errors.

The layer alone (``MoE``) and the GPT with MoE blocks, dropless, on meshes with expert = 2, 4, 8,
with and without fsdp/tensor, against one device at 1e-5 (f32) for the loss and every gradient.
Negative controls: a small capacity drops tokens and changes the result; wrong rule sets are refused.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.gpt_util import rel_err

import meshes
import spmd
from spmd.models import GPT, GPTConfig, MoE
from spmd.models import router as router_lib

TOL = 1e-5
D, F, E, K = 16, 32, 8, 2
B, L = 8, 8

# name -> (mesh sizes, rule preset)
LAYOUTS = {
    "single": ({}, "none"),
    "expert2": ({"expert": 2}, "dp_ep"),
    "expert4": ({"expert": 4}, "dp_ep"),
    "expert8": ({"expert": 8}, "dp_ep"),
    "data2_expert4": ({"data": 2, "expert": 4}, "dp_ep"),
    "fsdp2_expert4": ({"fsdp": 2, "expert": 4}, "fsdp_ep"),
    "fsdp4_expert2": ({"fsdp": 4, "expert": 2}, "fsdp_ep"),
    "fsdp2_expert2_tensor2": ({"fsdp": 2, "expert": 2, "tensor": 2}, "fsdp_tp_ep"),
}


def mesh_of(sizes):
    if not sizes:
        return meshes.single_device_mesh()
    n = int(np.prod(list(sizes.values())))
    return meshes.make_mesh(sizes, devices=jax.devices()[:n])


def layer_inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, L, D)).astype(np.float32), rng.standard_normal((B, L, D)).astype(np.float32))


def make_layer(cf=0.0, router="softmax", n_shared=0):
    return MoE(D, F, E, K, rngs=nnx.Rngs(0), capacity_factor=cf, router=router, n_shared=n_shared, report_rows=True)


@functools.cache
def layer_step(name, cf=0.0):
    """(mesh, rules, params, jitted (params, x, target) -> ((loss, (y, stats)), grads)) for the layer alone."""
    sizes, rules = LAYOUTS[name]
    mesh, rules = mesh_of(sizes), spmd.get_rules(rules)
    graphdef, params, _ = spmd.init_params(lambda: make_layer(cf), rules, mesh)

    def loss_fn(params, x_BLD, target_BLD):
        with spmd.use_rules(rules, mesh):
            y_BLD, stats = nnx.merge(graphdef, params)(x_BLD)
        loss = jnp.mean((y_BLD - target_BLD) ** 2) + 0.01 * stats["aux_loss"] + 0.001 * stats["z_loss"]
        return loss, (y_BLD, stats)

    return mesh, rules, params, jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


@functools.cache
def layer_result(name, cf=0.0):
    mesh, rules, params, step = layer_step(name, cf)
    tokens = spmd.batch_sharding(rules, mesh)
    x, target = (jax.device_put(a, tokens) for a in layer_inputs())
    (loss, (y, stats)), grads = step(params, x, target)
    return float(loss), np.asarray(y), {k: float(v) for k, v in stats.items()}, jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sweep) if n in ("expert8", "fsdp4_expert2") else n
                                  for n in LAYOUTS if n != "single"])  # those two: the sweep
def test_layer_matches_single_device(name):
    ref_loss, ref_y, ref_stats, ref_grads = layer_result("single")
    loss, y, stats, grads = layer_result(name)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    np.testing.assert_allclose(y, ref_y, rtol=TOL, atol=TOL * np.abs(ref_y).max())
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert rel_err(grads, ref_grads) < TOL
    rows = stats.pop("expert_rows")  # rows computed per assignment: block padding depends on the layout
    assert stats == pytest.approx({k: v for k, v in ref_stats.items() if k != "expert_rows"}, rel=TOL)
    assert 1.0 <= rows < 1.1 and 1.0 <= ref_stats["expert_rows"] < 1.1
    assert stats["dropped"] == 0.0  # dropless
    # not vacuous: every parameter receives a gradient, and the routing is not trivially uniform
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))
    assert stats["load_max"] > stats["load_min"]


def test_capacity_drops_tokens_and_changes_the_result():
    """Negative control: capacity factor 0.5 drops assignments, so the output differs from dropless."""
    _, y0, s0, _ = layer_result("single")
    _, y1, s1, _ = layer_result("single", 0.5)
    assert s0["dropped"] == 0.0 and s1["dropped"] >= 0.5  # half the slots at most: >= half dropped
    assert np.linalg.norm(y1 - y0) / np.linalg.norm(y0) > 0.1
    # a capacity factor of E / k gives every expert room for every token: dropless again
    _, y2, s2, _ = layer_result("single", E / K)
    assert s2["dropped"] == 0.0
    np.testing.assert_allclose(y2, y0, rtol=1e-6, atol=1e-6)


def test_capacity_groups_are_per_device():
    """With a capacity, each device fills its experts' slots from its own tokens: the sharded output
    equals the single-device layer applied to each device's rows separately."""
    _, y, stats, _ = layer_result("data2_expert4", 1.0)
    mesh, rules, params, _ = layer_step("single", 1.0)
    graphdef = nnx.graphdef(make_layer(1.0))
    x, _ = layer_inputs()
    parts = [nnx.merge(graphdef, params)(x[i:i + 1]) for i in range(B)]  # 8 devices, one row each
    np.testing.assert_allclose(y, np.concatenate([np.asarray(p[0]) for p in parts]), rtol=TOL, atol=TOL)
    assert stats["dropped"] == pytest.approx(np.mean([float(p[1]["dropped"]) for p in parts]), rel=TOL)
    assert stats["dropped"] > 0


def test_grouped_mlp_matches_a_per_row_reference():
    """Each present row through its own expert, absent rows (group G) give 0; gradients too."""
    from spmd.models import grouped

    rng = np.random.default_rng(2)
    r, g, f = 40, 4, 8
    x = jnp.asarray(rng.standard_normal((r, D)), jnp.float32)
    group = jnp.asarray(rng.integers(0, g + 1, r), jnp.int32)  # some rows absent (group g)
    w_gu = jnp.asarray(rng.standard_normal((g, D, 2, f)), jnp.float32)
    w_d = jnp.asarray(rng.standard_normal((g, f, D)), jnp.float32)

    def reference(x, w_gu, w_d):
        h = jnp.einsum("rd,rdtf->rtf", x, w_gu[jnp.minimum(group, g - 1)])
        y = jnp.einsum("rf,rfd->rd", jax.nn.silu(h[:, 0]) * h[:, 1], w_d[jnp.minimum(group, g - 1)])
        return jnp.where((group < g)[:, None], y, 0.0)

    for impl in grouped.IMPLS:  # the block loop (CPU's default) and ragged_dot (GPU's and TPU's)
        def run(x, w_gu, w_d, impl=impl):
            return grouped.grouped_mlp(x, group, w_gu, w_d, max_rows=int(np.sum(np.asarray(group) < g)), impl=impl)[0]

        np.testing.assert_allclose(run(x, w_gu, w_d), reference(x, w_gu, w_d), rtol=1e-5, atol=1e-5)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1, 2))(x, w_gu, w_d)
        ref_grads = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a))), argnums=(0, 1, 2))(x, w_gu, w_d)
        # two algorithms, two f32 summation orders (ragged_dot's differs again without LLVM's optimisation): 3e-5
        assert rel_err(grads, ref_grads) < 3e-5, impl
    assert np.abs(np.asarray(reference(x, w_gu, w_d))).max() > 0 and np.sum(np.asarray(group) == g) > 0
    n_present = int(np.sum(np.asarray(group) < g))
    assert int(grouped.grouped_mlp(x, group, w_gu, w_d, max_rows=n_present, impl="ragged")[1]) == n_present
    with pytest.raises(ValueError, match="impl='dense'; valid: loop, ragged"):
        grouped.grouped_mlp(x, group, w_gu, w_d, max_rows=n_present, impl="dense")
    # the loops ran over the used blocks only: each group's rows padded to a block multiple
    n_rows, counts = int(np.sum(np.asarray(group) < g)), np.bincount(np.asarray(group), minlength=g + 1)[:g]
    blk = grouped.block_rows(n_rows, g)
    rows = grouped.grouped_mlp(x, group, w_gu, w_d, max_rows=n_rows)[1]
    assert int(rows) == int(np.sum(-(-counts // blk) * blk)), (int(rows), counts, blk)
    # blocks: the padding stays under 1/16 of the rows
    assert grouped.block_rows(512, 8) == 4 and grouped.n_blocks(512, 8, 4) == 134
    assert grouped.block_rows(10, 8) == 1 and grouped.block_rows(10**6, 8) == grouped.MAX_BLOCK


def test_dropless_computes_the_assigned_rows_only():
    """The dropless layer's matmul FLOPs are ~k/E of the dense dispatch's (C = T slots for every expert):
    T * k = 128 rows plus 8 of block padding, where the dense slots hold E * T = 512."""
    from benchmarks.mfu import dot_flops
    from spmd.models import grouped

    def flops(cf, trips=1.0):
        _, rules, params, step = layer_step("single", cf)
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in layer_inputs()]
        return dot_flops(step.lower(params, *abstract).compile().as_text(), trips)[0]

    # the grouped loops run once per used block, a count known at run time: the layer reports its rows
    rows = layer_result("single")[2]["expert_rows"] * B * L * K
    blocks = rows / grouped.block_rows(B * L * K, E)
    static, per_block = flops(0.0, 0), flops(0.0) - flops(0.0, 0)
    ratio = (static + per_block * blocks) / flops(E / K)
    assert per_block > 0 and K / E < ratio <= 1.1 * K / E


def test_slots_and_capacity_match_a_reference():
    experts_TK = jnp.array([[0, 1], [0, 2], [1, 0], [0, 3]])
    slot, kept = router_lib.slots(experts_TK, 4, capacity=2)
    # first choices in token order (0,0,1,0), then second choices (1,2,0,3)
    np.testing.assert_array_equal(slot, [[0, 1], [1, 0], [0, 3], [2, 0]])
    np.testing.assert_array_equal(kept, [[True, True], [True, True], [True, False], [False, True]])
    assert router_lib.capacity(64, 8, 2, 1.0) == 16 and router_lib.capacity(64, 8, 2, 0.0) == 64
    assert router_lib.capacity(64, 8, 2, 1.25) == 20 and router_lib.capacity(4, 8, 2, 100.0) == 4


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_router_losses(kind):
    """Balanced routing gives aux loss 1; a router sending everything to one expert gives ~E."""
    t = 64
    balanced = jnp.where(jnp.arange(t)[:, None] % E == jnp.arange(E)[None], 10.0, 0.0)
    r = router_lib.route(balanced, 1, kind)
    assert float(r.stats["load_max"]) == pytest.approx(1.0) == float(r.stats["load_min"])
    if kind == "softmax":
        assert float(r.stats["aux_loss"]) == pytest.approx(1.0)
    skewed = router_lib.route(jnp.zeros((t, E)).at[:, 3].set(20.0), 1, kind)
    assert float(skewed.stats["load_max"]) == E and float(skewed.stats["load_min"]) == 0.0
    assert float(skewed.stats["aux_loss"]) > 0.9 * E if kind == "softmax" else float(skewed.stats["aux_loss"]) > 1.5
    logits = jax.random.normal(jax.random.key(0), (t, E))
    top2 = router_lib.route(logits, 2, kind)
    np.testing.assert_allclose(top2.gates_TK.sum(-1), 1.0, rtol=1e-6)  # k > 1: gates normalised
    assert float(top2.stats["z_loss"]) == pytest.approx(float(jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)), rel=1e-6)


# ----------------------------------------------------------------------------- the GPT with MoE blocks
# 4 layers as 2 groups of (dense block, MoE block): 2 MoE layers in the Stack's scan (scanned: the collectives
# are read per loop body, count = trip count); sigmoid router, a shared expert
GPT_CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, d_ff=64, n_experts=E, experts_per_token=K,
                    moe_every=2, n_shared_experts=1, router="sigmoid", aux_loss_weight=0.1, router_z_loss_weight=0.01,
                    scan_layers="scanned")
GPT_B, GPT_L = 8, 8


def gpt_batch():
    tokens = np.random.default_rng(1).integers(0, GPT_CFG.vocab_size, size=(GPT_B, GPT_L + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.cache
def gpt_step(name):
    sizes, rules = LAYOUTS[name]
    mesh, rules = mesh_of(sizes), spmd.get_rules(rules)
    graphdef, params, shardings = spmd.init_params(lambda: GPT(GPT_CFG, rngs=nnx.Rngs(0)), rules, mesh)

    def loss_fn(params, batch):
        with spmd.use_rules(rules, mesh):
            return nnx.merge(graphdef, params).loss(batch["inputs"], batch["targets"])

    batch_sh = spmd.batch_sharding(rules, mesh)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh) for k, v in gpt_batch().items()}
    compiled = jax.jit(jax.value_and_grad(loss_fn, has_aux=True)).lower(params, abstract).compile()
    return mesh, rules, params, shardings, batch_sh, compiled


@functools.cache
def gpt_result(name):
    mesh, rules, params, _, batch_sh, compiled = gpt_step(name)
    (loss, metrics), grads = compiled(params, {k: jax.device_put(v, batch_sh) for k, v in gpt_batch().items()})
    return float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.map(np.asarray, grads)


def test_gpt_matches_single_device():
    ref_loss, ref_metrics, ref_grads = gpt_result("single")
    loss, metrics, grads = gpt_result("fsdp2_expert4")
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(grads, ref_grads) < TOL
    assert metrics == pytest.approx(ref_metrics, rel=TOL)
    assert {"ce", "moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_load_min", "moe_dropped"} <= set(metrics)
    # the loss is ce + the weighted MoE losses (means over the 2 MoE layers)
    assert loss == pytest.approx(metrics["ce"] + 0.1 * metrics["moe_aux_loss"] + 0.01 * metrics["moe_z_loss"], rel=1e-6)
    assert metrics["moe_aux_loss"] > 0 and metrics["moe_dropped"] == 0.0
    # the experts of both MoE layers (stacked [2, E, ...]) and the dense blocks' MLPs all receive gradients
    moe = grads["blocks"]["block"]["moe"]["mlp"]
    assert moe["w_gate_up"].shape == (2, E, 32, 2, 64) and np.abs(moe["w_gate_up"]).max(axis=(2, 3, 4)).min() > 0
    assert np.abs(moe["w_router"]).max() > 0 and np.abs(moe["shared"]["w_down"]).max() > 0


def test_gpt_all_to_alls_per_moe_layer():
    """2 all-to-alls of rows per MoE layer forward (dispatch, combine) and 2 backward, over ``expert``, each
    moving x[ep, R, D] (dropless: R = T x min(k, E/ep) rows to each device, T the device's tokens: 1 row of 8
    on each of 8 devices), and the rows' local expert ids [ep, R] beside the dispatch."""
    mesh, *_, compiled = gpt_step("fsdp2_expert4")
    ops = [c for c in spmd.hlo.collectives(compiled, mesh) if c.kind == "all-to-all"]
    t_loc, ep = GPT_B * GPT_L // 8, 4
    rows = ep * t_loc * min(K, E // ep)
    assert sorted((c.backward, c.count, c.axes, c.bytes) for c in ops) == sorted(
        [(False, 2, ("expert",), rows * 4)] + [(False, 2, ("expert",), rows * GPT_CFG.d_model * 4)] * 2
        + [(True, 2, ("expert",), rows * GPT_CFG.d_model * 4)] * 2)


def test_layer_all_to_all_bytes_at_a_capacity():
    """Capacity factor 1: C = ceil(T * k / E) slots per expert per device; the all-to-alls move [E, C, D].
    This step differentiates the params only: the dispatch's transpose (the gradient of x) is not needed,
    so the backward pass has 1 all-to-all (the combine's transpose) where the GPT has 2."""
    mesh, rules, params, step = layer_step("data2_expert4", 1.0)
    tokens = spmd.batch_sharding(rules, mesh)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tokens) for a in layer_inputs()]
    ops = [c for c in spmd.hlo.collectives(step.lower(params, *abstract).compile(), mesh) if c.kind == "all-to-all"]
    t = B * L // 8
    c = router_lib.capacity(t, E, K, 1.0)
    assert c == 2
    assert sorted((op.backward, op.count, op.axes, op.bytes) for op in ops) == (
        [(False, 1, ("expert",), E * c * D * 4)] * 2 + [(True, 1, ("expert",), E * c * D * 4)])


# Every collective of the dropless layer step (loss and parameter gradients) on each expert-parallel layout,
# as (kind, axes) -> why the layout needs it. Nothing moves routed rows over ``tensor``: the grouped experts keep
# ``w_gate_up[E, D, 2, F_tensor]``'s ``2`` and ``F`` apart (merged into ``2F`` they made XLA reshard the weights
# with an all-to-all over tensor, and the gate/up halves with collective-permutes, each way).
A2A = ("dispatch (rows and their local expert ids) and combine forward, the combine's transpose backward (the x "
       "gradient is not taken here)")
ROUTER = "router: its stats' means over every token, and w_router's gradient summed over the token axes"
TOP_K = ("NOT needed: XLA's partitioner gathers the router's scores [T, E] before top_k (its custom call is not "
         "partitioned along the tokens); it goes when routing moves inside the shard_map")
REPLICAS = "the experts' gradients summed over the token axes the experts are replicated on (shard_map transpose)"
FSDP = "w_router, w_gate_up and w_down gathered over fsdp (D_fsdp) before use"
TP = "w_down is row-parallel (F_tensor): the experts' partial sums, once per block of rows in the grouped loop"
EP_COLLECTIVES = {
    "expert2": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("expert",)): ROUTER, ("all-gather", ("expert",)): TOP_K},
    "expert4": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("expert",)): ROUTER, ("all-gather", ("expert",)): TOP_K},
    "expert8": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("expert",)): ROUTER, ("all-gather", ("expert",)): TOP_K},
    "data2_expert4": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("data", "expert")): ROUTER,
                      ("all-gather", ("data", "expert")): TOP_K, ("all-reduce", ("data",)): REPLICAS},
    "fsdp2_expert4": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("fsdp", "expert")): ROUTER,
                      ("all-gather", ("fsdp", "expert")): TOP_K, ("all-reduce", ("fsdp",)): REPLICAS,
                      ("all-gather", ("fsdp",)): FSDP},
    "fsdp4_expert2": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("fsdp", "expert")): ROUTER,
                      ("all-gather", ("fsdp", "expert")): TOP_K, ("all-reduce", ("fsdp",)): REPLICAS,
                      ("all-gather", ("fsdp",)): FSDP},
    "fsdp2_expert2_tensor2": {("all-to-all", ("expert",)): A2A, ("all-reduce", ("fsdp", "expert")): ROUTER,
                              ("all-gather", ("fsdp", "expert")): TOP_K, ("all-reduce", ("fsdp",)): REPLICAS,
                              ("all-gather", ("fsdp",)): FSDP, ("all-reduce", ("tensor",)): TP},
}


@pytest.mark.parametrize("name", list(EP_COLLECTIVES))
def test_dropless_layer_collectives_per_layout(name):
    """The dropless layer step runs exactly the collectives of EP_COLLECTIVES (the compile test_layer_matches_
    single_device made: a persistent-cache hit after it); the all-to-alls are over expert only."""
    assert set(EP_COLLECTIVES) == set(LAYOUTS) - {"single"}  # every expert-parallel layout has its table
    mesh, rules, params, step = layer_step(name)
    tokens = spmd.batch_sharding(rules, mesh)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=tokens) for a in layer_inputs()]
    ops = spmd.hlo.collectives(step.lower(params, *abstract).compile(), mesh)
    assert sorted(spmd.hlo.summarize(ops)) == sorted(EP_COLLECTIVES[name])
    # dispatch (the rows, and their local expert ids), combine, the combine's transpose
    assert sum(op.count for op in ops if op.kind == "all-to-all") == 4


def trace_layer(sizes, rules, n_experts=E):
    layer = MoE(D, F, n_experts, K, rngs=nnx.Rngs(0))
    mesh = mesh_of(sizes)

    def f(x):
        with spmd.use_rules(rules, mesh):
            return layer(x)[0]

    return jax.eval_shape(f, jax.ShapeDtypeStruct((B, L, D), jnp.float32))


def test_wrong_rule_sets_are_refused():
    trace_layer({"data": 2, "expert": 4}, "dp_ep")  # the right rule set traces
    with pytest.raises(ValueError, match=r"rule set 'dp' maps the MoE dim 'expert'.*expert=4.*dp_ep, fsdp_ep"):
        trace_layer({"data": 2, "expert": 4}, "dp")
    no_batch = spmd.Rules("ep_only", params=(("expert", "expert"),), activations=(("expert", "expert"), ("batch", "data")))
    with pytest.raises(ValueError, match=r"'ep_only' does not split the batch over the expert axis"):
        trace_layer({"data": 2, "expert": 4}, no_batch)
    with pytest.raises(ValueError, match=r"n_experts=8 does not divide over the expert axis of size 3"):
        trace_layer({"expert": 3}, "dp_ep")
    with pytest.raises(ValueError, match=r"maps the MoE dim 'expert' to params"):
        trace_layer({"data": 8}, spmd.get_rules("dp").replace(name="dp_x", params={"expert": "data"},
                                                              activations={"expert": "data"}))


@pytest.mark.parametrize("kw, match", [
    ({"experts_per_token": 9}, "experts_per_token=9 must be between 1 and n_experts=8"),
    ({"moe_every": 3}, "moe_every=3 must be >= 1 and divide n_layers=4"),
    ({"capacity_factor": -1.0}, "capacity_factor must be >= 0"),
    ({"router": "relu"}, "router 'relu' is not one of"),
    ({"n_experts": -2}, "n_experts must be >= 0"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**GPT_CFG.__dict__, **kw})


def test_a_pipeline_config_on_one_device_gives_the_moe_loss():
    """Without a pipe axis the pipelined loss runs the stack once: the MoE losses (carried in the activations'
    statistics channels) and metrics are GPT.loss's (tests/trainers/test_pipeline_axes.py: on a pipe axis)."""
    from spmd.pipeline import PipelineConfig

    model = GPT(GPT_CFG, rngs=nnx.Rngs(0))
    batch = gpt_batch()
    loss, aux = model.loss(batch["inputs"], batch["targets"])
    piped, piped_aux = model.loss(batch["inputs"], batch["targets"], pipeline=PipelineConfig("gpipe", microbatches=2))
    assert float(piped) == pytest.approx(float(loss), rel=1e-6) and aux["moe_aux_loss"] > 0
    assert set(piped_aux) == set(aux)
    for k in aux:
        assert float(piped_aux[k]) == pytest.approx(float(aux[k]), rel=1e-6, abs=1e-7), k


def test_checkpoint_restores_onto_a_mesh_without_the_expert_axis(tmp_path):
    """Params saved from fsdp=2 x expert=4 restore bit-equal onto data=8 (rules dp: experts replicated)
    and onto expert=8; the loss on data=8 (no all-to-all) is the saved model's single-device loss."""
    from trainers.checkpoint import CheckpointConfig, Checkpointer

    _, _, params, _, _, _ = gpt_step("fsdp2_expert4")
    assert params["blocks"]["block"]["moe"]["mlp"]["w_gate_up"].sharding.spec[:3] == (None, "expert", "fsdp")
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1, keep=1)) as ck:
        ck.save(1, {"params": params}, {})
        ck.wait()
        for sizes, rules, spec in [({"data": 8}, "dp", ()), ({"expert": 8}, "dp_ep", (None, "expert"))]:
            mesh = mesh_of(sizes)
            graphdef, _, shardings = spmd.init_params(lambda: GPT(GPT_CFG, rngs=nnx.Rngs(0)), rules, mesh)
            target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)
            _, restored, _ = ck.restore({"params": target})
            restored = restored["params"]
            assert tuple(restored["blocks"]["block"]["moe"]["mlp"]["w_gate_up"].sharding.spec) == spec
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(params)))
            if rules == "dp":
                on_dp = (mesh, graphdef, restored)
    mesh, graphdef, restored = on_dp
    batch = gpt_batch()
    with spmd.use_rules("dp", mesh):
        loss, _ = jax.jit(lambda p: nnx.merge(graphdef, p).loss(batch["inputs"], batch["targets"]))(restored)
    assert float(loss) == pytest.approx(gpt_result("single")[0], rel=TOL)
