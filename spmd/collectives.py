"""Explicit collectives for ``shard_map`` code, documented in the scaling book's notation.

Each collective is a subscript edit: ``all_gather`` ``A[I_X, J] -> A[I, J]``, ``psum``
``A[I, J]{U_X} -> A[I, J]``, ``psum_scatter`` ``A[I, J]{U_X} -> A[I_X, J]``, ``all_to_all``
``A[I_X, J] -> A[I, J_X]``, ``ppermute`` moves blocks. Table and ring costs: docs/sharding.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

AxisName = str | tuple[str, ...]


def psum(x: jax.Array, axis: AxisName) -> jax.Array:
    """All-reduce (sum): ``A[I]{U_X} -> A[I]``. Every device ends with the sum of all blocks."""
    return lax.psum(x, axis)


def pmean(x: jax.Array, axis: AxisName) -> jax.Array:
    """All-reduce (mean): ``A[I]{U_X} -> A[I] / |X|``, e.g. averaging data-parallel gradients."""
    return lax.pmean(x, axis)


def all_gather(x: jax.Array, axis: AxisName, *, dim: int = 0, tiled: bool = True, invariant: bool = False) -> jax.Array:
    """All-gather: ``A[I_X, J] -> A[I, J]`` along tensor dim ``dim``.

    ``tiled=True`` concatenates the blocks (shape grows |X|-fold along ``dim``); ``tiled=False``
    stacks them in a new dim of size |X| inserted at position ``dim``. ``invariant=True`` marks the
    result as identical on every device of X, which ``out_specs=P()`` needs under shard_map's
    replication checking.
    """
    return lax.all_gather(x, axis, axis=dim, tiled=tiled, to="invarying" if invariant else "varying")


def psum_scatter(x: jax.Array, axis: AxisName, *, dim: int = 0) -> jax.Array:
    """Reduce-scatter: ``A[I, J]{U_X} -> A[I_X, J]``: sum over X, each device keeps its block of ``dim``.

    Half an all-reduce; what FSDP does with weight gradients.
    """
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def all_to_all(x: jax.Array, axis: AxisName, *, split_dim: int, concat_dim: int) -> jax.Array:
    """All-to-all: ``A[I_X, J] -> A[I, J_X]`` moves the sharding from ``concat_dim`` to ``split_dim``.

    ``split_dim`` is cut into |X| blocks sent one to each device; the received blocks are
    concatenated along ``concat_dim`` (the dim that was sharded). Used for MoE dispatch and for
    switching between sequence and head sharding.
    """
    return lax.all_to_all(x, axis, split_axis=split_dim, concat_axis=concat_dim, tiled=True)


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, axis: str, *, bound: int) -> jax.Array:
    """Ragged all-to-all (:func:`jax.lax.ragged_all_to_all`'s arguments): ``operand[input_offsets[j]:][:send_sizes[j]]``
    goes to device j of ``axis``, which writes it into ``output`` at the ``output_offsets[j]`` this device names;
    ``recv_sizes[i]`` rows come from device i. Only the rows sent move (GPU, TPU). XLA:CPU has no such
    collective: there each slice is padded to ``bound`` rows (a static bound on every ``send_sizes``) and moved by
    one :func:`all_to_all`, so the same call runs, with the same result, moving ``|axis| * bound`` rows."""
    if jax.default_backend() != "cpu":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis)
    i_B = jnp.arange(bound)
    rows_SB = jnp.where(i_B < send_sizes[:, None], input_offsets[:, None] + i_B, operand.shape[0])
    chunks = jnp.take(operand, rows_SB, axis=0, mode="fill", fill_value=0)  # [|axis|, bound, ...]
    chunks = all_to_all(chunks, axis, split_dim=0, concat_dim=0)  # [sources, bound, ...]
    offsets_S = all_to_all(output_offsets, axis, split_dim=0, concat_dim=0)  # where each source's rows go here
    dest_SB = jnp.where(i_B < recv_sizes[:, None], offsets_S[:, None] + i_B, output.shape[0])
    return output.at[dest_SB.reshape(-1)].set(chunks.reshape(-1, *chunks.shape[2:]), mode="drop")


def ppermute(x: jax.Array, axis: str, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """Collective permute: the block on axis index ``src`` goes to ``dst`` for each (src, dst).

    Devices that receive nothing get zeros. Pipelines pass activations between stages this way.
    """
    return lax.ppermute(x, axis, perm=list(perm))


def shift(x: jax.Array, axis: str, size: int, *, offset: int = 1, wrap: bool = True) -> jax.Array:
    """ppermute by ``offset`` positions along an axis of ``size`` devices (ring when ``wrap``)."""
    if wrap:
        perm = [(i, (i + offset) % size) for i in range(size)]
    else:
        perm = [(i, i + offset) for i in range(size) if 0 <= i + offset < size]
    return ppermute(x, axis, perm)


def axis_index(axis: str) -> jax.Array:
    """This device's position along ``axis`` (0 .. |axis|-1)."""
    return lax.axis_index(axis)


def varying_like(x: jax.Array, *like: jax.Array) -> jax.Array:
    """``x`` typed as varying over every manual axis any of ``like`` varies over (``pcast(..., to="varying")``).

    A loop carry that starts as a constant (zeros, ``-inf``) is invariant; once the body mixes in an
    input that varies over a manual axis (inside ``shard_map``: a batch split over ``data``) the
    carry's type changes and the loop is refused. Starting the carry with its final type avoids that.
    Outside ``shard_map`` (no manual axes), or when ``x`` already varies as ``like``, it returns ``x``.
    """
    missing = tuple(sorted(set().union(*(varying_axes(jax.typeof(a)) for a in like)) - varying_axes(jax.typeof(x))))
    return lax.pcast(x, missing, to="varying") if missing else x


def varying_axes(aval: jax.core.AbstractValue) -> frozenset:
    """The manual axes an abstract value (``jax.typeof(x)``) varies over (jax >= 0.10 keeps them in
    ``manual_axis_type.varying``, earlier releases in ``vma``); empty outside ``shard_map``."""
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))
