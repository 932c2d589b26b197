"""Nothing accepted silently, nothing lost: each case of docs/faults.md's table is refused with a message
naming the key and the fix (or stopped, or kept), against a negative control that still passes."""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fault_worker import kill_at_line, tiny_config, worker_env
from helpers.paths import REPO

from trainers import Task
from trainers.checkpoint import CheckpointConfig, Checkpointer, load_params
from trainers.config import RunConfig, override
from trainers.data import DataConfig
from trainers.data.checks import check_batch_ids, check_token_ids
from trainers.faults import guard
from trainers.faults.guard import DivergenceError
from trainers.launch import cli
from trainers.log_files import read_scalars
from trainers.logger import read_metrics
from trainers.loop import train
from trainers.recipes import recipe
from trainers.task import lm_windows

WORKER = os.path.join(REPO, "tests", "helpers", "fault_worker.py")
TINY = ["gpt-small", "--tiny", "--set", "run.progress=false", "--set", "run.tensorboard=false"]


def _npy_config(tmp_path, ids, *sets):
    path = tmp_path / "ids.npy"
    np.save(path, np.asarray(ids))
    return override(recipe("gpt-small", tiny=True), ["data.corpus=npy", f"data.path={path}", *sets])


# ----------------------------------------------------------------------------- data against the model
@pytest.mark.parametrize("fill, needle", [(-1, r"\[-1, -1\].*negative ids are never valid"),
                                          (300, r"\[300, 300\].*data.vocab_size=256 allows only \[0, 255\]")])
def test_token_ids_outside_the_vocab_are_refused_before_compiling(tmp_path, fill, needle):
    cfg = _npy_config(tmp_path, np.full(5000, fill, np.int32))
    with pytest.raises(ValueError, match=needle):
        lm_windows(cfg, "train")
    ok = _npy_config(tmp_path, np.arange(5000) % 256)  # negative control: every id in range
    assert len(lm_windows(ok, "train")) > 0


def test_a_task_that_declares_its_vocab_has_each_batch_checked():
    batch = {"inputs": np.array([[1, 2, 64]]), "targets": np.array([[2, 3, 4]]), "weights": np.ones((1, 3))}
    with pytest.raises(ValueError, match=r"batch 7: batch\['inputs'\].*Task.vocab_size=64.*position 2, value 64"):
        check_batch_ids(batch, 64, ("inputs", "targets"), where="batch 7")
    check_batch_ids(batch, 65, ("inputs", "targets"), where="batch 7")  # negative control
    with pytest.raises(ValueError, match="Task.vocab_size must be a positive int"):
        Task(model=lambda r: None, loss=lambda m, b, r: 0.0, data=[1], vocab_size=0)
    with pytest.raises(ValueError, match="must be integers"):
        check_token_ids(np.ones(3, np.float32), 8, what="x")


def test_binary_data_is_not_a_text_corpus(tmp_path):
    binary, latin1 = tmp_path / "random.bin", tmp_path / "latin1.txt"
    binary.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    latin1.write_bytes("café déjà vu ".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"random.bin' is not a text file \(a NUL byte at offset \d+"):
        DataConfig(corpus="text", path=str(binary))
    DataConfig(corpus="text", path=str(latin1))  # negative control: text in another encoding is still text
    from trainers.launch import tokenize

    assert tokenize.main([str(binary), "--tokenizer", "none.json", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_a_global_batch_larger_than_the_corpus_is_refused(tmp_path):
    cfg = _npy_config(tmp_path, np.arange(400) % 256, "data.global_batch=32")  # 380 train tokens: 23 windows of 16
    with pytest.raises(ValueError, match=r"data.global_batch=32 needs 32 windows.*23 windows.*at most 23"):
        lm_windows(cfg, "train")
    assert len(lm_windows(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch=16)), "train")) == 23


