"""Trainer overhead: the train step of ``trainers.build`` against a minimal hand-written ``jax.jit`` step.

The trainer's step does more than a training step strictly needs: a pre-clip global gradient
norm for logging, a NaN/Inf guard (``jnp.where`` on every parameter and optimizer-state leaf),
counters, an RNG split and the LR metric. This benchmark measures what that costs per step.

For each layout

- 1 device: ``meshes.single_device_mesh()``, rules "none";
- N devices: the recipe's mesh (gpt-small: ``data=2,fsdp=2,tensor=2``) and rules (``fsdp_tp``),

it builds, from the same recipe (model, optimizer, schedule) and the same global batch,

- **trainer**: ``trainers.build(cfg).train_step``, the step the training loop runs;
- **minimal**: ``jax.jit(value_and_grad(loss) -> tx.update -> optax.apply_updates)`` with the same
  in/out shardings for params and optimizer state, the state donated, the same activation rules,
  and only the loss returned (no guard, no norm, no counters, no metrics).

Both are compiled and warmed up, then timed in interleaved rounds (``rounds`` x ``steps`` steps;
the order A/B alternates each round so that drift on a shared machine hits both alike;
``block_until_ready`` ends each round). Reported: the median per-step time of each, the ratio
trainer/minimal and whether it meets the goal (<= 1.03), plus the range of the per-round ratios
as a noise gauge, XLA's own cost model of the two compiled steps (flops and bytes accessed per
device, trainer/minimal), which does not depend on machine load, and the largest parameter
difference after both ran the same steps (0 here: the baseline computes the same thing). The
table goes to the console and to ``benchmarks/RESULTS.md``.

Devices: by default the run simulates 8 CPU devices (set before the backend starts, as the
tests do). ``--real-devices`` uses whatever devices jax finds (GPU, TPU); a layout needing more
devices than exist is skipped and reported as such.

    python -m benchmarks.overhead [--quick] [--real-devices] [--rounds 5] [--steps 10] [--output PATH]

``--quick`` uses the recipe's tiny variant, the N-device layout only and 2 rounds x 2 steps (a smoke test,
not a measurement).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

import meshes
from benchmarks import common
from benchmarks.common import RESULTS, minimal_step, setup_devices
from trainers import Config, recipe
from trainers.setup import build

GOAL = 1.03


@dataclasses.dataclass(frozen=True)
class Settings:
    """What to run: recipe, timing rounds x steps per round, warm-up steps, devices, output file."""

    recipe: str = "gpt-small"
    rounds: int = 5
    steps: int = 10
    warmup: int = 2
    real_devices: bool = False
    output: Path | None = RESULTS
    quick: bool = False

    def __post_init__(self) -> None:
        for name, low in (("rounds", 1), ("steps", 1), ("warmup", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Settings.{name}={value!r} must be an integer >= {low}")


@dataclasses.dataclass(frozen=True)
class Row:
    """One layout's result: median seconds per step of each step function, per-round ratios."""

    what: str
    devices: int
    trainer_s: float
    minimal_s: float
    round_ratios: tuple[float, ...]
    flops_ratio: float
    bytes_ratio: float
    max_param_diff: float

    @property
    def ratio(self) -> float:
        return self.trainer_s / self.minimal_s

    @property
    def met(self) -> bool:
        return self.ratio <= GOAL


def make_batch(cfg: Config, sharding: jax.sharding.NamedSharding, seed: int = 0) -> dict[str, jax.Array]:
    """One fixed global batch of random tokens, ``inputs``/``targets`` ``[global_batch, seq_len]``."""
    rng = np.random.default_rng(seed)
    shape = (cfg.data.global_batch, cfg.data.seq_len + 1)
    tokens = rng.integers(0, cfg.data.vocab_size, size=shape, dtype=np.int32)
    return {"inputs": jax.device_put(tokens[:, :-1], sharding), "targets": jax.device_put(tokens[:, 1:], sharding)}


def _time_round(step: Callable, state: Any, batch: dict[str, jax.Array], steps: int) -> tuple[Any, float]:
    start = time.perf_counter()
    for _ in range(steps):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return state, (time.perf_counter() - start) / steps


