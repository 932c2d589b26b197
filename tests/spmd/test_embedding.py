"""The token-embedding lookup inside a manual region (gradient accumulation's loop, manual over
``data``) equals ``jnp.take`` on one device, values and gradients, ids outside the vocab included;
a shuffled table is caught (negative control)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import meshes
from spmd import get_rules
from spmd.manual import with_inner_rules
from spmd.models import embedding

V, D = 64, 8


def _inside_data_manual(table, tokens, weights):
    """``(sum(lookup(table, tokens) * weights), d/dtable)`` in a shard_map manual over ``data`` on the
    default 8-device mesh with ``fsdp_tp`` rules (``E[V_tensor, D]``, ``fsdp`` automatic and free):
    the region XLA's partitioner of the plain gather aborts on with jax 0.12."""
    mesh = meshes.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = get_rules("fsdp_tp")
    seen = []

    def local(table, tokens, weights):
        seen.append(embedding.vocab_parallel_axes())

        def loss(t):
            x_BLD = embedding.lookup(t, tokens)
            return jnp.sum(jnp.where(jnp.isnan(x_BLD), 0.0, x_BLD) * weights)

        table = jax.lax.pcast(table, ("data",), to="varying")
        value, grad = jax.value_and_grad(loss)(table)
        value, grad = (a.astype(jnp.float32) for a in (value, grad))  # summed over data in f32, as a step does
        return jax.lax.psum(value, "data"), jax.lax.psum(grad, "data"), jnp.isnan(embedding.lookup(table, tokens))

    inner = with_inner_rules(local, mesh, rules, "data", ("data",))
    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                    out_specs=(P(), P(), P("data")), axis_names=frozenset({"data"})))(
            table, tokens, weights)
    assert seen == [("tensor",)], seen  # the spelled-out path ran
    return out


def test_lookup_in_a_manual_region_equals_take_on_one_device():
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (8, 16)), jnp.int32)
    tokens = tokens.at[0, :3].set(jnp.asarray([-1, -V, V]))  # counted from the end, twice; out of range: NaN
    weights = jnp.asarray(rng.normal(size=(8, 16, D)), jnp.float32)

    def reference(t):
        x = jnp.take(t, tokens, axis=0)
        return jnp.sum(jnp.where(jnp.isnan(x), 0.0, x) * weights)

    want, want_grad = jax.value_and_grad(reference)(table)
    got, grad, nan = _inside_data_manual(table, tokens, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(nan).any(-1), np.isnan(np.asarray(jnp.take(table, tokens, axis=0))).any(-1))
    assert np.asarray(nan)[0, 2].all() and not np.asarray(nan)[0, :2].any()
    # negative control: rows moved between the vocab shards change the result the comparison reads
    swapped = jnp.concatenate([table[V // 2:], table[: V // 2]])
    bad, _, _ = _inside_data_manual(swapped, tokens, weights)
    assert abs(float(bad) - float(want)) > 1e-3 * abs(float(want))


def test_a_bf16_lookup_in_a_manual_region_compiles_and_is_exact():
    """bf16 (a model's compute dtype): XLA:CPU's all-reduce promotion aborted the process on the nested
    region's 16-bit psum ("Invalid binary instruction opcode copy"), which any bf16 run with accumulation and
    a vocab split over tensor reached; each row is nonzero on one shard, so the sum is exact in any dtype."""
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, V, (8, 16)), jnp.int32)
    weights = jnp.ones((8, 16, D), jnp.bfloat16)
    got, grad, _ = _inside_data_manual(table, tokens, weights)
    rows = jnp.take(table, tokens, axis=0)
    np.testing.assert_allclose(float(got), float(jnp.sum(rows.astype(jnp.float32))), rtol=1e-2)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=V)  # d/dE of sum(E[tokens]): each row's count
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.repeat(counts[:, None], D, 1).astype(np.float32))