def test_a_task_with_fewer_examples_than_a_global_batch_is_refused():
    cfg = override(recipe("gpt-small", tiny=True), ["data.global_batch=16"])
    examples = [{"x": np.zeros(3, np.float32)}] * 12
    task = Task(model=lambda r: None, loss=lambda m, b, r: 0.0, data=examples, name="few")
    with pytest.raises(ValueError, match=r"task 'few'.s data has 12 examples, fewer than data.global_batch=16"):
        task.train_source(cfg)
    assert len(dataclasses.replace(task, data=examples * 2).train_source(cfg)) == 24  # negative control


def test_absurd_step_counts_and_device_counts_are_refused(capsys):
    with pytest.raises(ValueError, match=r"run.steps=100000000000000000000 is beyond the int32 step counter"):
        RunConfig(steps=10**20)
    RunConfig(steps=2**31 - 1)  # negative control
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["gpt-small", "--dry-run", "--devices", "0"])
    assert e.value.code == cli.EXIT_USAGE and "--devices: 0 is not allowed: give an integer >= 1" in capsys.readouterr().err


def test_a_dry_run_of_100000_devices_answers_within_30_s_under_2_gb():
    cmd = [sys.executable, "-m", "trainers.launch.cli", "gpt-small", "--tiny", "--dry-run", "--devices", "100000",
           "--mesh", "data=-1"]
    from benchmarks.guard import MEASURE  # a small parent reads the command's peak RSS

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", MEASURE, *cmd], cwd=REPO, env=worker_env(1), capture_output=True,
                          text=True, timeout=60)
    seconds = time.perf_counter() - t0
    rss_gb = int(proc.stderr.strip().splitlines()[-1]) / 2**20  # KiB -> GiB
    assert proc.returncode == cli.EXIT_USAGE, proc.stderr
    assert "more than the 4096 this toolkit simulates" in proc.stderr and "--no-compile" in proc.stderr, proc.stderr
    assert seconds < 30 and rss_gb < 2, (seconds, rss_gb)


def test_the_planner_ranks_100000_devices_without_compiling(capsys):
    from trainers.launch import plan

    t0 = time.perf_counter()
    plan.main(["gpt-small", "--tiny", "--devices", "100000"])
    err = capsys.readouterr().err
    assert "more than the 4096 a compile check simulates; ranking analytically" in err and time.perf_counter() - t0 < 30


# ----------------------------------------------------------------------------- the run directory
def _tiny_state():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    return {"w": jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(mesh, jax.P("data")))}


def test_retention_counts_only_valid_steps(tmp_path):
    directory = tmp_path / "checkpoints"
    (directory / "99").mkdir(parents=True)  # an empty step directory: not valid
    with Checkpointer(directory, CheckpointConfig(keep=2, async_save=False)) as ck:
        for step in (1, 2, 3):
            ck.save(step, _tiny_state(), {}, force=True)
        ck.wait()
        assert ck.valid_steps() == [2, 3]  # keep=2 valid steps; the empty 99 neither counted nor deleted
    assert sorted(os.listdir(directory)) == ["2", "3", "99"]


def test_a_refused_resume_writes_no_config(capsys, tmp_path):
    run_dir = str(tmp_path / "run")
    assert cli.main([*TINY, "--simulate-devices", "8", "--run-dir", run_dir]) == 0
    os.remove(os.path.join(run_dir, "config.json"))
    code = cli.main([*TINY, "--simulate-devices", "8", "--run-dir", run_dir, "--set", "model.d_model=64"])
    assert code == cli.EXIT_USAGE and "does not match the restore target" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(run_dir, "config.json"))  # nothing recorded for a refused run
    assert cli.main([*TINY, "--simulate-devices", "8", "--run-dir", run_dir, "--steps", "3"]) == 0  # the original resumes


