"""The training run: accumulation, NaN guard, resume (same and other mesh), recipes, CLI."""

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshes
from trainers.checkpoint import Checkpointer
from trainers.config import override
from trainers.launch import cli
from trainers.loop import train
from trainers.recipes import RECIPES, recipe
from trainers.setup import build


def tiny(tmp_path, *sets):
    cfg = recipe("gpt-small", tiny=True)
    return override(cfg, [f"run.run_dir={tmp_path}", "run.progress=false", "run.tensorboard=false", *sets])


def _state_and_step(cfg, mesh, grad_accum):
    """(the state at step 0, the run's train step, the batch sharding); spike and update checks off."""
    cfg = override(cfg, [f"run.grad_accum={grad_accum}", "run.spike_factor=0", "run.max_update_ratio=0",
                         "run.max_param_growth=0"])
    run = build(cfg, mesh=mesh, donate=False)
    return run.stepped.state, run.train_step, run.batch_sharding


def _batch(bs, n=16, length=16, seed=0, bad=False):
    tokens = np.random.default_rng(seed).integers(0, 256, size=(n, length + 1), dtype=np.int32)
    if bad:
        tokens[3, 5] = 10**6  # out-of-range token id: the embedding lookup fills NaN
    return {"inputs": jax.device_put(tokens[:, :-1], bs), "targets": jax.device_put(tokens[:, 1:], bs)}


def test_accumulation_equals_one_big_batch(tmp_path):
    # SGD: the update is lr * gradient, so params compare the gradients themselves (Adam would amplify
    # float noise in near-zero gradients by lr/eps)
    cfg = tiny(tmp_path, "data.global_batch=16", "optimizer.name=sgd", "optimizer.momentum=0", "optimizer.clip_norm=none",
               "lr.kind=constant", "lr.warmup_steps=0", "lr.peak_lr=1.0")
    mesh = meshes.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state0, step1, bs = _state_and_step(cfg, mesh, 1)
    _, step4, _ = _state_and_step(cfg, mesh, 4)
    batch = _batch(bs)
    s1, m1 = step1(state0, batch)
    s4, m4 = step4(state0, batch)
    diff = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s1.params, s4.params)
    assert max(jax.tree.leaves(diff)) < 1e-6
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-5)
    # the accumulator is sharded like the params: same output shardings, and the update really moved params
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s4.params, state0.params)
    assert max(jax.tree.leaves(moved)) > 1e-4
    # negative control: a different batch gives visibly different params
    s_other, _ = step4(state0, _batch(bs, seed=1))
    other = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), s_other.params, s1.params)
    assert max(jax.tree.leaves(other)) > 1e-5


def test_nan_batch_is_skipped_and_counted(tmp_path):
    cfg = tiny(tmp_path, "lr.kind=constant", "lr.warmup_steps=0")
    mesh = meshes.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state0, step, bs = _state_and_step(cfg, mesh, 1)
    state, m = step(state0, _batch(bs, bad=True))
    assert not bool(m["finite"]) and not np.isfinite(float(m["loss"]))
    assert int(state.skipped) == 1 and int(state.bad_streak) == 1 and int(state.step) == 1
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.params, state0.params)
    assert all(jax.tree.leaves(same))
    state, m = step(state, _batch(bs))
    assert bool(m["finite"]) and int(state.skipped) == 1 and int(state.bad_streak) == 0
    moved = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.params, state0.params)
    assert not all(jax.tree.leaves(moved))


def test_resume_gives_identical_losses(tmp_path):
    common = ["run.steps=4", "checkpoint.every_steps=2", "run.eval_batches=0"]
    straight = train(tiny(tmp_path / "a", *common))
    first = train(tiny(tmp_path / "b", *common, "run.steps=2"))
    resumed = train(tiny(tmp_path / "b", *common))
    assert resumed.start_step == 2 and first.final_step == 2
    assert [straight.losses[s] for s in (3, 4)] == [resumed.losses[s] for s in (3, 4)]
    assert [straight.losses[s] for s in (1, 2)] == [first.losses[s] for s in (1, 2)]
    # negative control: a different data seed changes the losses
    other = train(tiny(tmp_path / "c", *common, "data.seed=7"))
    assert other.losses[4] != straight.losses[4]


