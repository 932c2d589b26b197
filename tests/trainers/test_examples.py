"""The examples (``trainers.examples``) trained through ``trainers.train``: with dropout and
BatchNorm on, every layout (each with one example or both) gives the single-device run; resume is exact, also onto another mesh;
the classifier reports eval accuracy well above chance.

Both examples draw dropout masks from RNG streams held in the model (model variables), so the
comparisons cover parameters, batch statistics and RNG state alike. Each (example, layout) run is
trained once per module and shared by the tests that read it.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import meshes
from trainers.config import override
from trainers.examples import decoder, digits
from trainers.logger import read_metrics
from trainers.loop import train
from trainers.task import Task

STEPS = 5
TOL = 1e-5

# name -> (mesh axis sizes, rule set); "single" is the reference: every axis 1, one device
LAYOUTS = {
    "single": ({"data": 1}, "none"),
    "dp8": ({"data": 8}, "dp"),
    "fsdp8": ({"fsdp": 8}, "fsdp"),
    "dp2_tp4": ({"data": 2, "tensor": 4}, "dp_tp"),
    "dp2_fsdp2_tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
}
SHARDED = [name for name in LAYOUTS if name != "single"]

# tiny widths: embed dims divide by fsdp=8, mlp and heads dims by tensor=4
TINY_LM = decoder.DecoderConfig(max_len=16, d_model=16, n_heads=4, n_layers=2, d_ff=32)
TASKS: dict[str, Task] = {
    "digits": dataclasses.replace(digits.task, model=lambda rngs: digits.Mixer(rngs=rngs, d_model=16, d_tokens=16,
                                                                                d_channels=32)),
    "decoder": dataclasses.replace(decoder.task, model=lambda rngs: decoder.Decoder(TINY_LM, rngs=rngs)),
}
SETS = {"digits": [], "decoder": ["data.seq_len=16", "data.max_tokens=50000"]}
METRICS = {"digits": ("loss", "grad_norm", "lr", "accuracy"), "decoder": ("loss", "grad_norm", "lr")}


def mesh_for(layout: str) -> jax.sharding.Mesh:
    sizes, _ = LAYOUTS[layout]
    return meshes.make_mesh(sizes, devices=jax.devices()[:1] if layout == "single" else None)


def config(example: str, run_dir, layout: str, *sets: str):
    sizes, rules = LAYOUTS[layout]
    axes = ",".join(f"{axis}={size}" for axis, size in sizes.items())
    return override(TASKS[example].config, [
        f"run.run_dir={run_dir}", "run.progress=false", "run.tensorboard=false", "run.log_every=1",
        f"run.steps={STEPS}", f"lr.total_steps={STEPS}", "lr.warmup_steps=2", "run.eval_batches=0",
        "checkpoint.every_steps=2", "data.global_batch=16", f"mesh.axes={axes}", f"rules={rules}",
        *SETS[example], *sets])


def run(example: str, run_dir, layout: str, *sets: str, **kwargs):
    return train(config(example, run_dir, layout, *sets), TASKS[example], mesh=mesh_for(layout), **kwargs)


def rel_err(a, b) -> float:
    """Largest per-array norm-relative difference ``|a - b| / |b|`` between two pytrees; integer
    leaves (RNG key data and counts) must be equal (else inf)."""
    def one(x, y):
        x, y = np.asarray(x), np.asarray(y)
        if not np.issubdtype(y.dtype, np.floating):
            return 0.0 if np.array_equal(x, y) else np.inf
        return float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-30))

    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(jax.tree.leaves(jax.tree.map(one, a, b)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(example, layout) -> (Result with state, train metric records)`` of a STEPS-step run, trained once."""
    cache = {}

    def get(example: str, layout: str):
        if (example, layout) not in cache:
            run_dir = tmp_path_factory.mktemp(f"{example}-{layout}")
            result = run(example, run_dir, layout, keep_state=True)
            cache[example, layout] = result, read_metrics(run_dir, "train")
        return cache[example, layout]

    return get


