"""Which mesh axes run Manual inside a ``shard_map`` over the batch, and the rule set model code sees there.

Shared by the pipeline engine (``axis="pipe"``, always manual) and gradient accumulation's once-per-step
reduction: the axes the rule set splits ``batch`` over (``data``, ``fsdp``) run manual while each
microbatch's rows still divide (:func:`manual_batch_axes`); in a pipeline those it splits ``length`` over
too (:func:`manual_length_axes`). Inside, the model's
activation constraints are re-targeted at the partly manual mesh with those axes stripped
(:func:`with_inner_rules`): a constraint may only name automatic axes (``tensor``).
"""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import AxisType, Mesh

from meshes import axis_sizes
from spmd.constraints import use_rules
from spmd.rules import Rules, axes_of


def param_axes(rules: Rules) -> set[str]:
    """Every mesh axis the rule set shards some parameter dim over."""
    return {a for _, entry in rules.params for a in axes_of(entry)}


def manual_batch_axes(mesh: Mesh, rules: Rules | None, batch_rows: int, axis: str = "pipe", *,
                      shard_params: bool = True) -> tuple[str, ...]:
    """Mesh axes run Manual besides ``axis``: those ``rules`` split ``batch`` over (size > 1, in the
    rule's order) while ``batch_rows`` per microbatch still divides. ``shard_params=False`` leaves
    out the axes that also shard parameters (``fsdp``), which then stay automatic."""
    if rules is None:
        return ()
    acts = dict(rules.activations)
    skip = set() if shard_params else param_axes(rules)
    sizes = axis_sizes(mesh)
    out, n = [], 1
    for a in axes_of(acts.get("batch")):
        if a == axis or a in skip or sizes.get(a, 1) == 1 or batch_rows % (n * sizes[a]):
            continue
        out.append(a)
        n *= sizes[a]
    return tuple(out)


def manual_length_axes(mesh: Mesh, rules: Rules | None, axis: str = "pipe") -> tuple[str, ...]:
    """Mesh axes run Manual for the length besides ``axis``: those ``rules`` split ``length`` over (size > 1:
    context parallelism over ``seq``); inside, each device holds its shard of every row's positions."""
    if rules is None:
        return ()
    sizes = axis_sizes(mesh)
    return tuple(a for a in axes_of(dict(rules.activations).get("length")) if a != axis and sizes.get(a, 1) > 1)


def manual_mesh(mesh: Mesh, axes: frozenset[str]) -> Mesh:
    """The same devices with ``axes`` typed Manual: the context mesh inside a shard_map over them."""
    types = tuple(AxisType.Manual if n in axes else t for n, t in zip(mesh.axis_names, mesh.axis_types))
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def _strip_axes(rules: Rules, axes: tuple[str, ...]) -> Rules:
    """``rules`` with the (manual) ``axes`` removed from every mapping: inside the shard_map a
    constraint may only name automatic axes, and a manual batch axis is already split per device."""
    if not axes:
        return rules

    def strip(table):
        return tuple((dim, tuple(a for a in axes_of(entry) if a not in axes) or None) for dim, entry in table)

    return Rules(rules.name, strip(rules.params), strip(rules.activations))


def with_inner_rules(fn: Callable, mesh: Mesh, rules: Rules | None, axis: str,
                     batch_axes: tuple[str, ...] = ()) -> Callable:
    """Run ``fn`` with ``rules`` re-targeted at the partly manual mesh, so the model's activation
    constraints (which never name ``pipe``, and have the manual batch axes stripped) stay valid
    inside the shard_map; without rules ``fn`` runs as plain code."""
    if rules is None:
        return fn
    inner = manual_mesh(mesh, frozenset((axis, *batch_axes)))
    inner_rules = _strip_axes(rules, batch_axes)

    def wrapped(*args):
        with use_rules(inner_rules, inner):
            return fn(*args)

    return wrapped
