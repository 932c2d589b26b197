"""Every kind of NNX state, sharded from flax's own annotations, from path rules or by the default.

Layout (specs, decisions) is tested here without numbers; the step's handling of batch statistics,
RNG streams and the loss contract is tested on tiny models against one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd.variables import decide, format_decisions, init_model
from trainers.config import Config, override
from trainers.setup import build
from trainers.step import eval_view
from trainers.task import Task


class Annotated(nnx.Module):
    """flax's documented annotations, nothing toolkit-specific."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class Plain(nnx.Module):
    """No annotations, BatchNorm statistics and a dropout RNG stream."""

    def __init__(self, rngs, rate=0.5):
        self.up = nnx.Linear(16, 128, rngs=rngs)
        self.bn = nnx.BatchNorm(128, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.down = nnx.Linear(128, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.bn(self.up(x)))))


def _mesh(**sizes):
    n = int(np.prod(list(sizes.values())))
    return meshes.make_mesh(sizes, devices=jax.devices()[:n])


def test_with_partitioning_needs_no_flags():
    mesh = _mesh(fsdp=2, tensor=4)
    mv = init_model(lambda: Annotated(nnx.Rngs(0)), "fsdp_tp", mesh)
    assert mv.shardings["params"]["up"]["kernel"].spec == P("fsdp", "tensor")
    assert mv.shardings["params"]["down"]["kernel"].spec == P("tensor", "fsdp")
    assert mv.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    assert {d.source for d in mv.decisions if d.path.endswith("kernel")} == {"annotation"}
    # the same values as the model built plainly on one device
    with nnx.use_eager_sharding(False):
        ref = Annotated(nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(mv.params["up"]["kernel"]), np.asarray(ref.up.kernel[...]))


def test_default_fsdp_path_rules_and_table():
    mesh = _mesh(fsdp=8)
    abstract = spmd.sharding.abstract_module(lambda: Plain(nnx.Rngs(0)))
    _, params, other = nnx.split(abstract, nnx.Param, ...)
    by_path = {d.path: d for d in decide(params, "fsdp", mesh)}
    assert by_path["up/kernel"].spec == P(None, "fsdp")  # largest dim (128) divides by 8
    assert by_path["up/kernel"].source.startswith("default")
    assert by_path["down/kernel"].spec == P()  # [128, 4]: too small to shard
    assert by_path["up/bias"].spec == P()
    # under dp nothing is sharded by default
    assert all(d.spec == P() for d in decide(params, "dp", mesh))
    # path rules: logical dims through the rule set, or mesh axes directly
    rules = ((r"up/kernel", (None, "embed")), (r"down/kernel$", P(None, None)))
    by_path = {d.path: d for d in decide(params, "fsdp", mesh, path_rules=rules)}
    assert by_path["up/kernel"].spec == P(None, "fsdp") and "path rule" in by_path["up/kernel"].source
    assert by_path["down/kernel"].spec == P() and "path rule" in by_path["down/kernel"].source
    table = format_decisions(decide(params, "fsdp", mesh, path_rules=rules))
    assert "up/kernel" in table and "path rule 'up/kernel'" in table
    # batch statistics and RNG state are replicated
    assert all(d.spec == P() for d in decide(other, "fsdp", mesh))


@pytest.mark.parametrize("rules, match", [
    (((r"up/kernel", ("embed",)),), "needs 2"),
    (((r"up/kernel", P(None, "tensor", None)),), "3 dims"),
    (((r"[", ("embed", None)),), "not a valid regex"),
    (((r"down/bias", P("fsdp")),), "does not divide"),
    (((r"up/kernel", P("nope")),), "not in the mesh"),
    (("up/kernel",), "expected"),
])
def test_bad_path_rules_are_named(rules, match):
    mesh = _mesh(fsdp=8)
    _, params, _ = nnx.split(spmd.sharding.abstract_module(lambda: Plain(nnx.Rngs(0))), nnx.Param, ...)
    with pytest.raises(spmd.rules.RulesError, match=match):
        decide(params, "fsdp", mesh, path_rules=rules)


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 16)).astype(np.float32), "y": rng.integers(0, 4, size=(n,)).astype(np.int32)}


def _loss(model, batch, rngs):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(logits.argmax(-1) == batch["y"])}


def _build(mesh, rules, task, *sets):
    """The run of ``task`` on ``mesh`` under ``rules``: SGD at lr 0.1 (Adam would amplify float-level
    differences of near-zero gradients), 16 rows a batch, the spike and update checks off."""
    cfg = override(Config(), [f"rules={rules}", "data.global_batch=16", "run.spike_factor=0", "run.max_update_ratio=0",
                              "run.max_param_growth=0", *sets])
    return build(cfg, task, mesh, tx=optax.sgd(0.1), donate=False)


def _task(rate=0.5, loss=_loss, **kw):
    return Task(model=lambda rngs: Plain(rngs, rate), loss=loss, data=(), **kw)


def _run(mesh, rules, steps=3, rate=0.5, loss=_loss):
    run = _build(mesh, rules, _task(rate, loss))
    state, out = run.stepped.state, []
    for i in range(steps):
        state, m = run.train_step(state, jax.device_put(_batch(i), run.batch_sharding))
        out.append(float(m["loss"]))
    return run.sharded, state, out


