"""What a new user meets: every mistake is one message naming the value, the key and a fix, with a
documented exit status (trainers.launch.cli); --help is instant; Ctrl-C never crashes; the run
directory keeps its config history."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from helpers.fault_worker import default_signals
from helpers.paths import REPO

from trainers.launch import cli, local
from trainers.recipes import RECIPES

TINY = ["gpt-small", "--tiny", "--set", "run.progress=false", "--set", "run.tensorboard=false"]


def run_cli(capsys, *args):
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args, needles", [
    (["--mesh", "data=16"], ["multiply to 16", "8 devices", "--mesh"]),
    (["--mesh", "data=3"], ["{'data': 3}", "multiply to 3", "mesh.axes"]),
    (["--set", "data.global_batch=6", "--mesh", "data=4,tensor=2"], ["data.global_batch=6", "data=4", "multiple of 4"]),
    (["--steps", "0"], ["run.steps must be >= 1, got 0"]),
    (["--set", "lr.peek_lr=1"], ["unknown config key 'lr.peek_lr'", "did you mean lr.peak_lr"]),
    (["--set", "data.corpus=text", "--set", "data.path=/nonexistent/texts"], ["/nonexistent/texts"]),
    (["--mesh", "data=1,tensor=8"], ["kv_heads", "tensor=8", "model.n_kv_heads"]),
])
def test_user_errors_are_one_message_and_exit_2(capsys, tmp_path, args, needles):
    code, _, err = run_cli(capsys, *TINY, "--run-dir", str(tmp_path / "run"), *args)
    assert code == cli.EXIT_USAGE, err
    assert err.startswith("spmd-train: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_forgotten_simulate_devices_is_named():
    """On a laptop (one CPU device) the likely fix is --simulate-devices."""
    code = ("import sys\nfrom trainers.launch import cli\n"
            "sys.exit(cli.main(['gpt-small', '--tiny', '--mesh', 'data=2,tensor=4', '--run-dir', sys.argv[1]]))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as run_dir:
        result = subprocess.run([sys.executable, "-c", code, run_dir], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert "there are 1 devices" in result.stderr and "--simulate-devices 8" in result.stderr, result.stderr


def test_run_dir_that_is_a_file(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    code, _, err = run_cli(capsys, *TINY, "--run-dir", str(tmp_path / "afile"))
    assert code == cli.EXIT_USAGE and "is a file, not a directory" in err and "run.run_dir" in err, err


def test_debug_shows_the_traceback(capsys, tmp_path):
    code, _, err = run_cli(capsys, *TINY, "--run-dir", str(tmp_path), "--mesh", "data=3", "--debug")
    assert code == cli.EXIT_USAGE and "Traceback" in err and "spmd-train: error:" in err


def test_resume_refuses_a_new_model_shape_and_keeps_the_config_history(capsys, tmp_path):
    run_dir = str(tmp_path / "run")
    assert run_cli(capsys, *TINY, "--run-dir", run_dir)[0] == 0
    stored = (tmp_path / "run" / "config.json").read_bytes()
    code, _, err = run_cli(capsys, *TINY, "--run-dir", run_dir, "--set", "model.d_model=64", "--steps", "3")
    assert code == cli.EXIT_USAGE and "cannot resume" in err and "model.d_model" in err, err
    assert (tmp_path / "run" / "config.json").read_bytes() == stored  # refused before anything was written
    assert not list((tmp_path / "run").glob("config.*.json"))
    # a change that can be resumed is allowed and noted; the earlier config is kept as config.1.json
    code, out, err = run_cli(capsys, *TINY, "--run-dir", run_dir, "--set", "lr.peak_lr=0.001", "--steps", "3")
    assert code == 0, err
    assert "config changed" in out and "lr.peak_lr" in out, out
    assert (tmp_path / "run" / "config.1.json").read_bytes() == stored
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"]["peak_lr"] == 0.001


def test_help_is_instant_and_version_names_jax():
    code = ("import sys\nfrom trainers.launch import cli\ntry:\n    cli.parse_args(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint('jax imported:', 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "examples:" in out and "exit statuses:" in out and "jax imported: False" in out, out
    version = subprocess.run([sys.executable, "-m", "trainers", "--version"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    assert version.startswith("spmd ") and "jax " in version


def test_recipe_names_in_help_are_the_recipes():
    assert tuple(RECIPES) == cli.RECIPE_NAMES


def test_spmd_launch_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        local.main(["--help"])
    assert exit_info.value.code == 0 and "example:" in capsys.readouterr().out


def test_launch_finds_the_toolkit_without_path(tmp_path):
    """No venv activated: spmd-train is not on PATH, the launcher runs it through this interpreter."""
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        status = local.launch(["spmd-train", "--version"], processes=1, env=env, out=out)
    assert status == 0 and "spmd " in log.read_text(), log.read_text()


@pytest.mark.parametrize("after_s", [0.5, 2.0, 5.0])
def test_ctrl_c_at_any_moment_exits_cleanly(tmp_path, after_s):
    proc = subprocess.Popen([sys.executable, "-m", "trainers", "gpt-small", "--simulate-devices", "8", "--run-dir",
                             str(tmp_path / "run"), "--set", "run.progress=false"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode in (cli.EXIT_INTERRUPTED, cli.EXIT_PREEMPTED, -signal.SIGINT), (proc.returncode, err[-2000:])
    assert "Segmentation fault" not in err and "Fatal Python error" not in err, err[-2000:]


def test_print_config_is_a_config_file(capsys, tmp_path):
    """--print-config writes what --config reads (JSON, and the same as YAML); --set still overrides it."""
    import yaml

    from trainers.config import Config, override
    from trainers.config_files import config_file_overrides
    from trainers.recipes import recipe

    (tmp_path / "run.json").write_text(_printed(capsys, "gpt-small", "--set", "lr.peak_lr=0.002"))
    expected = override(recipe("gpt-small"), ["lr.peak_lr=0.002"])
    assert override(Config(), config_file_overrides(str(tmp_path / "run.json"))) == expected
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"lr": {"peak_lr": 0.002}, "run.steps": 70}))
    args = cli.parse_args(["gpt-small", "--config", str(tmp_path / "run.yaml"), "--set", "run.steps=90"])
    from trainers.launch import command

    cfg = command.build_config(args)
    assert (cfg.lr.peak_lr, cfg.run.steps) == (0.002, 90)  # the file, then --set over it
    (tmp_path / "bad.yaml").write_text("lr: [1, 2\n")
    code, _, err = run_cli(capsys, "gpt-small", "--config", str(tmp_path / "bad.yaml"), "--print-config")
    assert code == cli.EXIT_USAGE and "is not valid YAML" in err, err


def _printed(capsys, *args) -> str:
    assert cli.main([*args, "--print-config"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--devices", "0"], "devices must be a positive integer, got 0"),
    (["--devices", "8", "--top", "0"], "--top must be >= 1, got 0"),
    (["--devices", "8", "--hardware", "b300"], "unknown hardware 'b300'"),
])
def test_plan_errors_are_one_message_and_exit_2(capsys, args, needle):
    from trainers.launch.plan import main

    code = main(["gpt-small", "--tiny", "--no-compile", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("spmd-plan: error: ") and needle in err and "Traceback" not in err, err


# ------------------------------------------------------------------ messages that name the fix
def test_mesh_auto_in_any_case_is_the_planners_choice():
    from trainers.config import AUTO, MeshConfig

    assert MeshConfig(axes="AUTO").axes == MeshConfig(axes="Auto").axes == AUTO
    with pytest.raises(ValueError, match=r"mesh item 'AUTOMATIC' is not of the form axis=size"):
        MeshConfig(axes="AUTOMATIC")  # negative control: only the word itself


def test_no_validation_split_with_evals_on_is_refused_up_front(capsys, tmp_path):
    code, _, err = run_cli(capsys, *TINY, "--run-dir", str(tmp_path / "run"), "--set", "data.validation_fraction=0")
    assert code == cli.EXIT_USAGE, err
    assert "data.validation_fraction=0" in err and "run.eval_every=" in err and "run.eval_batches=0" in err, err
    assert not os.path.exists(tmp_path / "run")  # before anything was written or compiled
    from trainers.config import override
    from trainers.recipes import recipe
    from trainers.task import check_validation_split

    check_validation_split(override(recipe("gpt-small", tiny=True), ["data.validation_fraction=0",
                                                                     "run.eval_batches=0"]))  # evals off: fine


def test_an_ordinary_update_refused_by_a_tiny_limit_names_the_limit():
    from trainers.faults.guard import GuardEvent

    tiny_limit = GuardEvent(2, 1, "update_ratio", 0.00451, 1e-9, float("nan")).describe()
    assert "run.max_update_ratio=1e-09 is too small for this run" in tiny_limit and "learning rate" not in tiny_limit
    big_update = GuardEvent(2, 1, "update_ratio", 37.0, 1.0, float("nan")).describe()  # the learning rate's fault
    assert "learning rate is far too large" in big_update and "too small" not in big_update


def test_stopping_at_the_last_step_is_a_finished_run(monkeypatch, capsys, tmp_path):
    """A Ctrl-C or SIGTERM answered at the run's last step: the run finished, exit 0 (it used to be 76)."""
    from trainers.launch import command
    from trainers.loop import Result

    steps = {"done": 2, "stopped": 1}

    def fake_train(cfg, task=None):
        return Result(str(tmp_path), 0, steps["now"], {}, {}, 0, {}, preempted=True)

    monkeypatch.setattr(command, "train", fake_train)
    for case, code in (("done", cli.EXIT_OK), ("stopped", cli.EXIT_PREEMPTED)):
        steps["now"] = steps[case]
        assert run_cli(capsys, *TINY, "--run-dir", str(tmp_path / "run"))[0] == code, case


