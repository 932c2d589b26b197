"""Checkpoints: round trip, restore onto another mesh, keep-N, corruption fallback, mismatches."""

import collections
import gc
import json
import logging
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.paths import REPO
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.checkpoint import CheckpointConfig, Checkpointer, NoUsableCheckpointError

AdamLike = collections.namedtuple("AdamLike", "count mu")
LOGGER = "trainers.checkpoint"
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*(Event loop is closed|_read_array_index_and_device_put)"
    ":pytest.PytestUnraisableExceptionWarning"
)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _state(seed=0):
    mesh = _mesh((8,), ("fsdp",))
    fsdp, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    w = jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 7 + seed
    return {
        "params": {"w": jax.device_put(w, fsdp), "b": jax.device_put(jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16), fsdp)},
        "opt": AdamLike(count=jax.device_put(jnp.int32(3 + seed), rep), mu={"w": jax.device_put(w * 0.5, fsdp)}),
        "rng": jax.device_put(jax.random.key_data(jax.random.key(seed)), rep),
        "step": jax.device_put(jnp.int32(10 + seed), rep),
    }


def _abstract(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def _bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _trees_bit_equal(x, y):
    if jax.tree.structure(x) != jax.tree.structure(y):
        return False
    return all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def _ckpt(tmp_path, **kw):
    kw.setdefault("every_steps", 1)
    kw.setdefault("keep", 5)
    return Checkpointer(tmp_path / "ckpt", CheckpointConfig(**kw))


def _save_steps(ck, steps):
    for s in steps:
        assert ck.save(s, _state(seed=s), {"pos": s * 100})
    ck.wait()


def _skip_messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw", [{"every_steps": 0}, {"keep": 0}, {"keep": 1.5}, {"every_steps": True}, {"async_save": 1}, {"directory": ""}]
)
def test_config_rejects_bad_values(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        CheckpointConfig(**kw)


def test_config_resolves_directory():
    assert CheckpointConfig().resolve_directory("/runs/a") == os.path.join("/runs/a", "checkpoints")
    assert CheckpointConfig(directory="/elsewhere").resolve_directory("/runs/a") == "/elsewhere"


# ----------------------------------------------------------------------------- round trip
def test_save_then_restore_is_bit_equal(tmp_path):
    state = _state()
    with _ckpt(tmp_path) as ck:
        assert ck.save(7, state, {"pos": 123, "epoch": 1})
        ck.wait()
        step, restored, data_state = ck.restore(_abstract(state))
    assert step == 7 and data_state == {"pos": 123, "epoch": 1}
    assert isinstance(restored["opt"], AdamLike)
    assert _trees_bit_equal(restored, state)
    # Negative control: the comparison notices a one-ulp change in one element.
    perturbed = jax.tree.map(lambda a: a, state)
    perturbed["params"]["w"] = state["params"]["w"].at[0, 0].set(jnp.nextafter(state["params"]["w"][0, 0], 1e9))
    assert not _trees_bit_equal(restored, perturbed)


def test_restore_onto_another_mesh(tmp_path):
    fsdp = NamedSharding(_mesh((8,), ("fsdp",)), P("fsdp"))
    state = {
        "w_DF": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8), fsdp),
        "b_F": jax.device_put(jnp.arange(8, dtype=jnp.float32) - 3.5, fsdp),
        "e_VD": jax.device_put(jnp.arange(128, dtype=jnp.bfloat16).reshape(16, 8), fsdp),
    }
    mesh2 = _mesh((2, 4), ("data", "tensor"))
    specs = {"w_DF": P(None, "tensor"), "b_F": P("tensor"), "e_VD": P("data", "tensor")}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, specs[k])) for k, v in state.items()}
    with _ckpt(tmp_path) as ck:
        ck.save(1, state, {})
        ck.wait()
        _, restored, _ = ck.restore(target)
    for k, v in restored.items():
        assert v.sharding == target[k].sharding, k
        assert v.sharding != state[k].sharding, k  # the layout really changed
        assert _bits_equal(v, state[k]), k
    assert restored["w_DF"].addressable_shards[0].data.shape == (8, 2)  # W[D, F_tensor]
    assert restored["e_VD"].addressable_shards[0].data.shape == (8, 2)  # E[V_data, D_tensor]


