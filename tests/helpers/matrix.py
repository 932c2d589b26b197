"""The cross-feature matrix as data: factors, an all-pairs design over them, and one cell's run against one device.

Each cell is a tiny training run (``trainers.train`` through the same config keys a user sets) on 8
simulated devices. It passes when it equals the same run on one device (the loss of every step and the
final parameters, relative to the update they took: 1e-5 in f32, 1e-3 / 2e-2 in bf16), or when it is
refused before compiling with a message that names both features. ``python tests/helpers/matrix.py``
runs every cell and writes the table in docs/compose.md; tests/trainers/test_compose.py checks the design's
coverage and runs the cells.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import sys
import tempfile

LAYOUTS = {  # name -> overrides: mesh, rules and what the layout turns on
    "dp": ["mesh.axes=data=8", "rules=dp"],
    "fsdp": ["mesh.axes=fsdp=8", "rules=fsdp"],
    "tp_sp": ["mesh.axes=data=2,tensor=4", "rules=dp_tp_sp"],
    "seq_ring": ["mesh.axes=data=2,seq=2,tensor=2", "rules=dp_tp", "model.context_exchange=ring"],
    "seq_allgather": ["mesh.axes=data=2,seq=2,tensor=2", "rules=dp_tp", "model.context_exchange=allgather"],
    "expert": ["mesh.axes=data=2,expert=2,tensor=2", "rules=fsdp_tp_ep"],
    "pipe_1f1b": ["mesh.axes=data=2,pipe=2,tensor=2", "rules=dp_tp", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
    "pipe_zb": ["mesh.axes=data=2,pipe=2,tensor=2", "rules=dp_tp", "pipeline.schedule=zb-h1", "pipeline.microbatches=2"],
    "pipe_seq": ["mesh.axes=data=2,seq=2,pipe=2", "rules=dp_tp", "pipeline.schedule=interleaved",
                 "pipeline.virtual_stages=2", "pipeline.microbatches=2"],
    "pipe_expert": ["mesh.axes=expert=2,seq=2,pipe=2", "rules=dp_ep", "pipeline.schedule=1f1b", "pipeline.microbatches=2"],
    "expert_seq": ["mesh.axes=expert=2,seq=2,tensor=2", "rules=fsdp_tp_ep"],
}
FACTORS: dict[str, tuple] = {
    "layout": tuple(LAYOUTS),
    "model": ("gpt", "moe", "user"),  # user: a Task with BatchNorm and dropout (tests/helpers/byom_task.py)
    "length": ("short", "blockwise"),  # blockwise: seq_len 32 > model.attention_block 8
    "grad_accum": (1, 2),
    "fsdp_gather": ("per_microbatch", "per_step"),
    "remat": ("none", "full"),
    "dtype": ("float32", "bfloat16"),
    "loss_chunk": (0, 8),
    "local_sgd": (0, 1),  # H = 1 with a plain outer step (outer lr 1, no momentum): equals data parallelism
    "resume": ("no", "other_mesh"),  # one step here, the next resumed on data=2 x fsdp=2 x tensor=2
}
GPT_ONLY = {"length": "short", "dtype": "float32", "loss_chunk": 0}  # the user task has no such settings
RESUME_MESH = ["mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp", "pipeline.schedule=none"]
STEPS = 2
# (loss, parameter update). bf16: the weight-gradient dots round their per-device, per-microbatch partial sums
# to bf16 before the f32 reduction, and partials cancel: 8 devices x 2 microbatches measured 1.1e-2 (docs/compose.md)
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1e-3, 2e-2)}
# bf16 MoE: a layout's other rounding can flip the top-k choice of a nearly tied token, and a flipped token
# takes another expert's gradient: measured 2.1e-2 and 5.8e-2 (the same cells in f32: 3.8e-6)
MOE_BF16_UPDATE = 1e-1
# local SGD at H = 1 equals data parallelism in exact arithmetic, but the outer step averages the groups'
# parameters (p - lr g), not their gradients: f32 rounding of p, 1e-7 |p|, measured 6.9e-5 of the update
LOCAL_SGD_UPDATE = 1e-3


PIPES, SEQS = ("pipe_1f1b", "pipe_zb", "pipe_seq", "pipe_expert"), ("seq_ring", "seq_allgather", "pipe_seq",
                                                                    "pipe_expert", "expert_seq")
MICROBATCHES = 2  # a pipe layout's pipeline.microbatches: its one-device reference accumulates as many
# pairs the toolkit refuses before compiling (docs/compose.md says why): each is one refusal cell of its own;
# every other cell avoids them, so a refusal never hides the pairs a cell was meant to cover
REFUSED = ({(("layout", p), ("local_sgd", 1)) for p in ("fsdp", "pipe_expert", "expert_seq")}  # no data axis
           | {(("layout", p), ("model", "user")) for p in PIPES})
# triples most large runs use, each forced into the design as a cell of its own (all-pairs covers only pairs)
TRIPLES = (dict(layout="pipe_expert", model="moe", grad_accum=2),  # pipeline x MoE x accumulation (x seq x expert)
           dict(layout="pipe_seq", dtype="bfloat16"),  # pipeline x seq x bf16
           dict(layout="expert_seq", model="moe", grad_accum=2))  # expert x seq x accumulation
BASE = dict(layout="dp", model="gpt", length="short", grad_accum=1, fsdp_gather="per_microbatch", remat="none",
            dtype="float32", loss_chunk=0, local_sgd=0, resume="no")

# LoRA (lora.rank=4, lora.alpha=8: adapters on a frozen base) crossed with the features it composes with. These
# cells stand beside the all-pairs design (a factor more would redraw it); each is compared with the same LoRA
# run on one device. lora_dropout > 0: each row draws its masks from its index in the batch, in natural token order,
# on every layout (a pipeline carries the row index into its stages), so they equal one device's.
LORA_CELLS = {
    "pipe_1f1b": dict(layout="pipe_1f1b", grad_accum=2, fsdp_gather="per_step"),
    "seq_ring": dict(layout="seq_ring", length="blockwise", lora_dropout=0.1),
    "expert_moe": dict(layout="expert", model="moe", grad_accum=2),
    "tp_sp_bf16": dict(layout="tp_sp", dtype="bfloat16", remat="full"),
    "fsdp_accum": dict(layout="fsdp", grad_accum=2, fsdp_gather="per_step", lora_dropout=0.1),
    "pipe_zb_dropout": dict(layout="pipe_zb", lora_dropout=0.1),
}


def lora_cell(name: str) -> dict:
    """The LoRA cell ``name`` of :data:`LORA_CELLS`, completed from :data:`BASE`."""
    return {**BASE, "lora": 4, "lora_dropout": 0.0, **LORA_CELLS[name]}


def applicable(cell: dict) -> bool:
    """False for combinations without meaning (the user task has no attention, dtype or chunked loss)."""
    return cell.get("model") != "user" or all(cell.get(k, v) == v for k, v in GPT_ONLY.items())


def refused(cell: dict) -> bool:
    return bool(pairs_of(cell) & REFUSED)


def data_size(overrides: list[str]) -> int:
    """The ``data`` size of a layout's (or the resume mesh's) ``mesh.axes`` override."""
    return int(dict(a.split("=") for a in overrides[0].removeprefix("mesh.axes=").split(",")).get("data", 1))


def regroups(cell: dict) -> bool:
    """Local SGD resumed on a mesh with another ``data`` size, ``local_sgd.groups`` at its default (the data
    size): another number of replica groups, refused naming the key to set."""
    return (cell["local_sgd"] == 1 and cell["resume"] == "other_mesh"
            and data_size(LAYOUTS[cell["layout"]]) != data_size(RESUME_MESH))


def pairs_of(cell: dict) -> set:
    items = sorted(cell.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def possible_pairs() -> set:
    """Every pair of factor levels that some applicable cell can hold."""
    out = set()
    for (f1, l1), (f2, l2) in itertools.combinations([(f, lvl) for f in FACTORS for lvl in FACTORS[f]], 2):
        if f1 != f2 and applicable({f1: l1, f2: l2}):
            out.add(tuple(sorted(((f1, l1), (f2, l2)))))
    return out


def design(seed: int = 0, candidates: int = 60) -> list[dict]:
    """The refusal cells (one per refused pair, the rest of the cell at :data:`BASE`), then a greedy all-pairs
    design over the rest: each new cell, the best of ``candidates`` random completions that hold no refused
    pair, covers the most pairs not yet covered, until every possible pair is. Deterministic for a seed."""
    cells = [{**BASE, **dict(pair), **(GPT_ONLY if ("model", "user") in pair else {})} for pair in sorted(REFUSED)]
    cells += [{**BASE, **triple} for triple in TRIPLES]
    rng, todo = random.Random(seed), possible_pairs() - set().union(*map(pairs_of, cells))
    while todo:
        (f1, l1), (f2, l2) = min(todo, key=lambda p: (str(p[0]), str(p[1])))  # seed each cell with an uncovered pair
        best, gain = None, -1
        for _ in range(candidates):
            cell = {f: rng.choice(levels) for f, levels in FACTORS.items()}
            cell.update({f1: l1, f2: l2})
            if cell["model"] == "user":
                cell.update(GPT_ONLY)
            if not applicable(cell) or refused(cell):
                continue
            g = len(pairs_of(cell) & todo)
            if g > gain:
                best, gain = cell, g
        cells.append(best)
        todo -= pairs_of(best)
    return cells


def coverage(cells: list[dict]) -> tuple[int, int]:
    """(pairs covered, pairs possible)."""
    possible = possible_pairs()
    return len(set().union(*map(pairs_of, cells)) & possible), len(possible)


@dataclasses.dataclass
class Outcome:
    cell: dict
    status: str  # "equal" | "refused" | "differs" | "crashed"
    detail: str  # the errors, or the refusal / crash message

    @property
    def ok(self) -> bool:
        if refused(self.cell) or regroups(self.cell) or (self.cell["local_sgd"] and self.cell["model"] == "user"):
            return self.status == "refused" and names_both(self.cell, self.detail)
        return self.status == "equal"


def names_both(cell: dict, message: str) -> bool:
    """A refusal names the features it is about: at least two config keys or values of the cell."""
    words = {"pipeline", "pipe", "seq", "lora", "context", "local_sgd", "expert", "MoE", "n_experts", "grad_accum", "mesh", "state",
             "fsdp_gather", "remat", "bfloat16", "loss_chunk", "attention", "task", "resume", "checkpoint"}
    return sum(w in message for w in words) >= 2


def overrides(cell: dict, *, one_device: bool = False) -> list[str]:
    # a checkpoint at each run's last step only: a resumed cell reads its first run's (step 1)
    sets = ["run.steps=1", "run.eval_batches=0", "run.progress=false", "run.tensorboard=false", "run.log_every=1",
            "checkpoint.every_steps=100", "optimizer.name=sgd", "optimizer.clip_norm=null", "optimizer.weight_decay=0",
            "lr.kind=constant", "lr.peak_lr=0.1", "lr.warmup_steps=0", "data.global_batch=16",
            f"run.grad_accum={accumulated(cell) if one_device else cell['grad_accum']}",
            f"run.fsdp_gather={cell['fsdp_gather']}"]
    if cell["model"] != "user":
        sets += ["model.n_layers=4", f"model.dtype={cell['dtype']}", f"model.loss_chunk={cell['loss_chunk']}",
                 f"model.remat_policy={cell['remat']}", "data.corpus=synthetic"]
        sets += ["data.seq_len=32", "model.attention_block=8"] if cell["length"] == "blockwise" else ["data.seq_len=16"]
    if cell.get("lora"):
        sets += [f"lora.rank={cell['lora']}", "lora.alpha=8", f"lora.dropout={cell.get('lora_dropout', 0.0)}"]
    if cell["model"] == "moe":  # dropless: capacity groups are per device, so a capacity drops differently per layout
        sets += ["model.capacity_factor=0"] + (["model.aux_loss_weight=0"] if group_balanced(cell) else [])
    if one_device:
        return sets + ["mesh.axes=data=1", "rules=none"]
    sets += LAYOUTS[cell["layout"]]
    if cell["local_sgd"]:
        sets += ["local_sgd.every=1", "local_sgd.outer_optimizer=sgd", "local_sgd.outer_lr=1", "local_sgd.outer_momentum=0"]
    return sets


def accumulated(cell: dict) -> int:
    """The microbatches one device accumulates to equal ``cell``: its ``grad_accum``, times a pipeline's
    microbatches for the MoE (the router's losses are means per microbatch)."""
    return cell["grad_accum"] * (MICROBATCHES if cell["model"] == "moe" and cell["layout"] in PIPES else 1)


def group_balanced(cell: dict) -> bool:
    """A MoE cell with local SGD: each replica group's load-balancing loss is a product of means over its own
    contiguous rows, which no one-device accumulation (microbatches of strided rows) reproduces, so it runs
    with ``model.aux_loss_weight=0``, and so does its reference (tests/trainers/test_local_sgd_compose.py
    checks the groups' own losses against independent runs on their rows)."""
    return cell["model"] == "moe" and bool(cell["local_sgd"])


def _config_and_task(cell: dict, sets: list[str]):
    from trainers.config import override
    from trainers.recipes import recipe

    if cell["model"] == "user":
        from helpers.byom_task import make_task

        task = make_task()
        return override(task.config, sets), task
    base = recipe("gpt-moe" if cell["model"] == "moe" else "gpt-small", tiny=True)
    return override(base, sets), None


def _train(cell: dict, sets: list[str], run_dir: str, steps: int, *, start: list | None = None):
    """The run's Result; ``start``, when given, receives the parameters it starts from (on the host), read
    from the same build the run steps (one initialisation, not a second one for the reference)."""
    import jax
    import numpy as np

    import meshes
    from trainers.loop import drive
    from trainers.setup import build

    cfg, task = _config_and_task(cell, [*sets, f"run.run_dir={run_dir}", f"run.steps={steps}"])
    one = cfg.mesh.axes == "data=1"
    run = build(cfg, task, meshes.single_device_mesh() if one else None)
    if start is not None:
        start.append(jax.tree.map(np.array, run.sharded.state.params))  # a copy: the first step donates the state
    return drive(run, keep_state=True)


def _params(result, cell: dict | None = None):
    """The run's parameters, its layers in natural order (an interleaved layout stores them in chunk order)."""
    import jax
    import numpy as np

    params = jax.tree.map(np.asarray, result.state.params)
    if cell is not None and cell["resume"] == "no" and "pipeline.virtual_stages=2" in LAYOUTS[cell["layout"]]:
        from spmd.pipeline.order import LayerOrder

        natural, blocks = LayerOrder(2, 2).to_natural, params["blocks"]
        if cell["local_sgd"]:  # X[G_data, layers, ...]: each replica group's stack
            groups = jax.tree.leaves(blocks)[0].shape[0]
            parts = [natural(jax.tree.map(lambda a, g=g: a[g], blocks)) for g in range(groups)]
            params["blocks"] = jax.tree.map(lambda *xs: np.stack(xs), *parts)
        else:
            params["blocks"] = natural(blocks)
    return params


def run_cell(cell: dict, reference, workdir: str) -> Outcome:
    """Run ``cell`` (two steps, or one plus one resumed on another mesh) and compare it with ``reference``:
    ``(losses, params before, params after)`` of the same run on one device, or a function that computes
    it, called only when the cell ran (a refused cell needs no reference)."""
    import jax
    import numpy as np

    run_dir = os.path.join(workdir, "cell")
    try:
        result = _train(cell, overrides(cell), run_dir, 1 if cell["resume"] == "other_mesh" else STEPS)
        if cell["resume"] == "other_mesh":
            sets = [s for s in overrides(cell) if not s.startswith(("mesh.", "rules=", "pipeline."))]
            sets += [f"run.grad_accum={accumulated(cell)}"]  # without the pipeline: accumulate its microbatches
            result2 = _train(cell, sets + RESUME_MESH, run_dir, STEPS)
            result = dataclasses.replace(result2, losses={**result.losses, **result2.losses})
    except ValueError as e:  # a refusal: before compiling, with its message
        return Outcome(cell, "refused", str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001 - a crash is this cell's result
        return Outcome(cell, "crashed", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    losses, p0, p1 = reference() if callable(reference) else reference
    tol_loss, tol_update = TOL[cell["dtype"]]
    if cell["model"] == "moe" and cell["dtype"] == "bfloat16":
        tol_update = MOE_BF16_UPDATE
    if cell["local_sgd"]:  # the outer step averages parameters: the update is a difference of values of size |p|
        tol_update = max(tol_update, LOCAL_SGD_UPDATE)
    loss_err = max(abs(result.losses[s] - losses[s]) / max(abs(losses[s]), 1e-30) for s in losses)
    update = np.sqrt(sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0))))
    diff = np.sqrt(sum(float(np.sum((a.astype(np.float64) - b) ** 2))
                       for a, b in zip(jax.tree.leaves(_params(result, cell)), jax.tree.leaves(p1))))
    detail = f"loss {loss_err:.1e}, update {diff / max(update, 1e-30):.1e}"
    ok = loss_err <= tol_loss and diff <= tol_update * update
    return Outcome(cell, "equal" if ok else "differs", detail)