def measure(what: str, cfg: Config, mesh: jax.sharding.Mesh, rules_name: str, settings: Settings) -> Row:
    """Build both steps for this mesh and rule set, warm them up, time them interleaved."""
    run_cfg = dataclasses.replace(cfg, rules=rules_name)
    run = build(run_cfg, mesh=mesh)  # the run's own step (trainers.setup)
    rules, tx = run.rules, run.tx

    sharded, batch_sharding = run.stepped, run.batch_sharding
    batch = make_batch(cfg, batch_sharding)
    trainer = run.train_step
    trainer_state: Any = sharded.state

    twin = build(run_cfg, mesh=mesh, tx=tx).sharded  # the same state again: the trainer's is donated
    minimal = minimal_step(twin, tx, rules, mesh, batch_sharding)
    minimal_state: Any = (twin.state.params, twin.state.opt_state)

    # Compile (ahead of time: the jit cache keeps the executables, and XLA's cost model compares
    # what each step computes and moves, a noise-free complement to the timings), then warm up.
    trainer_cost = trainer.lower(sharded.abstract, batch).compile().cost_analysis()
    minimal_cost = minimal.lower((twin.abstract.params, twin.abstract.opt_state), batch).compile().cost_analysis()
    trainer_state, _ = _time_round(trainer, trainer_state, batch, 1 + settings.warmup)
    minimal_state, _ = _time_round(minimal, minimal_state, batch, 1 + settings.warmup)

    holder = {"trainer": trainer_state, "minimal": minimal_state}

    def timer(name: str, step: Callable) -> Callable[[], float]:
        def one_round() -> float:
            holder[name], t = _time_round(step, holder[name], batch, settings.steps)
            return t
        return one_round

    times = common.interleaved(settings.rounds, {"trainer": timer("trainer", trainer), "minimal": timer("minimal", minimal)})
    trainer_times, minimal_times = times["trainer"], times["minimal"]
    trainer_state, minimal_state = holder["trainer"], holder["minimal"]
    ratios = tuple(a / b for a, b in zip(trainer_times, minimal_times))
    # Both took the same steps from the same state on the same batch: the params must agree, or
    # the baseline is not the same computation.
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         trainer_state.params, minimal_state[0])
    return Row(what, mesh.size, statistics.median(trainer_times), statistics.median(minimal_times), ratios,
               _cost_ratio(trainer_cost, minimal_cost, "flops"), _cost_ratio(trainer_cost, minimal_cost, "bytes accessed"),
               max(jax.tree.leaves(diffs)))


def _cost_ratio(a: Any, b: Any, key: str) -> float:
    """``a[key] / b[key]`` from two ``cost_analysis()`` dicts (per device); NaN where a backend has none."""
    a, b = (x[0] if isinstance(x, (list, tuple)) and x else x for x in (a, b))  # older jax: one dict per program
    if not a or not b or not b.get(key):
        return math.nan
    return float(a.get(key, math.nan)) / float(b[key])


def layouts(cfg: Config) -> list[tuple[str, Callable[[], jax.sharding.Mesh] | None, str, str]]:
    """(what, mesh factory or None if the devices do not suffice, rules, skip reason)."""
    spec = cfg.mesh.spec
    sizes = [size for _, size in spec.ici]
    devices = jax.devices()
    need = math.prod(sizes) if -1 not in sizes else len(devices)
    out: list[tuple[str, Callable[[], jax.sharding.Mesh] | None, str, str]] = [
        ("1 device, rules none", lambda: meshes.single_device_mesh(), "none", ""),
    ]
    what = f"{need} devices, {spec}, rules {cfg.rules}"
    if need <= len(devices) and need > 1:
        out.append((what, lambda: cfg.mesh.build(devices[:need]),
                    cfg.rules, ""))
    else:
        out.append((what, None, cfg.rules, f"needs {need} devices, {len(devices)} present"))
    return out


