"""DPO under a pipeline (``spmd.models.piped_dpo``) equals one device: the loss, every metric and every
gradient, with the frozen copy and with LoRA (the reference = the adapters off), on data x pipe and
fsdp x tensor x pipe, for 1F1B, GPipe, interleaved and the zero-bubble schedules; the reference gets no
gradient; a pipelined CLI run equals the same run unpipelined over 3 steps; what cannot run is refused."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig
from spmd.models.dpo import with_reference
from spmd.models.lora import LoRASpec, draw_dropout
from spmd.pipeline import PipelineConfig
from trainers.config import Config, override
from trainers.data import DataConfig
from trainers.data.pairs import pair_stream
from trainers.examples import dpo as example
from trainers.loop import train
from trainers.objectives.config import DPOConfig
from trainers.objectives.dpo import METRICS, base_logps, check_dpo, dpo_loss_fn
from trainers.step import normalize_weights

TOL = 1e-5
CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                tied_head_scale=False)
DPO = DPOConfig(beta=0.1, pairs_per_row=2)
ROWS, LENGTH = 8, 32


@functools.cache
def _batch() -> dict:
    import tempfile

    path = example.write_pairs(tempfile.mkdtemp() + "/pairs.jsonl", n=64)
    data = DataConfig(corpus="jsonl", path=str(path), fields="prompt,chosen,rejected", seq_len=LENGTH, global_batch=ROWS)
    batch = next(iter(pair_stream(data, "train", pairs_per_row=DPO.pairs_per_row)))
    return jax.tree.map(np.asarray, normalize_weights({k: jnp.asarray(v) for k, v in batch.items()}))


def _perturb(tree, key, scale):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [a + scale * jax.random.normal(k, a.shape) for a, k in zip(leaves, keys)])


@functools.cache
def _model(lora: bool, moe: bool = False, dropout: bool = False):
    """``(graphdef, params, other)`` of the tiny GPT on the host (``moe``: every block MoE, 4 experts): with
    LoRA (every B nonzero, so the base differs from the policy) or with a frozen copy of itself whose policy
    has moved since (``dropout``: LoRA's 0.1)."""
    cfg = dataclasses.replace(CFG, n_experts=4, experts_per_token=2) if moe else CFG
    model = GPT(cfg, rngs=nnx.Rngs(0), lora=LoRASpec(4, 8.0, dropout=0.1 if dropout else 0.0) if lora else None)
    if not lora:
        model = with_reference(model)
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    params = _perturb(nnx.to_pure_dict(params), jax.random.key(1), 0.05)
    return graphdef, jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, nnx.to_pure_dict(other))


class Case:
    """One compiled ``value_and_grad`` of the DPO loss (w.r.t. the params) on a mesh, rules and pipeline."""

    def __init__(self, sizes: tuple, rules: str, pipeline: PipelineConfig | None, lora: bool, moe: bool = False,
                 dropout: bool = False):
        n = int(np.prod([s for _, s in sizes])) if sizes else 1
        self.mesh = meshes.make_mesh(dict(sizes), devices=jax.devices()[:n]) if n > 1 else meshes.single_device_mesh()
        self.rules = spmd.get_rules(rules)
        graphdef, params, other = _model(lora, moe, dropout)
        shard = self._shardings(graphdef, params, other)
        self.params = jax.device_put(params, shard[0])
        self.other = jax.device_put(other, shard[1])
        loss_fn = dpo_loss_fn(DPO, reference=base_logps if lora else None, pipeline=pipeline)
        rules_, mesh = self.rules, self.mesh

        def loss(params, other, batch):
            model = nnx.merge(graphdef, params, other)
            if dropout:  # as the train step's LoRA loss does: train mode, the masks' keys drawn from the step's key
                model.train()
                draw_dropout(model, jax.random.key(7))
            with spmd.use_rules(rules_, mesh):
                return loss_fn(model, batch)

        self.batch_sharding = spmd.batch_sharding(self.rules, self.mesh)
        self.step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True, allow_int=True))  # (params, the reference)

    def _shardings(self, graphdef, params, other):
        model = nnx.merge(graphdef, params, other)
        return tuple(spmd.param_shardings(nnx.state(model, kind), self.rules, self.mesh)
                     for kind in (nnx.Param, nnx.Not(nnx.Param)))

    def __call__(self, other=None):
        batch = {k: jax.device_put(v, self.batch_sharding) for k, v in _batch().items()}
        (loss, metrics), (grads, ref_grads) = self.step(self.params, self.other if other is None else other, batch)
        floats = [g for g in jax.tree.leaves(ref_grads) if g.dtype != jax.dtypes.float0]  # (dropout keys: ints)
        assert all(not np.asarray(g).any() for g in floats)  # the reference: no gradient
        return float(loss), {k: float(v) for k, v in metrics.items()}, jax.tree.map(np.asarray, grads)


