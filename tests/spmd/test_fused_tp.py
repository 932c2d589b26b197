"""Fused TP projections and GQA with more tensor shards than KV heads: numbers, layout, collectives, checkpoints.

q/k/v run as one matmul per KV slot and gate/up as one (spmd.models.layers); with tensor = t > n_kv_heads
each KV head is replicated over the t / n_kv_heads shards sharing it. Every case matches one device
(loss and every gradient, 1e-5 in f32); a step written with the old separate weights restores.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.gpt_util import BATCH, CFG, LENGTH, batches
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd.hlo import collectives
from spmd.models import GPT, lm_loss
from spmd.models.layers import kv_slots, valid_head_shards
from spmd.rules import RulesError
from trainers.checkpoint import Checkpointer
from trainers.checks.layout import check_heads

TOL = 1e-5
F32 = 4
GQA = dataclasses.replace(CFG, n_kv_heads=2)  # 8 query heads, 2 KV heads
CASES = {  # name -> (model config, mesh sizes, rule preset)
    "mha4_dp2_tp4": (CFG, {"data": 2, "tensor": 4}, "dp_tp"),  # CFG has 4 KV heads: sharded over tensor
    # 2 KV heads on 4 shards: each copied twice (the layer loop's collectives read per layer: scanned)
    "gqa2_dp2_tp4": (dataclasses.replace(GQA, scan_layers="scanned"), {"data": 2, "tensor": 4}, "dp_tp"),
    "gqa2_dp2_tp4_unrolled": (dataclasses.replace(GQA, scan_layers="unrolled"), {"data": 2, "tensor": 4}, "dp_tp"),
    "gqa2_tp8": (GQA, {"tensor": 8}, "tp"),  # ... on 8 shards: each copied 4 times
}


class Case:
    """Params and one compiled ``value_and_grad`` of the loss for a (config, mesh, rules)."""

    def __init__(self, cfg, sizes, rules):
        self.cfg, self.rules = cfg, spmd.get_rules(rules)
        self.mesh = meshes.make_mesh(sizes) if sizes else meshes.single_device_mesh()
        self.graphdef, self.params, self.shardings = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)),
                                                                      self.rules, self.mesh)
        self.batch_sharding = spmd.batch_sharding(self.rules, self.mesh)
        graphdef, rules, mesh = self.graphdef, self.rules, self.mesh

        def loss(params, inputs, targets):
            with spmd.use_rules(rules, mesh):
                return lm_loss(nnx.merge(graphdef, params)(inputs), targets)[0]

        tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32, sharding=self.batch_sharding)
        self.loss = loss
        self.compiled = jax.jit(jax.value_and_grad(loss)).lower(self.params, tokens, tokens).compile()

    def __call__(self, batch, params=None):
        put = lambda x: jax.device_put(x, self.batch_sharding)
        loss, grads = self.compiled(self.params if params is None else params, put(batch["inputs"]),
                                    put(batch["targets"]))
        return float(loss), jax.tree.map(np.asarray, grads)


@functools.cache
def case(name: str) -> Case:
    if name.startswith("single"):
        return Case({"single_mha4": CFG, "single_gqa2": GQA}[name], {}, "none")
    return Case(*CASES[name])


def rel_errs(a, b) -> dict[str, float]:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(
        lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)), a, b))[0]
    return {spmd.sharding.path_str(p): e for p, e in flat}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_every_gradient_match_one_device(name):
    ref = case("single_gqa2" if name.startswith("gqa") else "single_mha4")
    batch = batches(1)[0]
    ref_loss, ref_grads = ref(batch)
    loss, grads = case(name)(batch)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    errs = rel_errs(grads, ref_grads)
    assert {"blocks/block/attn/w_q", "blocks/block/attn/w_kv", "blocks/block/mlp/w_gate_up"} <= set(errs)
    bad = {k: e for k, e in errs.items() if e > TOL}
    assert not bad, f"gradients differ from one device: {bad}"


def test_negative_control_a_changed_token_is_caught():
    batch = batches(1)[0]
    changed = {k: v.copy() for k, v in batch.items()}
    changed["inputs"][0, 3] = (changed["inputs"][0, 3] + 1) % CFG.vocab_size
    _, ref_grads = case("single_gqa2")(batch)
    _, grads = case("gqa2_tp8")(changed)
    assert rel_errs(grads, ref_grads)["blocks/block/attn/w_kv"] > TOL


def test_kv_heads_replicated_when_tensor_outnumbers_them():
    """Stored: w_q[D, H_tensor, K] sharded, w_kv[D, G, 2, K] whole on every shard (D*G*2*K per layer)."""
    params = case("gqa2_tp8").params["blocks"]["block"]["attn"]
    w_kv, w_q = params["w_kv"], params["w_q"]
    assert w_kv.shape == (GQA.n_layers, GQA.d_model, 2, 2, GQA.k)
    assert w_kv.sharding.is_fully_replicated and w_q.sharding.spec == P(None, None, "tensor")
    assert spmd.inspection.tree_bytes_per_device(w_kv) == GQA.n_layers * GQA.d_model * 2 * 2 * GQA.k * F32
    # control: with 4 KV heads on tensor = 4 the KV heads are sharded, not replicated
    sharded = case("mha4_dp2_tp4").params["blocks"]["block"]["attn"]["w_kv"]
    assert sharded.sharding.spec == P(None, None, "tensor")


def test_gqa_step_communicates_two_activation_all_reduces_per_direction():
    """gqa2 on dp2 x tp4: per layer over tensor, forward: w_o and w_down outputs; backward: the fused
    q/k/v and gate/up input gradients ([B_local, L, D] each); plus the w_kv gradient, summed over the
    2 shards that share each KV head (all-reduce of their [D, 1, 2, K] copy) and gathered whole."""
    c = case("gqa2_dp2_tp4")
    bld = BATCH // 2 * LENGTH * GQA.d_model * F32
    ops = [o for o in collectives(c.compiled, c.mesh) if o.axes == ("tensor",) and "/while/body/" in o.op_name]
    acts = sorted((o.backward, o.op_name.rsplit("/", 2)[-2]) for o in ops if o.bytes == bld)
    assert acts == [(False, "blf,fd->bld"), (False, "blhk,hkd->bld"), (True, "bld,dcf->blcf"),
                    (True, "bld,dnsk->blnsk")]
    assert all(o.kind == "all-reduce" and o.count == GQA.n_layers for o in ops if o.bytes == bld)
    kv_copy = GQA.d_model * 2 * GQA.k * F32  # one shard's [D, 1, 2, K] slot of the repeated w_kv
    rest = sorted((o.kind, o.bytes, o.backward) for o in ops if o.bytes != bld)
    assert rest == [("all-gather", 2 * kv_copy, True), ("all-reduce", kv_copy, True)]
    # unrolled, the same bytes over tensor, outside any loop (XLA may combine the layers' small w_kv all-reduces)
    def totals(name):
        out = {}
        for o in collectives(case(name).compiled, c.mesh):
            if o.axes == ("tensor",):
                out[(o.kind, o.backward)] = out.get((o.kind, o.backward), 0) + o.count * o.bytes
        return out

    unrolled = case("gqa2_dp2_tp4_unrolled")
    assert not any("/while/body/" in o.op_name for o in collectives(unrolled.compiled, unrolled.mesh))
    assert totals("gqa2_dp2_tp4_unrolled") == totals("gqa2_dp2_tp4")
    # over the 2 shards that share a KV head, or over all 4 tensor shards (XLA versions differ): same bytes
    assert {o.group_size for o in ops if o.bytes != bld} <= {2, 4}


def test_head_counts_tensor_cannot_serve_are_refused_by_name():
    assert valid_head_shards(8, 2) == [1, 2, 4, 8]
    assert check_heads(GQA, "dp_tp", {"data": 1, "tensor": 8}) == []
    (issue,) = check_heads(GQA, "dp_tp", {"data": 1, "tensor": 16})
    assert issue.fatal and "model.n_heads=8 and model.n_kv_heads=2" in str(issue) and "tensor=16" in str(issue)
    assert "use tensor of 1 or 2 or 4 or 8" in str(issue)
    odd = dataclasses.replace(CFG, n_heads=12, n_kv_heads=4, head_dim=8)  # tensor=6 divides 12, not 4, nor 4 | 6
    assert "model.n_heads=12 and model.n_kv_heads=4" in str(check_heads(odd, "tp", {"tensor": 6})[0])
    mesh3 = jax.sharding.Mesh(np.array(jax.devices()[:6]), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,))
    with spmd.use_rules("tp", mesh3), pytest.raises(ValueError, match=r"n_heads=12, n_kv_heads=4 .* valid sizes: 1, 2, "
                                                                       r"4, 12"):
        kv_slots(12, 4)
    with pytest.raises(RulesError, match=r"'kv_heads'\) has size 4.*tensor=6.*nor is 6 a multiple of 4"):
        spmd.sharding.spec_for((64, 4, 2, 8), ("embed", "kv_heads", None, "head_dim"), "tp", mesh3)
    assert spmd.sharding.spec_for((64, 2, 2, 8), ("embed", "kv_heads", None, "head_dim"), "tp", mesh3) == P()


# ------------------------------------------------------------------------------ checkpoint conversion
def old_layout(tree):
    """The tree as the GPT stored it before fused projections: w_k, w_v [.., D, G, K] and w_gate, w_up [.., D, F]."""
    def split(d):
        out = {k: v for k, v in d.items() if k not in ("w_kv", "w_gate_up")}
        if "w_kv" in d:
            out["w_k"], out["w_v"] = d["w_kv"][..., 0, :], d["w_kv"][..., 1, :]
        if "w_gate_up" in d:
            out["w_gate"], out["w_up"] = d["w_gate_up"][..., 0, :], d["w_gate_up"][..., 1, :]
        return out
    fused = lambda x: isinstance(x, dict) and ("w_kv" in x or "w_gate_up" in x)
    return jax.tree.map(lambda x: split(x) if fused(x) else x, tree, is_leaf=fused)


def test_a_checkpoint_with_separate_weights_restores_fused(tmp_path, caplog):
    """Saved from one device in the old layout (params + Adam moments), restored onto dp2 x tp4 with
    GQA's KV heads replicated: same loss, moments converted, the conversion logged."""
    import optax

    src, dst = case("single_gqa2"), case("gqa2_dp2_tp4")
    tx = optax.adam(1e-3)
    opt = tx.init(src.params)
    opt = jax.tree.map(lambda x: x + 1.0 if x.ndim else x, opt)  # moments that differ from params' zeros
    state = {"params": src.params, "opt": opt}
    old = old_layout(state)
    assert "w_k" in old["params"]["blocks"]["block"]["attn"] and "w_kv" not in old["params"]["blocks"]["block"]["attn"]
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(7, old, {"step": 7}, force=True)
        ckpt.wait()
    abstract = {"params": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), dst.params,
                                       dst.shardings),
                "opt": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
                    dst.mesh, P())), jax.eval_shape(tx.init, dst.params))}
    with caplog.at_level(logging.INFO, logger="trainers.checkpoint.upgrade"), Checkpointer(tmp_path / "ckpt") as ckpt:
        step, restored, data = ckpt.restore(abstract)
        _, params_only = ckpt.restore_params(abstract["params"])
    assert (step, data) == (7, {"step": 7})
    assert "checkpoint conversion applied: gpt fused k/v" in caplog.text and "gate/up" in caplog.text
    kv = restored["params"]["blocks"]["block"]["attn"]["w_kv"]
    assert kv.sharding == dst.shardings["blocks"]["block"]["attn"]["w_kv"]
    for tree in (restored["params"], params_only):
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), tree, src.params)))
    mu = restored["opt"][0].mu
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), mu, opt[0].mu)))
    batch = batches(1)[0]
    assert dst(batch, restored["params"])[0] == dst(batch)[0]  # the same function: bit-equal loss
    # negative control: the same step restored with k and v swapped would compute another loss
    swapped = jax.tree.map(lambda x: x, restored["params"])
    swapped["blocks"]["block"]["attn"]["w_kv"] = kv[..., ::-1, :]
    assert abs(dst(batch, swapped)[0] - dst(batch)[0]) > TOL


def test_spmd_train_runs_gqa_on_more_tensor_shards_than_kv_heads(tmp_path, capsys):
    """``spmd-train gpt-small --tiny`` (4 heads) with 2 KV heads on tensor = 4 trains; tensor = 8 is
    refused before anything is built, naming the head counts and the valid tensor sizes."""
    from trainers.launch import cli

    common = ["gpt-small", "--tiny", "--set", "model.n_kv_heads=2", "--set", "rules=dp_tp", "--set", "run.steps=1",
              "--set", "run.eval_batches=0", "--set", "run.progress=false", "--set", "run.tensorboard=false"]
    assert cli.main(common + ["--set", "mesh.axes=data=2,tensor=4", "--set", f"run.run_dir={tmp_path / 'ok'}"]) == 0
    capsys.readouterr()
    assert cli.main(common + ["--set", "mesh.axes=data=1,tensor=8", "--set", f"run.run_dir={tmp_path / 'no'}"]) == 2
    err = capsys.readouterr().err
    assert "model.n_heads=4 and model.n_kv_heads=2 cannot shard over tensor=8" in err and "tensor of 1 or 2 or 4" in err