def rows_of(rows: Sequence[Row], skipped: Sequence[tuple[str, str]]) -> list[common.Row]:
    """The common results rows: trainer vs minimal per layout, the noise and XLA's cost model in the note."""
    out = []
    for row in rows:
        out.append(common.Row(
            row.what, f"{row.trainer_s * 1e3:.2f} ms/step (trainer)", f"{row.minimal_s * 1e3:.2f} ms/step (minimal jit)",
            row.ratio, f"<= {GOAL}", row.met,
            f"per-round ratios {min(row.round_ratios):.3f}-{max(row.round_ratios):.3f}; XLA flops ratio "
            f"{row.flops_ratio:.3f}, bytes ratio {row.bytes_ratio:.3f}; max param diff {row.max_param_diff:.1e}"))
    for what, reason in skipped:
        out.append(common.Row(what, "-", "-", math.nan, f"<= {GOAL}", None, f"skipped: {reason}"))
    return out


def run(settings: Settings, command: str = "python -m benchmarks.overhead") -> list[Row]:
    """Measure every layout; print the table; write ``settings.output`` unless it is None."""
    setup_devices(settings.real_devices)
    started = common.load()
    cfg = recipe(settings.recipe, tiny=settings.quick)
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []
    # quick (the test suite's smoke run): the recipe's own layout only; 1 device runs the same code on another mesh
    for what, make_mesh, rules_name, reason in layouts(cfg)[1 if settings.quick else 0:]:
        if make_mesh is None:
            print(f"{what}: skipped ({reason})", flush=True)
            skipped.append((what, reason))
            continue
        start = time.perf_counter()
        row = measure(what, cfg, make_mesh(), rules_name, settings)
        rows.append(row)
        print(f"{what}: trainer {row.trainer_s * 1e3:.2f} ms, minimal {row.minimal_s * 1e3:.2f} ms, "
              f"ratio {row.ratio:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model = cfg.model
    before = [
        f"- recipe {settings.recipe}: GPT d_model={model.d_model}, n_layers={model.n_layers}, n_heads={model.n_heads}, "
        f"d_ff={model.d_ff}, vocab={model.vocab_size}, {model.dtype}; {cfg.optimizer.name}, clip {cfg.optimizer.clip_norm}, "
        f"{cfg.lr.kind} schedule; batch {cfg.data.global_batch} x {cfg.data.seq_len} tokens",
        f"- timing: {settings.rounds} interleaved rounds x {settings.steps} steps each, after compile + "
        f"{settings.warmup} warm-up steps; median per-step time",
    ]
    after = [
        "minimal = `jax.jit(value_and_grad(loss) -> tx.update -> optax.apply_updates)` with the trainer's "
        "shardings and donation, returning only the loss. ratio = trainer / minimal (medians); per-round "
        "ratios show the timing noise. XLA flops/bytes ratios: trainer / minimal from the compiled steps' "
        "`cost_analysis()` (per device), independent of machine load. max param diff: largest |trainer - minimal| "
        "parameter after both ran the same steps (shows the baseline computes the same thing).",
    ]
    options = common.Options(quick=settings.quick, real_devices=settings.real_devices, output=settings.output)
    common.report("overhead", "Trainer overhead: `build(...).train_step` vs a minimal `jax.jit` step", rows_of(rows, skipped),
                  options, command, before=before, after=after, started_load=started)
    return rows


def parser() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt-small", help="recipe whose model, optimizer and mesh to use")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; quick 2)")
    p.add_argument("--steps", type=int, default=None, help="steps per round (default 10; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after compiling (default 2; quick 1)")
    return p


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.overhead") -> int:
    args = parser().parse_args(argv)
    quick = {"rounds": 2, "steps": 2, "warmup": 1} if args.quick else {}
    chosen = {k: getattr(args, k) for k in ("rounds", "steps", "warmup") if getattr(args, k) is not None}
    opts = common.options(args)
    settings = Settings(recipe=args.recipe, real_devices=opts.real_devices, output=opts.output, quick=opts.quick,
                        **{**quick, **chosen})
    run(settings, command=" ".join([command, *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