def test_keep_n_keeps_the_last_steps(tmp_path):
    with _ckpt(tmp_path, keep=2) as ck:
        _save_steps(ck, [1, 2, 3, 4, 5])
        assert ck.all_steps() == [4, 5]
        assert ck.valid_steps() == [4, 5]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["4", "5"]


def test_every_steps_and_force(tmp_path):
    with _ckpt(tmp_path, every_steps=4) as ck:
        assert not ck.save(3, _state(), {})
        assert ck.save(4, _state(), {})
        assert ck.save(5, _state(), {}, force=True)
        ck.wait()
        assert ck.all_steps() == [4, 5]


def test_should_save_is_the_one_cadence_decision(tmp_path):
    with _ckpt(tmp_path, every_steps=4) as ck:
        assert [s for s in range(1, 10) if ck.should_save(s)] == [4, 8]
        assert ck.should_save(5, force=True) and not ck.should_save(5)


# ----------------------------------------------------------------------------- corruption
def _state_data_files(step_dir):
    """The OCDBT data files of the state item (where tiny arrays and their zarr metadata live)."""
    files = [os.path.join(step_dir, "state", "d", f) for f in os.listdir(os.path.join(step_dir, "state", "d"))]
    assert files
    return files


def _empty_step_dir(root):
    os.mkdir(os.path.join(root, "3"))  # a higher, empty step: what orbax would call latest
    return 3


def _delete_data_file(root):
    for f in _state_data_files(os.path.join(root, "2")):
        os.remove(f)
    return 2


def _truncate_data_file(root):
    for f in _state_data_files(os.path.join(root, "2")):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)
    return 2


def _remove_metadata(root):
    os.remove(os.path.join(root, "2", "state", "_METADATA"))
    return 2


def _garble_data_state(root):  # readable metadata; fails only when the JSON is read
    with open(os.path.join(root, "2", "data", "metadata"), "w") as fh:
        fh.write("{not json")
    return 2


CORRUPTIONS = [_empty_step_dir, _delete_data_file, _truncate_data_file, _remove_metadata, _garble_data_state]


@pytest.fixture
def _collect_garbage():
    yield
    gc.collect()


# A failed tensorstore read inside orbax leaves sibling futures and coroutines that finish after
# orbax closed its event loop; Python reports them as unraisable, sometimes during the next test.
# That is orbax noise, not a failure: it is ignored (only that noise, module-wide) and collected
# inside the test that caused it.
orbax_read_noise = pytest.mark.usefixtures("_collect_garbage")


@orbax_read_noise
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_step_is_skipped_with_warning(tmp_path, caplog, corrupt):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
        bad = corrupt(str(tmp_path / "ckpt"))
        assert bad in ck.all_steps()
        if corrupt is not _garble_data_state:  # metadata-level damage is visible without reading arrays
            assert ck.valid_steps() == sorted({1, 2} - {bad})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            step, restored, data_state = ck.restore(_abstract(_state()))
    expected_step = bad - 1  # the next older step
    assert (step, data_state) == (expected_step, {"pos": expected_step * 100})
    assert _trees_bit_equal(restored, _state(seed=step))
    messages = _skip_messages(caplog)
    assert len(messages) == 1 and f"step {bad} " in messages[0], messages


