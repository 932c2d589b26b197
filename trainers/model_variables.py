"""Every variable of a model, abstract (shapes, dtypes, logical dims; nothing allocated), and how a layout shards it.

    model_variables(lambda: Model(rngs=nnx.Rngs(0))) -> ModelVariables   # any model
    param_infos(gpt_config) -> (ParamInfo(path, shape, dims, itemsize), ...)   # the built-in GPT

What the layout checks (:mod:`trainers.checks`) and the planning layer read of a model, decided by the
same :func:`spmd.variables.decide` the run's state builder calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

import spmd
from meshes import AXES
from spmd.models import GPTConfig
from spmd.models.lora import LoRASpec
from spmd.rules import axes_of
from spmd.sharding import abstract_module, fit_spec
from spmd.variables import Decision, PathRules, decide


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One variable of a model: path, shape, logical dims (from its annotation or a path rule; None
    when it has none), bytes per element of its stored form, its kind and where its dims came from."""

    path: str
    shape: tuple[int, ...]
    dims: tuple[str | None, ...] | None
    itemsize: int
    kind: str = "Param"
    source: str = "annotation"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


class _AxisSizes:
    """What ``spmd.variables.decide`` reads of a mesh, its axis names and sizes, without devices:
    the planning layer decides layouts for meshes larger than this machine."""

    def __init__(self, sizes: Mapping[str, int]):
        self.axis_names = tuple(sizes)
        self.devices = np.broadcast_to(np.uint8(0), tuple(max(int(s), 1) for s in sizes.values()))


def _storage(x) -> tuple[tuple[int, ...], int]:
    """Shape and item size of a variable as the train state stores it (RNG keys as uint32 key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return tuple(data.shape), np.dtype(data.dtype).itemsize
    return tuple(x.shape), np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class ModelVariables:
    """Every variable of a model, abstract (shapes, dtypes, metadata; nothing allocated): what the
    planning layer reads of any task's model. ``params`` / ``other`` are the abstract ``nnx.State``
    of the ``nnx.Param`` variables and of every other kind (batch statistics, RNG streams, ...)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    other: nnx.State
    path_rules: tuple
    infos: tuple[ParamInfo, ...]  # the parameters, in tree order
    other_infos: tuple[ParamInfo, ...]

    @property
    def param_count(self) -> int:
        return sum(p.size for p in self.infos)

    def decisions(self, rules: spmd.Rules | str, sizes: Mapping[str, int], *,
                  on_indivisible: str = "error") -> list[Decision]:
        """How every variable (parameters first) is sharded on a mesh of these axis sizes: the same
        :func:`spmd.variables.decide` the run's state builder calls (raises ``spmd.rules.RulesError``)."""
        mesh = _AxisSizes({a: sizes.get(a, 1) for a in AXES})
        return (decide(self.params, rules, mesh, path_rules=self.path_rules, on_indivisible=on_indivisible)
                + decide(self.other, rules, mesh, path_rules=self.path_rules, on_indivisible=on_indivisible))


def model_variables(make, path_rules: PathRules = ()) -> ModelVariables:
    """The :class:`ModelVariables` of ``make()`` (a function returning an ``nnx.Module``), traced abstractly."""
    graphdef, params, other = nnx.split(abstract_module(make), nnx.Param, ...)
    path_rules = tuple(path_rules)
    unit = _AxisSizes({a: 1 for a in AXES})

    def infos(state) -> tuple[ParamInfo, ...]:
        leaves = {spmd.sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
        out = []
        for d in decide(state, "none", unit, path_rules=path_rules):
            shape, itemsize = _storage(leaves[d.path])
            out.append(ParamInfo(d.path, shape, d.dims, itemsize, d.kind, d.source))
        return tuple(out)

    return ModelVariables(graphdef, params, other, path_rules, infos(params), infos(other))


@functools.lru_cache(maxsize=32)
def _gpt_variables(model: GPTConfig, lora: LoRASpec | None = None) -> ModelVariables:
    from spmd.models import GPT  # as trainers.task.lm_model builds it

    return model_variables(lambda: GPT(model, rngs=nnx.Rngs(0), lora=lora))


def param_infos(model: GPTConfig | ModelVariables, lora: LoRASpec | None = None) -> tuple[ParamInfo, ...]:
    """Path, shape, logical dims and item size of every parameter of the built-in GPT of a
    ``GPTConfig`` (with ``lora``'s adapters), or of any model's :class:`ModelVariables` (from an abstract
    model, no allocation)."""
    return (_gpt_variables(model, lora) if isinstance(model, GPTConfig) else model).infos


def shard_divisors(info: ParamInfo, rules: spmd.Rules, sizes: Mapping[str, int], kind: str = "params") -> list[int]:
    """Per dim, the product of the mesh axes the rule set shards it over."""
    if info.dims is None:
        return [1] * len(info.shape)
    spec = fit_spec(rules.spec(info.dims, kind=kind, mesh_sizes=sizes, what=info.path), info.shape, info.dims, sizes)
    entries = list(spec) + [None] * (len(info.shape) - len(spec))
    return [math.prod(sizes[a] for a in axes_of(e)) for e in entries]
