"""Crashes and damaged checkpoints: SIGKILL at random moments, each corruption kind, shape mismatch,
params-only restore, bounded waits, and no pickle anywhere."""

import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers.fault_worker import REPO, kill_at_line, tiny_config, worker_env

from trainers.checkpoint import Checkpointer, CheckpointTimeoutError, NoUsableCheckpointError
from trainers.loop import train

WORKER = os.path.join(REPO, "tests", "helpers", "fault_worker.py")
STEPS = 8
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*(Event loop is closed|_read_array_index_and_device_put)"
    ":pytest.PytestUnraisableExceptionWarning"
)


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _equal(a, b):
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def _ckpt_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: its directory (checkpoints at every step) and final state."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    result = train(tiny_config(run_dir, STEPS), keep_state=True)
    return run_dir, result.state


def _copy(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference[0], run_dir)
    return run_dir


# ----------------------------------------------------------------------------- SIGKILL
def _kill_at_random_moment(run_dir, rng):
    """Start a worker, SIGKILL it a random moment after a random step; returns (step seen, tmp dirs left)."""
    at = rng.randint(2, STEPS - 2)
    proc = subprocess.Popen([sys.executable, WORKER, run_dir, str(STEPS)], env=worker_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_at_line(proc, f"STEP {at}", lambda: rng.uniform(0.0, 0.15))  # lands in a step, an async save, or a commit
    partial = [d for d in os.listdir(_ckpt_dir(run_dir)) if "tmp" in d]
    return at, partial


@pytest.mark.parametrize("trial", [0, *(pytest.param(t, marks=pytest.mark.sweep) for t in (1, 2))])  # more moments: the sweep
def test_sigkill_at_a_random_moment_resumes_from_a_complete_checkpoint(tmp_path, reference, trial):
    run_dir = str(tmp_path / "run")
    at, partial = _kill_at_random_moment(run_dir, random.Random(trial))
    with Checkpointer(_ckpt_dir(run_dir), tiny_config(run_dir, 1).checkpoint) as ck:
        valid = ck.valid_steps()
    resumed = train(tiny_config(run_dir, STEPS), keep_state=True)
    assert resumed.start_step == max(valid, default=0) and resumed.final_step == STEPS
    assert resumed.start_step >= at - 2  # saves kept up with the steps (one may still have been in flight)
    assert _equal(resumed.state, reference[1])  # same final params and optimizer state, bit for bit
    assert not [d for d in os.listdir(_ckpt_dir(run_dir)) if "tmp" in d], partial  # leftovers were cleaned up


def test_an_interrupted_save_is_never_listed_and_is_cleaned_up(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    root = _ckpt_dir(run_dir)
    shutil.copytree(os.path.join(root, "3"), os.path.join(root, "9.orbax-checkpoint-tmp-1234"))  # a save cut short
    with Checkpointer(root, tiny_config(run_dir, 1).checkpoint) as ck:
        assert 9 not in ck.all_steps() and max(ck.valid_steps()) == STEPS
    assert "9.orbax-checkpoint-tmp-1234" not in os.listdir(root)


# ----------------------------------------------------------------------------- corruption kinds
def _state_files(step_dir):
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state")) for f in fs
            if os.path.basename(d) == "d"]


def _empty_newer_step(root):
    os.mkdir(os.path.join(root, str(STEPS + 1)))
    return STEPS + 1, "item 'state' is missing"


def _deleted_data_files(root):
    for f in _state_files(os.path.join(root, str(STEPS))):
        os.remove(f)
    return STEPS, "NOT_FOUND|unreadable|restore failed"


def _truncated_data_files(root):
    for f in _state_files(os.path.join(root, str(STEPS))):
        os.truncate(f, os.path.getsize(f) // 2)
    return STEPS, "unreadable|restore failed"


def _missing_state_metadata(root):
    os.remove(os.path.join(root, str(STEPS), "state", "_METADATA"))
    return STEPS, "_METADATA"


def _missing_data_item(root):
    shutil.rmtree(os.path.join(root, str(STEPS), "data"))
    return STEPS, "item 'data' is missing"


def _garbled_data_json(root):
    with open(os.path.join(root, str(STEPS), "data", "metadata"), "w") as fh:
        fh.write("{not json")
    return STEPS, "restore failed"


CORRUPTIONS = [_empty_newer_step, _deleted_data_files, _truncated_data_files, _missing_state_metadata,
               _missing_data_item, _garbled_data_json]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_each_corruption_is_skipped_with_a_warning_naming_step_and_reason(tmp_path, reference, caplog, corrupt):
    run_dir = _copy(reference, tmp_path)
    bad, reason = corrupt(_ckpt_dir(run_dir))
    with caplog.at_level(logging.WARNING, logger="trainers.checkpoint"):
        result = train(tiny_config(run_dir, STEPS), keep_state=True)
    expected_start = STEPS if bad > STEPS else STEPS - 1
    assert result.start_step == expected_start and result.final_step == STEPS
    assert _equal(result.state, reference[1])  # the older step + one re-run step = the same final state
    skips = [r.getMessage() for r in caplog.records if r.name.startswith("trainers.checkpoint") and "skipping" in r.getMessage()]
    assert len(skips) == 1 and f"skipping checkpoint step {bad} " in skips[0], skips
    import re

    assert re.search(reason, skips[0]), skips[0]


def test_no_usable_checkpoint_is_an_error_unless_a_fresh_start_is_allowed(tmp_path, reference, caplog):
    run_dir = _copy(reference, tmp_path)
    for step in os.listdir(_ckpt_dir(run_dir)):
        os.remove(os.path.join(_ckpt_dir(run_dir), step, "state", "_METADATA"))
    with pytest.raises(NoUsableCheckpointError, match=r"(?s)refusing to start from scratch.*step 8: .*_METADATA"):
        train(tiny_config(run_dir, STEPS))
    with caplog.at_level(logging.WARNING):
        fresh = train(tiny_config(run_dir, 2, "checkpoint.allow_fresh_start=true"))
    assert fresh.start_step == 0 and fresh.final_step == 2 and "allow_fresh_start" in caplog.text


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    with pytest.raises(ValueError, match=r"run.resume=false but .*checkpoint steps \[1, 2"):
        train(tiny_config(run_dir, STEPS, "run.resume=false"))


# ----------------------------------------------------------------------------- mismatches and params only
def test_shape_mismatch_lists_paths_stored_vs_expected(tmp_path, reference):
    run_dir = _copy(reference, tmp_path)
    with pytest.raises(ValueError, match=r"cannot resume .* with model.d_model: 32 -> 48"):  # the stored config says so
        train(tiny_config(run_dir, STEPS, "model.d_model=48"))
    os.remove(os.path.join(run_dir, "config.json"))  # without it, the checkpoint itself catches the change
    with pytest.raises(ValueError, match=r"(?s)does not match the restore target.*: checkpoint \([^)]*32[^)]*\) float32 vs expected \([^)]*48[^)]*\) float32"):
        train(tiny_config(run_dir, STEPS, "model.d_model=48"))
    params = reference[1].params
    target = _abstract(params)
    with Checkpointer(_ckpt_dir(run_dir), tiny_config(run_dir, 1).checkpoint) as ck:
        assert _equal(ck.restore_params(target)[1], params)  # negative control: the matching target restores
        path, leaf = jax.tree_util.tree_flatten_with_path(target)[0][0]
        wrong = jax.tree_util.tree_map_with_path(
            lambda p, a: jax.ShapeDtypeStruct((a.shape[0] + 1, *a.shape[1:]), a.dtype, sharding=a.sharding) if p == path else a,
            target)
        with pytest.raises(ValueError, match=r"checkpoint \(.*\) float32 vs expected \(.*\) float32"):
            ck.restore_params(wrong)


def test_params_only_restore_starts_at_step_zero_with_a_fresh_optimizer(tmp_path, reference, capsys):
    run_dir = str(tmp_path / "finetune")
    cfg = tiny_config(run_dir, 1, f"checkpoint.init_from={_ckpt_dir(reference[0])}/{STEPS - 1}")
    result = train(cfg, keep_state=True)
    assert result.start_step == 0 and int(result.state.step) == 1
    assert f"initialised params from step {STEPS - 1}" in capsys.readouterr().out
    counts = [int(v) for p, v in jax.tree_util.tree_flatten_with_path(result.state.opt_state)[0] if "count" in jax.tree_util.keystr(p)]
    assert counts and set(counts) == {1}  # the optimizer took one step from fresh (the reference's took 8)
    with Checkpointer(_ckpt_dir(reference[0]), cfg.checkpoint, read_only=True) as src:
        _, start_params = src.restore_params(_abstract(result.state.params), step=STEPS - 1)
    fresh = train(tiny_config(str(tmp_path / "fresh"), 1), keep_state=True)
    dist = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert dist(result.state.params, start_params) < dist(fresh.state.params, start_params) / 5
    # a restarted fine-tuning run resumes its own checkpoint instead of re-initialising
    again = train(tiny_config(run_dir, 2, f"checkpoint.init_from={_ckpt_dir(reference[0])}"))
    assert again.start_step == 1


def test_init_from_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="init_from=.*nowhere.* is not a directory"):
        train(tiny_config(str(tmp_path), 1, f"checkpoint.init_from={tmp_path}/nowhere"))


# ----------------------------------------------------------------------------- bounded waits
def test_a_save_that_does_not_commit_in_time_raises(tmp_path, reference, monkeypatch):
    with Checkpointer(tmp_path / "ck", tiny_config(str(tmp_path), 1).checkpoint) as ck:
        monkeypatch.setattr(ck._manager, "wait_until_finished", lambda: time.sleep(1.0))
        with pytest.raises(CheckpointTimeoutError, match=r"timed out after 0.1 s waiting for a checkpoint save to commit in .*ck"):
            ck.wait(timeout_s=0.1)
        monkeypatch.undo()
        ck.wait(timeout_s=5)  # negative control: a real wait returns


# ----------------------------------------------------------------------------- no code from checkpoints
def test_no_pickle_is_written_or_read(tmp_path, reference, monkeypatch):
    run_dir = _copy(reference, tmp_path)
    for d, _, files in os.walk(_ckpt_dir(run_dir)):
        for f in files:
            assert not f.endswith((".pkl", ".pickle")), f
            with open(os.path.join(d, f), "rb") as fh:
                head = fh.read(3)
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), os.path.join(d, f)

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while restoring a checkpoint")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    with Checkpointer(_ckpt_dir(run_dir), tiny_config(run_dir, 1).checkpoint) as ck:
        step, state, data_state = ck.restore(_abstract(reference[1]))
        _, params = ck.restore_params(_abstract(reference[1].params))
    assert step == STEPS and _equal(state, reference[1]) and _equal(params, reference[1].params)
    assert data_state["train"]["step"] == STEPS