@pytest.fixture(scope="module")
def reference():
    return _run(_mesh(data=1), "dp")


def test_batch_stats_and_rng_streams_are_state(reference):
    sharded, state, losses = reference
    other = state.model_state
    assert other["drop"]["rngs"]["key"].dtype == jnp.uint32  # stored as key data: checkpoints hold plain arrays
    assert int(other["drop"]["rngs"]["count"]) == 3  # one dropout mask per step
    assert not np.allclose(np.asarray(other["bn"]["mean"]), 0.0)  # running statistics moved
    assert len(set(losses)) == 3


@pytest.mark.parametrize("sizes, rules", [({"data": 8}, "dp"), ({"fsdp": 8}, "fsdp"), ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp")])
def test_batch_stats_and_dropout_equal_one_device(reference, sizes, rules):
    _, ref_state, ref_losses = reference
    _, state, losses = _run(_mesh(**sizes), rules)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref_state.model_state), jax.tree.leaves(state.model_state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_negative_control_dropout_changes_the_run(reference):
    _, _, ref_losses = reference
    _, _, losses = _run(_mesh(data=8), "dp", rate=0.3)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[1:], ref_losses[1:])) > 1e-3


@pytest.mark.parametrize("bad, match", [
    (lambda m, b, r: (_loss(m, b, r)[0], {}, 1), "tuple of 3"),
    (lambda m, b, r: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]), "scalar"),
    (lambda m, b, r: (_loss(m, b, r)[0], {"per_row": m(b["x"])[:, 0]}), "per_row"),
])
def test_loss_contract_errors(bad, match):
    mesh = _mesh(data=1)
    with pytest.raises(TypeError, match=match):
        _run(mesh, "dp", steps=1, loss=bad)


def test_scalar_loss_and_eval_metric_contract(reference):
    _, state, _ = reference
    mesh = _mesh(data=1)
    acc = lambda m, b: m(b["x"]).argmax(-1) == b["y"]
    run = _build(mesh, "dp", _task(loss=lambda m, b, r: _loss(m, b, r)[0], eval_metrics={"accuracy": acc}))
    ev, bs = run.eval_step, run.batch_sharding
    view = eval_view(state)
    mask = np.asarray([1.0] * 12 + [0.0] * 4, np.float32)
    out = jax.device_get(ev(view, jax.device_put(_batch(7), bs), jax.device_put(mask, bs)))
    assert out["count"] == 12 and 0 <= out["accuracy"] <= 12
    bad = _build(mesh, "dp", _task(eval_metrics={"mean_acc": lambda m, b: jnp.mean(acc(m, b))})).eval_step
    with pytest.raises(TypeError, match="one value per example"):
        bad(view, jax.device_put(_batch(7), bs), jax.device_put(mask, bs))


def test_jaxpr_flops_counts_scanned_layers():
    from spmd.models import GPT, GPTConfig, flops_per_step

    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=128)
    graphdef, params, _ = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), "dp", _mesh(data=1))
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    counted = 3 * spmd.inspection.jaxpr_flops(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    analytic = flops_per_step(cfg, 2, 32)
    assert counted == pytest.approx(analytic, rel=0.15)
    one_layer = GPTConfig(vocab_size=256, d_model=64, n_layers=1, n_heads=4, d_ff=128)
    g1, p1, _ = spmd.init_params(lambda: GPT(one_layer, rngs=nnx.Rngs(0)), "dp", _mesh(data=1))
    single = 3 * spmd.inspection.jaxpr_flops(lambda p, t: nnx.merge(g1, p)(t), p1, tokens)
    assert counted > 2.5 * single  # the scan body counted once per layer, not once


def test_a_loss_may_draw_keys_from_rngs_with_accumulation():
    """The step's rngs are made inside the differentiated function, per microbatch."""
    mesh = _mesh(data=2)

    def noisy(model, batch, rngs):
        keep = jax.random.bernoulli(rngs.dropout(), 0.5, batch["x"].shape)
        return _loss(model, {**batch, "x": batch["x"] * keep}, rngs)

    run = _build(mesh, "dp", _task(0.0, noisy), "run.grad_accum=2")
    step, state0 = run.train_step, run.stepped.state
    batch = jax.device_put(_batch(0), run.batch_sharding)
    s1, m1 = step(state0, batch)
    _, m2 = step(state0, batch)
    _, m3 = step(s1, batch)
    assert float(m1["loss"]) == float(m2["loss"])  # same state, same keys: reproducible
    assert float(m3["loss"]) != float(m1["loss"])  # the next step draws other keys


def test_stack_blocks_update_their_batch_statistics():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.bn(x)

    stack = spmd.Stack(lambda r: Block(r), 3, rngs=nnx.Rngs(0))
    stack(jnp.arange(32.0).reshape(4, 8))
    mean = np.asarray(stack.block.bn.mean[...])
    assert mean.shape == (3, 8) and np.all(np.abs(mean[0]) > 0.1)  # written back per layer, not dropped
