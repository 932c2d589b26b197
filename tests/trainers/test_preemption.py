"""Preemption: SIGTERM/SIGINT finish the step, checkpoint it, return cleanly, and resuming is exact."""

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys

import pytest
from helpers.fault_worker import REPO, default_signals, last_train_losses, tiny_config, worker_env

from trainers.checkpoint import Checkpointer
from trainers.faults.preemption import PreemptionWatcher, barrier
from trainers.loop import train

WORKER = os.path.join(REPO, "tests", "helpers", "fault_worker.py")
STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's per-step losses."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    result = train(tiny_config(run_dir, STEPS, "checkpoint.every_steps=1000"))  # saved once, at the end: losses only
    assert not result.preempted and result.final_step == STEPS
    return last_train_losses(run_dir)


def _checkpoint_steps(run_dir):
    with Checkpointer(os.path.join(run_dir, "checkpoints"), tiny_config(run_dir, 1).checkpoint) as ck:
        return ck.valid_steps()


# ----------------------------------------------------------------------------- the watcher itself
@pytest.fixture(autouse=True)
def _sigint_default():
    """SIGINT as in a foreground process, even when the suite runs as a background job (SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with PreemptionWatcher():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as the CLI leaves it
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # negative control: SIGTERM is watched
    finally:
        signal.signal(signal.SIGINT, previous)


def test_handlers_are_installed_only_inside_and_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionWatcher() as watcher:
        assert signal.getsignal(signal.SIGTERM) == watcher._handle
        assert not watcher.should_stop(1)  # negative control: nothing asked yet
        signal.raise_signal(signal.SIGTERM)
        assert watcher.requested and watcher.reason == "SIGTERM" and watcher.should_stop(2)
    assert {s: signal.getsignal(s) for s in before} == before


def test_second_sigint_interrupts():
    with PreemptionWatcher(defer_sigint=False) as watcher:
        signal.raise_signal(signal.SIGINT)
        assert watcher.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_sigint_before_the_first_step_interrupts_and_after_it_stops_at_a_step():
    """Before the first step there is nothing to save: Ctrl-C keeps its handler (spmd-train's answers within a
    second with 130); it used to wait for the first compile to end, then save and exit 76."""
    with PreemptionWatcher() as watcher:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert not watcher.should_stop(1)  # the first step ran: SIGINT is the watcher's now
        signal.raise_signal(signal.SIGINT)
        assert watcher.reason == "SIGINT" and watcher.should_stop(2)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_while_the_stop_saves_is_answered_not_obeyed(caplog):
    with PreemptionWatcher(defer_sigint=False) as watcher:
        signal.raise_signal(signal.SIGINT)
        assert watcher.should_stop(3)  # agreed: the loop now writes the checkpoint of step 3
        signal.raise_signal(signal.SIGINT)  # warned, the save goes on
        assert "Ctrl-C once more abandons it" in caplog.text
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("kw", [{"check_every": 0}, {"signals": (signal.SIGKILL,)}])
def test_watcher_rejects_bad_arguments(kw):
    with pytest.raises(ValueError, match="check_every|SIGKILL|signal"):
        PreemptionWatcher(**kw)


def test_barrier_validates_and_is_free_on_one_process():
    with pytest.raises(ValueError, match="timeout_s"):
        barrier("x", 0)
    barrier("one-process", 1.0)


# ----------------------------------------------------------------------------- in-process trials
@pytest.mark.slow  # repeated preemptions; the fast tier keeps one signal to a subprocess
def test_sigterm_at_random_steps_resumes_exactly(tmp_path, reference):
    """Four preemptions at random steps of one run (each resume is the next trial); the stitched
    run's losses equal the uninterrupted run's, step for step, bit for bit."""
    run_dir = str(tmp_path / "run")
    stops = sorted(random.Random(0).sample(range(1, STEPS), 4))
    start = 0
    for stop in stops:
        hook = lambda step, stop=stop: signal.raise_signal(signal.SIGTERM) if step == stop else None
        sigint_before = signal.getsignal(signal.SIGINT)
        result = train(tiny_config(run_dir, STEPS), step_hook=hook)
        assert signal.getsignal(signal.SIGINT) == sigint_before  # handlers restored after train()
        assert result.preempted and (result.start_step, result.final_step) == (start, stop)
        assert stop in _checkpoint_steps(run_dir)
        start = stop
    final = train(tiny_config(run_dir, STEPS))
    assert not final.preempted and (final.start_step, final.final_step) == (stops[-1], STEPS)
    resumed = last_train_losses(run_dir)
    assert resumed == reference
    # negative control: the comparison sees a one-ulp change of one loss
    perturbed = dict(resumed)
    perturbed[5] = math.nextafter(resumed[5], math.inf)
    assert perturbed != reference


# ----------------------------------------------------------------------------- real signals, real processes
def _run_worker(run_dir, *args, send=None, at_step=None):
    """Run the worker; with ``send``, signal it once it printed ``STEP at_step``. Returns (rc, output, result)."""
    proc = subprocess.Popen([sys.executable, WORKER, run_dir, str(STEPS), *args], env=worker_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if send is not None and line.strip() == f"STEP {at_step}":
                proc.send_signal(send)
                send = None
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    return proc.returncode, out, results[0] if results else None


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.sweep)], ids=["SIGTERM", "SIGINT"])
def test_signal_to_a_subprocess_exits_zero_with_a_checkpoint(tmp_path, reference, sig):
    run_dir = str(tmp_path / "run")
    at = {signal.SIGTERM: 4, signal.SIGINT: 7}[sig]
    rc, out, result = _run_worker(run_dir, "--sleep", "0.2", send=sig, at_step=at)
    assert rc == 0, out[-3000:]
    assert result["preempted"] and result["final_step"] >= at, out[-3000:]
    stopped = result["final_step"]
    assert f"stopping at step {stopped} ({sig.name})" in out
    assert max(_checkpoint_steps(run_dir)) == stopped
    rc, out, result = _run_worker(run_dir)
    assert rc == 0 and result == {"preempted": False, "final_step": STEPS, "start_step": stopped, "process": 0}, out[-3000:]
    assert last_train_losses(run_dir) == reference


# ----------------------------------------------------------------------------- many processes
@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(tmp_path, reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = str(tmp_path / "run")
    procs = [
        subprocess.Popen([sys.executable, WORKER, run_dir, str(STEPS), "--process-id", str(i), "--num-processes", "2",
                          "--port", str(port), "--devices", "4", "--sleep", "0.1"],
                         env=worker_env(4), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outputs = ["", ""]
    try:
        for line in procs[1].stdout:  # only process 1 gets the signal
            outputs[1] += line
            if line.strip() == "STEP 3":
                procs[1].send_signal(signal.SIGTERM)
        outputs[0] = procs[0].communicate(timeout=180)[0]
        procs[1].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    assert all(r["preempted"] for r in results), results
    stopped = results[0]["final_step"]
    assert results[1]["final_step"] == stopped and 3 <= stopped < STEPS, results
    assert max(_checkpoint_steps(run_dir)) == stopped
    # the agreed checkpoint is consistent: a single-process resume reproduces the reference losses
    final = train(tiny_config(run_dir, STEPS))
    assert final.start_step == stopped
    resumed = last_train_losses(run_dir)
    assert sorted(resumed) == sorted(reference)
    assert [resumed[s] for s in sorted(resumed)] == pytest.approx([reference[s] for s in sorted(reference)], rel=1e-5)
