"""Whole pytrees -> NamedShardings: parameters, optimizer state, batches.

Parameters carry their logical dims as Flax NNX variable metadata (``out_sharding=("embed",
"mlp")``, the key ``nnx.with_partitioning`` writes). :func:`param_shardings` reads them from an
abstract (shape-only) state, applies a rule set and returns NamedShardings in the same pure-dict
structure as ``nnx.to_pure_dict(state)``, ready for ``jax.jit(out_shardings=...)``. So a train
state is created directly sharded and never materialised whole on one device.

A dim whose size does not divide by the product of its mesh axes is an error by default (naming the
path, dim, size and axes): silent replication would hide a memory blow-up that shows only on the pod.
Exception by design: ``kv_heads`` outnumbered by its axes is replicated (:func:`fit_spec`).
``on_indivisible="replicate"`` opts into replicating any such dim with a logged warning instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshes import axis_sizes
from meshes.build import MeshLike
from spmd.rules import Rules, RulesError, axes_of, get_rules

log = logging.getLogger(__name__)

_DIM_KEYS = ("out_sharding", "sharding_names", "sharding")


def path_str(path: Sequence[Any], *, drop: tuple[str, ...] = ("value",)) -> str:
    """'blocks/attn/w_q' from a jax key path (NNX's trailing 'value' attribute left out by default)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(p for p in parts if p not in drop)


def _variables(tree: Any) -> list[tuple[str, nnx.Variable]]:
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [(path_str(p), v) for p, v in leaves]


def variable_dims(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical dims stored on a variable, or None when it carries none."""
    meta = var.get_metadata()
    for key in _DIM_KEYS:
        if meta.get(key) is not None:
            dims = meta[key]
            return tuple(dims) if not isinstance(dims, P) else tuple(dims)
    return None


def logical_dims(tree: Any) -> dict[str, tuple[str | None, ...] | None]:
    """{path: dims} for every variable of an NNX module or state."""
    return {path: variable_dims(v) for path, v in _variables(tree)}


# Dims that fall back to replication when their mesh axes outnumber them by a whole factor: with
# tensor = t a multiple of n_kv_heads = G, each KV head is copied to the t/G shards whose query heads
# read it (spmd.models.layers.Attention), as Megatron and MaxText do. Any other dim must divide.
REPLICATED_WHEN_OUTNUMBERED: tuple[str, ...] = ("kv_heads",)


def fit_spec(spec: P, shape: Sequence[int], dims: Sequence[str | None], sizes: Mapping[str, int]) -> P:
    """``spec`` with every :data:`REPLICATED_WHEN_OUTNUMBERED` dim whose size its axes outnumber
    (product a multiple of the size, e.g. ``kv_heads``=2 over tensor=8) replicated; the rest as given."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, entry in enumerate(entries):
        n = math.prod(sizes.get(a, 1) for a in axes_of(entry))
        if dims[i] in REPLICATED_WHEN_OUTNUMBERED and shape[i] % n and n % shape[i] == 0:
            entries[i] = None
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def spec_for(
    shape: Sequence[int],
    dims: Sequence[str | None] | None,
    rules: Rules | str,
    mesh: MeshLike,
    *,
    kind: str = "params",
    path: str = "array",
    on_indivisible: str = "error",
) -> P:
    """PartitionSpec of one array, checked against its shape."""
    rules = get_rules(rules)
    if dims is None:
        return P()
    if len(dims) != len(shape):
        raise RulesError(f"{path} has shape {tuple(shape)} but {len(dims)} logical dims {tuple(dims)}")
    sizes = axis_sizes(mesh)
    spec = fit_spec(rules.spec(dims, kind=kind, mesh_sizes=sizes, what=path), shape, dims, sizes)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, entry in enumerate(entries):
        axes = axes_of(entry)
        n = math.prod(sizes[a] for a in axes)
        if shape[i] % n:
            detail = (
                f"{path}: dim {i} ({dims[i]!r}) has size {shape[i]}, which does not divide by mesh axes "
                f"{' x '.join(f'{a}={sizes[a]}' for a in axes)} = {n} under rule set {rules.name!r}"
            )
            if dims[i] in REPLICATED_WHEN_OUTNUMBERED:
                detail += f" (nor is {n} a multiple of {shape[i]}, which would replicate it)"
            if on_indivisible == "replicate":
                log.warning("%s; replicating this dim", detail)
                entries[i] = None
            elif on_indivisible == "error":
                raise RulesError(detail + "; pick sizes that divide, or map this dim to other axes")
            else:
                raise RulesError(f"on_indivisible must be 'error' or 'replicate', got {on_indivisible!r}")
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def param_shardings(
    abstract: Any, rules: Rules | str, mesh: Mesh, *, on_indivisible: str = "error"
) -> dict[str, Any]:
    """NamedShardings for an NNX module/state, as a pure dict matching ``nnx.to_pure_dict``.

    Variables without logical dims are replicated.
    """
    state = nnx.state(abstract) if isinstance(abstract, nnx.Module) else abstract

    def one(path, var):
        spec = spec_for(var.shape, variable_dims(var), rules, mesh, path=path_str(path), on_indivisible=on_indivisible)
        return NamedSharding(mesh, spec)

    mapped = jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(mapped) if isinstance(mapped, nnx.State) else mapped


def optimizer_shardings(
    tx: optax.GradientTransformation, abstract_opt_state: Any, param_sharding: Any, mesh: Mesh
) -> Any:
    """Shardings for an optax state: parameter-shaped parts (moments, accumulators) follow the
    parameters' shardings; everything else (step counts, scalars) is replicated. A state with masked
    parts (``optax.masked``, ``optax.multi_transform``: e.g. a frozen base) is matched by key path: a
    leaf whose path ends with a parameter's path takes that parameter's sharding."""
    replicated = NamedSharding(mesh, P())
    if any(isinstance(x, optax.MaskedNode) for x in
           jax.tree.leaves(abstract_opt_state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))):
        by_path = {path_str(p, drop=()): s for p, s in jax.tree_util.tree_flatten_with_path(
            param_sharding, is_leaf=lambda x: isinstance(x, NamedSharding))[0]}

        def match(path: Any, _: Any) -> NamedSharding:
            name = path_str(path, drop=())
            return next((s for p, s in by_path.items() if name == p or name.endswith("/" + p)), replicated)

        return jax.tree_util.tree_map_with_path(match, abstract_opt_state)
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_sharding,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def batch_sharding(
    rules: Rules | str, mesh: Mesh, dims: Sequence[str | None] = ("batch", "length")
) -> NamedSharding:
    """Sharding of a batch array with these logical dims (activation rules)."""
    return NamedSharding(mesh, get_rules(rules).spec(dims, kind="activations", mesh_sizes=axis_sizes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def abstract_module(make: Callable[[], nnx.Module]) -> nnx.Module:
    """The model as shapes only (``nnx.eval_shape``), annotated variables left unsharded."""
    with nnx.use_eager_sharding(False):  # the toolkit shards from the metadata, not flax at construction
        return nnx.eval_shape(make)


def abstract_model(make: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of a model without allocating it."""
    return nnx.split(abstract_module(make))


def init_params(
    make: Callable[[], nnx.Module], rules: Rules | str, mesh: Mesh, *, on_indivisible: str = "error"
) -> tuple[nnx.GraphDef, dict[str, Any], dict[str, Any]]:
    """Create a model's parameters directly sharded: ``(graphdef, params, shardings)``.

    ``make`` builds the model (e.g. ``lambda: GPT(cfg, rngs=nnx.Rngs(0))``). It is traced once
    abstractly to read shapes and logical dims, then run under ``jax.jit`` with ``out_shardings``,
    so each device only ever allocates its own shards. ``params`` is a pure dict of arrays;
    ``nnx.merge(graphdef, params)`` rebuilds the model inside a step.
    """
    graphdef, abstract_params, rest = nnx.split(abstract_module(make), nnx.Param, ...)
    if jax.tree.leaves(rest):
        kinds = sorted({type(v).__name__ for _, v in _variables(rest)})
        raise RulesError(f"model has non-parameter state ({', '.join(kinds)}); init_params takes nnx.Param state only: "
                         "use spmd.init_model, which shards and returns every variable kind")
    shardings = param_shardings(abstract_params, rules, mesh, on_indivisible=on_indivisible)

    def init() -> dict[str, Any]:
        with nnx.use_eager_sharding(False):
            return nnx.to_pure_dict(nnx.state(make(), nnx.Param))

    params = jax.jit(init, out_shardings=shardings)()
    return graphdef, params, shardings
