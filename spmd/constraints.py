"""Activation constraints usable inside model code.

``constrain(x_BLD, ("batch", "length", "embed"))`` returns ``x`` unchanged outside a :func:`use_rules`
context; inside one, the dims are mapped through the rule set's activation table. The context is read
at trace time: enter it inside the jitted function. See docs/sharding.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from meshes import axis_sizes
from spmd.rules import Rules, axes_of, get_rules
from spmd.sharding import fit_spec

_CURRENT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("spmd_rules", default=None)


_GROUPS: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("spmd_group_axes", default=frozenset())


@contextlib.contextmanager
def replica_groups(axes: Iterable[str]) -> Iterator[None]:
    """Mark ``axes``, manual around the model, as splitting independent replica groups (local SGD's over
    ``data``) rather than one model's tokens: a layer with its own ``shard_map`` (MoE) then keeps its
    token statistics within a group and opens its region nested in theirs (:func:`group_axes`)."""
    token = _GROUPS.set(frozenset(axes))
    try:
        yield
    finally:
        _GROUPS.reset(token)


def group_axes() -> frozenset[str]:
    """The axes :func:`replica_groups` marked around the code being traced (empty outside)."""
    return _GROUPS.get()


@contextlib.contextmanager
def use_rules(rules: Rules | str, mesh: Mesh) -> Iterator[Rules]:
    """Make ``rules`` on ``mesh`` the layout that :func:`constrain` applies."""
    token = _CURRENT.set((mesh, get_rules(rules)))
    try:
        yield get_rules(rules)
    finally:
        _CURRENT.reset(token)


def active_layout() -> tuple[Mesh, Rules] | None:
    """The active (mesh, rules), or None for plain single-device code.

    The one channel by which model code sees the mesh: layers and :func:`spmd.pipeline.pipelined_loss`
    read it here; everything below them (the pipeline engine, shardings) takes mesh and rules as arguments.
    """
    return _CURRENT.get()


def dim_shards(dim: str) -> int:
    """How many shards the active activation rules split logical ``dim`` into (1 without a layout)."""
    active = _CURRENT.get()
    if active is None:
        return 1
    mesh, rules = active
    sizes = axis_sizes(mesh)
    spec = rules.spec((dim,), kind="activations", mesh_sizes=sizes, what="activation")
    return math.prod(sizes[a] for a in axes_of(spec[0])) if len(spec) else 1


def constrain(x: jax.Array, dims: Sequence[str | None], *, kind: str = "activations") -> jax.Array:
    """Constrain ``x`` (logical ``dims``) to the active rule set; no-op without one.

    ``kind="activations"`` (the default) uses the activation table; ``kind="params"`` the parameter
    table, for a value that must keep its parameter's layout (a weight cast on its own shard).
    """
    active = _CURRENT.get()
    if active is None:
        return x
    mesh, rules = active
    if len(dims) != x.ndim:
        raise ValueError(f"constrain: array of shape {x.shape} given {len(dims)} dims {tuple(dims)}")
    what = "activation" if kind == "activations" else "parameter"
    sizes = axis_sizes(mesh)
    # inside a region manual over some axes, the abstract mesh (which a vmap over the region can batch)
    target = mesh.abstract_mesh if AxisType.Manual in mesh.axis_types else mesh
    sharding = NamedSharding(target, fit_spec(rules.spec(dims, kind=kind, mesh_sizes=sizes, what=what), x.shape, dims, sizes))
    if all(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