def reference_key(cell: dict) -> tuple:
    """What the one-device run depends on: remat and the loss chunk change no number beyond rounding, and
    accumulation changes none for the plain GPT (the MoE's router losses, BatchNorm and LoRA dropout's masks are
    per microbatch)."""
    per_microbatch = cell["model"] != "gpt" or cell.get("lora_dropout", 0.0) > 0
    return (cell["model"], cell["length"], cell["dtype"], accumulated(cell) if per_microbatch else 1,
            cell.get("lora", 0), cell.get("lora_dropout", 0.0), group_balanced(cell))


def run_reference(cell: dict, workdir: str):
    """(losses, params before the first step, params after the last) on one device."""
    before: list = []
    result = _train(cell, overrides(cell, one_device=True), os.path.join(workdir, "ref"), STEPS, start=before)
    return result.losses, before[0], _params(result)


def table(outcomes: list[Outcome]) -> str:
    head = "| " + " | ".join(FACTORS) + " | result | detail |\n|" + "---|" * (len(FACTORS) + 2) + "\n"
    return head + "".join("| " + " | ".join(str(o.cell[f]) for f in FACTORS) + f" | {o.status} | {o.detail} |\n"
                          for o in outcomes)


DOC = """# Features together: the cross-feature matrix

Generated by `python tests/helpers/matrix.py` (tests/helpers/matrix.py holds the factors and the design;
tests/trainers/test_compose.py checks the coverage; the sweep, `pytest -m sweep`, runs representative cells). Each row is one cell: a tiny
training run on 8 simulated CPU devices, two steps (or one, then one more resumed on
`data=2 x fsdp=2 x tensor=2`), compared with the same run on one device. `equal`: the losses of both steps
and the final parameters agree (the detail gives the loss error and the parameter error relative to the
update the parameters took; tolerances 1e-5 in f32, 1e-3 / 2e-2 in bf16, 1e-1 for the update of bf16 MoE). `refused`: the run stopped
before compiling with the message shown.

The combinations refused today, and why (each has nothing to run, cannot equal one device, or cannot be built
from what the toolkit is given):

- local SGD on a mesh without a `data` axis of size >= 2 (`fsdp=8`, `expert=2 x seq=2 x pipe=2`, `expert=2 x
  seq=2 x tensor=2`) and `local_sgd.groups` at its default (the `data` size): one group is ordinary training
  (`local_sgd.every=0`). With `local_sgd.groups=G >= 2` such a mesh runs G groups on every device;
- (no longer refused: a local-SGD checkpoint of G groups resumes on a mesh with another `data` size that
  divides G, with `local_sgd.groups=G`, each data shard running G/D groups: tests/trainers/test_local_sgd.py.
  The matrix leaves `local_sgd.groups` at its default, under which such a resume is refused naming the key;
  no cell of the design is one);
- local SGD with a model that has non-parameter state (the user task's BatchNorm statistics): one device
  (and data parallelism) normalises each row with the statistics of the whole global batch, a replica group
  with those of its own B/G rows, so the forward pass differs from one device's at every step, for every H
  (H = 1 included): no averaging rule for the statistics can make it equal;
- (no longer refused: MoE blocks with local SGD. The MoE layer's region opens nested in the replica groups'
  region manual over `data`, both typed unchecked, so the inner step sends nothing over `data`. A group's
  load-balancing loss is a product of means over its own rows, which one device does not compute, so a MoE
  cell with local SGD and its reference run with `model.aux_loss_weight=0`; the groups' own losses are checked
  against independent runs on their rows: docs/training.md, "Local SGD");
- a user task under a pipeline without an `spmd.Stack`: a pipeline splits the model into S x V stages of one
  structure, and an arbitrary module declares no sequence of layers to split. With its repeated blocks in a
  `spmd.Stack` run through `spmd.pipeline.pipelined_loss` (`Task(pipelined=True)`, as the GPT's loss does) a
  user task runs pipelined (tests/trainers/test_task.py, GPipe on `data=4 x pipe=2`).

Outside the matrix's factors: DPO runs under every pipeline schedule (docs/post-training.md), with context
parallelism too: each stage device holds its shard of every row's length, and the head adds each pair's summed
log-probabilities over `seq` (a psum of `[B, P]` inside the engine's branches) before the loss, which every
device of the `seq` group then computes whole.

An interleaved pipeline's chunk-ordered stacks start from one device's numbers bit for bit (`trainers.state`
creates them in natural order on their natural shards, then moves them). Created in the chunk order's sharding
at once, about 40% of the block weights came out 1 ulp apart at LLVM `-O0` (what the tests run), which showed
here as an update 1.6e-5 to 3.1e-5 off in the f32 interleaved cells; the gradients agreed to 5e-7 throughout.
tests/spmd/pipeline/test_pipeline_order.py checks the start bit for bit.

"""