@functools.cache
def compiled(sizes: tuple = (), rules: str = "none", schedule: str = "none", m: int = 1, v: int = 1,
             lora: bool = False, moe: bool = False, dropout: bool = False) -> Case:
    return Case(sizes, rules, PipelineConfig(schedule, m, v) if schedule != "none" else None, lora, moe, dropout)


@functools.cache
def case(*args):
    return compiled(*args)()


def _rel_errs(a, b) -> dict[str, float]:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(
        lambda x, y: float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-30)), a, b))[0]
    return {spmd.sharding.path_str(p): e for p, e in flat}


def assert_equal_to_one_device(got, lora: bool, moe: bool = False, dropout: bool = False):
    loss, metrics, grads = got
    ref_loss, ref_metrics, ref_grads = case((), "none", "none", 1, 1, lora, moe, dropout)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert set(metrics) == set(ref_metrics) >= set(METRICS) | {"loss_weight"}
    for k in ref_metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=TOL, abs=1e-6), k
    errs = _rel_errs(grads, ref_grads)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)) > 1e-4  # not vacuous
    bad = {k: e for k, e in errs.items() if e > TOL}
    assert not bad, f"gradients differ from one device: {bad}"


DP_PIPE = (("data", 2), ("pipe", 2))
FSDP_TP_PIPE = (("fsdp", 2), ("pipe", 2), ("tensor", 2))
FAST = [(DP_PIPE, "dp", "1f1b", 4, 1, False)]
# the tiers: 1F1B with the copy here, 1F1B with LoRA on data x seq x pipe in the slow tier; the sweep: every
# schedule, both layouts, the copy and LoRA, dropout, the 3-step runs
SLOW = [(FSDP_TP_PIPE, "fsdp_tp", "zb-h1", 4, 1, True), (FSDP_TP_PIPE, "fsdp_tp", "interleaved", 4, 2, False),
        (DP_PIPE, "dp", "gpipe", 4, 1, False), (DP_PIPE, "dp", "zb-h2", 4, 1, True),
        ((("pipe", 2),), "none", "zb-v", 4, 2, False)]


@pytest.mark.parametrize("sizes, rules, schedule, m, v, lora",
                         FAST + [pytest.param(*c, marks=pytest.mark.sweep) for c in SLOW])
def test_pipelined_dpo_equals_one_device(sizes, rules, schedule, m, v, lora):
    assert_equal_to_one_device(case(sizes, rules, schedule, m, v, lora), lora)


@pytest.mark.sweep
@pytest.mark.parametrize("sizes, rules", [((("expert", 2), ("pipe", 2)), "dp_ep")])  # experts sharded in the stage
def test_with_moe_blocks(sizes, rules):
    """MoE blocks (the router's statistics are not read, as without a pipeline), experts over expert too."""
    assert_equal_to_one_device(case(sizes, rules, "1f1b", 4, 1, False, True), False, True)