def test_resume_onto_another_mesh(tmp_path):
    common = ["run.steps=4", "checkpoint.every_steps=2", "run.eval_batches=0"]
    saved = train(tiny(tmp_path, *common, "run.steps=2", "mesh.axes=fsdp=8", "rules=fsdp"), keep_state=True)
    # the checkpoint restores bit-equal onto DP=2 x TP=4
    cfg = tiny(tmp_path, *common, "mesh.axes=data=2,tensor=4", "rules=dp_tp")
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    with Checkpointer(os.path.join(tmp_path, "checkpoints"), cfg.checkpoint) as ckpt:
        step, restored, _ = ckpt.restore(build(cfg, mesh=mesh).sharded.abstract)
    assert step == 2
    equal = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), restored, saved.state)
    assert all(jax.tree.leaves(equal))
    assert restored.params["blocks"]["block"]["mlp"]["w_gate_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tensor")
    # and training continues there with the losses of the same-mesh continuation
    resumed = train(cfg)
    same_mesh = train(tiny(tmp_path / "ref", *common, "mesh.axes=fsdp=8", "rules=fsdp"))
    assert resumed.start_step == 2
    for s in (3, 4):
        assert resumed.losses[s] == pytest.approx(same_mesh.losses[s], rel=1e-5)


def test_corrupt_latest_checkpoint_falls_back(tmp_path, caplog):
    common = ["run.steps=4", "checkpoint.every_steps=2", "run.eval_batches=0"]
    train(tiny(tmp_path, *common))
    (tmp_path / "checkpoints" / "6").mkdir()  # an empty (partial) newer step
    for f in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and "d" == f.parent.name:
            f.write_bytes(b"")  # truncated array data in the newest real step
    with caplog.at_level(logging.WARNING):
        resumed = train(tiny(tmp_path, *common, "run.steps=5"))
    assert resumed.start_step in (2, 4)
    assert "6" in caplog.text


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sweep) if n == "gpt-small-pp" else n for n in sorted(RECIPES)])
def test_each_recipe_tiny_variant_runs_two_steps(tmp_path, name):
    cfg = override(recipe(name, tiny=True), [f"run.run_dir={tmp_path}", "run.progress=false"])
    result = train(cfg)
    assert sorted(result.losses) == [1, 2] and all(np.isfinite(list(result.losses.values())))
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "config.json").exists()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu"} <= set(rows[0])
    assert any(r["split"] == "eval" for r in rows)
    assert (tmp_path / "checkpoints" / "2").is_dir()


def test_full_recipes_load():
    for name, fn in RECIPES.items():
        cfg = fn()
        assert cfg.run.steps > 2 and cfg.lr.for_run(cfg.run.steps).total_steps >= cfg.run.steps, name


def test_cli_rejects_bad_override(capsys):
    assert cli.main(["gpt-small", "--set", "model.d_modle=64", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'model.d_modle'" in err and "model.d_model" in err
    assert cli.main(["gpt-small", "--set", "model.d_model=big", "--print-config"]) == 2
    assert "model.d_model='big' is not an integer" in capsys.readouterr().err
    assert cli.main(["gpt-small", "--mesh", "data=2,tensr=4", "--print-config"]) == 2
    assert "unknown mesh axis 'tensr'" in capsys.readouterr().err
    assert cli.main(["gpt-small", "--set", "optimizer.name=adamx", "--print-config"]) == 2
    assert "adamx" in capsys.readouterr().err
    # and a good one goes through
    assert cli.main(["gpt-small", "--tiny", "--set", "model.d_model=48", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["d_model"] == 48


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe 'gpt-huge'; valid recipes: gpt-small"):
        recipe("gpt-huge")


def test_config_is_frozen():
    cfg = recipe("gpt-small")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run.steps = 3


def test_run_stops_after_consecutive_bad_steps(tmp_path):
    # with the update checks off, an absurd LR blows the params up to ~1e30 in one step; every later
    # loss overflows to inf/NaN, each such step is skipped (no update) and the run stops after
    # max_bad_steps in a row (with the checks on, step 1's update is refused: tests/trainers/test_nothing_silent.py)
    from trainers.loop import DivergenceError

    cfg = tiny(tmp_path, "run.steps=8", "lr.kind=constant", "lr.warmup_steps=0",
               "lr.peak_lr=1e30", "optimizer.clip_norm=none", "run.max_bad_steps=3", "run.eval_batches=0",
               "checkpoint.every_steps=100", "run.max_update_ratio=0", "run.max_param_growth=0")
    with pytest.raises(DivergenceError, match=r"3 consecutive steps ending at step \d+ had a non-finite loss"):
        train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped"] == 3 and rows[0]["loss"] is not None  # step 1 was finite, then 3 skipped
