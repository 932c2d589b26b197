"""What the planning layer knows of any task without building it: its variables, its batch, its jaxpr.

:func:`profile_task` reads a :class:`trainers.task.Task` abstractly (nothing allocated, no mesh) into a
:class:`TaskProfile`: variables with logical dims, one example's shapes, forward FLOPs, saved bytes
and matmuls. See docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx

import spmd
from spmd.variables import ModelVars
from trainers.config import Config
from trainers.model_variables import ModelVariables, model_variables
from trainers.step import loss_and_metrics
from trainers.task import Task

Pair = tuple[float, float]  # a value at 1 row and at 2 rows


def at(pair: Pair, rows: float) -> float:
    """A quantity measured at 1 and 2 rows, at ``rows`` rows (a fixed part plus a part per row)."""
    return pair[0] + (pair[1] - pair[0]) * (rows - 1)


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul or convolution of the forward pass (x ``count`` when it sits in a scan body)."""

    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # lhs, rhs at 1 row
    fixed: tuple[bool, bool]  # operand shape independent of the rows (a weight, not an activation)
    contracting: tuple[tuple[int, ...], tuple[int, ...]]  # lhs, rhs dims summed over
    flops: Pair
    lhs_bytes: Pair
    rhs_bytes: Pair
    out_bytes: Pair
    dtype: str


@dataclasses.dataclass(frozen=True, eq=False)
class TaskProfile:
    """A task as the planning layer sees it (see the module docstring)."""

    name: str
    variables: ModelVariables
    example: Any  # one row: a pytree of ShapeDtypeStruct without the batch dim
    forward_flops: Pair | None
    saved: Pair | None  # bytes jax.vjp keeps for the backward pass
    matmuls: tuple[Matmul, ...]
    flops_per_example: float | None  # the task's own figure, preferred when given
    pipelined: bool
    note: str = ""  # why the jaxpr figures are missing

    @property
    def example_bytes(self) -> int:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(self.example))

    @property
    def compute_dtype(self) -> str:
        """"bfloat16" when most matmul FLOPs take 16-bit operands, else "float32" (for the peak FLOP/s)."""
        half = sum(m.flops[0] for m in self.matmuls if m.dtype in ("bfloat16", "float16"))
        return "bfloat16" if half > sum(m.flops[0] for m in self.matmuls) / 2 else "float32"

    def model_flops(self, rows: int) -> float:
        """Forward + backward FLOPs of ``rows`` examples: the task's figure, else 3 x the jaxpr's forward."""
        if self.flops_per_example is not None:
            return self.flops_per_example * rows
        return 3 * at(self.forward_flops, rows) if self.forward_flops is not None else 0.0

    def activations(self, rows: float) -> int:
        """Bytes the backward pass reads of ``rows`` rows' forward pass (0 when unknown, see ``note``)."""
        return int(at(self.saved, rows)) if self.saved is not None else 0


def example_of(source: Any) -> Any:
    """Shapes and dtypes of one row of a task's train data (the dtypes jax will use, e.g. int64 -> int32)."""
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        if len(source) < 1:
            raise ValueError("the task's train data is empty")
        row = source[0]
    elif hasattr(source, "__iter__"):
        batch = next(iter(source))
        bad = [x for x in jax.tree.leaves(batch) if np.ndim(x) < 1]
        if bad:
            raise ValueError(f"a batch of the task's iterable data has a leaf without a batch dim "
                             f"(shape {np.shape(bad[0])})")
        row = jax.tree.map(lambda x: np.asarray(x)[0], batch)
    else:
        raise TypeError(f"task data is a {type(source).__name__}: give a grain MapDataset (or sequence) of examples, "
                        "a grain IterDataset or an iterable of per-process batches, or a function cfg -> one of these")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)),
                        row)


