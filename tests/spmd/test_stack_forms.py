"""The layer stack scanned or unrolled (``model.scan_layers``): same parameters, same numbers, other program.

Unrolled and scanned compile the same per-block computation; XLA fuses the inlined blocks' norm and
softmax reductions differently from the loop body, so values may differ in the last bit (docs/performance.md):
the comparisons allow 1e-6, and a negative control shows that a real change is caught at that tolerance.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig
from spmd.stack import UNROLL_UP_TO, stack_form
from trainers import override, recipe
from trainers.config import fixed_on_resume
from trainers.planning.hardware import get_hardware
from trainers.planning.planner import plan
from trainers.planning.report import layer_stack

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64)
TOL = 1e-6


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(8, 17), dtype=np.int32)


def loss_and_grads(form: str, rules: str = "none", sizes: dict | None = None, seed: int = 0, base: GPTConfig = CFG):
    """``(loss, grads, compiled step)`` of the tiny GPT with its blocks ``form``, on ``sizes`` under ``rules``."""
    cfg = dataclasses.replace(base, scan_layers=form)
    mesh = meshes.make_mesh(sizes) if sizes else meshes.single_device_mesh()
    rules = spmd.get_rules(rules)
    graphdef, params, _ = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), rules, mesh)
    batch = jax.device_put(tokens(seed), spmd.batch_sharding(rules, mesh, dims=("batch",)))  # rows: L + 1 tokens

    def loss(params, batch):
        with spmd.use_rules(rules, mesh):
            return nnx.merge(graphdef, params).loss(batch[:, :-1], batch[:, 1:])[0]

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(params, batch)
    return float(value), jax.tree.map(np.asarray, grads), step.lower(params, batch).compile()


def max_rel(a, b) -> float:
    errs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)), a, b)
    return max(jax.tree.leaves(errs))


@pytest.mark.parametrize("sizes,rules", [
    pytest.param(None, "none", marks=pytest.mark.sweep), ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
    pytest.param({"seq": 2, "tensor": 4}, "dp_tp_sp", marks=pytest.mark.sweep),  # context + sequence parallel
], ids=["single", "dp2_fsdp2_tp2", "seq2_tp4_sp"])
def test_unrolled_equals_scanned(sizes, rules):
    loss_s, grads_s, compiled_s = loss_and_grads("scanned", rules, sizes)
    loss_u, grads_u, compiled_u = loss_and_grads("unrolled", rules, sizes)
    assert loss_u == pytest.approx(loss_s, rel=TOL, abs=0)
    assert jax.tree.structure(grads_u) == jax.tree.structure(grads_s)
    assert max_rel(grads_u, grads_s) < TOL
    # another program really ran: the scanned step loops over the layers, the unrolled one has no such loop
    # (XLA:CPU's own loops, e.g. its legacy emitters', and the ring exchange of context parallelism remain)
    layer_loop = f'"known_trip_count":{{"n":"{CFG.n_layers}"}}'
    if "seq" in (sizes or {}):
        assert compiled_s.as_text() != compiled_u.as_text()
    else:
        assert layer_loop in compiled_s.as_text() and layer_loop not in compiled_u.as_text()
    # negative control: another batch moves the loss and the grads far beyond the tolerance
    loss_o, grads_o, _ = loss_and_grads("unrolled", rules, sizes, seed=1)
    assert abs(loss_o - loss_s) / loss_s > 100 * TOL and max_rel(grads_o, grads_s) > 100 * TOL


def test_moe_groups_unrolled_equal_scanned():
    """MoE groups (a dense block, then a MoE block) as the stack's unit; the MoE losses summed over layers."""
    moe = dataclasses.replace(CFG, n_layers=4, n_experts=4, moe_every=2, experts_per_token=2)
    loss_s, grads_s, compiled_s = loss_and_grads("scanned", base=moe)
    loss_u, grads_u, compiled_u = loss_and_grads("unrolled", base=moe)
    assert loss_u == pytest.approx(loss_s, rel=TOL, abs=0) and max_rel(grads_u, grads_s) < TOL
    # the loop over the 2 groups is gone (the grouped expert matmuls keep loops of their own, over row blocks)
    layer_loop = '"known_trip_count":{"n":"2"}'
    assert layer_loop in compiled_s.as_text() and layer_loop not in compiled_u.as_text()