@pytest.mark.parametrize("sizes, rules, schedule, m, v, lora", [
    pytest.param((("data", 2), ("seq", 2), ("pipe", 2)), "dp", "1f1b", 4, 1, True, marks=pytest.mark.sweep),
    pytest.param((("seq", 2), ("pipe", 2), ("tensor", 2)), "dp_tp", "interleaved", 4, 2, False, marks=pytest.mark.sweep),
])
def test_with_context_parallelism(sizes, rules, schedule, m, v, lora):
    """Each stage device holds its shard of every row's length (load-balanced order, the positions carried);
    the head adds each pair's sums over seq, then every device of the seq group computes the whole loss."""
    assert_equal_to_one_device(case(sizes, rules, schedule, m, v, lora), lora)


@pytest.mark.sweep
def test_pair_sums_left_per_length_shard_are_caught(monkeypatch):
    """Negative control: heads that skip the sum over seq (each device's pairs from its shard of the length
    alone) differ from one device."""
    from spmd.models import context

    monkeypatch.setattr(context, "sum_over_length", lambda x, axis="seq": x)
    loss, _, _ = Case((("data", 2), ("seq", 2), ("pipe", 2)), "dp", PipelineConfig("1f1b", 4, 1), True)()
    assert abs(loss - case((), "none", "none", 1, 1, True)[0]) > 1e3 * TOL * abs(loss)


@pytest.mark.sweep
@pytest.mark.parametrize("sizes, rules, schedule, m, v", [(FSDP_TP_PIPE, "fsdp_tp", "interleaved", 4, 2)])
def test_with_lora_dropout(sizes, rules, schedule, m, v):
    """LoRA dropout: the policy's masks are the whole batch's (each row's index rides into the stages)."""
    got = case(sizes, rules, schedule, m, v, True, False, True)
    assert_equal_to_one_device(got, True, False, True)
    assert abs(got[0] - case((), "none", "none", 1, 1, True)[0]) > 1e-4  # the masks act: not dropout-free


def test_negative_control_the_policy_as_its_own_reference_is_caught():
    """The same pipeline with the reference swapped for the policy differs from one device (the ratios vanish)."""
    piped = compiled(DP_PIPE, "dp", "1f1b", 4, 1, False)
    loss, metrics, _ = piped({**piped.other, "reference": piped.params})
    ref_loss, ref_metrics, _ = case((), "none", "none", 1, 1, False)
    assert abs(loss - ref_loss) > 1e3 * TOL * abs(ref_loss)
    assert abs(metrics["rewards/margins"] - ref_metrics["rewards/margins"]) > 1e-3


def test_what_cannot_run_is_refused_before_compiling(tmp_path):
    """A reference function it cannot split into stages (context parallelism under a pipeline runs)."""
    path = example.write_pairs(tmp_path / "pairs.jsonl", n=16)
    base = ["run.objective=dpo", "data.corpus=jsonl", f"data.path={path}", "data.fields=prompt,chosen,rejected",
            "pipeline.schedule=1f1b", "pipeline.microbatches=2"]
    check_dpo(override(Config(), [*base, "mesh.axes=data=2,pipe=2"]))  # runs
    check_dpo(override(Config(), [*base, "mesh.axes=seq=2,pipe=2"]))  # runs (test_with_context_parallelism)
    check_dpo(override(Config(), [*base, "lora.rank=4", "lora.dropout=0.1"]))  # runs
    with pytest.raises(ValueError, match="runs only unpipelined"):
        dpo_loss_fn(DPO, reference=lambda model, batch: batch["targets"], pipeline=PipelineConfig("1f1b", 2))


# ------------------------------------------------------------------ runs (slow: each compiles the tiny GPT twice)
STEPS = 3
RUN_METRICS = ("loss", "grad_norm", *METRICS)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return example.write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", n=400)


