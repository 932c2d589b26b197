"""Remat policies by name (spmd.remat): names and errors, loss and gradient parity with ``none`` on a
sharded mesh, what each policy keeps (no gathered weights but under ``none``), recompute, and the
compiled temp bytes of the train step on dp8 and fsdp8, with negative controls."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.gpt_util import BATCH, CFG, LENGTH, batches

import meshes
import spmd
from benchmarks.remat import kept_weights
from spmd import remat as remat_lib
from spmd.models import GPT, GPTConfig, lm_loss

POLICIES = remat_lib.POLICIES
TOL = 1e-5  # f32: the recompute runs the same ops, so only reassociation differs
MESHES = {"fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"), "dp8": ({"data": 8}, "dp"),
          "fsdp8": ({"fsdp": 8}, "fsdp")}


def cfg_for(policy: str, attention: str = "auto") -> GPTConfig:
    """The tiny GPT under ``policy``; with ``attention="blockwise"`` in blocks of 8 positions."""
    block = 8 if attention == "blockwise" else CFG.attention_block
    return dataclasses.replace(CFG, remat_policy=policy, attention=attention, attention_block=block)


def abstract(cfg: GPTConfig) -> tuple[nnx.GraphDef, dict]:
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)


@functools.cache
def layout(name: str) -> tuple[jax.sharding.Mesh, spmd.Rules, dict, jax.sharding.NamedSharding]:
    sizes, preset = MESHES[name]
    mesh, rules = meshes.make_mesh(sizes), spmd.get_rules(preset)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    return mesh, rules, spmd.param_shardings(nnx.state(model, nnx.Param), rules, mesh), spmd.batch_sharding(rules, mesh)


def loss_fn(policy: str, mesh, rules, attention: str = "auto"):
    graphdef, _ = abstract(cfg_for(policy, attention))

    def loss(params, batch):
        with spmd.use_rules(rules, mesh):
            return lm_loss(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])[0]

    return loss


# --- names -----------------------------------------------------------------------------------------


def test_policy_names_and_errors():
    assert remat_lib.resolve(False) == "none" and remat_lib.resolve(True) == "full"
    assert all(remat_lib.resolve(p) == p for p in POLICIES)
    assert {"none", "full", "save_dots", "save_block_input", "offload"} <= set(POLICIES)
    with pytest.raises(ValueError, match="'dots' is not one of none, save_all_but_gathered, save_dots, offload, full"):
        remat_lib.resolve("dots")
    with pytest.raises(ValueError, match="is not one of"):
        spmd.Stack(lambda r: nnx.Linear(2, 2, rngs=r), 2, rngs=nnx.Rngs(0), remat="everything")
    with pytest.raises(ValueError, match="remat_policy 'dots' is not one of"):
        GPTConfig(remat_policy="dots")
    assert GPTConfig(remat=True).policy == "full" and GPTConfig(remat=True, remat_policy="save_dots").policy == "save_dots"
    assert remat_lib.jax_policy("none") is None
    assert remat_lib.jax_policy("save_block_input") is remat_lib.jax_policy("full")  # an alias, said so


def test_offload_needs_host_memory_and_names_the_backend():
    class Memory:
        def __init__(self, kind):
            self.kind = kind

    class Device:  # a backend with device memory only
        platform, device_kind = "metal", "Apple M9"

        def addressable_memories(self):
            return [Memory("device")]

    with pytest.raises(ValueError, match=r"'offload' .* 'pinned_host' memory, which the metal backend \(Apple M9\)"):
        remat_lib.check("offload", Device())
    assert remat_lib.check("save_dots", Device()) == "save_dots"  # only offload needs the host
    assert remat_lib.check("offload") == "offload"  # the CPU backend has pinned_host memory ...
    assert not remat_lib.offloads()  # ... but jax lowers the copies away there: it runs as save_dots


# --- numbers ---------------------------------------------------------------------------------------


@functools.cache
def sharded_params_and_batch(name: str, seed: int = 0):
    """Parameters filled from numpy (norm scales 1, weights N(0, 1/D)), placed on the layout."""
    mesh, _, shardings, batch_sharding = layout(name)
    _, shapes = abstract(CFG)
    rng = np.random.default_rng(seed)

    def fill(path, x, sharding):
        scale = spmd.sharding.path_str(path).endswith("scale")
        value = np.ones(x.shape, np.float32) if scale else rng.normal(0.0, CFG.d_model**-0.5, x.shape).astype(np.float32)
        return jax.device_put(value, sharding)

    params = jax.tree_util.tree_map_with_path(fill, shapes, shardings)
    batch = {k: jax.device_put(v, batch_sharding) for k, v in batches(1)[0].items()}
    return params, batch


@functools.cache
def loss_and_grads(policy: str, name: str = "fsdp_tp", seed: int = 0, attention: str = "auto"):
    mesh, rules, _, _ = layout(name)
    params, batch = sharded_params_and_batch(name, seed)
    loss, grads = jax.jit(jax.value_and_grad(loss_fn(policy, mesh, rules, attention)))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# offload is save_dots's program on CPU (no host memory space): the sweep
@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.sweep) if p == "offload" else p for p in POLICIES[1:]])
def test_every_policy_matches_none_on_a_sharded_mesh(policy):
    """data=2 x fsdp=2 x tensor=2: same loss and gradients as ``none`` to 1e-5 (f32)."""
    loss0, grads0 = loss_and_grads("none")
    loss1, grads1 = loss_and_grads(policy)
    assert abs(loss1 - loss0) <= TOL and max_diff(grads1, grads0) <= TOL


def test_policies_wrap_blockwise_attention_too():
    """The custom-VJP blockwise attention (block 8 of L=16) inside a rematerialised block."""
    loss0, grads0 = loss_and_grads("none", attention="blockwise")
    for policy in ("save_dots", "full"):
        loss1, grads1 = loss_and_grads(policy, attention="blockwise")
        assert abs(loss1 - loss0) <= TOL and max_diff(grads1, grads0) <= TOL, policy
    assert abs(loss0 - loss_and_grads("none")[0]) <= TOL  # and equal to the naive path


def test_parity_tolerance_is_not_vacuous():
    """Negative control: other weights move the loss and the gradients far beyond the tolerance."""
    loss0, grads0 = loss_and_grads("none")
    loss1, grads1 = loss_and_grads("full", seed=1)
    assert abs(loss1 - loss0) > 10 * TOL and max_diff(grads1, grads0) > 10 * TOL


def test_what_each_policy_recomputes():
    """Matmul FLOPs of the gradient (jaxpr, scan bodies x length): ``full`` recomputes every block
    matmul, ``save_dots`` only attention's batched ones, ``save_all_but_gathered`` none."""
    mesh, rules, _, _ = layout("fsdp8")
    _, shapes = abstract(CFG)
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    flops = {p: spmd.inspection.jaxpr_flops(jax.grad(loss_fn(p, mesh, rules)), shapes, batch) for p in POLICIES}
    assert flops["save_all_but_gathered"] == flops["none"] < flops["save_dots"] < flops["full"]
    assert flops["offload"] == flops["save_dots"] and flops["save_block_input"] == flops["full"]
    # per token and layer, 2 x the multiply-adds recomputed: full re-runs the block's forward but
    # the last matmul (w_down: its output is only summed into the block output, which the backward
    # pass does not read); save_dots re-runs only attention's scores and weighted sum (2 H K L)
    attention = 2 * CFG.n_heads * CFG.k * LENGTH
    forward = (CFG.n_heads + 2 * CFG.kv_heads) * CFG.k * CFG.d_model + CFG.n_heads * CFG.k * CFG.d_model \
        + 2 * CFG.d_model * CFG.ff + attention
    per_token = 2 * BATCH * LENGTH * CFG.n_layers
    assert flops["full"] - flops["none"] == per_token * forward
    assert flops["save_dots"] - flops["none"] == per_token * attention