@orbax_read_noise
def test_damaged_array_chunks_fail_only_when_read(tmp_path, caplog):
    """Chunk data of a larger array lives outside the metadata file: valid_steps cannot see the
    damage, restore discovers it, warns, and falls back."""
    mesh = _mesh((8,), ("fsdp",))
    big = lambda seed: {"w": jax.device_put(jax.random.normal(jax.random.key(seed), (256, 64)), NamedSharding(mesh, P("fsdp")))}
    with _ckpt(tmp_path) as ck:
        for s in (1, 2):
            ck.save(s, big(s), {"pos": s})
        ck.wait()
        chunk_dirs = [d for d in os.listdir(tmp_path / "ckpt" / "2" / "state") if d.startswith("ocdbt.process_")]
        damaged = 0
        for d in chunk_dirs:
            for f in (tmp_path / "ckpt" / "2" / "state" / d / "d").iterdir():
                if f.stat().st_size > 4096:
                    os.truncate(f, f.stat().st_size // 2)
                    damaged += 1
        assert damaged and ck.valid_steps() == [1, 2]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            step, restored, data_state = ck.restore(_abstract(big(0)))
    assert (step, data_state) == (1, {"pos": 1}) and _trees_bit_equal(restored, big(1))
    messages = _skip_messages(caplog)
    assert len(messages) == 1 and "step 2 " in messages[0] and "restore failed" in messages[0], messages


@orbax_read_noise
def test_all_steps_corrupt_raises_listing_each(tmp_path, caplog):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
        root = str(tmp_path / "ckpt")
        _remove_metadata(root)
        for f in _state_data_files(os.path.join(root, "1")):
            os.remove(f)
        with pytest.raises(NoUsableCheckpointError, match=r"(?s)step 2: .*_METADATA.*step 1: .*NOT_FOUND"):
            ck.restore(_abstract(_state()))
    assert len(_skip_messages(caplog)) == 2


def test_no_steps_restores_none(tmp_path):
    with _ckpt(tmp_path) as ck:
        assert ck.all_steps() == [] and ck.valid_steps() == []
        assert ck.restore(_abstract(_state())) is None


def test_explicit_step(tmp_path):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
        step, restored, data_state = ck.restore(_abstract(_state()), step=1)
        assert (step, data_state) == (1, {"pos": 100}) and _trees_bit_equal(restored, _state(seed=1))
        with pytest.raises(ValueError, match=r"step 9 .*\[1, 2\]"):
            ck.restore(_abstract(_state()), step=9)


# ----------------------------------------------------------------------------- mismatches and bad input
def test_shape_and_dtype_mismatch_names_paths(tmp_path):
    state = _state()
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        target = _abstract(state)
        assert ck.restore(target)[0] == 1  # negative control: the matching target restores
        w = target["params"]["w"]
        target["params"]["w"] = jax.ShapeDtypeStruct((8, 6), w.dtype, sharding=w.sharding)
        with pytest.raises(ValueError, match=r"params/w: checkpoint \(8, 4\) float32 vs expected \(8, 6\) float32"):
            ck.restore(target)
        target = _abstract(state)
        target["step"] = jax.ShapeDtypeStruct((), jnp.int16, sharding=target["step"].sharding)
        with pytest.raises(ValueError, match=r"step: checkpoint \(\) int32 vs expected \(\) int16"):
            ck.restore(target)


def test_bad_inputs_raise(tmp_path):
    with _ckpt(tmp_path) as ck:
        with pytest.raises(ValueError, match="JSON"):
            ck.save(1, _state(), {"pos": object()})
        with pytest.raises(ValueError, match="dict"):
            ck.save(1, _state(), [1, 2])
        with pytest.raises(ValueError, match="PRNG key"):
            ck.save(1, {"key": jax.random.key(0)}, {})
        with pytest.raises(ValueError, match=r"\['name'\] is a str; a checkpoint holds arrays"):
            ck.save(1, {"name": "adamw"}, {})
        with pytest.raises(ValueError, match="step must be"):
            ck.save(-1, _state(), {})
        with pytest.raises(ValueError, match=r"\['w'\].*sharding"):
            ck.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
        assert ck.all_steps() == []


# ----------------------------------------------------------------------------- async and existing steps
def test_async_save_then_wait_commits(tmp_path):
    with _ckpt(tmp_path, async_save=True) as ck:
        t0 = time.perf_counter()
        assert ck.save(1, _state(), {"pos": 1})
        started = time.perf_counter() - t0
        ck.wait()
        step_dir = tmp_path / "ckpt" / "1"
        assert (step_dir / "state" / "_METADATA").exists()
        assert json.loads((step_dir / "data" / "metadata").read_text()) == {"pos": 1}
        assert ck.valid_steps() == [1]
    assert started < 5.0


def test_saving_an_existing_valid_step_is_skipped(tmp_path, caplog):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert not ck.save(1, _state(seed=5), {"pos": -1}, force=True)
        assert any("already exists" in r.getMessage() for r in caplog.records if r.name.startswith(LOGGER))
        step, restored, data_state = ck.restore(_abstract(_state()))
    assert data_state == {"pos": 100} and _trees_bit_equal(restored, _state(seed=1))
    assert not _trees_bit_equal(restored, _state(seed=5))  # negative control


def test_saving_over_an_unusable_step_replaces_it(tmp_path, caplog):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1, 2])
        _remove_metadata(str(tmp_path / "ckpt"))
        assert ck.valid_steps() == [1]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert ck.save(2, _state(seed=7), {"pos": 7})
            ck.wait()
        assert any("replacing" in m for m in _skip_messages(caplog))
        assert ck.valid_steps() == [1, 2]
        step, restored, data_state = ck.restore(_abstract(_state()))
    assert (step, data_state) == (2, {"pos": 7}) and _trees_bit_equal(restored, _state(seed=7))


