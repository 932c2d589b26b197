"""DPO (``run.objective=dpo``): the loss and its gradients equal TRL's on the same log-probabilities
(fixtures: tests/fixtures/trl/make_fixtures.py); pairs pack side by side in one row; bad input is refused
naming it; a run learns a rule that picks the chosen answer (held-out reward accuracy >= 0.9); the run on
data=2 x fsdp=2 x tensor=2 equals one device and resumes onto another mesh exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshes
from trainers.config import Config, override
from trainers.data import DataConfig
from trainers.data.pairs import pair_stream
from trainers.examples import dpo as example
from trainers.loop import train
from trainers.objectives.config import DPOConfig
from trainers.objectives.dpo import dpo_objective
from trainers.step import normalize_weights

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trl")
CASES = ("sigmoid", "sigmoid_beta05", "ipo", "cdpo")
TOL = 1e-5


def _rows(policy, ref, mask, pairs_per_row):
    """TRL's batch (chosen rows, then rejected rows, responses left-aligned) packed as the pair packer
    packs it: pair k of a row is segments 2k + 1, 2k + 2; the first chosen response token carries the weight."""
    n, t = policy.shape[0] // 2, policy.shape[1]
    rows, L = -(-n // pairs_per_row), 2 * pairs_per_row * t
    out = {k: np.zeros((rows, L)) for k in ("policy", "ref", "response", "weights")}
    seg = np.full((rows, L), L + 1, np.int32)
    where = np.zeros((2 * n, t, 2), np.int64)  # (row, column) of each fixture entry
    for i in range(n):
        b, k = divmod(i, pairs_per_row)
        for side, src in enumerate((i, n + i)):
            o = (2 * k + side) * t
            seg[b, o: o + t] = 2 * k + 1 + side
            for key, a in (("policy", policy), ("ref", ref), ("response", mask)):
                out[key][b, o: o + t] = a[src]
            where[src, :, 0], where[src, :, 1] = b, o + np.arange(t)
        out["weights"][b, 2 * k * t] = 1.0  # responses start at column 0
    return out, seg, where


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_equal_trl(case):
    f = np.load(os.path.join(FIXTURES, f"{case}.npz"))
    cfg = DPOConfig(beta=float(f["case:beta"]), loss=str(f["case:loss"]),
                    label_smoothing=float(f["case:label_smoothing"]) if "case:label_smoothing" in f else 0.0,
                    pairs_per_row=4)
    with jax.enable_x64(True):
        rows, seg, where = _rows(f["policy"], f["ref"], f["mask"], cfg.pairs_per_row)
        batch = normalize_weights({"segment_ids": jnp.asarray(seg), "response": jnp.asarray(rows["response"]),
                                   "weights": jnp.asarray(rows["weights"])})
        batch["weights"] = batch["weights"].astype(jnp.float64)

        def loss(policy_BL):
            return dpo_objective(policy_BL, jnp.asarray(rows["ref"]), batch, cfg)

        (value, metrics), grad_BL = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(rows["policy"]))
        grad = np.asarray(grad_BL)[where[..., 0], where[..., 1]] * f["mask"]
    np.testing.assert_allclose(float(value), float(f["loss"]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(grad, f["grad"], rtol=0, atol=1e-6)
    assert np.abs(f["grad"]).max() > 1e-3  # not vacuous
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        np.testing.assert_allclose(float(metrics[name]), float(f[f"metric:{name}"]), rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    # negative control: the gradient of a loss that drops one pair differs from TRL's
    assert np.abs(np.asarray(jax.grad(lambda p: loss(p * (seg != 1))[0])(jnp.asarray(rows["policy"]))).sum()
                  - f["grad"].sum()) > 1e-6


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pairs_pack_side_by_side_with_the_prompt_masked(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "ab:", "chosen": "12", "rejected": "345"}] * 3)
    cfg = DataConfig(corpus="jsonl", path=str(path), fields="prompt,chosen,rejected", seq_len=20, global_batch=1,
                     validation_fraction=0.0)
    batch = next(iter(pair_stream(cfg, "train", pairs_per_row=2)))
    # prompt + chosen + end = 6 tokens (5 inputs), prompt + rejected + end = 7 (6 inputs): 2 pairs = 22 > 20
    seg, resp, w = batch["segment_ids"][0], batch["response"][0], batch["weights"][0]
    np.testing.assert_array_equal(seg[:11], [1] * 5 + [2] * 6)
    np.testing.assert_array_equal(seg[11:], [21] * 9)  # one pair fits; the rest is padding
    np.testing.assert_array_equal(batch["positions"][0][:11], list(range(5)) + list(range(6)))
    # targets of the chosen document: "b:12<end>"; the response's (and the end token's) weighted
    np.testing.assert_array_equal(resp[:11], [0, 0, 1, 1, 1] + [0, 0, 1, 1, 1, 1])
    assert w.sum() == 1 and w[2] == 1
    assert bytes(batch["inputs"][0][:5].astype(np.uint8)) == b"ab:12"


def test_the_pair_stream_resumes_exactly_and_splits_over_processes(tmp_path):
    path = example.write_pairs(tmp_path / "pairs.jsonl", n=200)
    cfg = DataConfig(corpus="jsonl", path=str(path), fields="prompt,chosen,rejected", seq_len=64, global_batch=4)
    stream = pair_stream(cfg, "train", pairs_per_row=3)
    it = iter(stream)
    for _ in range(3):
        next(it)
    state, expected = it.get_state(), next(it)
    assert expected["weights"].sum(1).max() == 3  # 4 pairs of 16 tokens would fit: pairs_per_row=3 stops at 3
    resumed = iter(pair_stream(cfg, "train", pairs_per_row=3))
    resumed.set_state(state)
    halves = [iter(stream.for_process(p, 2)) for p in range(2)]  # two processes' rows of the global batch
    for half in halves:
        half.set_state(state)
    again, split = next(resumed), [next(half) for half in halves]
    for key, value in expected.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
        np.testing.assert_array_equal(np.concatenate([b[key] for b in split]), value, err_msg=key)


@pytest.mark.parametrize("records, sets, match", [
    ([{"prompt": "a", "chosen": "x"}], [], "no field 'rejected'"),
    ([{"prompt": "a", "chosen": "x", "rejected": "x"}], [], "chosen and rejected documents are the same"),
    ([{"prompt": "a" * 40, "chosen": "xy", "rejected": "zw"}], [], "cuts away every token of its chosen"),
    ([{"prompt": "q" * 6, "chosen": "xyxyxyxyxy1", "rejected": "xyxyxyxyxy2"}], [],
     "the same after the cut to data.seq_len"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y"}], ["dpo.beta=0"], "dpo.beta=0.0 must be > 0"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y"}], ["dpo.loss=hinge"], "dpo.loss='hinge' is not one of sigmoid"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y"}], ["dpo.label_smoothing=0.5"], r"must be in \[0, 0.5\)"),
])
def test_bad_input_is_refused_naming_it(tmp_path, records, sets, match):
    path = _write(tmp_path / "p.jsonl", records)
    with pytest.raises(ValueError, match=match):
        override(Config(), ["data.corpus=jsonl", f"data.path={path}", "data.fields=prompt,chosen,rejected",
                            "data.seq_len=16", "data.global_batch=1", "data.validation_fraction=0",
                            "run.objective=dpo", *sets])


def test_the_objective_needs_three_fields_and_a_known_name(tmp_path):
    from trainers.task import lm_task

    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "response": "x"}] * 4)
    cfg = override(Config(), ["data.corpus=jsonl", f"data.path={path}", "data.fields=prompt,response",
                              "data.global_batch=1", "data.validation_fraction=0", "run.objective=dpo"])
    with pytest.raises(ValueError, match="run.objective=dpo reads three"):
        lm_task(cfg)
    with pytest.raises(ValueError, match="run.objective='ppo' is not one of lm, dpo"):
        lm_task(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, objective="ppo")))


def test_the_dry_run_compiles_the_dpo_step(tmp_path):
    """The dry run compiles the step the run compiles: the pair rows' keys, the reference's forward."""
    from trainers.planning.dryrun import dry_run

    cfg = override(example.config(example.write_pairs(tmp_path / "pairs.jsonl", n=64), tmp_path / "run", tiny=True),
                   ["mesh.axes=data=2,fsdp=2,tensor=2"])
    report = dry_run(cfg, devices=8)
    assert report.compiled is not None and not any(i.fatal for i in report.issues), report.issues


def _lora_model(seed=0, b_scale=0.0):
    """A tiny GPT with rank-4 adapters on every projection (``b_scale`` > 0: nonzero B, as a trained adapter)."""
    from flax import nnx

    from spmd.models import GPT, GPTConfig
    from spmd.models.lora import LoRASpec

    cfg = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                    tied_head_scale=False)
    model = GPT(cfg, rngs=nnx.Rngs(seed), lora=LoRASpec(4, 8.0))
    key = jax.random.key(seed + 1)
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "b") and hasattr(node, "scale"):
            key, sub = jax.random.split(key)
            node.b.set_value(b_scale * jax.random.normal(sub, node.b.get_value().shape))
    return cfg, model


def _without_proj(tree):
    return {k: _without_proj(v) if isinstance(v, dict) else v for k, v in tree.items() if not k.endswith("_proj")}


def _pair_batch(tmp_path):
    path = example.write_pairs(tmp_path / "pairs.jsonl", n=64)
    data = DataConfig(corpus="jsonl", path=str(path), fields="prompt,chosen,rejected", seq_len=32, global_batch=4)
    batch = next(iter(pair_stream(data, "train", pairs_per_row=2)))
    return normalize_weights({k: jnp.asarray(v) for k, v in batch.items()})


@pytest.mark.slow
def test_with_lora_the_reference_is_the_base_without_its_adapters_and_no_copy(tmp_path):
    """``base_logps``: the LoRA model with every B zeroed equals the base model without adapters (same
    weights), the adapters themselves untouched; with fresh adapters (B = 0) the copy-free loss and every
    adapter gradient equal the copy-based ones; with a trained adapter the two references differ."""
    from flax import nnx

    from spmd.models import GPT
    from spmd.models.dpo import token_logps, with_reference
    from spmd.models.lora import without_adapters
    from trainers.objectives.dpo import base_logps, dpo_loss_fn

    batch = _pair_batch(tmp_path)
    cfg, adapted = _lora_model(b_scale=0.1)
    base = GPT(cfg, rngs=nnx.Rngs(0))
    weights = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    base_state = nnx.state(base, nnx.Param)
    nnx.replace_by_pure_dict(base_state, _without_proj(weights))
    nnx.update(base, base_state)
    b_before = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    ref_BL, logps = nnx.jit(base_logps)(adapted, batch), nnx.jit(token_logps)
    np.testing.assert_allclose(ref_BL, logps(base, batch), rtol=0, atol=1e-6)
    assert float(jnp.abs(logps(adapted, batch) - ref_BL).max()) > 1e-3  # negative control: adapters on
    assert _rel_err(nnx.to_pure_dict(nnx.state(adapted, nnx.Param)), b_before) == 0.0  # the view changed nothing
    assert _rel_err(nnx.to_pure_dict(nnx.state(without_adapters(adapted), nnx.Param)), weights) > 0.0

    dpo_cfg = DPOConfig(beta=0.1, pairs_per_row=2)
    _, fresh = _lora_model(seed=1)  # B = 0, A random: the adapters' gradient (through B) is not zero
    copied = with_reference(nnx.clone(fresh))

    @nnx.jit(static_argnums=1)
    def loss_and_grads(model, loss_fn):
        (value, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        return value, {k: v for k, v in nnx.to_pure_dict(grads).items() if k == "blocks"}

    copy_free_loss, copy_based_loss = dpo_loss_fn(dpo_cfg, reference=base_logps), dpo_loss_fn(dpo_cfg)
    copy_free, copy_based = loss_and_grads(fresh, copy_free_loss), loss_and_grads(copied, copy_based_loss)
    np.testing.assert_allclose(float(copy_free[0]), float(copy_based[0]), rtol=1e-6)
    assert _rel_err(copy_free[1], copy_based[1]) < 1e-5
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(copy_free[1])) > 1e-6  # not vacuous
    # the copy-free model holds its parameters once; the copy-based one twice
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m)))  # noqa: E731
    assert count(copied) > 1.9 * count(fresh)
    # a trained adapter: the copy holds it (reference = base + adapter), base_logps the base alone
    copy_of_trained = with_reference(nnx.clone(adapted))
    assert abs(float(nnx.jit(copy_based_loss)(copy_of_trained, batch)[0])
               - float(nnx.jit(copy_free_loss)(adapted, batch)[0])) > 1e-4


# ------------------------------------------------------------------ runs (slow: each compiles the tiny GPT)
STEPS = 4
LAYOUTS = {"single": ("data=1", "none"), "dp2_fsdp2_tp2": ("data=2,fsdp=2,tensor=2", "fsdp_tp"),
           "fsdp8": ("fsdp=8", "fsdp")}


def _rel_err(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.linalg.norm(np.asarray(x) - np.asarray(y)) / max(float(np.linalg.norm(y)), 1e-30)),
        a, b)))


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return example.write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", n=400)


def _run(pairs_file, run_dir, layout, *sets, **kwargs):
    axes, rules = LAYOUTS[layout]
    # checkpoints: each run saves its last step (the one a resume reads), not every step
    cfg = override(example.config(pairs_file, run_dir, steps=STEPS, tiny=True), [
        f"mesh.axes={axes}", f"rules={rules}", "run.eval_batches=0", "checkpoint.every_steps=100",
        "checkpoint.async_save=false", "lr.warmup_steps=1", "lr.peak_lr=1e-2", *sets])
    sizes = {axis: int(size) for axis, size in (a.split("=") for a in axes.split(","))}
    mesh = meshes.make_mesh(sizes, devices=jax.devices()[:1] if layout == "single" else None)
    return train(cfg, mesh=mesh, **kwargs)


@pytest.mark.sweep
def test_layout_equals_one_device_and_resumes_onto_another_mesh(pairs_file, tmp_path):
    single = _run(pairs_file, tmp_path / "single", "single", keep_state=True)
    straight = _run(pairs_file, tmp_path / "straight", "dp2_fsdp2_tp2", keep_state=True)
    losses = [single.losses[s] for s in range(1, STEPS + 1)]
    assert losses[-1] < 0.9 * losses[0]  # it trains: the comparison is not of a run that stands still
    np.testing.assert_allclose([straight.losses[s] for s in range(1, STEPS + 1)], losses, rtol=TOL)
    for key in ("params", "model_state", "opt_state"):
        assert _rel_err(getattr(straight.state, key), getattr(single.state, key)) < TOL, key
    # the reference stays the policy as it started: frozen on every layout
    assert _rel_err(straight.state.model_state["reference"], single.state.model_state["reference"]) == 0.0
    assert _rel_err(straight.state.params, straight.state.model_state["reference"]) > 100 * TOL
    # resume: 2 steps, then the rest on the same mesh (exact) and on fsdp=8 (the same continuation)
    first = _run(pairs_file, tmp_path / "a", "dp2_fsdp2_tp2", "run.steps=2")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = _run(pairs_file, tmp_path / "a", "dp2_fsdp2_tp2", keep_state=True)
    assert first.final_step == 2 and resumed.start_step == 2
    assert [resumed.losses[s] for s in range(3, STEPS + 1)] == [straight.losses[s] for s in range(3, STEPS + 1)]
    for key in ("params", "model_state", "opt_state"):
        assert _rel_err(getattr(resumed.state, key), getattr(straight.state, key)) == 0.0, key
    other = _run(pairs_file, tmp_path / "b", "fsdp8", keep_state=True)
    assert other.start_step == 2
    np.testing.assert_allclose([other.losses[s] for s in range(3, STEPS + 1)],
                               [straight.losses[s] for s in range(3, STEPS + 1)], rtol=TOL)
    assert _rel_err(other.state.params, straight.state.params) < TOL
    assert _rel_err(other.state.model_state, straight.state.model_state) == 0.0


@pytest.mark.slow
def test_a_rule_that_picks_the_chosen_answer_is_learned(tmp_path):
    """Chosen responses are even digits, rejected odd ones: after 10 steps the reward of the chosen
    response is the higher on >= 90% of the held-out pairs (measured: all of them, the loss at 0.09 of its start)."""
    steps = 10
    cfg = override(example.config(example.write_pairs(tmp_path / "pairs.jsonl", n=600), tmp_path / "run", steps=steps,
                                  tiny=True), ["lr.peak_lr=1e-2", f"checkpoint.every_steps={steps}",
                                               f"run.eval_every={steps}"])  # one save and one eval, at the end
    result = train(cfg)
    final = result.eval_metrics[steps]
    assert final["rewards/accuracies"] >= 0.9, final
    assert final["rewards/margins"] > 0 and final["rewards/chosen"] > final["rewards/rejected"]
    assert result.losses[steps] < 0.5 * result.losses[1]


@pytest.mark.sweep
def test_a_start_from_hugging_face_weights_is_the_reference(pairs_file, tmp_path):
    """``checkpoint.init_from=hf:DIR``: the weights load into the parameters as for any run (the model's
    own tree) and the reference is a copy of them, unchanged by training."""
    from flax import nnx

    from spmd.interchange import save_pretrained
    from spmd.models import GPT, GPTConfig

    model_cfg = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                          tied_head_scale=False)
    weights = nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(3)), nnx.Param))
    save_pretrained(str(tmp_path / "hf"), model_cfg, weights)
    result = _run(pairs_file, tmp_path / "run", "dp2_fsdp2_tp2", f"checkpoint.init_from=hf:{tmp_path / 'hf'}",
                  "run.steps=2", keep_state=True)
    reference = result.state.model_state["reference"]
    assert _rel_err(reference, weights) == 0.0
    assert _rel_err(result.state.params, weights) > 100 * TOL


@pytest.mark.sweep  # the slow tier: the reference-is-the-base test above
def test_with_lora_only_the_adapters_move_against_the_base_and_no_copy_is_held(pairs_file, tmp_path):
    """``lora.rank=4`` from Hugging Face weights: the state holds the policy's parameters once (no reference
    copy in the model's variables), the first step's loss is log 2 (fresh adapters: the policy is the
    reference, as with a copy), and training moves the adapters only: the base stays the loaded weights."""
    from flax import nnx

    from spmd.interchange import save_pretrained
    from spmd.models import GPT, GPTConfig
    from spmd.models.lora import LoRASpec

    model_cfg = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                          tied_head_scale=False)
    weights = nnx.to_pure_dict(nnx.state(GPT(model_cfg, rngs=nnx.Rngs(3)), nnx.Param))
    save_pretrained(str(tmp_path / "hf"), model_cfg, weights)
    result = _run(pairs_file, tmp_path / "run", "dp2_fsdp2_tp2", f"checkpoint.init_from=hf:{tmp_path / 'hf'}",
                  "lora.rank=4", "lora.alpha=8", "run.steps=3", keep_state=True)
    params, model_state = result.state.params, result.state.model_state
    assert model_state is None  # the model holds parameters only: no reference variables
    policy = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0), lora=LoRASpec(4, 8.0)))
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    assert size(params) == size(nnx.state(policy))  # the weights once: no second copy
    np.testing.assert_allclose(result.losses[1], np.log(2.0), rtol=1e-6)
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    loaded = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(weights)}
    adapters = [k for k in flat if "_proj" in k]
    assert len(adapters) == 14 and sorted(set(flat) - set(adapters)) == sorted(loaded)
    assert all(np.array_equal(flat[k], loaded[k]) for k in loaded)  # not one bit of the base moved
    assert min(float(np.abs(flat[k]).max()) for k in adapters if k.endswith("['b']")) > 1e-4  # every B moved
    assert result.losses[3] < result.losses[1]
