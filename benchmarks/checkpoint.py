"""Checkpoints: how long a save blocks the training loop, and how fast it reaches the disk.

Two train states on the fsdp_tp layout (data 2 x fsdp 2 x tensor 2), each saved with
``trainers.Checkpointer`` (async, keep 2) into a fresh temporary directory:

- **main**: the main job's state (gpt-small: params + AdamW moments), updated by its own train step;
- **large**: a bigger GPT's state (>= 256 MiB unless ``--quick``) filled with random values, so
  that it compresses no better than a trained state (fresh AdamW moments are zeros), updated by a
  donated elementwise step so that every save sees new buffers.

Interleaved rounds (the order reversed every other round; medians reported), per state:

- **bare copy**: copy every distinct shard of the state to host memory (all transfers started,
  then collected; on CPU a numpy copy, since ``np.asarray`` of a CPU buffer is a view of it): the
  least any save must do before the loop may overwrite the state.
- **save**: ``Checkpointer.save`` timed alone (how long the loop is blocked), then ``wait()``
  until the step is committed; throughput = state bytes / (save + wait).
- **raw disk**: write + ``fsync`` of the same number of random bytes into a new file, then delete
  the file of two rounds before: what a checkpoint with keep 2 does (its new step is written
  before the oldest is deleted, or a crash could leave fewer than ``keep`` steps). Also into one
  file overwritten in place (reported in a note).

Before every timed write (saves and raw writes alike) a scratch file of the same size is written
and deleted, untimed. On this host (a VM whose free memory goes back to the hypervisor), a write
that cannot reuse just-freed page-cache memory spends ~1 s of kernel time per 387 MiB getting it,
at random: without the scratch file, save and raw-write times each jump between two modes ~3x
apart, and which mode a round gets, not the code, decides a ratio.
- **bare orbax**: a default ``orbax.CheckpointManager`` saving the same state with ``StandardSave``
  (blocking time, and until committed): where the numbers stood before the Checkpointer's own path.
- main only: the train step (5 steps per round), the step that follows a ``save()`` and the one
  that follows a default orbax save (background work shares this host's cores with them), and
  ``restore`` of the newest step.

Goals: save() blocks <= 1.5 x the bare copy (both states) and <= 5 % of the main job's step; the
large state's save reaches >= 0.5 x the raw write + fsync of a new file. The bare copy and the
save are timed in pairs (three pairs per round for the small main state). ``--quick``: the tiny model (one block), a
smaller large state (its random values drawn on the host), 1 round of 2 train steps and one pair per round
(a smoke test, not a measurement).

    python -m benchmarks.checkpoint [--quick] [--output PATH]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import Row, fmt_bytes

COPY_GOAL = 1.5  # save() blocking over the bare copy
BLOCK_GOAL = 0.05  # save() blocking over the main job's step
SAVE_GOAL = 0.5  # save throughput over raw write + fsync (large state)
LARGE_MIN_BYTES = 256 * 2**20
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


class BareCopy:
    """Every distinct shard (replica 0) copied to host memory: transfers started, then collected.

    On CPU ``np.asarray`` is a view of the device buffer, so it is copied into host buffers kept
    from one call to the next (fresh memory would add a page fault per 4 KiB to the copy).
    """

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []

    def __call__(self, tree: Any) -> list[np.ndarray]:
        shards = [s.data for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.replica_id == 0]
        for data in shards:
            data.copy_to_host_async()
        if jax.devices()[0].platform != "cpu":
            return [np.asarray(data) for data in shards]  # a fresh host buffer, filled by the transfer
        if len(self.buffers) != len(shards):
            self.buffers = [np.empty(d.shape, d.dtype) for d in shards]
        for buffer, data in zip(self.buffers, shards):
            np.copyto(buffer, np.asarray(data))
        return self.buffers


def large_state(quick: bool) -> tuple[Any, Callable[[Any], Any], str]:
    """(state, donated update, description): a GPT's params + AdamW moments, random values."""
    import optax

    from spmd.models import GPTConfig
    from trainers.setup import build

    cfg = (GPTConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, d_ff=512) if quick else
           GPTConfig(vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048))
    mesh = common.layout_mesh(LAYOUT if len(jax.devices()) >= 8 else "single")
    rules = common.LAYOUTS.get(LAYOUT, ({}, "none"))[1] if len(jax.devices()) >= 8 else "none"
    sharded = build(common.run_config(cfg, rules, 8, 16), mesh=mesh, tx=optax.adamw(1e-3)).sharded
    state = {"params": sharded.state.params, "opt_state": sharded.state.opt_state}
    shardings = jax.tree.map(lambda a: a.sharding, state)

    def randomize(tree):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        return treedef.unflatten([jax.random.normal(k, a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a
                                  for k, a in zip(keys, leaves)])

    if quick:  # random values drawn on the host: no program to compile for a state this small
        rng = np.random.default_rng(0)
        state = jax.tree.map(lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s)
                             if jnp.issubdtype(a.dtype, jnp.floating) else a, state, shardings)
    else:
        state = jax.jit(randomize, out_shardings=shardings)(state)
    update = jax.jit(lambda t: jax.tree.map(lambda a: a * 1.0001 if jnp.issubdtype(a.dtype, jnp.floating) else a + 1, t),
                     out_shardings=shardings, donate_argnums=0)
    return state, update, f"GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}"


