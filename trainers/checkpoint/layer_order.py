"""Checkpoints hold every block stack in natural layer order, whatever order the run stores it in.

A run with an interleaved pipeline stores its stack in chunk order (``spmd.pipeline.order``).
:func:`to_natural` puts the stacked leaves of a state in natural order before a save,
:func:`from_natural` puts restored leaves back in the run's order, so a checkpoint restores onto any
mesh and schedule. A stacked leaf is one whose path holds a stack's block path (params, optimizer
moments, other variables alike) with the layers dim first, or second in a local-SGD state (after the
group dim of every leaf but ``outer_params`` and ``outer_opt_state``). Each is one jitted all-to-all over
``pipe`` that keeps every leaf's sharding (a save holds a converted copy of those leaves meanwhile).
"""

from __future__ import annotations

from typing import Any

import jax

from spmd.pipeline.order import LayerOrder
from trainers.local_sgd import OUTER_KEYS

StackOrders = tuple[tuple[tuple[str, ...], int, LayerOrder], ...]  # spmd.stack.stack_orders(model)


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _order(path: tuple[Any, ...], leaf: Any, stacks: StackOrders, lead: int) -> LayerOrder | None:
    names = _names(path)
    for block, n, order in stacks:
        inside = any(names[i:i + len(block)] == block for i in range(len(names) - len(block) + 1))
        if inside and getattr(leaf, "shape", ())[lead:lead + 1] == (n,):
            return order
    return None


def _convert(tree: Any, stacks: StackOrders, natural: bool, donate: bool) -> Any:
    if not stacks:
        return tree
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # a local-SGD state: every leaf but the outer ones has a group dim before the layers dim
    grouped = any(_names(path)[:1] == (OUTER_KEYS[0],) for path, _ in flat)
    lead = [int(grouped and _names(path)[0] not in OUTER_KEYS) for path, _ in flat]
    picked = [(i, order) for i, (path, leaf) in enumerate(flat)
              if (order := _order(path, leaf, stacks, lead[i])) is not None]
    if not picked:
        return tree
    orders = [order for _, order in picked]
    leads = [lead[i] for i, _ in picked]
    leaves = [flat[i][1] for i, _ in picked]

    def convert(xs):
        out = []
        for x, o, g in zip(xs, orders, leads):
            f = o.to_natural if natural else o.to_stored
            out.append(jax.vmap(f)(x) if g else f(x))
        return out

    shardings = [getattr(x, "sharding", None) for x in leaves]
    out = jax.jit(convert, out_shardings=shardings, donate_argnums=(0,) if donate else ())(leaves)
    new = [leaf for _, leaf in flat]
    for (i, _), x in zip(picked, out):
        new[i] = x
    return jax.tree.unflatten(treedef, new)


def to_natural(state: Any, stacks: StackOrders) -> Any:
    """``state`` with each stack's leaves in natural layer order (new arrays; ``state`` is untouched)."""
    return _convert(state, stacks, natural=True, donate=False)


def from_natural(state: Any, stacks: StackOrders) -> Any:
    """Restored ``state`` (natural order) with each stack's leaves in the run's order (donates them)."""
    return _convert(state, stacks, natural=False, donate=True)
