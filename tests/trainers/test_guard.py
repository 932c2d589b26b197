"""The loss-spike and divergence guard: in-step flags, and each policy on planted NaN and spike batches."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fault_worker import last_train_losses, tiny_config

from trainers import setup as setup_lib
from trainers.checkpoint import Checkpointer
from trainers.config import RunConfig
from trainers.faults import guard
from trainers.faults.guard import DivergenceError, Guard, read_events
from trainers.loop import train

STEPS = 8


# ----------------------------------------------------------------------------- planted bad batches
def spiky(loss_fn):
    """A loss, times 1000 on a planted batch (every row starts with byte 0, which Python source never has)."""

    def loss(model, batch, rngs):
        value, aux = loss_fn(model, batch, rngs)
        planted = jnp.all(batch["inputs"][:, 0] == 0)
        return value * jnp.where(planted, 1000.0, 1.0), aux

    return loss


def plant(nan=(), spike=()):
    """A batch hook: out-of-range token ids (the embedding yields NaN) or the spike marker at given batch indices."""

    def hook(index, batch):
        if index in nan or index in spike:
            batch = {k: v.copy() for k, v in batch.items()}
        if index in nan:
            batch["inputs"][0, 3] = 10**6
        if index in spike:
            batch["inputs"][:, 0] = 0
        return batch

    return hook


@pytest.fixture(name="spiky")
def spiky_task(monkeypatch):
    """The run's built-in LM task with the spiky loss, through the task seam (``build`` makes it)."""
    real = setup_lib.lm_task
    monkeypatch.setattr(setup_lib, "lm_task", lambda cfg: dataclasses.replace(real(cfg), loss=spiky(real(cfg).loss)))


def _params_at(run_dir, steps, like):
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
    with Checkpointer(os.path.join(run_dir, "checkpoints"), tiny_config(run_dir, 1).checkpoint) as ck:
        return {s: ck.restore_params(abstract, step=s)[1] for s in steps}


def _equal(a, b):
    same = lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=np.asarray(x).dtype.kind == "f"))
    return all(jax.tree.leaves(jax.tree.map(same, a, b)))


# ----------------------------------------------------------------------------- device half
def _window(values):
    g = guard.init_state(3)
    for v in values:
        g = guard.update(g, jnp.float32(v), jnp.float32(v), jnp.bool_(True))
    return g


def test_spike_needs_a_full_window_and_factor_times_median():
    assert not bool(guard.check(_window([1.0, 2.0]), jnp.float32(1e6), jnp.float32(1.0), 10.0)["loss_spike"])
    full = _window([1.0, 2.0, 3.0])  # median 2
    flags = guard.check(full, jnp.float32(25.0), jnp.float32(1.0), 10.0)
    assert bool(flags["loss_spike"]) and not bool(flags["ok"]) and float(flags["loss_median"]) == 2.0
    assert bool(guard.check(full, jnp.float32(1.0), jnp.float32(25.0), 10.0)["grad_norm_spike"])
    assert bool(guard.check(full, jnp.float32(19.0), jnp.float32(19.0), 10.0)["ok"])  # negative control: below 10 x 2
    assert not bool(guard.check(full, jnp.float32(1e9), jnp.float32(1.0), 0.0)["loss_spike"])  # spikes off
    nan = guard.check(full, jnp.float32(jnp.nan), jnp.float32(1.0), 10.0)
    assert not bool(nan["finite"]) and not bool(nan["ok"])


def test_window_takes_only_accepted_values_and_round_trips_json():
    g = _window([1.0, 2.0, 3.0, 4.0])  # ring of 3: 2, 3, 4
    rejected = guard.update(g, jnp.float32(99.0), jnp.float32(99.0), jnp.bool_(False))
    assert list(guard.window_of(rejected)) == [2.0, 3.0, 4.0] and int(rejected["count"]) == 4
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    back = guard.window_from_json(guard.window_to_json(g), 3, mesh)
    assert _equal(back, g)
    assert list(guard.window_of(guard.window_from_json(guard.window_to_json(g), 2, mesh))) == [3.0, 4.0]
    assert int(guard.window_from_json(None, 3, mesh)["count"]) == 0
    with pytest.raises(ValueError, match="guard window data"):
        guard.window_from_json({"loss": [1.0]}, 3, mesh)


@pytest.mark.parametrize("kw, match", [({"guard": "retry"}, "run.guard.*'retry'"), ({"spike_factor": 1.0}, "spike_factor.*1.0"),
                                       ({"spike_window": 0}, "spike_window.*0"), ({"spike_factor": float("inf")}, "spike_factor")])
def test_config_rejects_bad_guard_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**kw)