@pytest.mark.parametrize("example", ["digits", pytest.param("decoder", marks=pytest.mark.sweep)])  # the decoder's keys: below
def test_dropout_is_on_in_training_and_off_in_eval(example):
    with nnx.use_eager_sharding(False):
        model = TASKS[example].model(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.random((4, 8, 8, 1), np.float32) if example == "digits" else rng.integers(0, 256, (4, 16), np.int32)
    model.train()
    change = float(np.max(np.abs(np.asarray(model(x)) - np.asarray(model(x)))))
    assert change > 1e-3  # a new mask per call, from the model's own stream
    model.eval()
    np.testing.assert_array_equal(model(x), model(x))


@pytest.mark.parametrize("example", TASKS)
def test_single_device_reference_trains(runs, example):
    """The reference the layouts are held to really moves: params far beyond the tolerance,
    BatchNorm statistics away from their init, one dropout key per draw per step."""
    result, records = runs(example, "single")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(np.isfinite(result.losses[s]) for s in range(1, STEPS + 1)) and result.skipped == 0
    with nnx.use_eager_sharding(False):
        init = TASKS[example].model(nnx.Rngs(0))  # run.seed 0: the run's initial params
    _, init_params, _ = nnx.split(init, nnx.Param, ...)
    assert rel_err(result.state.params, nnx.to_pure_dict(init_params)) > 100 * TOL
    model_state = result.state.model_state
    if example == "digits":
        stats = model_state["blocks"][0]["channel_norm"]
        assert float(np.max(np.abs(np.asarray(stats["mean"])))) > 1e-2
        # 2 blocks x (token, channel) MLPs, each with its own stream, one draw per step
        counts = [int(np.asarray(v)) for p, v in jax.tree_util.tree_leaves_with_path(model_state)
                  if "count" in jax.tree_util.keystr(p)]
        assert counts == [STEPS] * 4
    else:  # the loss hands the model the step's key (rngs.dropout()): the model's own stream is left alone
        assert int(np.asarray(model_state["rngs"]["dropout"]["count"])) == 0


# every layout with one example or both; the two layouts the resume test trains anyway, with both
PAIRS = [("digits", "dp2_tp4"), ("decoder", "dp8"), *((e, layout) for e in TASKS for layout in ("fsdp8", "dp2_fsdp2_tp2"))]
assert {layout for _, layout in PAIRS} == set(SHARDED)


@pytest.mark.parametrize(("example", "layout"), [pytest.param(*p, marks=pytest.mark.sweep) if p == ("decoder", "dp8") else p
                                                 for p in PAIRS])  # decoder on dp8: the sweep
def test_layout_matches_single_device(runs, example, layout):
    ref, ref_records = runs(example, "single")
    got, records = runs(example, layout)
    for key in METRICS[example]:
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in ref_records], rtol=TOL, atol=1e-7,
                                   err_msg=f"{example} on {layout}: metric {key!r}")
    assert rel_err(got.state.params, ref.state.params) < TOL
    assert rel_err(got.state.model_state, ref.state.model_state) < TOL  # batch statistics, RNG streams
    assert rel_err(got.state.opt_state, ref.state.opt_state) < TOL
    assert int(got.state.step) == STEPS and np.array_equal(got.state.rng, ref.state.rng)


def _perturb(example: str):
    """A batch hook that changes one input of one example of the third batch by the smallest step."""
    def hook(index, batch):
        if index != 2:
            return batch
        batch = dict(batch)
        if example == "digits":
            batch["image"] = batch["image"].copy()
            batch["image"][0, 3, 3, 0] += 1 / 16  # one gray level of one pixel
        else:
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][0, 0] = (batch["inputs"][0, 0] + 1) % 256  # one byte
        return batch

    return hook


@pytest.mark.parametrize("example", TASKS)
def test_negative_control_perturbed_batch_is_caught(runs, example, tmp_path):
    """The comparison is not vacuous: one changed input in one batch moves the run beyond the tolerance."""
    ref, _ = runs(example, "single")
    got = run(example, tmp_path, "dp2_fsdp2_tp2", keep_state=True, batch_hook=_perturb(example))
    for s in (1, 2):  # before the perturbed batch: the same run
        assert got.losses[s] == pytest.approx(ref.losses[s], rel=TOL)
    assert abs(got.losses[3] - ref.losses[3]) > TOL * abs(ref.losses[3])
    assert rel_err(got.state.params, ref.state.params) > 10 * TOL


@pytest.mark.parametrize("example", TASKS)
def test_resume_is_exact_and_restores_onto_another_mesh(runs, example, tmp_path):
    layout = "dp2_fsdp2_tp2"
    straight, _ = runs(example, layout)
    first = run(example, tmp_path / "a", layout, "run.steps=2")  # checkpoint at step 2
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = run(example, tmp_path / "a", layout, keep_state=True)
    assert first.final_step == 2 and resumed.start_step == 2
    assert [first.losses[s] for s in (1, 2)] == [straight.losses[s] for s in (1, 2)]
    assert [resumed.losses[s] for s in range(3, STEPS + 1)] == [straight.losses[s] for s in range(3, STEPS + 1)]
    for key in ("params", "model_state", "opt_state"):
        assert rel_err(getattr(resumed.state, key), getattr(straight.state, key)) == 0.0, key
    # the same checkpoint continued on fsdp=8: the continuation of the uninterrupted run, to float tolerance
    other = run(example, tmp_path / "b", "fsdp8", keep_state=True)
    assert other.start_step == 2
    np.testing.assert_allclose([other.losses[s] for s in range(3, STEPS + 1)],
                               [straight.losses[s] for s in range(3, STEPS + 1)], rtol=TOL)
    assert rel_err(other.state.params, straight.state.params) < TOL
    assert rel_err(other.state.model_state, straight.state.model_state) < TOL


def test_classifier_eval_accuracy_is_well_above_chance(tmp_path):
    """The example's own config (data=2 x fsdp=2 x tensor=2, eval on the held-out images) with the
    tiny model, shortened to 100 steps (the full example reaches about 0.9)."""
    steps = 100
    cfg = override(digits.task.config, [
        f"run.run_dir={tmp_path}", "run.progress=false", "run.tensorboard=false", f"run.steps={steps}",
        "lr.warmup_steps=10", "run.eval_every=50", "run.log_every=50"])
    result = train(cfg, TASKS["digits"])
    assert sorted(result.eval_metrics) == [50, steps]
    final = result.eval_metrics[steps]
    assert set(final) == {"loss", "accuracy"}
    assert final["accuracy"] > 0.5  # chance: 0.1
    assert result.eval_losses[steps] < result.eval_losses[50]


def _loss_drawing_from_rngs(model, batch, rngs):
    logits_BLV = model(batch["inputs"], rngs.dropout())
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"]).mean()


def test_decoder_dropout_keys_from_the_loss_rngs(tmp_path):
    task = dataclasses.replace(TASKS["decoder"], loss=_loss_drawing_from_rngs)
    result = train(config("decoder", tmp_path, "single", "run.steps=2"), task, mesh=mesh_for("single"))
    assert all(np.isfinite(v) for v in result.losses.values())