LORA_DOC = """
## LoRA with the other features

`lora.rank=4`, `lora.alpha=8` (adapters on a frozen base: docs/post-training.md) in cells beside the design above
(`python tests/helpers/matrix.py --lora` reruns them and rewrites this section; tests/trainers/test_lora_compose.py, in the sweep,
runs them), each compared with the same LoRA run on one device as above. `lora_dropout` > 0: each row draws its masks
from its index in the batch, in natural token order, so a layout draws the masks one device draws, a pipeline too
(it carries each row's index into its stages).

"""
LORA_MARK = "## LoRA with the other features"
LORA_COLUMNS = ("layout", "model", "length", "grad_accum", "fsdp_gather", "remat", "dtype", "lora_dropout")


def lora_table(outcomes: list[Outcome]) -> str:
    head = "| " + " | ".join(LORA_COLUMNS) + " | result | detail |\n|" + "---|" * (len(LORA_COLUMNS) + 2) + "\n"
    return head + "".join("| " + " | ".join(str(o.cell[f]) for f in LORA_COLUMNS) + f" | {o.status} | {o.detail} |\n"
                          for o in outcomes)


def run_lora(log=print) -> list[Outcome]:
    """Every LoRA cell, in this process (one reference per :func:`reference_key`)."""
    import logging

    logging.disable(logging.WARNING)
    refs: dict = {}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in LORA_CELLS:
            cell = lora_cell(name)
            key = reference_key(cell)
            if key not in refs:
                refs[key] = run_reference(cell, os.path.join(tmp, f"ref{len(refs)}"))
            out.append(run_cell(cell, refs[key], os.path.join(tmp, name)))
            log(name, out[-1].status, out[-1].detail)
    return out


