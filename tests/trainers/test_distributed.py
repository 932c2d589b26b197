"""Many hosts: settings resolution, start-up consistency check, and real multi-process runs on localhost.

The slow tests start 2 or 4 processes with ``trainers.launch.local.launch`` (what ``spmd-launch`` runs)
and compare against the single-process 8-device run in this pytest process.
"""

import io
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers.paths import REPO

from meshes import distributed
from trainers.launch import cli, command
from trainers.launch.local import child_env, free_port, launch
from trainers.logger import read_metrics
from trainers.loop import train

WORKER = os.path.join(REPO, "tests", "helpers", "multihost_worker.py")


@pytest.fixture
def fresh(monkeypatch):
    """No SPMD_* settings, not initialised, and a recording stand-in for jax.distributed.initialize."""
    for key in (*distributed._ENV, distributed.TIMEOUT_ENV, "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_initialized", False)
    monkeypatch.setattr(distributed, "_settings", None)
    monkeypatch.setattr(distributed, "_cluster_detected", lambda: False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return calls


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("address, host, port", [("10.0.0.1:1234", "10.0.0.1", 1234), ("node-0:80", "node-0", 80),
                                                 ("[::1]:8476", "::1", 8476)])
def test_parse_coordinator(address, host, port):
    assert distributed.parse_coordinator(address) == (host, port)


@pytest.mark.parametrize("address", ["10.0.0.1", ":1234", "host:", "host:0", "host:70000", "host:12ab", "a b:1", 1234])
def test_parse_coordinator_rejects(address):
    with pytest.raises(ValueError, match=r"host:port"):
        distributed.parse_coordinator(address)


def test_explicit_arguments_beat_environment(fresh, monkeypatch):
    monkeypatch.setenv("SPMD_COORDINATOR", "10.0.0.9:9")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "8")
    monkeypatch.setenv("SPMD_PROCESS_ID", "5")
    env_only = distributed.resolve_settings()
    assert (env_only.coordinator, env_only.num_processes, env_only.process_id) == ("10.0.0.9:9", 8, 5)
    assert "SPMD_" in env_only.source
    explicit = distributed.resolve_settings("10.0.0.1:1234", 2, 1)
    assert (explicit.coordinator, explicit.num_processes, explicit.process_id, explicit.source) == (
        "10.0.0.1:1234", 2, 1, "arguments")


def test_single_host_cases_resolve_to_nothing(fresh, monkeypatch):
    assert distributed.resolve_settings() is None  # nothing set, no cluster
    assert distributed.resolve_settings("10.0.0.1:1234", 1, 0) is None  # one process
    monkeypatch.setattr(distributed, "_cluster_detected", lambda: True)
    assert distributed.resolve_settings().source.startswith("jax cluster detection")  # negative control
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task SLURM job is one host
    assert distributed.resolve_settings() is None


@pytest.mark.parametrize(
    "args, match",
    [
        (("10.0.0.1:1234", 4, 4), r"process_id 4 is not in \[0, 4\)"),
        (("10.0.0.1:1234", 0, 0), "num_processes must be >= 1, got 0"),
        (("10.0.0.1:1234", 2, None), "process_id must be an integer; got None"),
        (("10.0.0.1:1234", True, 0), "num_processes must be an integer; got True"),
        (("localhost", 2, 0), "'localhost' is not of the form host:port"),
        ((None, 2, 0), "without a coordinator"),
    ],
)
def test_bad_settings_raise(fresh, args, match):
    with pytest.raises(ValueError, match=match):
        distributed.initialize(*args)
    assert fresh == []


def test_bad_timeout_raises(fresh, monkeypatch):
    with pytest.raises(ValueError, match="timeout_s must be a positive integer.*got 0"):
        distributed.initialize(timeout_s=0)
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="SPMD_INIT_TIMEOUT='soon'"):
        distributed.initialize()


def test_initialize_is_idempotent_and_refuses_other_settings(fresh):
    assert distributed.initialize("10.0.0.1:1234", 4, 2, timeout_s=7) is True
    assert fresh == [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2, initialization_timeout=7)]
    assert distributed.initialize("10.0.0.1:1234", 4, 2) is True
    assert len(fresh) == 1  # the second call did nothing
    with pytest.raises(ValueError, match=r"already initialised.*process_id=2.*process_id=3"):
        distributed.initialize("10.0.0.1:1234", 4, 3)


