"""spmd-launch: environment of each child, prefixed output, failing as a whole, no orphans; pod command builders."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers.paths import REPO

from trainers.launch import local as launch_lib
from trainers.launch import pods
from trainers.launch.local import child_env, launch, parse_args


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pids, within=5.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# ----------------------------------------------------------------------------- environment and output
def test_child_env_sets_spmd_settings_and_replaces_the_device_count():
    env = child_env(1, 4, 12345, 2, 30, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1",
                                               "KEEP": "me"})
    assert env["SPMD_COORDINATOR"] == "127.0.0.1:12345"
    assert (env["SPMD_NUM_PROCESSES"], env["SPMD_PROCESS_ID"], env["SPMD_INIT_TIMEOUT"]) == ("4", "1", "30")
    assert env["JAX_PLATFORMS"] == "cpu" and env["KEEP"] == "me"
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]


def test_launch_prefixes_each_line_and_returns_zero():
    out = io.StringIO()
    code = """
        import os
        print(f"id={os.environ['SPMD_PROCESS_ID']} of {os.environ['SPMD_NUM_PROCESSES']} at {os.environ['SPMD_COORDINATOR']}")
        print(os.environ['XLA_FLAGS'], flush=True)
    """
    assert launch(_py(code), processes=3, devices_per_process=2, port=23456, out=out) == 0
    lines = out.getvalue().splitlines()
    for i in range(3):
        assert f"[p{i}] id={i} of 3 at 127.0.0.1:23456" in lines, lines
        flags = next(line for line in lines if line.startswith(f"[p{i}] --"))  # the others the parent set are kept
        assert flags.split()[-1] == "--xla_force_host_platform_device_count=2", flags
    assert all(line.startswith(("[p0] ", "[p1] ", "[p2] ")) for line in lines), lines


# ----------------------------------------------------------------------------- failing as a whole
def test_one_failing_child_stops_the_others_and_their_children(tmp_path):
    """Process 1 exits 3; process 0 (and a grandchild it started) would sleep for a minute."""
    code = f"""
        import os, subprocess, sys, time
        if os.environ["SPMD_PROCESS_ID"] == "1":
            time.sleep(0.5)
            sys.exit(3)
        child = subprocess.Popen(["sleep", "60"])
        open(r"{tmp_path}/pids", "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """
    out = io.StringIO()
    t0 = time.monotonic()
    assert launch(_py(code), processes=2, grace_s=1.0, out=out) == 3
    assert time.monotonic() - t0 < 15
    assert "process 1 exited with status 3; stopping the others" in out.getvalue()
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert _wait_dead(pids) == []


def test_grandchildren_left_behind_by_a_finished_child_are_cleaned_up(tmp_path):
    code = f"""
        import subprocess
        child = subprocess.Popen(["sleep", "60"])
        open(r"{tmp_path}/pid", "w").write(str(child.pid))
    """
    assert launch(_py(code), processes=1) == 0
    assert _wait_dead([int((tmp_path / "pid").read_text())]) == []


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    code = """
        import os, signal, sys, time
        if os.environ["SPMD_PROCESS_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(60)
    """
    out = io.StringIO()
    t0 = time.monotonic()
    assert launch(_py(code), processes=2, grace_s=0.5, out=out) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 < 15
    assert "process 0 exited with status 137" in out.getvalue()


def test_sigterm_to_the_launcher_is_forwarded_and_children_status_returned(tmp_path):
    code = f"""
        import os, signal, sys, time
        def stop(*_):
            print("got TERM", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        open(r"{tmp_path}/pid" + os.environ["SPMD_PROCESS_ID"], "w").write(str(os.getpid()))
        print("ready", flush=True)
        time.sleep(60)
    """
    cmd = [sys.executable, "-m", "trainers.launch.local", "--processes", "2", "--grace", "2", "--", *_py(code)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the handlers are installed before the pid files are written
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 7, out
    assert "[p0] got TERM" in out and "[p1] got TERM" in out, out
    assert _wait_dead([int((tmp_path / f"pid{i}").read_text()) for i in range(2)]) == []


# ----------------------------------------------------------------------------- bad input
def test_cli_requires_a_command_after_double_dash(capsys):
    assert launch_lib.main(["--processes", "2", "spmd-train", "gpt-small"]) == 2
    assert "missing '--'" in capsys.readouterr().err
    assert launch_lib.main(["--processes", "2", "--"]) == 2
    assert "no command after '--'" in capsys.readouterr().err
    args, cmd = parse_args(["--processes", "4", "--devices-per-process", "2", "--timeout", "9", "--", "spmd-train", "x", "--tiny"])
    assert (args.processes, args.devices_per_process, args.timeout, cmd) == (4, 2, 9, ["spmd-train", "x", "--tiny"])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"processes": 0}, "processes must be a positive integer, got 0"),
        ({"processes": 2, "devices_per_process": -1}, "devices_per_process must be a positive integer, got -1"),
        ({"processes": 2, "port": 70000}, "port must be in 1..65535"),
        ({"processes": 2, "timeout_s": 0}, "timeout_s must be a positive integer"),
    ],
)
def test_launch_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        launch(["true"], **kw)


