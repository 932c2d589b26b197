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

import meshes
import spmd
from helpers.gpt_util import rel_err
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
    return MoE(D, F, E, K, rngs=nnx.Rngs(0), capacity_factor=cf, router=router, n_shared=n_shared)


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


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "single"])
def test_layer_matches_single_device(name):
    ref_loss, ref_y, ref_stats, ref_grads = layer_result("single")
    loss, y, stats, grads = layer_result(name)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    np.testing.assert_allclose(y, ref_y, rtol=TOL, atol=TOL * np.abs(ref_y).max())
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert rel_err(grads, ref_grads) < TOL
    assert stats == pytest.approx(ref_stats, rel=TOL)
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