def block_weight_bytes() -> int:
    """Bytes of every layer's matmul weights, whole (f32)."""
    return sum(math.prod(x.shape) * 4 for path, x in jax.tree_util.tree_leaves_with_path(abstract(CFG)[1])
               if "blocks" in spmd.sharding.path_str(path) and len(x.shape) >= 3)


def test_no_policy_but_none_keeps_the_gathered_weights():
    """The backward pass's residuals under FSDP: every layer's gathered weights under ``none``
    (the negative control), the parameter shards only under every other policy."""
    mesh, _, _, _ = layout("fsdp8")
    weights = block_weight_bytes()
    for policy in POLICIES:
        kept = kept_weights(cfg_for(policy), mesh, "fsdp", BATCH, LENGTH)
        assert sum(b for _, b in kept) == (weights if policy == "none" else 0), (policy, kept)


# --- compiled memory -------------------------------------------------------------------------------


def compile_step(policy: str, name: str):
    """The donated SGD train step of the tiny GPT, compiled on a layout."""
    mesh, rules, shardings, batch_sharding = layout(name)
    loss = loss_fn(policy, mesh, rules)

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    _, shapes = abstract(CFG)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32, sharding=batch_sharding)
    return jax.jit(step, out_shardings=(shardings, spmd.sharding.replicated(mesh)), donate_argnums=0).lower(
        params, {"inputs": tokens, "targets": tokens}).compile()