def test_launch_rejects_unknown_command():
    with pytest.raises(ValueError, match="command 'no-such-command-xyz' not found"):
        launch(["no-such-command-xyz"], processes=2)
    with pytest.raises(ValueError, match="cmd must be a non-empty list"):
        launch([], processes=2)


# ----------------------------------------------------------------------------- pod command builders
def test_train_command_is_the_same_everywhere():
    cmd = pods.train_command("gpt-125m", ["run.steps=10"], mesh="data=-1,fsdp=8", dcn="data=2")
    assert cmd == ["spmd-train", "gpt-125m", "--mesh", "data=-1,fsdp=8", "--dcn", "data=2", "--set", "run.steps=10"]
    tpu = pods.tpu_pod_command("my-pod", "us-central2-b", cmd, project="proj", workdir="~/spmd")
    assert tpu[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod"]
    assert "--zone=us-central2-b" in tpu and "--worker=all" in tpu and "--project=proj" in tpu
    remote = tpu[-1].removeprefix("--command=")
    assert remote == "cd ~/spmd && spmd-train gpt-125m --mesh data=-1,fsdp=8 --dcn data=2 --set run.steps=10"
    slurm = pods.slurm_command(cmd, nodes=4, gpus_per_node=8)
    assert slurm[:4] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8"]
    assert slurm[4:] == cmd


def test_command_builders_quote_and_validate():
    cmd = pods.train_command("gpt-small", ["run.name=two words"])
    assert pods.tpu_pod_command("p", "z", cmd)[-1].endswith("--set 'run.name=two words'")
    for bad, match in [
        (lambda: pods.train_command("", []), "recipe"),
        (lambda: pods.train_command("gpt-small", ["noequals"]), "key=value"),
        (lambda: pods.tpu_pod_command("", "z", cmd), "tpu name"),
        (lambda: pods.tpu_pod_command("p", "", cmd), "zone"),
        (lambda: pods.slurm_command(cmd, nodes=0), "nodes must be"),
        (lambda: pods.slurm_command(cmd, nodes=2, gpus_per_node=0), "gpus_per_node must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad()


def test_launcher_scripts_run_the_same_train_command():
    here = os.path.join(REPO, "trainers", "launch", "scripts")
    tpu = open(os.path.join(here, "tpu_pod.sh")).read()
    slurm = open(os.path.join(here, "slurm_gpu.sbatch")).read()
    assert "gcloud compute tpus tpu-vm ssh" in tpu and "--worker=all" in tpu and "spmd-train" in tpu
    assert "#SBATCH --ntasks-per-node=1" in slurm and "srun" in slurm and "spmd-train" in slurm
    for script in ("tpu_pod.sh", "slurm_gpu.sbatch"):
        result = subprocess.run(["bash", "-n", os.path.join(here, script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