def test_host_policies_on_fetched_flags():
    bad = {"loss": 50.0, "grad_norm": 1.0, "finite": True, "ok": False, "loss_spike": True, "grad_norm_spike": False,
           "loss_median": 2.0, "grad_norm_median": 1.0}
    good = dict(bad, loss=2.0, ok=True, loss_spike=False)
    with pytest.raises(DivergenceError, match=r"step 7 \(batch 6\): loss spike: value 50, threshold 20, running median 2"):
        Guard("stop", spike_factor=10.0, spike_window=3, max_bad_steps=5).observe(7, 6, bad)
    skip = Guard("skip", spike_factor=10.0, spike_window=3, max_bad_steps=2)
    assert skip.observe(1, 0, good) == [] and len(skip.observe(2, 1, bad)) == 1
    assert skip.observe(3, 2, good) == []  # a good step resets the streak
    skip.observe(4, 3, bad)
    with pytest.raises(DivergenceError, match="2 consecutive steps ending at step 5"):
        skip.observe(5, 4, bad)
    rollback = Guard("rollback", spike_factor=10.0, spike_window=3, max_bad_steps=1)
    rollback.rolled_back(2, [4], at_step=5)
    with pytest.raises(DivergenceError, match="2 rollbacks"):
        rollback.rolled_back(2, [4, 6], at_step=7)


# ----------------------------------------------------------------------------- policies in a run
def test_skip_policy_leaves_params_unchanged_and_logs_events(tmp_path, spiky):
    run_dir = str(tmp_path)
    result = train(tiny_config(run_dir, STEPS), batch_hook=plant(nan={2}, spike={5}), keep_state=True)
    assert not result.preempted and result.final_step == STEPS and result.skipped == 2
    kinds = [(e.step, e.data_index, e.kind) for e in result.guard_events]
    assert kinds == [(3, 2, "nonfinite"), (6, 5, "loss_spike"), (6, 5, "grad_norm_spike")]
    assert repr(read_events(run_dir)) == repr(result.guard_events)  # repr: NaN fields compare equal
    spike = result.guard_events[1]
    assert spike.value > spike.threshold == pytest.approx(10 * spike.median) and 1 < spike.median < 10
    assert math.isnan(result.guard_events[0].threshold)
    p = _params_at(run_dir, [2, 3, 4, 5, 6], result.state.params)
    assert _equal(p[2], p[3]) and _equal(p[5], p[6])  # the bad steps' updates were not applied
    assert not _equal(p[3], p[4])  # negative control: a good step moves the params


def test_rollback_policy_restores_and_skips_the_bad_batch(tmp_path, spiky):
    run_dir = str(tmp_path)
    cfg = tiny_config(run_dir, STEPS, "run.guard=rollback", "checkpoint.every_steps=2")
    result = train(cfg, batch_hook=plant(spike={5}), keep_state=True)
    assert result.final_step == STEPS and result.skipped == 0  # the rolled-back state never saw the bad step
    assert [(e.step, e.data_index, e.kind) for e in result.guard_events][:1] == [(6, 5, "loss_spike")]
    from trainers.logger import read_metrics

    rollbacks = read_metrics(run_dir, split="guard/rollback")
    assert [(r["step"], r["to_step"], r["skipped_batches"]) for r in rollbacks] == [(6, 4, 1)]
    losses = last_train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and max(losses.values()) < 10
    logged = [r["step"] for r in read_metrics(run_dir, split="train")]
    assert logged == list(range(1, STEPS + 1))  # the rolled-back steps 5 and 6 are there once, as re-run
    with Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint) as ck:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), result.state)
        step, _, data_state = ck.restore(abstract)
    assert step == STEPS and data_state["skip_batches"] == [5] and data_state["train"]["step"] == STEPS + 1


def test_stop_policy_names_step_value_and_median(tmp_path, spiky):
    cfg = tiny_config(str(tmp_path), STEPS, "run.guard=stop")
    with pytest.raises(DivergenceError, match=r"run.guard='stop': step 6 \(batch 5\): loss spike: value \d.*running median \d"):
        train(cfg, batch_hook=plant(spike={5}))
    events = read_events(str(tmp_path))
    assert [(e.step, e.kind) for e in events][:1] == [(6, "loss_spike")]


def test_skip_policy_stops_after_max_bad_steps_in_a_row(tmp_path):
    cfg = tiny_config(str(tmp_path), STEPS, "run.max_bad_steps=2")
    with pytest.raises(DivergenceError, match=r"2 consecutive steps ending at step 4 .*max_bad_steps=2"):
        train(cfg, batch_hook=plant(nan={2, 3}))
    assert [(e.step, e.kind) for e in read_events(str(tmp_path))] == [(3, "nonfinite"), (4, "nonfinite")]
