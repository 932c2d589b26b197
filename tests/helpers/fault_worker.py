"""A training process to interrupt: ``python tests/fault_worker.py RUN_DIR STEPS [options]``.

Used by the fault, preemption and stress tests: it runs ``train()`` on the tiny config that every
fault test shares (one compiled step, so the persistent compile cache hits), prints ``STEP n``
after each step is dispatched (a parent waits for a step, then sends SIGTERM or SIGKILL), and
prints one ``RESULT {json}`` line when ``train()`` returns.

Options:
    --sigterm-at N        send itself SIGTERM right after step N (a preemption at a chosen step)
    --sleep S             sleep S seconds after each step (widens the window for a parent's signal)
    --set KEY=VALUE       extra config overrides (repeatable)
    --process-id I --num-processes P --port PORT
                          start ``jax.distributed`` as process I of P (coordinator on 127.0.0.1:PORT)
    --devices D           simulated CPU devices of this process (default 8)
    --digest              add a SHA-256 of the final state to the RESULT line
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("SPMD_TEST_COMPILE_CACHE", os.path.join(REPO, ".jax_cache"))  # conftest sets it

# The one tiny run every fault test uses: 8 devices (data x fsdp x tensor), a 37k-parameter GPT,
# checkpoints every step, kept long enough that every step a test looks at is still on disk.
TINY = (
    "run.progress=false", "run.tensorboard=false", "run.eval_batches=0", "run.log_every=1",
    "lr.kind=constant", "lr.warmup_steps=0", "run.spike_window=3", "run.spike_factor=10",
    "checkpoint.every_steps=1", "checkpoint.keep=50", "checkpoint.async_save=true",
)


def tiny_config(run_dir: str, steps: int, *sets: str):
    """The shared tiny config writing to ``run_dir`` for ``steps`` steps (``sets`` override it)."""
    from trainers.config import override
    from trainers.recipes import recipe

    return override(recipe("gpt-small", tiny=True),
                    [f"run.run_dir={run_dir}", f"run.steps={steps}", *TINY, *sets])


def worker_env(devices: int = 8) -> dict[str, str]:
    """Environment for a worker subprocess: CPU devices, the repo importable, the shared compile cache."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = xla_flags(devices)
    return env


def xla_flags(devices: int) -> str:
    """XLA_FLAGS with ``devices`` CPU devices, keeping the others set (the test setup's optimisation level)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def default_signals() -> None:
    """``preexec_fn`` of a child a test signals: SIGINT and SIGTERM at their defaults, whatever the
    suite inherited (a suite started in the background has SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def kill_at_line(proc, marker: str, delay=lambda: 0.0) -> str:
    """Read ``proc``'s output until the line ``marker``, wait ``delay()`` s, SIGKILL it; its output so far.
    Asserts it died of the SIGKILL (not earlier, of something else)."""
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == marker:
                time.sleep(delay())
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    return "".join(seen)


def last_train_losses(run_dir: str) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (re-run after a crash) keeps its last value."""
    losses = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec["split"] == "train":
                losses[rec["step"]] = rec["loss"]
    return losses


def state_digest(state) -> str:
    """SHA-256 over every leaf's dtype, shape and bytes: equal digests mean bit-equal states."""
    import hashlib

    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(state)):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--sigterm-at", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--set", dest="sets", action="append", default=[])
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--digest", action="store_true", help="report a SHA-256 of the final state (one process only)")
    args = p.parse_args(argv)

    os.environ["XLA_FLAGS"] = xla_flags(args.devices)
    import jax

    if args.num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                                   process_id=args.process_id)
    jax.config.update("jax_compilation_cache_dir", CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from trainers.loop import train

    def step_hook(step: int) -> None:
        print(f"STEP {step}", flush=True)
        if step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if args.sleep:
            time.sleep(args.sleep)

    result = train(tiny_config(args.run_dir, args.steps, *args.sets), step_hook=step_hook, keep_state=args.digest)
    report = {"preempted": result.preempted, "final_step": result.final_step, "start_step": result.start_step,
              "process": jax.process_index()}
    if args.digest:
        report["digest"] = state_digest(result.state)
    print("RESULT " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
