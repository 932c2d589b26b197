"""How the stage and head parameters enter the pipeline's ``shard_map``: specs, one gather, one reduction.

:class:`ParamLayout` all-gathers parameters sharded over a manual batch axis (``W[layers_pipe,
D_fsdp, F_tensor]``) once before the tick loop and reduce-scatters their gradients once after it.
See docs/pipelines.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd import collectives
from spmd.manual import param_axes
from spmd.rules import Rules, RulesError, axes_of
from spmd.sharding import spec_for, variable_dims

GatherPlan = tuple[tuple[int, tuple[str, ...]], ...]  # per leaf: (dim, manual axes sharding it), in dim order
# manual batch axes a parameter stays sharded over inside the region (not gathered): the layer that reads
# it takes its own shard (the MoE experts W[E_expert, ...]: each device computes its E/ep experts)
KEPT = ("expert",)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Per-leaf ``shard_map`` specs and gather plans of the stage params (``[L, ...]``) and the head.

    ``stage_specs[i]`` / ``head_specs[i]`` are the ``in_specs`` of the flattened leaves;
    ``stage_plans`` / ``head_plans`` say which dims to all-gather over which manual batch axes.
    ``batch_axes`` are all the manual batch axes (gradients are partial sums over each of them).
    """

    stage_specs: tuple[P, ...]
    head_specs: tuple[P, ...]
    stage_plans: tuple[GatherPlan, ...]
    head_plans: tuple[GatherPlan, ...]
    batch_axes: tuple[str, ...]
    stage_dtypes: tuple[Any, ...] = ()  # per stage leaf: the dtype it is gathered in (None: its own)

    @property
    def gathers(self) -> bool:
        """Whether any parameter is sharded over a manual batch axis (FSDP inside the pipeline)."""
        return any(self.stage_plans) or any(self.head_plans)

    @staticmethod
    def gather(leaves: list[jax.Array], plans: tuple[GatherPlan, ...], dtypes: tuple[Any, ...] = ()) -> list[jax.Array]:
        """``W[.., D_fsdp, ..] -> W[.., D, ..]``: tiled all-gather of each planned dim (once per step);
        a leaf with a narrower ``dtypes[i]`` moves in it (:func:`narrow_gather`)."""
        out = []
        for i, (x, plan) in enumerate(zip(leaves, plans, strict=True)):
            dtype = dtypes[i] if dtypes else None
            if plan and dtype is not None and jnp.dtype(dtype).itemsize < x.dtype.itemsize:
                out.append(narrow_gather(x, plan, dtype))
                continue
            for dim, axes in plan:
                x = collectives.all_gather(x, axes, dim=dim, tiled=True)
            out.append(x)
        return out

    def reduce(self, grads: list[jax.Array], plans: tuple[GatherPlan, ...], specs: tuple[P, ...]) -> list[jax.Array]:
        """``G{U_batch}`` at gathered size -> ``G`` in the stored layout: reduce-scatter over the
        gathered axes, all-reduce over the manual batch axes the leaf's spec does not name (one
        reduction per step; a leaf kept sharded, :data:`KEPT`, holds its own shard's whole gradient)."""
        out = []
        for g, plan, spec in zip(grads, plans, specs, strict=True):
            for dim, axes in reversed(plan):
                g = collectives.psum_scatter(g, axes, dim=dim)
            named = {a for entry in spec for a in axes_of(entry)}
            rest = tuple(a for a in self.batch_axes if a not in named)
            out.append(collectives.psum(g, rest) if rest else g)
        return out


