"""Checkpoints: save and restore throughput vs the disk, and how long a save blocks the loop.

The state is the GPT train state (params + AdamW moments) on the fsdp_tp layout
(data 2 x fsdp 2 x tensor 2), saved with ``trainers.Checkpointer`` (orbax, async) into a fresh
temporary directory. In interleaved rounds:

- **raw disk**: write a file of the same number of bytes and ``fsync`` it (the most the disk
  takes); read it back (likely from the page cache: an upper bound for restore).
- **save**: ``Checkpointer.save`` (timed alone: the time the training loop is blocked) then
  ``wait()`` until the step is committed; throughput = state bytes / (save + wait).
  Goal: >= 0.5 of the raw write bandwidth.
- **blocked fraction**: the time ``save()`` takes to return over one train step's time
  (the minimal step on the same layout, timed in the same rounds). Goal <= 5 %.
  A bare ``orbax.CheckpointManager.save`` of the same state is timed alongside, to tell the
  wrapper's cost from orbax's.
- **restore**: ``Checkpointer.restore`` of the newest step onto the same shardings; reported
  against the raw read bandwidth.

Medians over the rounds. Orbax writes through tensorstore with its own threads, which compete
with the step for the same cores on a CPU host.

    python -m benchmarks.checkpoint [--quick] [--output PATH]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import numpy as np

from benchmarks import common
from benchmarks.common import Row, fmt_bytes

SAVE_GOAL = 0.5
BLOCK_GOAL = 0.05
LAYOUT = "fsdp_tp"


def disk_write(path: str, payload: bytes) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start


def disk_read(path: str) -> float:
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    return time.perf_counter() - start


def run(options: common.Options, command: str = "python -m benchmarks.checkpoint") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    from trainers import CheckpointConfig, Checkpointer

    cfg, batch, length = common.gpt_config(options.quick)
    rounds, steps = (2, 2) if options.quick else (5, 5)
    layout = LAYOUT if len(jax.devices()) >= 8 else "single"
    setup = common.gpt_setup(cfg, common.layout_mesh(layout), common.LAYOUTS.get(layout, ({}, "none"))[1],
                             batch, length)
    holder = {"state": setup.state}
    abstract = {"params": setup.sharded.abstract["params"], "opt_state": setup.sharded.abstract["opt_state"]}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(setup.state))
    payload = np.random.default_rng(0).bytes(nbytes)
    root = tempfile.mkdtemp(prefix="spmd-bench-checkpoint-")
    raw_file = os.path.join(root, "raw.bin")
    saves, waits, restores, reads, writes, step_times, raw_saves = [], [], [], [], [], [], []
    counter = {"step": 0}
    try:
        ckpt = Checkpointer(os.path.join(root, "ckpt"), CheckpointConfig(every_steps=1, keep=2, async_save=True))

        def train_round() -> float:
            state = holder["state"]
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _ = setup.step(state, setup.batch)
            jax.block_until_ready(state)
            holder["state"] = state
            step_times.append((time.perf_counter() - t0) / steps)
            return step_times[-1]

        def save_round() -> float:
            counter["step"] += 1
            params, opt_state = holder["state"]
            t0 = time.perf_counter()
            started_save = ckpt.save(counter["step"], {"params": params, "opt_state": opt_state}, {"round": counter["step"]})
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            if not started_save:
                raise RuntimeError(f"checkpoint step {counter['step']} was not saved")
            saves.append(t1 - t0)
            waits.append(t2 - t1)
            return t2 - t0

        import orbax.checkpoint as ocp

        raw = ocp.CheckpointManager(os.path.join(root, "orbax"), options=ocp.CheckpointManagerOptions(max_to_keep=2))

        def orbax_round() -> float:  # the library underneath, without the Checkpointer's checks
            params, opt_state = holder["state"]
            t0 = time.perf_counter()
            counter["raw"] = counter.get("raw", 0) + 1
            if not raw.save(counter["raw"], args=ocp.args.StandardSave({"params": params, "opt_state": opt_state})):
                raise RuntimeError(f"orbax did not save step {counter['raw']}")
            raw_saves.append(time.perf_counter() - t0)
            raw.wait_until_finished()
            return raw_saves[-1]

        def restore_round() -> float:
            t0 = time.perf_counter()
            restored = ckpt.restore(abstract)
            jax.block_until_ready(restored[1])
            restores.append(time.perf_counter() - t0)
            return restores[-1]

        def disk_round() -> float:
            writes.append(disk_write(raw_file, payload))
            reads.append(disk_read(raw_file))
            return writes[-1]

        train_round()  # warm-up (and compile) the step
        save_round(), orbax_round(), restore_round()  # orbax's first save/restore sets up its machinery
        for lst in (saves, waits, restores, step_times, raw_saves):
            lst.clear()
        common.interleaved(rounds, {"train": train_round, "save": save_round, "orbax": orbax_round,
                                    "restore": restore_round, "disk": disk_round})
        ckpt.close()
        raw.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = statistics.median
    save_total = med([s + w for s, w in zip(saves, waits)])
    save_bw, write_bw = nbytes / save_total, nbytes / med(writes)
    restore_bw, read_bw = nbytes / med(restores), nbytes / med(reads)
    blocked, step_s = med(saves), med(step_times)
    rows = [
        Row("save throughput (save + wait until committed)", f"{save_bw / 2**20:.1f} MiB/s",
            f"{write_bw / 2**20:.1f} MiB/s raw write + fsync of {fmt_bytes(nbytes)}", save_bw / write_bw,
            f">= {SAVE_GOAL}", save_bw / write_bw >= SAVE_GOAL,
            f"save {med(saves) * 1e3:.1f} ms + commit {med(waits) * 1e3:.1f} ms (orbax's background write: "
            "tensorstore data, metadata files, finalising rename)"),
        Row("loop blocked by an async save (save() returning)", f"{blocked * 1e3:.1f} ms",
            f"{step_s * 1e3:.1f} ms per train step", blocked / step_s, f"<= {BLOCK_GOAL:.0%}", blocked / step_s <= BLOCK_GOAL,
            f"a bare orbax CheckpointManager.save of the same state returns in {med(raw_saves) * 1e3:.1f} ms; "
            + (f"the Checkpointer's checks (state validation, listing step directories) add "
               f"{(blocked - med(raw_saves)) * 1e3:.1f} ms" if blocked - med(raw_saves) > 0.1 * med(raw_saves) else
               "the Checkpointer adds nothing beyond the noise: the blocking is orbax's own")),
        Row("restore throughput (newest step onto the same shardings)", f"{restore_bw / 2**20:.1f} MiB/s",
            f"{read_bw / 2**20:.1f} MiB/s raw read of the same bytes (page cache)", restore_bw / read_bw, "reported",
            None, f"restore {med(restores) * 1e3:.1f} ms incl. validation of the step's metadata"),
    ]
    before = [f"- state: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, params + AdamW moments, "
              f"{fmt_bytes(nbytes)} in all, on layout {layout}; directory under {tempfile.gettempdir()}",
              f"- {rounds} interleaved rounds of: {steps} train steps, Checkpointer save + wait, bare orbax save + wait, "
              "restore, raw write + fsync + read"]
    common.report("checkpoint", "Checkpoints: save/restore throughput and loop blocking", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.checkpoint") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
