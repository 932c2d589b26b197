"""Inspection of placed arrays and compiled steps: shardings, per-device memory, FLOPs.

Used by the tests, notebooks and benchmarks to check layouts and to compare them with theory:

- :func:`sharding_table`: one row per array of a pytree: path, global shape, dtype, PartitionSpec,
  the shard shape each device holds, bytes per device;
- :func:`memory`: per-device bytes of a compiled function from XLA's memory analysis
  (arguments, outputs, aliased/donated, temporaries);
- :func:`compiled_flops`: XLA's FLOP count for one device's program;
- :func:`tree_bytes_per_device`: bytes of the shards of a pytree held by one device.

Collectives of a compiled step are in :mod:`spmd.hlo`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from spmd.sharding import path_str


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes of a compiled program."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int

    @property
    def total(self) -> int:
        """Peak-ish footprint: arguments + outputs not aliased to arguments + temporaries."""
        return self.argument + self.output - self.alias + self.temp


def memory(compiled: Any) -> Memory:
    m = compiled.memory_analysis()
    return Memory(
        argument=int(m.argument_size_in_bytes),
        output=int(m.output_size_in_bytes),
        alias=int(m.alias_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        generated_code=int(m.generated_code_size_in_bytes),
    )


def compiled_flops(compiled: Any) -> float:
    """FLOPs of one device's program as XLA counts them (matmuls and elementwise work).

    XLA's cost analysis counts the body of a ``while`` loop once, not once per iteration, so for
    a model whose layers run as a scan (``spmd.Stack``) this undercounts by about the number of
    layers. Use the analytic ``spmd.models.flops_per_step`` for MFU; use this for unrolled code.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def _shard_shape(x: Any) -> tuple[int, ...]:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return tuple(x.shape)
    return tuple(sharding.shard_shape(tuple(x.shape)))


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a pytree of (abstract or concrete) sharded arrays (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            total += math.prod(_shard_shape(x)) * np.dtype(x.dtype).itemsize
    return total


def sharding_table(tree: Any) -> list[dict[str, Any]]:
    """One row per array: path, shape, dtype, spec, shard shape, bytes per device."""
    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            continue
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        shard = _shard_shape(x)
        rows.append({
            "path": path_str(path),
            "shape": tuple(x.shape),
            "dtype": str(np.dtype(x.dtype)),
            "spec": str(spec) if spec is not None else "-",
            "shard": shard,
            "bytes_per_device": math.prod(shard) * np.dtype(x.dtype).itemsize,
        })
    return rows


def format_sharding_table(tree: Any) -> str:
    rows = sharding_table(tree)
    width = max([len(r["path"]) for r in rows] + [4])
    out = [f"{'path':<{width}}  {'shape':<18}{'spec':<34}{'shard':<18}{'bytes/dev':>12}"]
    for r in rows:
        out.append(f"{r['path']:<{width}}  {str(r['shape']):<18}{r['spec']:<34}{str(r['shard']):<18}{r['bytes_per_device']:>12,}")
    out.append(f"{'total':<{width}}  {'':<18}{'':<34}{'':<18}{sum(r['bytes_per_device'] for r in rows):>12,}")
    return "\n".join(out)


def jaxpr_flops(fn: Any, *args: Any) -> float:
    """Matmul and convolution FLOPs of ``fn(*args)`` counted from its jaxpr (args may be abstract).

    ``2 * M * N * K`` per ``dot_general`` and ``2 * out * in_features * kernel`` per convolution, with
    a ``scan`` body counted once per iteration (what XLA's cost analysis misses), a ``cond`` by its
    costliest branch and a ``while`` body once. Elementwise work is not counted: this is the
    "model FLOPs" convention of MFU.
    """
    return float(_jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr))


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                out.append(v)
    return out


def _jaxpr_flops(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "conv_general_dilated":
            rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * rhs[spec[1]] * math.prod(rhs[d] for d in spec[2:])
        elif name == "scan":
            total += eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(_jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            total += sum(_jaxpr_flops(j) for j in _sub_jaxprs(eqn.params))
    return total
