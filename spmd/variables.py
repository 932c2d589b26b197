"""Every kind of NNX model state, split into sharded pure dicts: params and the rest.

:func:`init_model` creates every variable directly sharded and returns a :class:`ModelVars`
(``params``, ``other``, ``shardings``). :func:`decide` picks each variable's sharding, first match
wins: annotation, path rule, FSDP default; :func:`format_decisions` prints them. See docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshes import axis_sizes
from meshes.build import MeshLike
from spmd.rules import Rules, RulesError, axes_of, get_rules
from spmd.sharding import abstract_module, path_str, spec_for, variable_dims

PathRules = Sequence[tuple[str, Any]]
MIN_DEFAULT_SIZE = 1 << 10  # elements; smaller unannotated variables stay replicated


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one variable is sharded, and why."""

    path: str
    kind: str  # the nnx.Variable type, e.g. "Param", "BatchStat", "RngKey"
    shape: tuple[int, ...]
    dims: tuple[str | None, ...] | None  # logical dims used (None for a direct spec or replication)
    spec: P
    source: str  # "annotation" | "path rule 'REGEX'" | "default (largest dim over AXES)" | "replicated"


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _check_path_rules(path_rules: PathRules) -> tuple[tuple[re.Pattern[str], Any, str], ...]:
    out = []
    for i, item in enumerate(path_rules):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise RulesError(f"path rule {i} is {item!r}; expected (regex, logical dims) or (regex, PartitionSpec)")
        pattern, dims = item
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise RulesError(f"path rule {i}: {pattern!r} is not a valid regex ({exc})") from None
        if not isinstance(dims, P) and not (isinstance(dims, (tuple, list)) and all(d is None or isinstance(d, str) for d in dims)):
            raise RulesError(f"path rule {pattern!r} -> {dims!r}: give a tuple of logical dims or a PartitionSpec")
        out.append((compiled, tuple(dims) if not isinstance(dims, P) else dims, pattern))
    return tuple(out)


def _default_spec(shape: tuple[int, ...], rules: Rules, sizes: dict[str, int], min_size: int) -> tuple[P, str]:
    """FSDP on the largest dividing dim when the rule set shards parameters' ``embed`` dim."""
    table = dict(rules.params)
    axes = tuple(a for a in axes_of(table.get("embed")) if sizes.get(a, 1) > 1)
    n = math.prod(sizes[a] for a in axes)
    if not axes or math.prod(shape) < min_size:
        return P(), "replicated"
    for i in sorted(range(len(shape)), key=lambda i: (-shape[i], i)):
        if shape[i] % n == 0:
            entries: list[Any] = [None] * len(shape)
            entries[i] = axes[0] if len(axes) == 1 else axes
            return P(*entries), f"default (dim {i} over {' x '.join(axes)})"
    return P(), f"replicated (no dim divides by {' x '.join(axes)}={n})"


def decide(abstract_state: nnx.State, rules: Rules | str, mesh: MeshLike, *, path_rules: PathRules = (),
           min_default_size: int = MIN_DEFAULT_SIZE, on_indivisible: str = "error") -> list[Decision]:
    """One :class:`Decision` per variable of an (abstract) NNX state, in tree order."""
    rules = get_rules(rules)
    compiled = _check_path_rules(path_rules)
    sizes = axis_sizes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    out = []
    for key_path, var in leaves:
        path, kind = path_str(key_path), type(var).__name__
        shape = tuple(getattr(var, "shape", ()))
        dims = variable_dims(var)
        if dims is not None:
            spec = spec_for(shape, dims, rules, mesh, path=path, on_indivisible=on_indivisible)
            out.append(Decision(path, kind, shape, dims, spec, "annotation"))
            continue
        match = next(((c, d, text) for c, d, text in compiled if c.search(path)), None)
        if match is not None:
            _, d, text = match
            if isinstance(d, P):
                entries = list(d)
                while entries and entries[-1] is None:
                    entries.pop()
                spec = P(*entries)
                _check_direct(path, shape, d, sizes, text)
                out.append(Decision(path, kind, shape, None, spec, f"path rule {text!r}"))
            else:
                if len(d) != len(shape):
                    raise RulesError(f"path rule {text!r} gives {path} (shape {shape}) {len(d)} dims {d}; "
                                     f"it needs {len(shape)}")
                spec = spec_for(shape, d, rules, mesh, path=path, on_indivisible=on_indivisible)
                out.append(Decision(path, kind, shape, d, spec, f"path rule {text!r}"))
            continue
        if kind.startswith("Rng") or _is_key(var):
            out.append(Decision(path, kind, shape, None, P(), "replicated"))
            continue
        spec, source = _default_spec(shape, rules, sizes, min_default_size) if isinstance(var, nnx.Param) else (P(), "replicated")
        out.append(Decision(path, kind, shape, None, spec, source))
    return out