def gather_dtypes(leaves: list[Any], compute_dtype: Any) -> tuple[Any, ...]:
    """Per stage leaf ``[L, ...]``, the dtype its gather moves: ``compute_dtype`` for the weight
    matrices (rank >= 3, floating: the blocks cast them to the compute dtype at use), None (their
    own) for the rest (norm scales and biases, which may be used in f32)."""
    if compute_dtype is None:
        return ()
    return tuple(compute_dtype if a.ndim >= 3 and jnp.issubdtype(a.dtype, jnp.floating) else None for a in leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def narrow_gather(x: jax.Array, plan: GatherPlan, dtype: Any) -> jax.Array:
    """``W[.., D_fsdp, ..] -> W[.., D, ..]`` moved in ``dtype`` (half the bytes of f32 under bf16) and
    widened back: the same values as the cast the blocks apply at use, so the forward pass is unchanged.
    Its VJP reduce-scatters the gradient in the parameter dtype (GPipe differentiates it; the table
    engine reduces the gathered gradients itself, :meth:`ParamLayout.reduce`)."""
    bits = jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")  # moved as its bits: no float collective to promote
    y = jax.lax.bitcast_convert_type(x.astype(dtype), bits)
    for dim, axes in plan:
        y = collectives.all_gather(y, axes, dim=dim, tiled=True)
    return jax.lax.bitcast_convert_type(y, dtype).astype(x.dtype)


def _narrow_gather_fwd(x, plan, dtype):
    return narrow_gather(x, plan, dtype), None


def _narrow_gather_bwd(plan, dtype, _, g):
    for dim, axes in reversed(plan):
        g = collectives.psum_scatter(g, axes, dim=dim)
    return (g,)


narrow_gather.defvjp(_narrow_gather_fwd, _narrow_gather_bwd)


def _leaf_dims(tree: Any) -> list[tuple[str | None, ...] | None] | None:
    variables = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) != len(jax.tree.leaves(tree)):
        return None
    return [variable_dims(v) if isinstance(v, nnx.Variable) else None for v in variables]


def _manual_part(spec: P, ndim: int, manual: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The manual axes of each entry of ``spec`` (None where a manual axis follows an automatic one
    in the same dim: the local block would not be contiguous)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for entry in entries:
        axes = axes_of(entry)
        keep = tuple(a for a in axes if a in manual)
        if keep != axes[:len(keep)]:
            return None
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return tuple(out)


def param_layout(stage_params: Any, head_params: Any, rules: Rules | None, mesh: Mesh, axis: str,
                 batch_axes: tuple[str, ...], compute_dtype: Any = None) -> ParamLayout | None:
    """The layout of the parameters with ``axis`` and ``batch_axes`` manual, or None when a leaf's
    stored sharding over a manual batch axis cannot be expressed (the caller keeps that axis automatic).
    ``compute_dtype``: what the stage weight matrices' gathers move (:func:`gather_dtypes`)."""
    stage_leaves, head_leaves = jax.tree.leaves(stage_params), jax.tree.leaves(head_params)
    sharding_axes = [a for a in batch_axes if rules is not None and a in param_axes(rules)]
    if not sharding_axes:
        return ParamLayout((P(axis),) * len(stage_leaves), (P(),) * len(head_leaves),
                           ((),) * len(stage_leaves), ((),) * len(head_leaves), batch_axes)
    specs: list[list[P]] = [[], []]
    plans: list[list[GatherPlan]] = [[], []]
    for k, tree in enumerate((stage_params, head_params)):
        dims = _leaf_dims(tree)
        if dims is None or any(d is None for d in dims):
            return None
        for leaf, d in zip(jax.tree.leaves(tree), dims, strict=True):
            try:
                full = spec_for(leaf.shape, d, rules, mesh)
            except RulesError:
                return None
            part = _manual_part(full, leaf.ndim, tuple(sharding_axes))
            if part is None or (k == 0 and part and part[0] is not None):
                return None
            if any(set(axes_of(e)) & set(KEPT) and set(axes_of(e)) - set(KEPT) for e in part if e is not None):
                return None  # a dim over a kept axis and a gathered one
            plans[k].append(tuple((i, axes_of(e)) for i, e in enumerate(part)
                                  if e is not None and not set(axes_of(e)) & set(KEPT)))
            specs[k].append(P(axis, *part[1:]) if k == 0 else P(*part))
    return ParamLayout(tuple(specs[0]), tuple(specs[1]), tuple(plans[0]), tuple(plans[1]), batch_axes,
                       gather_dtypes(stage_leaves, compute_dtype))