def test_jax_errors_name_coordinator_and_process(fresh, monkeypatch):
    def refuse(**kw):
        raise RuntimeError("jax.distributed.initialize() must be called before any JAX computations")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(distributed.DistributedError, match=r"process 1 of 2 \(coordinator 10.0.0.1:1234\).*before any"):
        distributed.initialize("10.0.0.1:1234", 2, 1, timeout_s=5)
    assert distributed._initialized is False


def test_timeout_message_says_what_to_check():
    port = free_port()  # nothing listens there
    peer = distributed._timeout_message(distributed.Settings(f"127.0.0.1:{port}", 2, 1, "arguments"), 5)
    assert f"process 1 of 2, waiting for coordinator 127.0.0.1:{port}" in peer
    assert f"nothing answers at 127.0.0.1:{port}" in peer and "firewall" in peer
    with socket.socket() as s:  # negative control: a listening coordinator port is reported as reachable
        s.bind(("127.0.0.1", 0))
        s.listen()
        up = distributed._timeout_message(distributed.Settings(f"127.0.0.1:{s.getsockname()[1]}", 2, 1, "x"), 5)
    assert "accepts connections, but not all processes joined" in up
    host = distributed._timeout_message(distributed.Settings(f"127.0.0.1:{port}", 2, 0, "x"), 5)
    assert "this process hosts the coordinator; the other processes never connected" in host


@pytest.mark.parametrize(
    "env, name",
    [
        ({}, None),
        ({"SPMD_COORDINATOR": "h:1"}, "spmd"),
        ({k: "1" for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")}, "slurm"),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2"}, None),  # an allocation, not an srun step
        ({"TPU_WORKER_HOSTNAMES": "w0,w1"}, "tpu"),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "h:1"}, "tpu"),
        ({"OMPI_MCA_orte_hnp_uri": "x"}, "ompi"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "k8s"),
    ],
)
def test_detect_cluster(env, name):
    assert distributed.detect_cluster(env) == name


# ----------------------------------------------------------------------------- consistency (one process)
def test_fingerprint_fields_and_config_hash():
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fp = distributed.fingerprint(mesh, {"model": {"d": 32}})
    assert set(fp) == {"spmd", "jax", "jaxlib", "devices", "mesh", "config"}
    assert fp["jax"] == jax.__version__ and fp["devices"] == "8 cpu"
    assert fp["mesh"].startswith("data=2,tensor=4 (8 devices, order ")
    assert distributed.fingerprint(mesh, {"model": {"d": 32}}) == fp
    assert distributed.fingerprint(mesh, {"model": {"d": 33}})["config"] != fp["config"]  # negative control


def _gathered(*fingerprints):
    return np.stack([distributed._encode(f) for f in fingerprints])


def test_disagreement_names_fields_and_processes():
    same = {"spmd": "0.1.0", "jax": "0.10.2", "config": "sha256:aa"}
    assert distributed.disagreement(_gathered(same, same, same), list(same)) is None
    other = dict(same, jax="0.10.1", config="sha256:bb")
    msg = distributed.disagreement(_gathered(same, other, same), list(same))
    assert "the 3 processes of this run disagree" in msg
    assert "jax: process(es) [0, 2] have '0.10.2'; process(es) [1] have '0.10.1'" in msg
    assert "config: process(es) [0, 2] have 'sha256:aa'; process(es) [1] have 'sha256:bb'" in msg
    assert "spmd:" not in msg  # agreeing fields are not listed
    fewer = {"spmd": "0.1.0", "jax": "0.10.2"}
    assert "fields: process(es) [0] have 'config,jax,spmd'; process(es) [1] have 'jax,spmd'" in distributed.disagreement(
        _gathered(same, fewer), list(same))


def test_check_consistent_is_a_noop_with_one_process_and_validates():
    t0 = time.perf_counter()
    distributed.check_consistent({"jax": jax.__version__})
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(ValueError, match="at most 31"):
        distributed.check_consistent({f"f{i}": i for i in range(32)})
    with pytest.raises(ValueError, match="non-empty str names"):
        distributed.check_consistent({1: "x"})