@functools.cache
def temp(policy: str, name: str) -> int:
    return spmd.inspection.memory(compile_step(policy, name)).temp


def test_compiled_temp_bytes_order_and_fsdp_below_dp():
    """fsdp8: full < save_dots < save_all_but_gathered < none; offload = save_dots on CPU; and at
    equal batch fsdp8's temp <= dp8's under every policy but none."""
    fsdp = {p: temp(p, "fsdp8") for p in ("none", "save_all_but_gathered", "save_dots", "offload", "full")}
    assert fsdp["full"] < fsdp["save_dots"] < fsdp["save_all_but_gathered"] < fsdp["none"]
    assert fsdp["offload"] == fsdp["save_dots"]  # no host memory space on CPU: the same program
    for policy in ("save_all_but_gathered", "save_dots", "full"):
        assert fsdp[policy] <= temp(policy, "dp8"), policy


def test_keeping_the_gathered_weights_would_show_in_temp(monkeypatch):
    """Negative control: save_dots plus the sharding constraints' outputs (the gathered weights) costs
    fsdp8 about every layer's weights more, and more than dp8 under save_dots."""
    cp = jax.checkpoint_policies
    keep = cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      lambda prim, *_, **__: prim.name == "sharding_constraint")
    monkeypatch.setattr(remat_lib, "jax_policy", lambda policy: keep)
    kept = spmd.inspection.memory(compile_step("save_dots", "fsdp8")).temp
    monkeypatch.undo()
    weights = block_weight_bytes()
    assert kept - temp("save_dots", "fsdp8") >= weights / 2
    assert kept > temp("save_dots", "dp8")


# --- the analytic estimate and the planner ---------------------------------------------------------


def test_estimate_and_planner_read_the_policy():
    """Activations: none = save_all_but_gathered > save_dots > offload = full = save_block_input;
    executed FLOPs: full > save_dots = offload > none; ``remat=True`` is ``full`` and a policy wins
    over it; a Layout may name a policy, and a bool Layout clears a policy set in the base config."""
    from trainers import override, recipe
    from trainers.planning.costs import comm_estimate, memory_estimate, roofline
    from trainers.planning.hardware import get_hardware
    from trainers.planning.planner import Layout

    hw, sizes = get_hardware("h100"), {"fsdp": 8}
    base = recipe("gpt-125m")

    def with_policy(policy):
        return override(base, [f"model.remat_policy={policy}"])

    acts = {p: memory_estimate(with_policy(p), sizes).activations for p in POLICIES}
    assert acts["none"] == acts["save_all_but_gathered"] > acts["save_dots"] > acts["offload"]
    assert acts["offload"] == acts["full"] == acts["save_block_input"]
    assert memory_estimate(override(base, ["model.remat=true", "model.remat_policy="]), sizes).activations == acts["full"]
    assert memory_estimate(override(base, ["model.remat=true", "model.remat_policy=none"]), sizes).activations == \
        acts["none"]

    def executed(policy):
        cfg = with_policy(policy)
        mem = memory_estimate(cfg, sizes)
        return roofline(cfg, 8, hw, mem, comm_estimate(cfg, sizes, hw)).flops_per_device

    flops = {p: executed(p) for p in ("none", "save_all_but_gathered", "save_dots", "offload", "full")}
    assert flops["full"] == pytest.approx(4 / 3 * flops["none"], rel=0.01)  # causal attention: 9/7, not 4/3
    assert flops["full"] > flops["save_dots"] == flops["offload"] > flops["none"] == flops["save_all_but_gathered"]

    layout = Layout((("fsdp", 8),), "fsdp", "save_dots")
    assert "model.remat_policy=save_dots" in layout.overrides() and layout.apply(base).model.policy == "save_dots"
    assert str(layout) == "fsdp=8 fsdp remat=save_dots" and "--set model.remat_policy=save_dots" in layout.command()
    plain = Layout((("fsdp", 8),), "fsdp", True)
    assert plain.apply(with_policy("save_dots")).model.policy == "full"  # the bool is what runs
    assert plain.command(with_policy("save_dots")).endswith("--set model.remat=true --set model.remat_policy=")
    with pytest.raises(ValueError, match="remat policy 'dots' is not one of"):
        Layout((("fsdp", 8),), "fsdp", "dots")