# ----------------------------------------------------------------------------- the guard watches the update
def test_update_flags_in_the_step():
    window = guard.init_state(3)
    ok = guard.check_update(window, jnp.float32(0.1), jnp.float32(10.0), jnp.float32(10.0), 1.0, 10.0)
    assert not bool(ok["update_ratio_high"]) and not bool(ok["param_norm_high"])  # negative control
    assert bool(guard.check_update(window, jnp.float32(11.0), jnp.float32(10.0), jnp.float32(20.0), 1.0, 0.0)["update_ratio_high"])
    assert bool(guard.check_update(window, jnp.float32(1.0), jnp.float32(10.0), jnp.float32(jnp.inf), 0.0, 0.0)["param_norm_high"])
    window = guard.update(window, jnp.float32(1.0), jnp.float32(1.0), jnp.bool_(True), jnp.float32(10.0))
    assert float(window["param_norm0"]) == 10.0
    assert bool(guard.check_update(window, jnp.float32(1.0), jnp.float32(10.0), jnp.float32(101.0), 0.0, 10.0)["param_norm_high"])
    with pytest.raises(ValueError, match=r"run.max_update_ratio must be 0 \(check off\) or a finite number > 0"):
        RunConfig(max_update_ratio=-1.0)
    pending = [(s, s - 1, {"ok": jnp.bool_(s != 2)}) for s in (1, 2, 3, 4)]  # the loop's unfetched steps
    assert not guard.peek_bad(pending[:3]) and guard.peek_bad(pending)  # step 2 is seen 2 steps later


def test_a_destructive_learning_rate_stops_within_3_steps_and_the_last_checkpoint_is_sound(tmp_path):
    run_dir = str(tmp_path / "run")
    train(tiny_config(run_dir, 3))  # three good steps, a checkpoint at each
    seen = []
    sets = ("lr.peak_lr=1e30", "run.log_every=100", "checkpoint.every_steps=100")  # lr may change on resume
    with pytest.raises(DivergenceError, match=r"step 4 .*run.max_update_ratio=1.*lr.peak_lr.*last good checkpoint: \[3\]"):
        train(tiny_config(run_dir, 40, *sets), step_hook=seen.append)
    assert max(seen) <= 4 + 3, seen
    step, tree = load_params(run_dir)  # the newest valid step, whole on one device
    assert step == 3 and {x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(tree)} == {True}
    norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))
    first = read_metrics(run_dir, "train")[0]["param_norm"]  # the norm before step 1's update
    assert np.isfinite(norm) and norm < 10 * first, (norm, first)


# ----------------------------------------------------------------------------- crash-consistent logs
@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [pytest.param(3, marks=pytest.mark.sweep), 5])
def test_sigkill_then_resume_logs_every_step_once(tmp_path, kill_at):
    run_dir = str(tmp_path / "run")
    sets = ["--set", "run.tensorboard=true", "--set", "checkpoint.every_steps=3"]
    proc = subprocess.Popen([sys.executable, WORKER, run_dir, "8", "--sleep", "0.3", *sets], env=worker_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_at_line(proc, f"STEP {kill_at}", lambda: 0.1)
    logged = [r["step"] for r in read_metrics(run_dir, "train")]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) >= kill_at - 1, logged  # flushed as logged
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == logged
    result = train(tiny_config(run_dir, 8, "run.tensorboard=true", "checkpoint.every_steps=3"))
    assert 0 <= result.start_step <= kill_at  # step 3's save may not have committed: then from scratch
    rows = [(r["step"], r["loss"]) for r in read_metrics(run_dir, "train")]
    assert [s for s, _ in rows] == list(range(1, 9))  # every step exactly once
    assert [(s, pytest.approx(v)) for s, v in read_scalars(run_dir)["train/loss"]] == rows  # TensorBoard agrees
    assert {s: v for s, v in rows if s > result.start_step} == pytest.approx(result.losses)  # the resumed values


@pytest.mark.slow
@pytest.mark.parametrize("tiny", [[], pytest.param(["--tiny"], marks=pytest.mark.sweep)], ids=["main-job", "tiny-2-steps"])
def test_the_main_job_with_a_destructive_learning_rate_stops_naming_the_cause(tmp_path, tiny):
    cmd = [sys.executable, "-m", "trainers.launch.cli", "gpt-small", *tiny, "--simulate-devices", "8", "--run-dir",
           str(tmp_path / "run"), "--set", "lr.peak_lr=1e30", "--set", "run.progress=false"]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == cli.EXIT_DIVERGED, proc.stderr[-3000:]
    assert "run.max_update_ratio" in proc.stderr and "lr.peak_lr" in proc.stderr, proc.stderr[-3000:]
    events = [r for r in read_metrics(tmp_path / "run") if r["split"] == "guard/update_ratio"]
    assert events and events[0]["step"] <= 2, events  # the first update with a non-zero lr (warmup starts at 0)
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "50")  # stopped long before the first checkpoint


