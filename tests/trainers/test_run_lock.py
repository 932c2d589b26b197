"""One run per run directory (trainers.run_lock): a second start on a directory a live run holds exits 2
naming the holder and touches nothing of the first run; a lock left by a dead process on this host is
taken over with a message; a lock from another host is refused with the file to remove."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest
from helpers.paths import REPO

from trainers.launch import cli
from trainers.run_lock import LOCK_FILE, RunDirectoryInUse, claim

HOLD = ("import sys, time\n"
        "from trainers.run_lock import claim\n"
        "with claim(sys.argv[1]):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n")


def _snapshot(directory) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), directory): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(directory) for f in names}


def test_a_second_start_on_a_held_run_directory_exits_2_and_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "2").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"run": {"steps": 5}}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 5.0}\n')
    (run_dir / "checkpoints" / "2" / "marker").write_text("in flight")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(run_dir)
        code = cli.main(["gpt-small", "--tiny", "--run-dir", str(run_dir), "--set", "run.progress=false"])
        err = capsys.readouterr().err
        assert code == cli.EXIT_USAGE, err
        assert f"is in use by process {holder.pid} on host {socket.gethostname()!r}" in err, err
        assert "--run-dir" in err
        assert _snapshot(run_dir) == before  # config, metrics, checkpoints and the holder's lock as they were
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_is_held_inside_and_released_after(tmp_path):
    run_dir = str(tmp_path / "run")
    with claim(run_dir):
        lock = json.loads(open(os.path.join(run_dir, LOCK_FILE)).read())
        assert (lock["host"], lock["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(RunDirectoryInUse, match=rf"in use by process {os.getpid()} on host"):
            with claim(run_dir):  # another open of the lock: refused while this one holds it
                pass
    assert not os.path.exists(run_dir)  # created for the run and left empty: removed again
    os.makedirs(run_dir)
    with claim(run_dir):
        pass
    assert os.listdir(run_dir) == []  # released: the lock file is gone, the directory stays


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0}))
    with caplog.at_level(logging.WARNING), claim(str(run_dir)):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"taking over the lock left by process {dead.pid}" in caplog.text
    assert not (run_dir / LOCK_FILE).exists()


def test_a_lock_from_another_host_is_refused_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "node-17", "pid": 4242, "started": 1.0}))
    with pytest.raises(RunDirectoryInUse, match=rf"may be in use by process 4242 on host 'node-17'.*remove "
                                                rf"{run_dir / LOCK_FILE}"):
        with claim(str(run_dir)):
            pass
    assert json.loads((run_dir / LOCK_FILE).read_text())["host"] == "node-17"  # left as it was