# ----------------------------------------------------------------------------- many processes
def _env() -> dict[str, str]:
    """Children share this session's persistent compilation cache."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _launch(cmd, processes, devices, **kw):
    out = io.StringIO()
    t0 = time.monotonic()
    code = launch(cmd, processes=processes, devices_per_process=devices, env=_env(), out=out, **kw)
    return code, out.getvalue(), time.monotonic() - t0


@pytest.fixture(scope="module")
def mesh_run():
    return _launch([sys.executable, WORKER, "mesh"], 2, 4, timeout_s=60, grace_s=2.0)


@pytest.mark.slow
def test_two_processes_form_one_mesh_and_load_disjoint_rows(mesh_run):
    code, out, _ = mesh_run
    for i in range(2):
        assert f"[p{i}] initialized=True" in out, out[-3000:]
        assert f"[p{i}] hybrid rows by process: [{{0}}, {{1}}]" in out, out[-3000:]  # data axis across processes
    assert "[p0] MESH OK process=0 rows=0..4" in out and "[p1] MESH OK process=1 rows=4..8" in out, out[-3000:]


@pytest.mark.slow
def test_a_dying_process_stops_the_whole_run(mesh_run):
    code, out, seconds = mesh_run
    assert "[p1] DYING" in out, out[-3000:]
    assert code == 3, out[-3000:]  # the dead process's status
    assert "process 1 exited with status 3; stopping the others" in out
    assert "UNEXPECTED" not in out  # process 0 was stopped inside the collective, not left hanging
    assert seconds < 60


@pytest.mark.slow
def test_unreachable_coordinator_and_missing_peer_give_clear_errors(tmp_path):
    timeout = 4
    closed = free_port()

    def start(pid, port):
        env = child_env(pid, 2, port, 1, timeout, base=_env())
        return subprocess.Popen([sys.executable, WORKER, "init"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    t0 = time.monotonic()
    peer, host = start(1, closed), start(0, free_port())  # process 1 finds nobody; process 0 waits alone
    outs = [p.communicate(timeout=60)[0] for p in (peer, host)]
    assert time.monotonic() - t0 < timeout + 30
    for p, out in zip((peer, host), outs):
        assert p.returncode == distributed.INIT_TIMEOUT_EXIT_CODE, out[-2000:]
        assert f"did not start within {timeout} s" in out and "initialized=" not in out, out[-2000:]
    assert f"process 1 of 2, waiting for coordinator 127.0.0.1:{closed}" in outs[0]
    assert f"nothing answers at 127.0.0.1:{closed}" in outs[0]
    assert "process 0 of 2" in outs[1] and "the other processes never connected" in outs[1]


TRAIN_ARGS = ["gpt-small", "--tiny", "--mesh", "data=2,tensor=4", "--rules", "dp_tp", "--steps", "4",
              "--set", "checkpoint.every_steps=2", "--set", "run.eval_batches=0", "--set", "run.progress=false"]


@pytest.mark.slow
def test_version_and_config_mismatch_fails_on_every_process(tmp_path):
    cmd = [sys.executable, WORKER, "mismatch", *TRAIN_ARGS, "--run-dir", str(tmp_path / "run")]
    code, out, _ = _launch(cmd, 2, 4, timeout_s=60)
    assert code == cli.EXIT_USAGE, out[-3000:]  # processes started with different configs: a user error
    for i in range(2):
        assert f"[p{i}] spmd-train: error: process {i}: the 2 processes of this run disagree" in out, out[-3000:]
    assert "[p0]   spmd: process(es) [0] have '" in out and "process(es) [1] have '0.0.0-other'" in out
    assert "[p1]   config: process(es) [0] have 'sha256:" in out
    assert "jax:" not in out and "mesh:" not in out  # only what differs is reported


def _train_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["split"] == "train"}


def _close(a: dict, b: dict, rtol=1e-5) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= rtol * abs(b[k]) for k in a)


def _copy_step(src_run, dst_run, step):
    shutil.copytree(os.path.join(src_run, "checkpoints", str(step)), os.path.join(dst_run, "checkpoints", str(step)))


@pytest.mark.slow
def test_losses_and_checkpoints_match_across_process_counts(tmp_path):
    """1x8 (here) vs 2x4 from scratch; a 2x4 checkpoint resumed on 1x8; a 1x8 checkpoint resumed on 4x2."""
    one, two, two_to_one, one_to_four = (str(tmp_path / n) for n in ("1x8", "2x4", "2x4-to-1x8", "1x8-to-4x2"))
    reference = train(command.build_config(cli.parse_args([*TRAIN_ARGS, "--run-dir", one])))
    assert sorted(reference.losses) == [1, 2, 3, 4]
    ref = _train_losses(one)
    assert _close(ref, reference.losses)

    code, out, _ = _launch([sys.executable, "-m", "trainers", *TRAIN_ARGS, "--run-dir", two], 2, 4)
    assert code == 0, out[-3000:]
    assert _close(_train_losses(two), ref), (_train_losses(two), ref)
    assert not _close({k: v * (1 + 1e-4) for k, v in ref.items()}, ref)  # negative control: the tolerance bites
    assert not _close({k: ref[k] for k in (3, 4)}, {k: ref[k] for k in (1, 2)})  # and the steps differ
    # Only process 0 logs: one JSONL record per step, one TensorBoard file, the mesh line from [p0] only.
    assert sorted(r["step"] for r in read_metrics(two) if r["split"] == "train") == [1, 2, 3, 4]
    assert len(os.listdir(os.path.join(two, "tensorboard"))) == 1
    assert "[p0] Mesh: 8 device(s) = data=2 x tensor=4" in out and "[p1] Mesh:" not in out

    _copy_step(two, two_to_one, 2)  # written by 2 processes, restored by 1
    resumed = train(command.build_config(cli.parse_args([*TRAIN_ARGS, "--run-dir", two_to_one])))
    assert resumed.start_step == 2
    assert _close(_train_losses(two_to_one), {k: ref[k] for k in (3, 4)})

    # Written by 1 process, restored by 4 processes x 2 devices on the same data=2 x tensor=4 mesh: each
    # data row now spans two processes, which load the same rows of the batch (trainers.data.process_rows).
    _copy_step(one, one_to_four, 2)
    args = [*TRAIN_ARGS, "--run-dir", one_to_four]
    code, out, _ = _launch([sys.executable, "-m", "trainers", *args], 4, 2)
    assert code == 0, out[-3000:]
    assert "[p0] resumed from step 2" in out and "[p0] Mesh: 8 device(s) = data=2 x tensor=4" in out
    assert _close(_train_losses(one_to_four), {k: ref[k] for k in (3, 4)})


@pytest.mark.sweep
def test_an_interleaved_pipeline_on_two_processes_matches_one_process(tmp_path):
    """An interleaved schedule (its stacks stored in chunk order, created in natural order and permuted:
    trainers.state) on 2 processes x 4 devices, each process one data row of pipe=2 x tensor=2: the losses
    of one process; its checkpoint resumed on one process continues them."""
    args = ["gpt-small", "--tiny", "--mesh", "data=2,pipe=2,tensor=2", "--rules", "dp_tp", "--steps", "3",
            "--set", "model.n_layers=4", "--set", "pipeline.schedule=interleaved", "--set", "pipeline.virtual_stages=2",
            "--set", "pipeline.microbatches=2", "--set", "checkpoint.every_steps=2", "--set", "run.eval_batches=0",
            "--set", "run.progress=false"]
    one, two, back = (str(tmp_path / n) for n in ("1x8", "2x4", "2x4-to-1x8"))
    reference = train(command.build_config(cli.parse_args([*args, "--run-dir", one])))
    code, out, _ = _launch([sys.executable, "-m", "trainers", *args, "--run-dir", two], 2, 4)
    assert code == 0, out[-3000:]
    assert _close(_train_losses(two), reference.losses), (_train_losses(two), reference.losses)
    _copy_step(two, back, 2)
    resumed = train(command.build_config(cli.parse_args([*args, "--run-dir", back])))
    assert resumed.start_step == 2 and _close(_train_losses(back), {3: reference.losses[3]})
