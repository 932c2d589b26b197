"""``python -m benchmarks.stress_faults --trials 20``: SIGKILL a training run at random moments.

Each trial starts a tiny training run (async checkpoint every step) in a fresh directory,
SIGKILLs it at a random moment after a random step (inside a step, an async save or its commit),
notes whether a save was cut short (an orbax tmp directory left behind), then restarts the same
run to the end. A trial is correct when the restart resumed from a complete checkpoint and
finished bit-equal (SHA-256 of every leaf of the final state) to an uninterrupted run, with the
same per-step losses. Prints one line per trial and a summary; exits 1 if any trial failed.

Runs on simulated CPU devices; each process is ``tests/helpers/fault_worker.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "helpers", "fault_worker.py")
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers.fault_worker import last_train_losses, worker_env  # noqa: E402


def run_worker(run_dir: str, steps: int, *, kill_after: int | None = None, delay: float = 0.0,
               timeout: float = 300.0) -> tuple[int, dict | None, str]:
    """Run one worker to the end, or SIGKILL it ``delay`` s after it printed ``STEP kill_after``."""
    args = [sys.executable, WORKER, run_dir, str(steps)] + ([] if kill_after is not None else ["--digest"])
    proc = subprocess.Popen(args, env=worker_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_after is not None and line.strip() == f"STEP {kill_after}":
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    return proc.returncode, results[0] if results else None, "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stress_faults", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=10, help="steps of each run")
    p.add_argument("--max-delay", type=float, default=0.3, help="longest wait after the chosen step before SIGKILL (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(argv)
    if args.trials < 1 or args.steps < 3 or args.max_delay < 0:
        p.error(f"need --trials >= 1, --steps >= 3, --max-delay >= 0; got {args.trials}, {args.steps}, {args.max_delay}")
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="stress_faults_")
    t0 = time.perf_counter()

    rc, ref, out = run_worker(os.path.join(root, "reference"), args.steps)
    if rc != 0 or ref is None:
        print(f"reference run failed (exit {rc}):\n{out[-3000:]}")
        return 1
    ref_losses = last_train_losses(os.path.join(root, "reference"))

    correct, mid_save, failures = 0, 0, []
    for trial in range(args.trials):
        run_dir = os.path.join(root, f"trial{trial}")
        at, delay = rng.randint(1, args.steps - 1), rng.uniform(0.0, args.max_delay)
        rc, _, out = run_worker(run_dir, args.steps, kill_after=at, delay=delay)
        ckpt_dir = os.path.join(run_dir, "checkpoints")
        leftovers = [d for d in os.listdir(ckpt_dir) if "tmp" in d] if os.path.isdir(ckpt_dir) else []
        committed = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit()) if os.path.isdir(ckpt_dir) else []
        mid_save += bool(leftovers)
        if rc != -signal.SIGKILL:
            failures.append(f"trial {trial}: the run was not killed (exit {rc})")
            continue
        rc, res, out = run_worker(run_dir, args.steps)
        ok = (rc == 0 and res is not None and res["digest"] == ref["digest"] and res["final_step"] == args.steps
              and last_train_losses(run_dir) == ref_losses and (not committed or res["start_step"] == max(committed)))
        correct += ok
        print(f"trial {trial:2d}: killed {delay * 1000:5.0f} ms after step {at:2d}; committed steps {committed[-3:]}, "
              f"partial save left: {'yes' if leftovers else 'no '}; resumed from {res['start_step'] if res else '?'}: "
              f"{'OK' if ok else 'FAILED'}", flush=True)
        if not ok:
            failures.append(f"trial {trial}: exit {rc}, result {res}\n{out[-2000:]}")
    print(f"\n{correct}/{args.trials} trials resumed correctly (bit-equal final state and losses); "
          f"{mid_save} killed during an async save (partial save left behind); {time.perf_counter() - t0:.0f} s")
    for f in failures:
        print(f)
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if correct == args.trials and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