def run(options: common.Options, command: str = "python -m benchmarks.checkpoint") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    import orbax.checkpoint as ocp

    from trainers.checkpoint import CheckpointConfig, Checkpointer

    cfg, batch, length = common.gpt_config(options.quick, one_block=True)
    rounds, steps = (1, 2) if options.quick else (9, 5)
    pairs = 1 if options.quick else 3  # bare copy + save pairs per round for the main state
    layout = LAYOUT if len(jax.devices()) >= 8 else "single"
    setup = common.gpt_setup(cfg, common.layout_mesh(layout), common.LAYOUTS.get(layout, ({}, "none"))[1],
                             batch, length)
    large, update, large_desc = large_state(options.quick)
    holder: dict[str, Any] = {"main": setup.state, "large": large}
    abstract = {"params": setup.sharded.abstract.params, "opt_state": setup.sharded.abstract.opt_state}
    nbytes = {"main": sum(x.nbytes for x in jax.tree.leaves(setup.state)),
              "large": sum(x.nbytes for x in jax.tree.leaves(large))}
    root = tempfile.mkdtemp(prefix="spmd-bench-checkpoint-")
    payload = {k: np.random.default_rng(0).bytes(n) for k, n in nbytes.items()}
    t: dict[str, list[float]] = {k: [] for k in (
        "main_copy", "main_device_get", "main_save", "main_wait", "main_orbax", "main_orbax_total", "main_raw",
        "main_raw_inplace", "main_read", "step", "step_after_save", "step_after_orbax", "restore",
        "large_copy", "large_save", "large_wait", "large_orbax", "large_orbax_total", "large_raw", "large_raw_inplace")}
    counter = {"main": 0, "large": 0, "orbax_main": 0, "orbax_large": 0, "raw_main": 0, "raw_large": 0}

    def free_memory(which: str) -> None:
        """Write and delete a scratch file of the state's size: the next write finds free memory."""
        scratch = os.path.join(root, "scratch.bin")
        with open(scratch, "wb") as f:
            f.write(payload[which])
        os.remove(scratch)

    def fresh(which: str) -> dict[str, Any]:
        """New buffers, as after a train step: the main job's step, or the large state's update."""
        if which == "main":
            holder["main"], _ = setup.step(holder["main"], setup.batch)
            params, opt_state = holder["main"]
            state = {"params": params, "opt_state": opt_state}
        else:
            state = holder["large"] = update(holder["large"])
        return jax.block_until_ready(state)

    try:
        ckpt = {k: Checkpointer(os.path.join(root, k), CheckpointConfig(every_steps=1, keep=2, async_save=True))
                for k in ("main", "large")}
        orbax = {k: ocp.CheckpointManager(os.path.join(root, f"orbax-{k}"),
                                          options=ocp.CheckpointManagerOptions(max_to_keep=2))
                 for k in ("main", "large")}

        def train_round() -> float:
            state = holder["main"]
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _ = setup.step(state, setup.batch)
            jax.block_until_ready(state)
            holder["main"] = state
            t["step"].append((time.perf_counter() - t0) / steps)
            return t["step"][-1]

        def save(which: str) -> float:
            state = fresh(which)
            counter[which] += 1
            free_memory(which)
            t0 = time.perf_counter()
            if not ckpt[which].save(counter[which], state, {"round": counter[which]}):
                raise RuntimeError(f"checkpoint step {counter[which]} was not saved")
            t1 = time.perf_counter()
            ckpt[which].wait()
            t[f"{which}_save"].append(t1 - t0)
            t[f"{which}_wait"].append(time.perf_counter() - t1)
            return time.perf_counter() - t0

        def copy_and_save_round(which: str, pairs: int) -> Callable[[], float]:
            bare_copy = BareCopy()

            def timed() -> float:
                for _ in range(pairs):
                    state = fresh(which)
                    t0 = time.perf_counter()
                    bare_copy(state)
                    t[f"{which}_copy"].append(time.perf_counter() - t0)
                    save(which)
                if which == "main":
                    state = fresh(which)
                    t0 = time.perf_counter()
                    jax.device_get(state)
                    t["main_device_get"].append(time.perf_counter() - t0)
                return t[f"{which}_save"][-1]
            return timed

        def step_after_save_round() -> float:
            state = fresh("main")
            counter["main"] += 1
            free_memory("main")
            ckpt["main"].save(counter["main"], state, {"round": counter["main"]})
            t0 = time.perf_counter()
            holder["main"] = jax.block_until_ready(setup.step(holder["main"], setup.batch)[0])
            t["step_after_save"].append(time.perf_counter() - t0)
            ckpt["main"].wait()
            state = fresh("main")  # the same with a default orbax save: its background part only
            counter["orbax_main"] += 1
            free_memory("main")
            orbax["main"].save(counter["orbax_main"], args=ocp.args.StandardSave(state))
            t0 = time.perf_counter()
            holder["main"] = jax.block_until_ready(setup.step(holder["main"], setup.batch)[0])
            t["step_after_orbax"].append(time.perf_counter() - t0)
            orbax["main"].wait_until_finished()
            return t["step_after_save"][-1]

        def orbax_round(which: str) -> Callable[[], float]:  # the library underneath, default options
            def timed() -> float:
                state = fresh(which)
                counter[f"orbax_{which}"] += 1
                free_memory(which)
                t0 = time.perf_counter()
                if not orbax[which].save(counter[f"orbax_{which}"], args=ocp.args.StandardSave(state)):
                    raise RuntimeError(f"orbax did not save step {counter[f'orbax_{which}']}")
                t[f"{which}_orbax"].append(time.perf_counter() - t0)
                orbax[which].wait_until_finished()
                t[f"{which}_orbax_total"].append(time.perf_counter() - t0)
                return t[f"{which}_orbax_total"][-1]
            return timed

        def restore_round() -> float:
            t0 = time.perf_counter()
            restored = ckpt["main"].restore(abstract)
            jax.block_until_ready(restored[1])
            t["restore"].append(time.perf_counter() - t0)
            return t["restore"][-1]

        def disk_round(which: str) -> Callable[[], float]:
            def timed() -> float:
                counter[f"raw_{which}"] += 1
                n = counter[f"raw_{which}"]
                free_memory(which)
                t0 = time.perf_counter()
                disk_write(os.path.join(root, f"raw-{which}-{n}.bin"), payload[which])
                if os.path.exists(old := os.path.join(root, f"raw-{which}-{n - 2}.bin")):
                    os.remove(old)  # keep 2, as the checkpoints
                t[f"{which}_raw"].append(time.perf_counter() - t0)
                inplace = os.path.join(root, f"raw-{which}-inplace.bin")
                free_memory(which)
                t[f"{which}_raw_inplace"].append(disk_write(inplace, payload[which]))
                if which == "main":
                    t["main_read"].append(disk_read(inplace))
                return t[f"{which}_raw"][-1]
            return timed

        rounds_of = {
            "train": train_round, "main copy and save": copy_and_save_round("main", pairs),
            "main step after save": step_after_save_round, "main orbax": orbax_round("main"),
            "main restore": restore_round, "main disk": disk_round("main"),
            "large copy and save": copy_and_save_round("large", 1), "large orbax": orbax_round("large"),
            "large disk": disk_round("large"),
        }
        for fn in rounds_of.values():  # warm-up: compile the steps, start orbax's machinery
            fn()
        for times in t.values():
            times.clear()
        common.interleaved(rounds, rounds_of)
        for manager in (*ckpt.values(), *orbax.values()):
            manager.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items()}
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    mib_s = lambda n, s: f"{n / s / 2**20:.0f} MiB/s"  # noqa: E731
    main_b, large_b = fmt_bytes(nbytes["main"]), fmt_bytes(nbytes["large"])
    save_total = {k: statistics.median([s + w for s, w in zip(t[f"{k}_save"], t[f"{k}_wait"])]) for k in ("main", "large")}
    large_ratio = med["large_raw"] / save_total["large"]
    big_enough = nbytes["large"] >= LARGE_MIN_BYTES
    rows = [
        Row(f"loop blocked by save(), main job state ({main_b})", ms(med["main_save"]),
            f"{ms(med['main_copy'])} bare device-to-host copy of the same state", med["main_save"] / med["main_copy"],
            f"<= {COPY_GOAL}", med["main_save"] / med["main_copy"] <= COPY_GOAL,
            f"save() is that copy plus checks; jax.device_get of the state takes {ms(med['main_device_get'])}; "
            f"a default orbax CheckpointManager.save blocks {ms(med['main_orbax'])}"),
        Row("loop blocked by save() vs the main job's train step", ms(med["main_save"]),
            f"{ms(med['step'])} per train step (same run)", med["main_save"] / med["step"], f"<= {BLOCK_GOAL:.0%}",
            med["main_save"] / med["step"] <= BLOCK_GOAL,
            f"default orbax: {ms(med['main_orbax'])} = {med['main_orbax'] / med['step']:.0%} of a step"),
        Row(f"loop blocked by save(), large state ({large_b})", ms(med["large_save"]),
            f"{ms(med['large_copy'])} bare device-to-host copy of the same state", med["large_save"] / med["large_copy"],
            f"<= {COPY_GOAL}", med["large_save"] / med["large_copy"] <= COPY_GOAL,
            f"a default orbax CheckpointManager.save blocks {ms(med['large_orbax'])}"),
        Row(f"save throughput (save + wait until committed), large state ({large_b})",
            mib_s(nbytes["large"], save_total["large"]),
            f"{mib_s(nbytes['large'], med['large_raw'])} raw write + fsync of the same bytes to a new file, "
            "deleting the file before last", large_ratio, f">= {SAVE_GOAL}", large_ratio >= SAVE_GOAL if big_enough else None,
            f"save {ms(med['large_save'])} + background {ms(med['large_wait'])} (orbax: tensorstore writes with fsync, "
            f"metadata, rename, deleting the step beyond keep=2); the same bytes overwritten in place: "
            f"{mib_s(nbytes['large'], med['large_raw_inplace'])} ({med['large_raw_inplace'] / save_total['large']:.2f}); "
            f"default orbax: {mib_s(nbytes['large'], med['large_orbax_total'])} "
            f"({med['large_raw'] / med['large_orbax_total']:.2f})"
            + ("" if big_enough else f"; quick mode: below {fmt_bytes(LARGE_MIN_BYTES)}, goal not judged")),
        Row(f"save throughput (save + wait until committed), main job state ({main_b})",
            mib_s(nbytes["main"], save_total["main"]),
            f"{mib_s(nbytes['main'], med['main_raw'])} raw write + fsync of the same bytes to a new file, "
            "deleting the file before last", med["main_raw"] / save_total["main"], "reported", None,
            f"save {ms(med['main_save'])} + background {ms(med['main_wait'])}: orbax's fixed cost per save (metadata "
            f"files, directory rename, its threads) dominates at this size; default orbax: "
            f"{mib_s(nbytes['main'], med['main_orbax_total'])}"),
        Row("train step right after save() (main job state)", ms(med["step_after_save"]),
            f"{ms(med['step'])} per train step", med["step_after_save"] / med["step"], "reported", None,
            "the save's background work (orbax's blocking part, tensorstore) shares this host's CPU cores with "
            f"the step; after a default orbax save the step takes {ms(med['step_after_orbax'])} (only tensorstore "
            f"runs beside it; orbax blocked {ms(med['main_orbax'])} before). Loop time lost per save: "
            f"{ms(med['main_save'] + med['step_after_save'] - med['step'])} here vs "
            f"{ms(med['main_orbax'] + med['step_after_orbax'] - med['step'])} with default orbax. On an accelerator "
            "the step runs on the device"),
        Row("restore throughput (newest step onto the same shardings)", mib_s(nbytes["main"], med["restore"]),
            f"{mib_s(nbytes['main'], med['main_read'])} raw read of the same bytes (page cache)",
            med["main_read"] / med["restore"], "reported", None,
            f"restore {ms(med['restore'])} incl. validation of the step's metadata"),
    ]
    before = [f"- main job state: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, params + AdamW moments, {main_b}, "
              f"updated by its train step; large state: {large_desc}, params + AdamW moments, random values, {large_b}, "
              f"updated by a donated elementwise step; layout {layout}; directories under {tempfile.gettempdir()}",
              f"- {rounds} interleaved rounds (order reversed every other round), medians: {steps} train steps; per state: "
              f"bare copy and Checkpointer save + wait in pairs ({pairs} per round for the main state), default orbax "
              "save + wait, raw write + fsync (new file; in place); main state: a step right after save(), restore. "
              "The host (2 cores) is shared with other jobs: single figures are noisy, ratios come from the same rounds",
              "- before every timed write (saves and raw writes alike), a scratch file of the same size is written and "
              "deleted, untimed: on this VM a write that finds no just-freed memory spends ~1 s of kernel time per "
              "387 MiB getting page-cache memory from the hypervisor, at random (see the module docstring)"]
    common.report("checkpoint", "Checkpoints: loop blocking, save and restore throughput", rows, options, command,
                  before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.checkpoint") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