def test_both_forms_hold_the_same_parameters():
    """Checkpoints restore either way: the same variables, shapes and logical dims (stacked over layers)."""
    def state(form):
        model = nnx.eval_shape(lambda: GPT(dataclasses.replace(CFG, scan_layers=form), rngs=nnx.Rngs(0)))
        return model, jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(nnx.state(model)))

    (scanned, a), (unrolled, b) = state("scanned"), state("unrolled")
    assert a == b and a["blocks"]["block"]["mlp"]["w_down"][0] == (3, 64, 32)
    assert spmd.sharding.logical_dims(scanned) == spmd.sharding.logical_dims(unrolled)
    assert (scanned.blocks.form, unrolled.blocks.form) == ("scanned", "unrolled")
    # a resumed run may change the form (not the model's shapes)
    assert not fixed_on_resume("model.scan_layers") and fixed_on_resume("model.n_layers")


def test_auto_form_by_depth_and_backend():
    for backend, limit in UNROLL_UP_TO.items():
        assert stack_form("auto", limit, backend) == "unrolled"
        assert stack_form("auto", limit + 1, backend) == "scanned"
    assert stack_form("auto", 4, "cpu") == "unrolled" and stack_form("auto", 48, "cpu") == "scanned"
    assert stack_form("scanned", 1, "cpu") == "scanned" and stack_form("unrolled", 96, "gpu") == "unrolled"
    assert stack_form("auto", 4) == "unrolled"  # this backend (cpu): the main job's 4 layers unroll
    with pytest.raises(ValueError, match="'loop' is not one of auto, scanned, unrolled"):
        stack_form("loop", 4)
    with pytest.raises(ValueError, match="GPTConfig.scan_layers 'loop'"):
        GPTConfig(scan_layers="loop")
    # MoE groups count as one block each: 24 layers in groups of 2 are 12 blocks
    moe = GPTConfig(n_layers=24, n_experts=4, moe_every=2)
    assert moe.stack_form("gpu") == "unrolled" and dataclasses.replace(moe, moe_every=1).stack_form("gpu") == "scanned"


def test_dry_run_and_planner_say_which_form_runs():
    deep = dataclasses.replace(CFG, n_layers=12)
    assert layer_stack(deep, get_hardware("tpu-v5p")) == "layer stack scanned (model.scan_layers=auto; auto: 12 layers on tpu)"
    assert layer_stack(deep, get_hardware("h100")).startswith("layer stack unrolled")
    assert layer_stack(deep, get_hardware("cpu")).startswith("layer stack unrolled")
    assert layer_stack(dataclasses.replace(deep, scan_layers="scanned"), get_hardware("cpu")) == \
        "layer stack scanned (model.scan_layers=scanned; set)"
    cfg = override(recipe("gpt-small"), ["model.n_layers=24"])
    found = plan(cfg, 8, "h100", confirm=0)
    assert found.layer_stack == layer_stack(cfg.model, get_hardware("h100")) and found.layer_stack.startswith(
        "layer stack scanned")
    assert found.layer_stack in found.format()


def test_stack_helper_unrolls_any_block():
    """spmd.Stack itself: a user's block, unrolled, gives the scanned result and its carried variables."""
    class Counted(nnx.Module):
        def __init__(self, rngs):
            self.w = spmd.models.param(rngs, nnx.initializers.normal(0.5), (4, 4), ("embed", "mlp"))
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] += 1.0
            return x + jnp.tanh(x @ self.w[...])

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    outs = {}
    for form in ("scanned", "unrolled"):
        stack = spmd.Stack(Counted, 5, rngs=nnx.Rngs(0), scan=form)
        outs[form] = (np.asarray(stack(x)), np.asarray(stack.block.calls[...]))
    np.testing.assert_allclose(outs["unrolled"][0], outs["scanned"][0], rtol=TOL)
    np.testing.assert_array_equal(outs["unrolled"][1], np.ones(5))
    np.testing.assert_array_equal(outs["scanned"][1], np.ones(5))


@pytest.mark.sweep
def test_a_run_resumes_across_the_form(tmp_path):
    """A checkpoint written by the scanned stack resumes unrolled and continues as the uninterrupted run."""
    from trainers import train

    common = ["run.log_every=1", "run.eval_batches=0", "run.progress=false", "run.tensorboard=false",
              "checkpoint.async_save=false", "checkpoint.every_steps=2", "lr.total_steps=10", "lr.warmup_steps=1"]
    cfg = override(recipe("gpt-small", tiny=True), [*common, "run.steps=2", f"run.run_dir={tmp_path / 'a'}",
                                                    "model.scan_layers=scanned"])
    train(cfg)
    resumed = train(override(cfg, ["run.steps=3", "model.scan_layers=unrolled"])).losses
    whole = train(override(cfg, ["run.steps=3", f"run.run_dir={tmp_path / 'b'}"])).losses
    assert set(resumed) == {3} and resumed[3] == pytest.approx(whole[3], rel=TOL, abs=0)
    assert resumed[3] != pytest.approx(whole[2], rel=1e-3)  # control: another step's loss is told apart
