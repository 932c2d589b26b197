"""spmd.collectives inside jax.shard_map: numbers against numpy, and the HLO op each one emits.

Mesh: data=2 x tensor=4 over 8 simulated devices. Global input ``x[8, 16]``; with
``in_specs=P("data", "tensor")`` device (d, t) holds the block ``x[4d:4d+4, 4t:4t+4]``.
Each case is compiled once and reused for the numeric and the HLO checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd import collectives as C

D, T = 2, 4  # data, tensor
MESH = meshes.make_mesh({"data": D, "tensor": T})
X = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * 0.5 - 7.0


def blocks(x: np.ndarray, rows: int, cols: int) -> list[list[np.ndarray]]:
    """x cut into rows x cols blocks: blocks(x)[r][c]."""
    return [np.split(r, cols, axis=1) for r in np.split(x, rows, axis=0)]


def ring(size: int, offset: int = 1, wrap: bool = True) -> list[tuple[int, int]]:
    if wrap:
        return [(i, (i + offset) % size) for i in range(size)]
    return [(i, i + offset) for i in range(size) if 0 <= i + offset < size]


def expected_psum(x):  # x[B_data, F_tensor]{sum over tensor} -> every tensor device holds the row-block sum
    return np.concatenate([sum(row) for row in blocks(x, D, T)], axis=0)


def expected_all_to_all(x):  # in: x[I_tensor, J] (rows split); out: x[I, J_tensor]
    return x  # moving the sharding from rows to columns does not change the global array


def expected_shift(x, perm):
    cols = np.split(x, T, axis=1)
    out = [np.zeros_like(c) for c in cols]
    for src, dst in perm:
        out[dst] = cols[src]
    return np.concatenate(out, axis=1)


def expected_psum_scatter(x):
    # In: the data-row block of x on every tensor device (replicated over tensor), so the sum over
    # tensor is T * block; each device keeps column block t of it.
    return T * x


# name -> (function of a block, in_specs, out_specs, expected(x), HLO (kind, axes) or None)
CASES = {
    "psum": (lambda b: C.psum(b, "tensor"), P("data", "tensor"), P("data"), expected_psum,
             ("all-reduce", ("tensor",))),
    "psum_data": (lambda b: C.psum(b, "data"), P("data", "tensor"), P(None, "tensor"),
                  lambda x: sum(np.split(x, D, axis=0)), ("all-reduce", ("data",))),
    "psum_both": (lambda b: C.psum(b, ("data", "tensor")), P("data", "tensor"), P(),
                  lambda x: sum(sum(row) for row in blocks(x, D, T)), ("all-reduce", ("data", "tensor"))),
    "pmean": (lambda b: C.pmean(b, "tensor"), P("data", "tensor"), P("data"), lambda x: expected_psum(x) / T,
              ("all-reduce", ("tensor",))),
    # Tiled and varying: each tensor device holds the whole row block; out_specs concatenates the T copies.
    "all_gather": (lambda b: C.all_gather(b, "tensor", dim=1), P("data", "tensor"), P("data", "tensor"),
                   lambda x: np.tile(x, (1, T)), ("all-gather", ("tensor",))),
    # Invariant: identical on every device, so out_specs=P() is allowed.
    "all_gather_invariant": (lambda b: C.all_gather(b, "tensor", dim=1, invariant=True), P(None, "tensor"), P(),
                             lambda x: x, ("all-gather", ("tensor",))),
    # Over both axes, one after the other: two all-gathers.
    "all_gather_2d": (
        lambda b: C.all_gather(C.all_gather(b, "tensor", dim=1, invariant=True), "data", dim=0, invariant=True),
        P("data", "tensor"), P(), lambda x: x, {("all-gather", ("tensor",)), ("all-gather", ("data",))}),
    # Untiled: a new dim of size T, at position ``dim``, stacks the blocks.
    "all_gather_stacked": (lambda b: C.all_gather(b, "tensor", dim=0, tiled=False, invariant=True),
                           P(None, "tensor"), P(), lambda x: np.stack(np.split(x, T, axis=1)),
                           ("all-gather", ("tensor",))),
    "all_gather_stacked_dim1": (lambda b: C.all_gather(b, "tensor", dim=1, tiled=False, invariant=True),
                                P(None, "tensor"), P(), lambda x: np.stack(np.split(x, T, axis=1), axis=1),
                                ("all-gather", ("tensor",))),
    # Each device sums the T blocks of its data row and keeps row t of the sum: rows ordered (d, t).
    "psum_scatter": (lambda b: C.psum_scatter(b, "tensor", dim=0), P("data", "tensor"), P(("data", "tensor")),
                     expected_psum, ("reduce-scatter", ("tensor",))),
    "psum_scatter_cols": (lambda b: C.psum_scatter(b, "tensor", dim=1), P("data"), P("data", "tensor"),
                          expected_psum_scatter, ("reduce-scatter", ("tensor",))),
    "all_to_all": (lambda b: C.all_to_all(b, "tensor", split_dim=1, concat_dim=0), P("tensor"), P(None, "tensor"),
                   expected_all_to_all, ("all-to-all", ("tensor",))),
    "ppermute": (lambda b: C.ppermute(b, "tensor", [(i, T - 1 - i) for i in range(T)]), P(None, "tensor"),
                 P(None, "tensor"), lambda x: expected_shift(x, [(i, T - 1 - i) for i in range(T)]),
                 ("collective-permute", ("tensor",))),
    "shift": (lambda b: C.shift(b, "tensor", T), P(None, "tensor"), P(None, "tensor"),
              lambda x: expected_shift(x, ring(T)), ("collective-permute", ("tensor",))),
    "shift_back": (lambda b: C.shift(b, "tensor", T, offset=-1), P(None, "tensor"), P(None, "tensor"),
                   lambda x: expected_shift(x, ring(T, -1)), ("collective-permute", ("tensor",))),
    "shift_nowrap": (lambda b: C.shift(b, "tensor", T, wrap=False), P(None, "tensor"), P(None, "tensor"),
                     lambda x: expected_shift(x, ring(T, wrap=False)), ("collective-permute", ("tensor",))),
    "axis_index": (lambda b: jnp.zeros_like(b) + 10 * C.axis_index("data") + C.axis_index("tensor"),
                   P("data", "tensor"), P("data", "tensor"),
                   lambda x: np.block([[np.full((4, 4), 10 * d + t, np.float32) for t in range(T)] for d in range(D)]),
                   None),
}


@functools.cache
def compiled(name: str):
    f, in_specs, out_specs, _, _ = CASES[name]
    mapped = jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs))
    return mapped.lower(jax.ShapeDtypeStruct(X.shape, X.dtype)).compile()


@pytest.mark.parametrize("name", CASES)
def test_matches_numpy(name):
    out = np.asarray(compiled(name)(jnp.asarray(X)))
    want = CASES[name][3](X)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_numpy_references_are_not_trivial():
    """Negative control: the references tell the collectives apart on this input."""
    assert not np.allclose(expected_shift(X, ring(T)), expected_shift(X, ring(T, -1)))
    assert not np.allclose(expected_shift(X, ring(T)), expected_shift(X, ring(T, wrap=False)))
    assert not np.allclose(expected_psum(X), expected_psum(X) / T)
    out = np.asarray(compiled("shift")(jnp.asarray(X)))
    assert not np.allclose(out, X)


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[4] is not None])
def test_hlo_kind_and_axes(name):
    want = CASES[name][4]
    want = want if isinstance(want, set) else {want}
    ops = spmd.hlo.collectives(compiled(name), MESH)
    assert {(op.kind, op.axes) for op in ops} == want, spmd.hlo.format_collectives(ops)
    assert len(ops) == len(want), spmd.hlo.format_collectives(ops)


def test_axis_index_needs_no_communication():
    assert spmd.hlo.collectives(compiled("axis_index"), MESH) == []


def test_collective_bytes():
    """Per-device bytes: the full buffer each collective produces (f32)."""
    block = 4 * 4 * 4  # x[4, 4] f32 block of P("data", "tensor")
    (op,) = spmd.hlo.collectives(compiled("psum"), MESH)
    assert (op.kind, op.bytes, op.group_size, op.count) == ("all-reduce", block, T, 1)
    (op,) = spmd.hlo.collectives(compiled("all_gather"), MESH)
    assert (op.kind, op.bytes, op.group_size) == ("all-gather", T * block, T)
    (op,) = spmd.hlo.collectives(compiled("psum_scatter"), MESH)  # the un-scattered input
    assert (op.kind, op.bytes, op.group_size) == ("reduce-scatter", block, T)
    (op,) = spmd.hlo.collectives(compiled("psum_scatter_cols"), MESH)
    assert (op.kind, op.bytes, op.group_size) == ("reduce-scatter", 4 * 16 * 4, T)
    ops = spmd.hlo.collectives(compiled("all_gather_2d"), MESH)
    assert sorted((op.axes, op.bytes) for op in ops) == [(("data",), 8 * 16 * 4), (("tensor",), 4 * 16 * 4)]
    summary = spmd.hlo.summarize(spmd.hlo.collectives(compiled("psum_both"), MESH))
    assert summary == {("all-reduce", ("data", "tensor")): {"count": 1, "bytes": block}}
