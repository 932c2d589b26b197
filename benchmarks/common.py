"""What every benchmark shares: devices, the machine description, timing, the GPT step, RESULTS.md.

A benchmark here compares one measured figure with a limit (a theoretical minimum, a hardware
peak or a hand-written baseline) and says whether a goal is met. So every benchmark reports
:class:`Row` s with the same columns (what, measured, limit or baseline, ratio, goal, met, note)
and hands them to :func:`report`, which prints the table and replaces the benchmark's own
section of ``benchmarks/RESULTS.md``. Sections are delimited by ``<!-- begin NAME -->`` /
``<!-- end NAME -->`` comments and kept in :data:`ORDER`; running one benchmark alone rewrites
only its section (and the machine description at the top), never the others.

- :func:`setup_devices`: 8 simulated CPU devices unless ``--real-devices`` (before jax starts).
- :func:`machine`: CPU model, cores, load, devices, GPU, jax and python versions.
- :func:`interleaved`: rounds of several timed functions, alternating their order each round so
  that drift on a shared machine hits all alike.
- :func:`gpt_setup` / :func:`minimal_step`: the reference GPT train step on a layout (``value_and_grad
  -> tx.update -> apply_updates``), which the layout benchmarks compile and inspect.
- :func:`parser` / :class:`Options`: ``--quick``, ``--real-devices``, ``--output``, common to all.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import meshes
import spmd
from spmd.models import GPTConfig, lm_loss
from spmd.units import fmt_bytes  # noqa: F401  (the benchmarks' byte formatter)

SIMULATED_DEVICES = 8
RESULTS = Path(__file__).resolve().with_name("RESULTS.md")
ORDER = ("overhead", "comms", "steptime", "stack", "peer", "memory", "attention", "context", "loss", "remat", "pipeline",
         "moe", "mfu", "checkpoint", "guard", "scaling",
         "local_sgd", "gpu", "gpu_train", "calibration", "packing", "interchange", "decode_gpu", "moe_gpu")
_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")

# name -> (mesh axis sizes, rule preset): the parallel layouts the layout benchmarks compare.
LAYOUTS: dict[str, tuple[dict[str, int], str]] = {
    "dp8": ({"data": 8}, "dp"),
    "fsdp8": ({"fsdp": 8}, "fsdp"),
    "dp2_tp4": ({"data": 2, "tensor": 4}, "dp_tp"),
    "fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Options every benchmark takes: quick mode, real devices, results file (None: do not write)."""

    quick: bool = False
    real_devices: bool = False
    output: Path | None = RESULTS

    def __post_init__(self) -> None:
        for name in ("quick", "real_devices"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Options.{name}={getattr(self, name)!r} must be True or False")
        if self.output is not None and not isinstance(self.output, Path):
            raise ValueError(f"Options.output={self.output!r} must be a pathlib.Path or None")


@dataclasses.dataclass(frozen=True)
class Row:
    """One comparison: a measured figure against its limit or baseline, and the goal for the ratio."""

    what: str
    measured: str
    limit: str
    ratio: float
    goal: str
    met: bool | None  # None: nothing to meet (reported only)
    note: str = ""

    def cells(self) -> list[str]:
        ratio = "-" if math.isnan(self.ratio) else f"{self.ratio:.3f}"
        met = "-" if self.met is None else ("met" if self.met else "NOT met")
        return [self.what, self.measured, self.limit, ratio, self.goal, met, self.note]


HEADERS = ("what", "measured", "limit or baseline", "ratio", "goal", "met", "note")


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="fewer steps and rounds, a smaller model (smoke test)")
    p.add_argument("--real-devices", action="store_true", help="use the devices jax finds instead of 8 simulated CPUs")
    p.add_argument("--output", default=str(RESULTS), help="results file ('' = do not write)")
    return p


def options(args: argparse.Namespace) -> Options:
    return Options(quick=args.quick, real_devices=args.real_devices, output=Path(args.output) if args.output else None)


def run_main(run: Callable[[Options, str], Any], doc: str, command: str, argv: Sequence[str] | None) -> int:
    """A benchmark's ``main``: parse the shared options, run it, echo the command line in RESULTS.md."""
    args = parser(doc.splitlines()[0]).parse_args(argv)
    run(options(args), " ".join([command, *(argv if argv is not None else sys.argv[1:])]))
    return 0