def test_unusable_higher_step_does_not_block_later_saves(tmp_path):
    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        os.mkdir(tmp_path / "ckpt" / "9")
        assert ck.restore(_abstract(_state()))[0] == 1
        assert ck.save(2, _state(seed=2), {"pos": 2})
        ck.wait()
        assert ck.valid_steps() == [1, 2]



def test_step_removed_behind_the_managers_back_can_be_saved_again(tmp_path):
    import shutil

    with _ckpt(tmp_path) as ck:
        _save_steps(ck, [1])
        shutil.rmtree(tmp_path / "ckpt" / "1")
        assert ck.save(1, _state(seed=3), {"pos": 3})
        ck.wait()
        assert ck.restore(_abstract(_state()))[2] == {"pos": 3}

# ----------------------------------------------------------------------------- many processes
_WORKER = r"""
import logging, os, sys
import numpy as np
import jax
pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from trainers.checkpoint import CheckpointConfig, Checkpointer
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
assert jax.process_count() == 2 and jax.device_count() == 8
def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
def full(seed):
    return np.arange(64, dtype=np.float32).reshape(8, 8) + 100 * seed
def state(seed):
    s = NamedSharding(mesh((8,), ("fsdp",)), P("fsdp"))
    return {"w": jax.make_array_from_callback((8, 8), s, lambda idx: full(seed)[idx])}
ck = Checkpointer(root, CheckpointConfig(every_steps=1))
for step in (1, 2, 3):
    assert ck.save(step, state(step), {"pos": step})
ck.wait()
if pid == 0:  # real damage, seen by both processes through the shared directory
    os.remove(os.path.join(root, "3", "state", "_METADATA"))
multihost_utils.sync_global_devices("corrupted")
if pid == 1:  # damage only process 1 sees: process 0 must fall back with it
    check = ck._invalid_reason
    ck._invalid_reason = lambda s: ("simulated local read error", None) if s == 2 else check(s)
target_sharding = NamedSharding(mesh((2, 4), ("data", "tensor")), P(None, "tensor"))
target = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=target_sharding)}
step, restored, data_state = ck.restore(target)
assert (step, data_state) == (1, {"pos": 1}), (step, data_state)
assert restored["w"].sharding == target_sharding
for shard in restored["w"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), full(1)[shard.index])
    assert not np.array_equal(np.asarray(shard.data), full(2)[shard.index])
ck.close()
print(f"OK process={pid} step={step}", flush=True)
"""


@pytest.mark.slow
def test_two_processes_save_and_fall_back_together(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = REPO
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    root = str(tmp_path / "ckpt")
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, str(i), str(port), root], env=env, cwd=repo,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert f"OK process={i} step=1" in out, out[-3000:]
        assert "skipping checkpoint step 3" in out and "_METADATA" in out, out[-3000:]
        agreed = "simulated local read error" if i == 1 else "failed on process(es) [1]"
        assert re.search(rf"skipping checkpoint step 2 .*{re.escape(agreed)}", out), out[-3000:]