def _run(pairs_file, run_dir, axes, rules, *sets):
    cfg = override(example.config(pairs_file, run_dir, steps=STEPS, tiny=True), [
        f"mesh.axes={axes}", f"rules={rules}", "run.eval_batches=2", "checkpoint.every_steps=100",
        "checkpoint.async_save=false", "lr.warmup_steps=1", "lr.peak_lr=1e-2", "model.n_layers=4", *sets])
    sizes = {axis: int(size) for axis, size in (a.split("=") for a in axes.split(","))}
    result = train(cfg, mesh=meshes.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))]),
                   keep_state=True)
    with open(f"{run_dir}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = {r["step"]: r for r in records if all(k in r for k in RUN_METRICS)}
    return result, [[steps[s][k] for k in RUN_METRICS] for s in range(1, STEPS + 1)]


def _run_rel_err(a, b) -> float:
    return max(_rel_errs(jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)).values())


@pytest.mark.parametrize("piped_axes, plain_axes, rules, pipeline, lora", [  # the sweep's (the tiers: one device)
    pytest.param("data=2,seq=2,pipe=2", "data=2,seq=2", "dp", ("1f1b", 2, 1), False, marks=pytest.mark.sweep),
    pytest.param("data=2,pipe=2", "data=2", "dp", ("1f1b", 2, 1), False, marks=pytest.mark.sweep),
    pytest.param("fsdp=2,pipe=2,tensor=2", "fsdp=2,tensor=2", "fsdp_tp", ("interleaved", 4, 2), True,
                 marks=pytest.mark.sweep),
])
def test_a_pipelined_run_equals_the_run_without_it(pairs_file, tmp_path, piped_axes, plain_axes, rules, pipeline, lora):
    """3 steps: the losses, grad norms and DPO metrics of every step, the eval at the end, the params, the
    optimizer state; the reference stays the starting policy (no optimizer state for it); with LoRA no copy
    is held. Negative control: the state moved by far more than the tolerance, and the same run on another
    order of the pairs (the same compiled steps) differs."""
    schedule, m, v = pipeline
    extra = ["lora.rank=4", "lora.alpha=8"] if lora else []
    piped, piped_metrics = _run(pairs_file, tmp_path / "piped", piped_axes, rules, f"pipeline.schedule={schedule}",
                                f"pipeline.microbatches={m}", f"pipeline.virtual_stages={v}", *extra)
    plain, plain_metrics = _run(pairs_file, tmp_path / "plain", plain_axes, rules, *extra)
    # step 1's rewards/accuracies counts ties (the policy is the reference: each pair's margin is 0, or a
    # rounding error's sign, 1e-9): compared from step 2 on, once the policy has moved
    tie = (0, RUN_METRICS.index("rewards/accuracies"))
    for got in (piped_metrics, plain_metrics):
        got[tie[0]][tie[1]] = 0.0
    np.testing.assert_allclose(piped_metrics, plain_metrics, rtol=TOL, atol=1e-6)
    assert plain_metrics[-1][0] < plain_metrics[0][0]  # it trains
    order = PipelineConfig(schedule, m, v).layer_order(2)  # the pipelined run stores its stacks in it

    def natural(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, a: order.to_natural(a) if "blocks" in spmd.sharding.path_str(p) else a, tree)

    for key in ("params", "opt_state"):
        assert _run_rel_err(natural(getattr(piped.state, key)), getattr(plain.state, key)) < TOL, key
    evals = [(piped.eval_metrics[STEPS][k], plain.eval_metrics[STEPS][k]) for k in ("loss", *METRICS)]
    np.testing.assert_allclose(*zip(*evals), rtol=TOL, atol=1e-6)  # the pipelined eval at the last step
    paths = [spmd.sharding.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(piped.state.opt_state)[0]]
    assert paths and not any("reference" in p for p in paths)  # no optimizer state for the reference
    if lora:
        assert piped.state.model_state is None  # no copy: the reference is the base
    else:
        reference = piped.state.model_state["reference"]
        assert _run_rel_err(natural(reference), plain.state.model_state["reference"]) == 0.0  # frozen on both
        assert _run_rel_err(piped.state.params, reference) > 100 * TOL  # the policy moved away from it
    # negative control: the same run on another order of the pairs is caught by the same comparison
    _, other = _run(pairs_file, tmp_path / "order", plain_axes, rules, "data.seed=1", *extra)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(piped_metrics, other, rtol=TOL, atol=1e-6)