# ----------------------------------------------------------------------------- unclear messages made clear
def test_malformed_config_files_name_line_and_column(tmp_path):
    from trainers.config_files import config_file_overrides

    (tmp_path / "bad.yaml").write_text("run:\n  steps: 3\n  name: [a\nlr:\n  x: 1\n")
    (tmp_path / "bad.json").write_text('{"run": {"steps": 3,}}')
    with pytest.raises(ValueError, match=r"bad.yaml' is not valid YAML at line 4, column 3"):
        config_file_overrides(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match=r"bad.json' is not valid JSON at line 1, column 21"):
        config_file_overrides(str(tmp_path / "bad.json"))


def test_a_text_file_given_as_npy_is_named(tmp_path):
    (tmp_path / "ids.npy").write_text("1 2 3\n")
    with pytest.raises(ValueError, match=r"is not a .npy file \(it starts b'1 2 3\\n': text\).*data.corpus=text"):
        DataConfig(corpus="npy", path=str(tmp_path / "ids.npy"))


def test_user_code_errors_are_user_errors_with_the_users_frame(tmp_path, monkeypatch, capsys):
    (tmp_path / "badtask.py").write_text("def helper():\n    return {}['missing']\n\n\ndef task():\n    return helper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["badtask:task", "--print-config"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "task raised KeyError: 'missing' at " in err and "badtask.py:2 in helper" in err, err
    assert "internal error" not in err
    from trainers.task import UserCodeError, call_user

    def model(rngs):
        return 1 / 0

    with pytest.raises(UserCodeError, match=r"the task's model function .*model raised ZeroDivisionError.*"
                                            r"test_nothing_silent.py:\d+ in model"):
        call_user(model, "the task's model function", None)


@pytest.mark.parametrize("exc, needles", [
    (OSError(30, "Read-only file system", "/ro/runs/x"), ["cannot use '/ro/runs/x': Read-only file system", "run.run_dir"]),
    (OSError(13, "Permission denied", "/data/corpus.txt"), ["cannot use '/data/corpus.txt': Permission denied",
                                                           "paths come from data.path"]),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9.1GiB"),
     ["out of device memory: RESOURCE_EXHAUSTED", "--dry-run --devices 8", "model.remat_policy=full", "fsdp"]),
])
def test_os_errors_and_out_of_memory_name_the_key_and_the_fix(monkeypatch, capsys, exc, needles):
    from trainers.launch import command

    def fail(args):
        raise exc

    monkeypatch.setattr(command, "run", fail)
    assert cli.main(["gpt-small", "--simulate-devices", "8"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert all(n in err for n in needles) and "internal error" not in err, err


def test_spmd_launch_says_which_processes_failed():
    import io

    from trainers.launch import local

    out = io.StringIO()
    assert local.launch([sys.executable, "-c", "import sys; sys.exit(3)"], processes=2, out=out) == 3
    assert "exited with status 3" in out.getvalue(), out.getvalue()


@pytest.mark.slow
def test_ctrl_c_inside_native_code_is_answered_within_a_second(tmp_path):
    """A command stuck in C code (XLA making devices, a compile; here a BLAS loop) cannot see the
    KeyboardInterrupt; the grace timer ends it within ``cli.INTERRUPT_GRACE_S``."""
    from helpers.fault_worker import default_signals

    code = ("import sys, numpy as np\nfrom trainers.launch import cli, command\n"
            "def stuck(args):\n    a = np.ones((6000, 6000), np.float32)\n    print('STUCK', flush=True)\n"
            "    a @ a @ a @ a\n"  # seconds in BLAS, one Python instruction: only the grace timer can end it
            "command.run = stuck\nsys.argv = ['spmd-train', 'gpt-small']\nsys.exit(cli.main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=worker_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    assert proc.stdout.readline().strip() == "STUCK"
    time.sleep(0.5)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_INTERRUPTED and "interrupted (Ctrl-C)" in err, (proc.returncode, err[-2000:])
    assert time.perf_counter() - sent < cli.INTERRUPT_GRACE_S + 0.5


def test_out_of_memory_gives_the_estimate_and_the_nearest_layout_that_fits(monkeypatch, capsys, tmp_path):
    from trainers.launch import command
    from trainers.planning import oom
    from trainers.planning.hardware import custom

    cfg = override(recipe("gpt-125m"), ["mesh.axes=data=8", "rules=dp"])
    text = oom.explain(cfg, 8, "NVIDIA H100 80GB HBM3", "RESOURCE_EXHAUSTED: Out of memory allocating 12.5GiB",
                       hardware=custom("h100", hbm_bytes=1.2e9, name="h100-small"), target="gpt-125m")
    assert "estimated per device on mesh data=8 (8 devices): 1.97 GiB = params" in text and "of 1.12 GiB" in text, text
    assert "nearest layout that fits: --mesh fsdp=8 --rules fsdp" in text, text  # one axis and its rule set changed
    assert oom.hardware_of("NVIDIA H100 80GB HBM3").name == "h100" and oom.hardware_of("cpu") is None

    def oom_at_start(cfg, task=None):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")

    monkeypatch.setattr(command, "train", oom_at_start)  # the command's own path: the run's config is known
    assert cli.main([*TINY, "--simulate-devices", "8", "--run-dir", str(tmp_path / "run")]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "out of device memory: RESOURCE_EXHAUSTED" in err and "estimated per device on mesh data=2,fsdp=2,tensor=2 (8 devices)" in err, err


def test_the_docs_give_preemption_its_exit_status():
    faults = open(os.path.join(REPO, "docs", "faults.md")).read()
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "`spmd-train` then exits 76" in faults and "exits 0 (all processes" not in faults
    assert f"| {cli.EXIT_PREEMPTED} | preempted" in readme


def test_two_ctrl_cs_during_the_stops_save_keep_the_step(tmp_path, monkeypatch, caplog):
    """The first Ctrl-C stops the run at the step in flight; the second arrives while that step's async
    save is committing: answered with a warning, and the step is committed (before: lost)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground process
    real_wait = Checkpointer.wait
    pressed = []

    def wait_with_a_second_ctrl_c(self, *args, **kwargs):
        if not pressed:
            pressed.append(1)
            signal.raise_signal(signal.SIGINT)
        return real_wait(self, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "wait", wait_with_a_second_ctrl_c)
    run_dir = str(tmp_path / "run")
    try:
        result = train(tiny_config(run_dir, 8), step_hook=lambda s: s == 3 and signal.raise_signal(signal.SIGINT))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert pressed and result.preempted and result.final_step == 3
    assert "Ctrl-C once more abandons it" in caplog.text
    with Checkpointer(os.path.join(run_dir, "checkpoints"), CheckpointConfig(), read_only=True) as ck:
        assert ck.valid_steps()[-1] == 3  # the step in flight is committed


def test_a_state_guard_window_saved_before_param_norm0_still_restores(tmp_path):
    """Local SGD keeps its guard windows in the checkpointed state; steps written before the update
    checks lack ``param_norm0``: they restore with it NaN (set again at the next accepted step)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = jax.NamedSharding(mesh, jax.P())
    put = lambda a: jax.device_put(np.asarray(a), rep)
    old = {"params": _tiny_state(), "guard": {"loss": put(np.ones(3, np.float32)), "grad_norm": put(np.ones(3, np.float32)),
                                              "count": put(np.int32(3))}}
    with Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False)) as ck:
        ck.save(1, old, {}, force=True)
        new = {**old, "guard": {**old["guard"], "param_norm0": put(np.float32(2.0))}}
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), new)
        step, state, _ = ck.restore(abstract)
    assert step == 1 and np.isnan(float(state["guard"]["param_norm0"])) and int(state["guard"]["count"]) == 3
    assert state["guard"]["param_norm0"].sharding == rep