# ----------------------------------------------------------------------------- plain orbax reads it
def _plain_orbax_save(directory, steps):
    """What a user of orbax alone writes for ``{step: state}`` (no toolkit code)."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory) as manager:
        for step, state in steps.items():
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        manager.wait_until_finished()


def _plain_orbax_restore(directory, step, abstract=None):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(directory) as manager:
        if abstract is None:
            return manager.restore(step)["state"]
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]


def _described(tree):
    """Structure, leaf types, dtypes, shapes, shardings and bytes: what restoring gives a user."""
    def leaf(x):
        return (type(x).__name__, getattr(x, "dtype", None), getattr(x, "shape", None),
                getattr(x, "sharding", None), np.asarray(x).tobytes())
    return jax.tree.structure(tree), [leaf(x) for x in jax.tree.leaves(tree)]


@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")  # orbax, restoring without a target
def test_plain_orbax_restores_a_toolkit_checkpoint_as_its_own(tmp_path):
    """A toolkit checkpoint restored by orbax alone gives the tree, values and shardings saved, and
    exactly what orbax gives for a checkpoint it wrote itself (with a target, and without one)."""
    import orbax.checkpoint as ocp

    arrays = _state()
    mixed = {**_state(seed=2), "np_scalar": np.float32(2.5), "number": 7, "host": np.arange(3.0)}
    with _ckpt(tmp_path) as ck:
        assert ck.save(1, arrays, {"pos": 1}) and ck.save(2, mixed, {"pos": 2})
    _plain_orbax_save(tmp_path / "plain", {1: arrays, 2: mixed})
    target = _abstract(arrays)
    restored = _plain_orbax_restore(tmp_path / "ckpt", 1, target)
    assert _trees_bit_equal(restored, arrays) and isinstance(restored["opt"], AdamLike)
    assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(lambda a: a.sharding, arrays)
    assert _described(restored) == _described(_plain_orbax_restore(tmp_path / "plain", 1, target))
    item = ocp.StandardCheckpointer().restore(tmp_path / "ckpt" / "1" / "state", target)
    assert _described(item) == _described(restored)
    # Without a target orbax rebuilds the tree from the metadata: same as for its own checkpoints.
    for step in (1, 2):
        ours = _plain_orbax_restore(tmp_path / "ckpt", step)
        assert _described(ours) == _described(_plain_orbax_restore(tmp_path / "plain", step)), step
    assert all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(mixed), strict=True))
    # Negative control: one changed value is noticed.
    mixed["params"]["w"] = mixed["params"]["w"] + 1
    _plain_orbax_save(tmp_path / "plain2", {2: mixed})
    assert _described(_plain_orbax_restore(tmp_path / "plain2", 2)) != _described(ours)


def test_a_step_in_the_earlier_format_still_restores(tmp_path):
    """Steps written before the save path changed (StandardSave: zarr2, zstd) restore as before."""
    import orbax.checkpoint as ocp

    state = _state(seed=6)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"pos": 6})))
        manager.wait_until_finished()
    with _ckpt(tmp_path) as ck:
        assert ck.valid_steps() == [6]
        step, restored, data_state = ck.restore(_abstract(state))
        assert ck.save(7, _state(seed=7), {"pos": 7})
    assert (step, data_state) == (6, {"pos": 6}) and _trees_bit_equal(restored, state)
    metadata = {s: json.loads((tmp_path / "ckpt" / str(s) / "state" / "_METADATA").read_text()) for s in (6, 7)}
    assert (metadata[6]["use_zarr3"], metadata[7]["use_zarr3"]) == (False, True)  # the two formats side by side


def test_a_train_state_is_stored_as_the_dict_of_its_fields(tmp_path):
    """A typed ``TrainState`` is saved as the plain dict of its set fields (what orbax alone reads, and what
    dict states wrote before it existed) and restored as a ``TrainState``; a dict checkpoint restores onto one."""
    from trainers.state import TrainState

    d = _state(seed=3)
    typed = TrainState(d["params"], d["opt"], d["step"], model_state={"stat": d["params"]["b"]})
    with _ckpt(tmp_path) as ck:
        assert ck.save(1, typed, {"pos": 1})
        ck.wait()
        step, restored, _ = ck.restore(_abstract(typed))
    assert step == 1 and isinstance(restored, TrainState) and restored.guard is None
    assert _trees_bit_equal(restored, typed) and sorted(restored.as_dict()) == ["model_state", "opt_state", "params", "step"]
    plain = _plain_orbax_restore(tmp_path / "ckpt", 1, _abstract(typed.as_dict()))
    assert isinstance(plain, dict) and _trees_bit_equal(plain, typed.as_dict())
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "written_as_dict") as manager:  # a checkpoint of a dict state
        manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(typed.as_dict()),
                                                data=ocp.args.JsonSave({"pos": 2})))
        manager.wait_until_finished()
    with Checkpointer(tmp_path / "written_as_dict", CheckpointConfig(every_steps=1)) as ck:
        _, again, _ = ck.restore(_abstract(typed))
    assert isinstance(again, TrainState) and _trees_bit_equal(again, typed)
    with pytest.raises(ValueError, match="no fields \\['opt'\\]"):
        TrainState.from_dict(d)  # a dict that is not a train state's fields is refused by name


# ----------------------------------------------------------------------------- saving in the background
def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def test_save_returns_before_orbax_starts_and_never_reads_the_callers_arrays(tmp_path):
    """save() returns while the hand-off to orbax is held back; the caller's arrays are deleted
    and its data_state mutated before orbax runs; the step still holds the values at save()."""
    import threading

    state, data_state = _state(seed=3), {"pos": 300, "epoch": [1]}
    expected = _numpy(state)
    with _ckpt(tmp_path) as ck:
        release, entered = threading.Event(), threading.Event()
        orbax_save = ck._manager.save

        def held_back(*args, **kwargs):
            entered.set()
            assert release.wait(30)
            return orbax_save(*args, **kwargs)

        ck._manager.save = held_back
        assert ck.save(1, state, data_state)
        assert entered.wait(30) and not release.is_set()  # orbax has not started; save() returned
        assert threading.current_thread() is threading.main_thread()
        for leaf in jax.tree.leaves(state):
            leaf.delete()
        data_state["pos"], data_state["epoch"][0] = -1, -1
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # the buffers really are gone
        release.set()
        ck.wait()
        step, restored, restored_data = ck.restore(_abstract(_state()))
    assert (step, restored_data) == (1, {"pos": 300, "epoch": [1]})
    assert _trees_bit_equal(restored, expected)
    assert not _trees_bit_equal(restored, _numpy(_state(seed=4)))  # negative control


def test_state_donated_right_after_save_is_saved_as_it_was(tmp_path):
    state = _state(seed=1)
    expected = _numpy(_state(seed=1))  # (a numpy view of `state` itself would make jax refuse the donation)
    bump = jax.jit(lambda t: jax.tree.map(lambda a: a + jnp.ones((), a.dtype), t), donate_argnums=0)
    with _ckpt(tmp_path) as ck:
        assert ck.save(1, state, {})
        bumped = bump(state)  # overwrites the donated buffers while orbax may still be writing
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # every buffer was donated
        jax.block_until_ready(bumped)
        ck.wait()
        _, restored, _ = ck.restore(_abstract(bumped))
    assert _trees_bit_equal(restored, expected)
    assert not _trees_bit_equal(restored, _numpy(bumped))  # negative control: the update changed every leaf


def test_an_error_in_the_background_is_raised_by_wait_once(tmp_path):
    with _ckpt(tmp_path) as ck:
        def full_disk(*args, **kwargs):
            raise OSError("No space left on device")

        ck._manager.save = full_disk
        assert ck.save(1, _state(), {})
        with pytest.raises(RuntimeError, match=r"saving checkpoint step 1 in .*ckpt failed: OSError: No space left"):
            ck.wait()
        del ck._manager.save  # orbax's own save again
        ck.wait()  # the error was reported; nothing is pending
        assert ck.save(2, _state(seed=2), {"pos": 2})
        ck.wait()
        assert ck.valid_steps() == [2]


def test_an_interrupt_after_save_still_commits_the_step(tmp_path):
    state = _state(seed=5)
    with pytest.raises(KeyboardInterrupt):
        with _ckpt(tmp_path) as ck:
            assert ck.save(4, state, {"pos": 4})
            raise KeyboardInterrupt  # close() in __exit__ (the loop's finally) finishes the save
    with _ckpt(tmp_path) as ck:
        step, restored, data_state = ck.restore(_abstract(state))
    assert (step, data_state) == (4, {"pos": 4}) and _trees_bit_equal(restored, state)


def test_host_copy_copies_each_distinct_shard_once_and_rebuilds_the_shardings():
    from trainers.checkpoint.host_copy import HostCopy

    mesh = _mesh((2, 4), ("data", "fsdp"))
    state = {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp"))),  # 4 distinct x 2 replicas
        "b": jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P())),  # 1 distinct x 8
        "g": jax.device_put(jnp.arange(16, dtype=jnp.int32).reshape(2, 8), NamedSharding(mesh, P("data", "fsdp"))),  # 8
        "n": np.ones(3), "k": 5,
    }
    copy = HostCopy(state)
    assert len(copy.buffers) == 4 + 1 + 8
    rebuilt = copy.arrays()
    assert _trees_bit_equal(rebuilt, state)
    for key in ("w", "b", "g"):
        assert rebuilt[key].sharding == state[key].sharding
    owned = {b.ctypes.data for b in copy.buffers}  # on CPU the rebuilt shards alias the copy
    assert all(s.data.unsafe_buffer_pointer() in owned for k in ("w", "b", "g") for s in rebuilt[k].addressable_shards)
    again = HostCopy(state, spare=copy.buffers)
    assert [id(b) for b in again.buffers] == [id(b) for b in copy.buffers]  # spare buffers reused in order
    assert len({id(b) for b in HostCopy(state).buffers} & {id(b) for b in copy.buffers}) == 0  # negative control


def test_a_save_waits_for_the_previous_one_and_reuses_its_host_buffers(tmp_path):
    """At most one save in flight (as with orbax's own save): save() waits for the previous commit,
    after which orbax no longer reads that copy's buffers, and the new copy reuses them."""
    import threading

    with _ckpt(tmp_path) as ck:
        ck.save(1, _state(seed=1), {"pos": 1})
        first = list(ck._last_copy.buffers)
        commits = []  # steps on disk whenever the caller's thread waited for orbax
        orbax_wait = ck._manager.wait_until_finished

        def recorded_wait():
            orbax_wait()
            if threading.current_thread() is threading.main_thread():
                commits.append(ck.all_steps())

        ck._manager.wait_until_finished = recorded_wait
        ck.save(2, _state(seed=2), {"pos": 2})  # back to back: step 1 may still be in flight
        assert commits == [[1]]  # committed before the new copy was taken
        assert len(first) == len(ck._last_copy.buffers) and all(a is b for a, b in zip(first, ck._last_copy.buffers))
        for step in (3, 4, 5):
            ck.save(step, _state(seed=step), {"pos": step})
        ck.wait()
        for step in (1, 2, 3, 4, 5):
            _, restored, data_state = ck.restore(_abstract(_state()), step=step)
            assert data_state == {"pos": step} and _trees_bit_equal(restored, _state(seed=step)), step
        assert not _trees_bit_equal(restored, _state(seed=4))  # negative control


_KILLED_WORKER = r"""
import os, sys, time
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from trainers import checkpoint
from trainers.checkpoint.host_copy import HostCopy

root = sys.argv[1]
mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
state = lambda seed: {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) + seed, NamedSharding(mesh, P("fsdp")))}
ck = checkpoint.Checkpointer(root, checkpoint.CheckpointConfig(every_steps=1))
ck.save(1, state(1), {"pos": 1})
ck.wait()
rebuild = HostCopy.arrays

def slow_rebuild(self):
    open(root + ".handing-off", "w").close()
    time.sleep(60)
    return rebuild(self)

HostCopy.arrays = slow_rebuild
assert ck.save(2, state(2), {"pos": 2})
while not os.path.exists(root + ".handing-off"):  # the hand-off to orbax has started and is held
    time.sleep(0.01)
print("HANDING OFF", flush=True)
time.sleep(60)
"""


def test_a_process_killed_while_handing_a_save_to_orbax_keeps_the_previous_step(tmp_path):
    import subprocess
    import sys

    from helpers.fault_worker import kill_at_line

    repo = REPO
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    root = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, root], env=env, cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_at_line(proc, "HANDING OFF")
    with Checkpointer(root, CheckpointConfig(every_steps=1)) as ck:
        assert ck.all_steps() == [1] and ck.valid_steps() == [1]
        target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(_mesh((8,), ("fsdp",)), P("fsdp")))}
        step, restored, data_state = ck.restore(target)
    assert (step, data_state) == (1, {"pos": 1})
    assert _bits_equal(restored["w"], np.arange(64.0, dtype=np.float32).reshape(8, 8) + 1)
    assert not [d for d in os.listdir(root) if "tmp" in d]