def setup_devices(real_devices: bool) -> None:
    """Simulate CPU devices unless real ones are requested; must run before the backend starts.

    An ``XLA_FLAGS`` device count already set by the caller is kept; otherwise 8.
    """
    if real_devices:
        return
    found = _COUNT_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    meshes.simulate_cpu_devices(int(found.group(1)) if found else SIMULATED_DEVICES)


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            return names[0]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, str]:
    """CPU model, cores, load, jax devices, GPU and versions of this machine."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    gpus = [d for d in devices if d.platform == "gpu"]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return {
        "CPU": cpu_model(),
        "cores": f"{os.cpu_count()} ({usable} usable)",
        "load average (1, 5, 15 min)": load(),
        "devices": f"{len(devices)} x {devices[0].platform} ({', '.join(kinds)})",
        "GPU": f"{len(gpus)} x {gpus[0].device_kind}" if gpus else "none",
        "jax": f"{jax.__version__} (jaxlib {jax.lib.__version__})" if hasattr(jax, "lib") else jax.__version__,
        "python": platform.python_version(),
    }


def interleaved(rounds: int, fns: Mapping[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Run each ``fn`` (one timed round, returns seconds) ``rounds`` times, order reversed every other round."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} must be an integer >= 1")
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(float(fns[name]()))
    return out


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of ``fn`` takes, its result blocked on."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rows_table(rows: Sequence[Row]) -> str:
    return markdown_table(HEADERS, [row.cells() for row in rows])


# ------------------------------------------------------------------------------------ RESULTS.md
_SECTION = re.compile(r"<!-- begin (\w+) -->\n(.*?)<!-- end \1 -->\n?", re.S)


def read_sections(path: Path) -> dict[str, str]:
    """{benchmark name: its section's text} of an existing results file (empty if none)."""
    if not path.exists():
        return {}
    return {m.group(1): m.group(2) for m in _SECTION.finditer(path.read_text())}


def write_section(path: Path, name: str, body: str, info: Mapping[str, str]) -> None:
    """Replace (or add) section ``name`` of the results file; keep every other section as it was."""
    if not re.fullmatch(r"\w+", name):
        raise ValueError(f"section name {name!r} must be letters, digits or '_'")
    sections = read_sections(path)
    sections[name] = body.rstrip("\n") + "\n"
    names = [n for n in ORDER if n in sections] + sorted(n for n in sections if n not in ORDER)
    text = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks` (all) or `python -m benchmarks.NAME` (one section); do not edit by hand.",
        "Each section is replaced only by its own benchmark and says when and where it ran.",
        "",
        "## Machine of the latest run",
        "",
        *[f"- {key}: {value}" for key, value in info.items()],
        "",
    ]
    for n in names:
        text += [f"<!-- begin {n} -->", sections[n].rstrip("\n"), f"<!-- end {n} -->", ""]
    path.write_text("\n".join(text))


def report_gpu(name: str, title: str, rows: Callable[[bool], list[Row]], options: Options, command: str,
               before: Callable[[], list[str]]) -> list[Row]:
    """A one-GPU benchmark's section: ``rows(quick)`` when a GPU is present, else "no GPU: skipped"."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        print("no GPU: skipped")
        report(name, title, [], options, command, after=["no GPU: skipped"])
        return []
    result = rows(options.quick)
    report(name, title, result, options, command, before=before())
    return result


def report(name: str, title: str, rows: Sequence[Row], options: Options, command: str, *,
           before: Sequence[str] = (), after: Sequence[str] = (), info: Mapping[str, str] | None = None,
           started_load: str | None = None) -> str:
    """Print the rows as a table and write them as section ``name`` of the results file."""
    info = dict(info or machine())
    table = rows_table(rows) if rows else ""
    print(table, flush=True)
    for line in after:
        print(line)
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}"
    where = f"{info['devices']}, CPU {info['CPU']}, GPU {info['GPU']}, jax {info['jax']}"
    body = [
        f"## {title}",
        "",
        f"Run {when} with `{command}`{' (quick mode)' if options.quick else ''} on {where}; "
        f"load average at start {started_load or info['load average (1, 5, 15 min)']}, at end {load()}.",
        "",
        *before,
        *([""] if before else []),
        *([table, ""] if table else []),
        *after,
    ]
    if options.output is not None:
        write_section(options.output, name, "\n".join(body), info)
        print(f"wrote section {name!r} of {options.output}")
    return "\n".join(body)


# ------------------------------------------------------------------------------------ GPT step
def gpt_config(quick: bool, *, one_block: bool = False) -> tuple[GPTConfig, int, int]:
    """(model, global batch, sequence length): the gpt-small recipe's shape, or a tiny one when quick
    (``one_block``: with one block instead of two; the CPU backend unrolls short stacks, so a step's
    compile time follows the depth: a benchmark's ``--quick`` smoke run asks for it)."""
    if quick:
        return GPTConfig(vocab_size=256, d_model=64, n_layers=1 if one_block else 2, n_heads=8, n_kv_heads=4,
                         d_ff=128), 8, 16
    return GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512), 16, 128


def run_config(model: GPTConfig, rules: str, batch: int, length: int, *sets: str) -> Any:
    """The gpt-small recipe's run ``Config`` with this model, rule set, batch and length (and ``sets``):
    what :func:`trainers.setup.build` assembles the run's own step from (on the synthetic corpus: the benchmarks
    feed their own batches)."""
    from trainers import override, recipe

    cfg = override(recipe("gpt-small", tiny=True), [f"rules={rules}", "data.corpus=synthetic", f"data.global_batch={batch}",
                                                     f"data.seq_len={length}", f"data.vocab_size={model.vocab_size}",
                                                     *sets])
    return dataclasses.replace(cfg, model=model)


def layout_mesh(name: str) -> jax.sharding.Mesh:
    """The mesh of a :data:`LAYOUTS` entry (or ``"single"``: one device)."""
    if name == "single":
        return meshes.single_device_mesh()
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; valid: single, {', '.join(LAYOUTS)}")
    return meshes.make_mesh(LAYOUTS[name][0])


def minimal_step(sharded: Any, tx: optax.GradientTransformation, rules: spmd.Rules, mesh: jax.sharding.Mesh,
                 batch_sharding: jax.sharding.NamedSharding, *, donate: bool = True, pipeline: Any = None) -> Callable:
    """``step((params, opt_state), batch) -> ((params, opt_state), loss)``: the least a step can do.

    ``pipeline``: an ``spmd.pipeline.PipelineConfig``; the loss then runs through ``GPT.loss``.
    """
    graphdef = sharded.graphdef
    state_shardings = (sharded.shardings.params, sharded.shardings.opt_state)

    def loss_of(params, batch):
        model = nnx.merge(graphdef, params)
        if pipeline is not None:
            return model.loss(batch["inputs"], batch["targets"], pipeline=pipeline)[0]
        return lm_loss(model(batch["inputs"]), batch["targets"])[0]

    def step(state, batch):
        params, opt_state = state
        with spmd.use_rules(rules, mesh):
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(
        step,
        in_shardings=(state_shardings, {"inputs": batch_sharding, "targets": batch_sharding}),
        out_shardings=(state_shardings, spmd.sharding.replicated(mesh)),
        donate_argnums=(0,) if donate else (),
    )


def make_batch(vocab: int, batch: int, length: int, sharding: jax.sharding.NamedSharding,
               seed: int = 0) -> dict[str, jax.Array]:
    """One fixed global batch of random tokens, ``inputs``/``targets`` ``[batch, length]``."""
    tokens = np.random.default_rng(seed).integers(0, vocab, size=(batch, length + 1), dtype=np.int32)
    return {"inputs": jax.device_put(tokens[:, :-1], sharding), "targets": jax.device_put(tokens[:, 1:], sharding)}


@dataclasses.dataclass
class GPTSetup:
    """A GPT train state on a layout and its minimal step, compiled."""

    cfg: GPTConfig
    mesh: jax.sharding.Mesh
    rules: spmd.Rules
    sharded: Any  # trainers.state.ShardedState (its leaves ShapeDtypeStructs when set up abstract)
    batch: dict[str, jax.Array]
    step: Callable
    compiled: Any
    compile_s: float  # wall seconds of lower + compile
    compile_cpu_s: float  # CPU seconds of this process (all threads) for the same: less sensitive to load
    abstract: bool = False  # set up abstract: ``state`` is shapes, dtypes and shardings only

    @property
    def state(self) -> tuple[Any, Any]:
        state = self.sharded.abstract if self.abstract else self.sharded.state
        return state.params, state.opt_state


def gpt_setup(cfg: GPTConfig, mesh: jax.sharding.Mesh, rules: str, batch: int, length: int, *,
              tx: optax.GradientTransformation | None = None, donate: bool = True, pipeline: Any = None,
              abstract: bool = False) -> GPTSetup:
    """Create the sharded state (f32 AdamW) with :func:`trainers.setup.build`, the batch and the compiled
    minimal step for one layout. ``abstract``: the state as shapes and shardings only (``build(abstract=True)``,
    no init program compiled or run), for the quick mode of a benchmark that only compiles the step."""
    from trainers.setup import build  # trainers sits above spmd; only the benchmarks join them

    tx = tx or optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    run_cfg = run_config(cfg, rules, batch, length)
    if pipeline is not None:
        run_cfg = dataclasses.replace(run_cfg, pipeline=pipeline)
    run = build(run_cfg, mesh=mesh, tx=tx, donate=donate, abstract=abstract)  # the state in the pipeline's layer order
    sharded = run.sharded
    batch_sharding = spmd.batch_sharding(run.rules, mesh)
    data = make_batch(cfg.vocab_size, batch, length, batch_sharding)
    step = minimal_step(sharded, tx, run.rules, mesh, batch_sharding, donate=donate, pipeline=pipeline)
    shapes = (sharded.abstract.params, sharded.abstract.opt_state)
    start, cpu = time.perf_counter(), time.process_time()
    compiled = step.lower(shapes, data).compile()
    return GPTSetup(cfg, mesh, run.rules, sharded, data, step, compiled, time.perf_counter() - start,
                    time.process_time() - cpu, abstract)