def _check_direct(path: str, shape: tuple[int, ...], spec: P, sizes: dict[str, int], rule: str) -> None:
    if len(spec) > len(shape):
        raise RulesError(f"path rule {rule!r} gives {path} (shape {shape}) the spec {spec} of {len(spec)} dims")
    for i, entry in enumerate(spec):
        axes = axes_of(entry)
        for a in axes:
            if a not in sizes:
                raise RulesError(f"path rule {rule!r}: mesh axis {a!r} is not in the mesh ({', '.join(sizes)})")
        n = math.prod(sizes[a] for a in axes)
        if shape[i] % n:
            raise RulesError(f"path rule {rule!r}: {path} dim {i} has size {shape[i]}, which does not divide by "
                             f"{' x '.join(f'{a}={sizes[a]}' for a in axes)} = {n}")


def format_decisions(decisions: Sequence[Decision]) -> str:
    """The sharding of every variable, and why, as a table."""
    rows = [(d.path, d.kind, str(d.shape), str(d.spec), d.source) for d in decisions]
    head = ("variable", "kind", "shape", "spec", "why")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _to_storage(x: Any) -> Any:
    return jax.random.key_data(x) if _is_key(x) else x


def _abstract_storage(x: Any) -> Any:
    return jax.eval_shape(jax.random.key_data, x) if _is_key(x) else x


@dataclasses.dataclass
class ModelVars:
    """A model split for a functional step: graph, params, every other variable, their shardings.

    ``merge(params, other)`` rebuilds the module inside a jitted function; ``split(module)`` takes
    ``(params, other)`` back out of it (after a call updated batch statistics or RNG counts).
    """

    graphdef: nnx.GraphDef
    params: Any
    other: Any
    shardings: dict[str, Any]
    keys: Any  # pure dict of bools over ``other``: which leaves are RNG keys (stored as key data)
    decisions: list[Decision]

    def merge(self, params: Any, other: Any) -> nnx.Module:
        other = jax.tree.map(lambda is_key, x: jax.random.wrap_key_data(x) if is_key else x, self.keys, other)
        return nnx.merge(self.graphdef, params, other) if other else nnx.merge(self.graphdef, params)

    def split(self, module: nnx.Module) -> tuple[Any, Any]:
        _, params, other = nnx.split(module, nnx.Param, ...)
        return nnx.to_pure_dict(params), jax.tree.map(_to_storage, nnx.to_pure_dict(other))


def init_model(make: Callable[[], nnx.Module], rules: Rules | str, mesh: Mesh, *, path_rules: PathRules = (),
               abstract: bool = False, on_indivisible: str = "error") -> ModelVars:
    """Create every variable of ``make()`` directly sharded (``abstract=True``: shapes and shardings only).

    ``make`` is traced once abstractly to read shapes and metadata, then run under ``jax.jit`` with
    ``out_shardings``, so each device only ever allocates its own shards.
    """
    model = abstract_module(make)
    graphdef, params_state, other_state = nnx.split(model, nnx.Param, ...)
    decisions = decide(params_state, rules, mesh, path_rules=path_rules, on_indivisible=on_indivisible)
    decisions += decide(other_state, rules, mesh, path_rules=path_rules, on_indivisible=on_indivisible)
    by_path = {d.path: NamedSharding(mesh, d.spec) for d in decisions}

    def shardings_of(state: nnx.State) -> Any:
        pure = nnx.to_pure_dict(state)
        flat = jax.tree_util.tree_flatten_with_path(pure)[0]
        treedef = jax.tree.structure(pure)
        return jax.tree.unflatten(treedef, [by_path[path_str(p)] for p, _ in flat])

    shardings = {"params": shardings_of(params_state), "other": shardings_of(other_state)}
    keys = jax.tree.map(_is_key, nnx.to_pure_dict(other_state))
    if abstract:
        params = nnx.to_pure_dict(params_state)
        other = jax.tree.map(_abstract_storage, nnx.to_pure_dict(other_state))
    else:
        def init() -> tuple[Any, Any]:
            with nnx.use_eager_sharding(False):
                _, p, o = nnx.split(make(), nnx.Param, ...)
            return nnx.to_pure_dict(p), jax.tree.map(_to_storage, nnx.to_pure_dict(o))

        params, other = jax.jit(init, out_shardings=(shardings["params"], shardings["other"]))()
    return ModelVars(graphdef, params, other, shardings, keys, decisions)