def batch_shapes(example: Any, rows: int, sharding: Any = None) -> Any:
    """``[rows, ...]`` of one example's shapes, as ``ShapeDtypeStruct`` (with ``sharding`` when given)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape), x.dtype, sharding=sharding), example)


def profile_task(task: Task, cfg: Config) -> TaskProfile:
    """Read ``task`` under ``cfg`` abstractly: variables, one example, and its loss's jaxpr at 1 and 2 rows."""
    variables = model_variables(lambda: task.model(nnx.Rngs(cfg.run.seed)), task.path_rules)
    example = example_of(task.train_source(cfg, check=False))  # a plan may be for more data than the task has
    flops = saved = None
    matmuls: tuple[Matmul, ...] = ()
    note = ""
    try:
        (f1, s1, m1), (f2, s2, m2) = (_trace(task, variables, example, rows) for rows in (1, 2))
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the dry run's compile shows the real error
        note = (f"the loss could not be traced outside a mesh ({type(e).__name__}: {str(e)[:200]}); "
                "no activation or FLOP count from its jaxpr")
    else:
        flops, saved = (f1, f2), (s1, s2)
        if len(m1) == len(m2):
            matmuls = tuple(dataclasses.replace(a, fixed=(a.shapes[0] == b.shapes[0], a.shapes[1] == b.shapes[1]),
                                                flops=(a.flops[0], b.flops[0]), lhs_bytes=(a.lhs_bytes[0], b.lhs_bytes[0]),
                                                rhs_bytes=(a.rhs_bytes[0], b.rhs_bytes[0]),
                                                out_bytes=(a.out_bytes[0], b.out_bytes[0]))
                            for a, b in zip(m1, m2))
    return TaskProfile(task.name, variables, example, flops, saved, matmuls, task.flops_per_example, task.pipelined, note)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _model_vars(variables: ModelVariables) -> ModelVars:
    """The abstract variables as the train step holds them (RNG keys as key data), to ``merge`` in a trace."""
    other = nnx.to_pure_dict(variables.other)
    stored = jax.tree.map(lambda x: jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x, other)
    return ModelVars(variables.graphdef, nnx.to_pure_dict(variables.params), stored, {}, jax.tree.map(_is_key, other), [])


def _trace(task: Task, variables: ModelVariables, example: Any, rows: int) -> tuple[float, float, list[Matmul]]:
    """Forward FLOPs, bytes saved for the backward and the matmuls of the loss at ``rows`` rows."""
    mv = _model_vars(variables)
    batch = batch_shapes(example, rows)

    def forward(params, other, batch):
        model = mv.merge(params, other)
        model.train()
        return loss_and_metrics(task.loss(model, batch, nnx.Rngs(0)))[0]

    def pullback(params, other, batch):
        return jax.vjp(lambda p: forward(p, other, batch), params)[1]

    flops = spmd.inspection.jaxpr_flops(forward, mv.params, mv.other, batch)
    jaxpr = jax.make_jaxpr(pullback)(mv.params, mv.other, batch).jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    kept = {id(v): v.aval for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal) and id(v) not in inputs}
    saved = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in kept.values()
                if not _is_key(a))
    return flops, float(saved), _matmuls(jaxpr)


def _nbytes(aval) -> float:
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def _matmuls(jaxpr: Any, times: int = 1) -> list[Matmul]:
    """Every matmul / convolution of a jaxpr (values at this trace's rows in the pairs' first slot)."""
    out: list[Matmul] = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "conv_general_dilated"):
            lhs, rhs, res = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
            if name == "dot_general":
                (lc, rc), _ = eqn.params["dimension_numbers"]
                flops = 2 * math.prod(res.shape) * math.prod(lhs.shape[d] for d in lc)
            else:
                numbers = eqn.params["dimension_numbers"]
                lc, rc = (numbers.lhs_spec[1], *numbers.lhs_spec[2:]), (numbers.rhs_spec[1], *numbers.rhs_spec[2:])
                flops = 2 * math.prod(res.shape) * math.prod(rhs.shape[d] for d in rc)
            out.append(Matmul((tuple(lhs.shape), tuple(rhs.shape)), (True, True), (tuple(lc), tuple(rc)),
                              (times * flops, 0.0), (times * _nbytes(lhs), 0.0), (times * _nbytes(rhs), 0.0),
                              (times * _nbytes(res), 0.0), str(np.dtype(lhs.dtype))))
        elif name == "scan":
            out += _matmuls(eqn.params["jaxpr"].jaxpr, times * eqn.params["length"])
        elif name == "cond":
            out += max((_matmuls(b.jaxpr, times) for b in eqn.params["branches"]),
                       key=lambda ms: sum(m.flops[0] for m in ms))
        else:
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(v, jax.extend.core.ClosedJaxpr):
                        out += _matmuls(v.jaxpr, times)
                    elif isinstance(v, jax.extend.core.Jaxpr):
                        out += _matmuls(v, times)
    return out
