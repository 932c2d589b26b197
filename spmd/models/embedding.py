"""Token-embedding lookup: ``x[B, L, D] = E[V, D][tokens[B, L]]``, on every layout.

Outside a manual region the lookup is one gather that GSPMD partitions: with ``E[V_tensor, D]``
each device looks up the ids of its own vocab shard and an all-reduce over ``tensor`` sums the
partial rows. Inside a ``shard_map`` manual over some axes (gradient accumulation's loop is manual
over ``data``), XLA's partitioner of that gather aborts the process on some jax versions (0.12: a
failed check in ``spmd_partitioner_util.cc`` when the table's vocab axis is automatic and another
automatic axis is free). There :func:`lookup` spells the same plan out in a ``shard_map`` of its
own over the vocab axes: a local masked gather of ``E[V/n, D]``, then ``psum`` over the vocab axes
(the all-reduce GSPMD would run). Both give the same numbers, also for ids outside ``[0, V)``
(``jnp.take``'s rules: a negative id counts from the end, one outside ``[-V, V)`` gives a NaN row).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from meshes import axis_sizes
from spmd.constraints import active_layout
from spmd.rules import axes_of


def vocab_parallel_axes() -> tuple[str, ...]:
    """The automatic mesh axes the active activation rules split ``vocab`` over, when the active mesh
    also has Manual axes (a lookup there is spelled out by :func:`lookup`); () otherwise."""
    active = active_layout()
    if active is None:
        return ()
    mesh, rules = active
    if not any(t == AxisType.Manual for t in mesh.axis_types):
        return ()
    sizes, types = axis_sizes(mesh), dict(zip(mesh.axis_names, mesh.axis_types))
    entry = dict(rules.activations).get("vocab")
    return tuple(a for a in axes_of(entry) if sizes.get(a, 1) > 1 and types.get(a) != AxisType.Manual)


def lookup(table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """``table[tokens]`` along dim 0 (``x[B, L, D]``); see the module docstring for the two plans.

    ``table_VD`` is the table as used in compute (``E[V_tensor, D]``, e.g. from
    :func:`spmd.models.layers.weight`); inside a manual region with vocab split over automatic axes
    ``V`` must divide over them (it does: the rules fit the table to the mesh)."""
    axes = vocab_parallel_axes()
    sizes = axis_sizes(active_layout()[0]) if axes else {}
    n = math.prod(sizes[a] for a in axes)
    if not axes or table_VD.shape[0] % n:
        return jnp.take(table_VD, tokens_BL, axis=0)
    v = table_VD.shape[0]
    tokens_BL = jnp.where(tokens_BL < 0, tokens_BL + v, tokens_BL)  # numpy's negative indices, as jnp.take

    shard, dtype, mesh = v // n, table_VD.dtype, jax.sharding.get_abstract_mesh()

    def mine(tokens_BL: jax.Array) -> tuple[jax.Array, jax.Array]:  # this shard's row of each id, and whether it has it
        ids_BL = tokens_BL - jax.lax.axis_index(axes) * shard
        ok_BL = (ids_BL >= 0) & (ids_BL < shard)
        return jnp.where(ok_BL, ids_BL, 0), ok_BL

    # XLA:CPU sums a 16-bit float psum in f32 (its all-reduce promotion), and aborts on the reducer jax gives
    # a region nested in another ("Invalid binary instruction opcode copy"): there the rows are summed in f32
    # (exact either way: each row is nonzero on one shard only)
    wide = jnp.promote_types(dtype, jnp.float32) if jax.default_backend() == "cpu" else dtype

    def forward(table_vD: jax.Array, tokens_BL: jax.Array) -> jax.Array:  # x[B, L, D]{U_axes} -> psum
        ids_BL, ok_BL = mine(tokens_BL)
        x_BLD = jnp.take(table_vD, ids_BL, axis=0).astype(wide)
        return jax.lax.psum(jnp.where(ok_BL[..., None], x_BLD, jnp.zeros((), wide)), axes).astype(dtype)

    def backward(tokens_BL: jax.Array, dx_BLD: jax.Array) -> jax.Array:  # dE[V_axes, D]: each shard its rows
        ids_BL, ok_BL = mine(tokens_BL)
        dx_BLD = jnp.where(ok_BL[..., None], dx_BLD, jnp.zeros((), dx_BLD.dtype))
        return jnp.zeros((shard, dx_BLD.shape[-1]), dx_BLD.dtype).at[ids_BL].add(dx_BLD)

    # a custom VJP keeps AD out of the inner shard_map: its residuals, differentiated through, would be
    # stacked over the outer manual axes in an order the sharding verifier rejects
    @jax.custom_vjp
    def parallel(table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
        return jax.shard_map(forward, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(),
                             axis_names=frozenset(axes))(table_VD, tokens_BL)

    def parallel_fwd(table_VD, tokens_BL):
        return parallel(table_VD, tokens_BL), tokens_BL

    def parallel_bwd(tokens_BL, dx_BLD):
        d_VD = jax.shard_map(backward, mesh=mesh, in_specs=(P(), P()), out_specs=P(axes),
                             axis_names=frozenset(axes))(tokens_BL, dx_BLD)
        return d_VD.astype(dtype), None

    parallel.defvjp(parallel_fwd, parallel_bwd)
    x_BLD = parallel(table_VD, tokens_BL)
    valid_BL = (tokens_BL >= 0) & (tokens_BL < v)
    return jnp.where(valid_BL[..., None], x_BLD, jnp.asarray(jnp.nan, x_BLD.dtype))
