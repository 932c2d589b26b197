"""Step time against the base commit: the comms layouts' minimal GPT step, new code vs old, same run.

For each layout of ``common.LAYOUTS`` the minimal train step (``common.gpt_setup``) is compiled by
this checkout and by the code at :data:`BASE` (a ``git worktree`` in a temporary directory, run in
a subprocess started with ``sys.executable``). Both warm up, then time ``steps`` steps per round
in interleaved rounds (this process, then the old one, order reversed every other round; only
one runs at a time). ratio = median new / median old per layout, goal <= 1.05. Without git or the
base commit the rows say so (quick mode: skipped).

    python -m benchmarks.steptime [--quick] [--output PATH]
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from benchmarks import common
from benchmarks.common import Row

BASE = "7efef23329355d55483799eeae0f7c4a7a07d30c"
GOAL = 1.05
REPO = Path(__file__).resolve().parent.parent
# The old code's side: build the layout's step, then time `steps` steps per line read from stdin.
CHILD = """
import sys, time
from benchmarks import common
common.setup_devices(False)
import jax
name, quick = sys.argv[1], sys.argv[2] == "1"
cfg, batch, length = common.gpt_config(quick)
s = common.gpt_setup(cfg, common.layout_mesh(name), common.LAYOUTS[name][1], batch, length)
state = s.state
state, _ = s.step(state, s.batch); jax.block_until_ready(state)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter()
    for _ in range(n):
        state, _ = s.step(state, s.batch)
    jax.block_until_ready(state)
    print((time.perf_counter() - t0) / n, flush=True)
"""


def base_worktree(path: Path) -> str:
    """Check out :data:`BASE` at ``path`` (``git worktree add``; the main checkout is untouched); '' or why not."""
    if shutil.which("git") is None:
        return "git is not available"
    if (path / "benchmarks" / "common.py").exists():
        return ""
    out = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), BASE],
                         capture_output=True, text=True)
    return "" if out.returncode == 0 else f"git worktree add failed: {out.stderr.strip()[:200]}"


class OldStep:
    """The base commit's step for one layout, in a subprocess; ``round(n)`` returns seconds per step."""

    def __init__(self, base: Path, name: str, quick: bool):
        env = {**__import__("os").environ, "PYTHONPATH": str(base)}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, name, "1" if quick else "0"], cwd=base, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the base commit's step for {name} did not start: {line!r}")

    def round(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def layout_row(name: str, base: Path, quick: bool, rounds: int, steps: int) -> Row:
    cfg, batch, length = common.gpt_config(quick)
    setup = common.gpt_setup(cfg, common.layout_mesh(name), common.LAYOUTS[name][1], batch, length)
    holder = {"state": setup.state}

    def new_round() -> float:
        t0 = time.perf_counter()
        state = holder["state"]
        for _ in range(steps):
            state, _ = setup.step(state, setup.batch)
        jax.block_until_ready(state)
        holder["state"] = state
        return (time.perf_counter() - t0) / steps

    new_round()  # warm up
    old = OldStep(base, name, quick)
    try:
        times = common.interleaved(rounds, {"new": new_round, "old": lambda: old.round(steps)})
    finally:
        old.close()
    new, prev = statistics.median(times["new"]), statistics.median(times["old"])
    ratios = [a / b for a, b in zip(times["new"], times["old"])]
    return Row(f"{name}: minimal step time (new / base)", f"{new * 1e3:.2f} ms", f"{prev * 1e3:.2f} ms at {BASE[:7]}",
               new / prev, f"<= {GOAL}", new / prev <= GOAL,
               f"{rounds} interleaved rounds x {steps} steps; per-round ratios {min(ratios):.3f}-{max(ratios):.3f}")


def run(options: common.Options, command: str = "python -m benchmarks.steptime") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    rounds, steps = (2, 2) if options.quick else (7, 10)
    rows: list[Row] = []
    after: list[str] = []
    with tempfile.TemporaryDirectory(prefix="spmd-base-") as tmp:
        base = Path(tmp) / "base"
        why = base_worktree(base)
        names = list(common.LAYOUTS)[:1] if options.quick else list(common.LAYOUTS)
        if why:
            rows = [Row(f"{n}: minimal step time (new / base)", "-", "-", float("nan"), f"<= {GOAL}",
                        None if options.quick else False, f"skipped: {why}") for n in names]
        else:
            try:
                for name in names:
                    rows.append(layout_row(name, base, options.quick, rounds, steps))
                    print(f"{name}: ratio {rows[-1].ratio:.3f}", flush=True)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
    cfg, batch, length = common.gpt_config(options.quick)
    before = [f"- the comms layouts' minimal step (value_and_grad -> AdamW -> apply, f32), GPT d_model={cfg.d_model}, "
              f"n_layers={cfg.n_layers}, batch {batch} x {length}; base = commit {BASE[:10]} in a git worktree, "
              "run in a subprocess; median seconds per step"]
    common.report("steptime", "Step time: this code vs the base commit", rows, options, command, before=before,
                  after=after, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.steptime") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