@pytest.mark.slow
def test_ctrl_c_while_the_first_step_compiles_exits_130_within_a_second(tmp_path):
    """Ctrl-C early in a start used to wait for the first compile, save step 1 and exit 76."""
    proc = subprocess.Popen([sys.executable, "-m", "trainers", "gpt-small", "--simulate-devices", "8", "--run-dir",
                             str(tmp_path / "run"), "--set", "run.progress=false", "--set", "run.tensorboard=false"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_signals)
    lines = []
    for line in proc.stdout:  # the last message before the loop's first step (and its compile)
        lines.append(line)
        if line.startswith("MFU from") or "step 1/" in line:
            break
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    assert proc.returncode == cli.EXIT_INTERRUPTED, (proc.returncode, "".join(lines) + rest)
    assert took < 1.5, took
    assert "interrupted (Ctrl-C)" in rest and "Traceback" not in rest, rest
    assert not os.path.isdir(tmp_path / "run" / "checkpoints") or not os.listdir(tmp_path / "run" / "checkpoints")


def test_ctrl_c_inside_an_import_exits_at_once(tmp_path):
    """Ctrl-C while a module initializes (jaxlib's C extension, in a slow start) must not raise into it:
    that aborted the process (SIGABRT) instead of exiting 130."""
    (tmp_path / "slow_module.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                             "time.sleep(30)\n")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from trainers.launch import cli\n"
              "cli.answer_ctrl_c('spmd-train', 'nothing was left half-written')\nimport slow_module\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=20, preexec_fn=default_signals)
    assert proc.returncode == cli.EXIT_INTERRUPTED, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip() == "spmd-train: interrupted (Ctrl-C); nothing was left half-written", proc.stderr