def groups(cells: list[dict]) -> list[list[int]]:
    """Cell indices grouped by reference (one one-device run serves a group), refusals first."""
    keys: dict = {}
    for i, cell in enumerate(cells):
        keys.setdefault(("refused",) if refused(cell) else reference_key(cell), []).append(i)
    return list(keys.values())


def run_group(indices: list[int]) -> None:
    """Child process: run these cells (sharing one reference) and print one JSON line per cell."""
    import json
    import logging

    logging.disable(logging.WARNING)
    cells, ref = design(), None
    with tempfile.TemporaryDirectory() as tmp:
        for i in indices:
            cell = cells[i]
            if ref is None and not refused(cell):
                ref = run_reference(cell, os.path.join(tmp, "ref"))
            out = run_cell(cell, ref, os.path.join(tmp, f"cell{i}"))
            print("CELL " + json.dumps({"i": i, "status": out.status, "detail": out.detail}), flush=True)


def run_all(log=print) -> list[Outcome]:
    """Every cell of the design, each group in a child process: a cell that aborts the process (an XLA check
    failure) is recorded as crashed with the abort's first line, and its group goes on in a new process."""
    import json
    import subprocess

    cells, outcomes = design(), {}
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    for group in groups(cells):
        todo = list(group)
        while todo:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--cells", ",".join(map(str, todo))],
                                  env=env, capture_output=True, text=True)
            for line in proc.stdout.splitlines():
                if line.startswith("CELL "):
                    r = json.loads(line[5:])
                    outcomes[r["i"]] = Outcome(cells[r["i"]], r["status"], r["detail"])
                    log(r["i"], r["status"], r["detail"])
            todo = [i for i in todo if i not in outcomes]
            if todo and proc.returncode != 0:
                fatal = [ln for ln in proc.stderr.splitlines() if ln.startswith(("F1", "F0")) or "Error" in ln]
                outcomes[todo[0]] = Outcome(cells[todo[0]], "crashed", (fatal[-1] if fatal else
                                                                       f"exit {proc.returncode}")[:300])
                log(todo[0], "crashed", outcomes[todo[0]].detail)
                todo = todo[1:]
    return [outcomes[i] for i in range(len(cells))]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--cells":
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:0] = [os.path.dirname(tests), tests]  # the repository first: tests/meshes would shadow meshes
        return run_group([int(i) for i in sys.argv[2].split(",")])
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "compose.md")
    if sys.argv[1:] == ["--lora"]:  # the LoRA section alone
        with open(path) as f:
            text = f.read().split(LORA_MARK)[0].rstrip("\n") + "\n"
        with open(path, "w") as f:
            f.write(text + LORA_DOC + lora_table(run_lora()))
        return None
    cells = design()
    outcomes = run_all()
    covered, possible = coverage(cells)
    summary = (f"Pairs of factor levels covered / possible: {covered} / {possible} = {covered / possible:.3f} "
               f"({len(cells)} cells; {sum(o.status == 'equal' for o in outcomes)} equal, "
               f"{sum(o.status == 'refused' for o in outcomes)} refused, {sum(not o.ok for o in outcomes)} failing).\n\n")
    with open(path, "w") as f:
        f.write(DOC + summary + table(outcomes) + LORA_DOC + lora_table(run_lora()))
    print(summary)


if __name__ == "__main__":
    main()
