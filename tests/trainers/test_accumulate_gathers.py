"""A loss that gathers inside gradient accumulation's manual region (a user model's ``jnp.take`` of a
vocab-sharded table) is found before compiling; on the jax versions whose XLA aborts on it the loop
runs under GSPMD instead, with a warning, and its gradients equal the plain ones. The built-in
lookup, which opens a region of its own, is not counted (its loop keeps the once-per-step reduction)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd.manual import with_inner_rules
from spmd.models import embedding
from trainers import accumulate

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
WARNING = "the loop runs under GSPMD instead"


def _loss(params, other, batch, key):
    """A user's loss that gathers rows of a vocab-sharded table in the loop's region."""
    x_BLD = jnp.take(params["table"], batch["ids"], axis=0)
    return jnp.mean(jnp.sum(x_BLD * batch["w"], -1) ** 2), ({"n": jnp.float32(1)}, other)


def test_a_gathering_loss_runs_under_gspmd_with_equal_gradients(monkeypatch, caplog):
    monkeypatch.setattr(accumulate, "GATHER_ABORTS", True)  # as on jax 0.12, whatever jax runs the test
    mesh, rules = meshes.make_mesh(MESH), spmd.get_rules("fsdp_tp")
    rng = np.random.default_rng(0)
    params = {"table": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}
    batch = {"ids": jnp.asarray(rng.integers(0, 64, (8, 32)), jnp.int32),
             "w": jnp.asarray(rng.normal(size=(8, 32, 8)), jnp.float32)}
    shardings = {"table": NamedSharding(mesh, P("tensor", "fsdp"))}

    def accumulated(params, batch):
        with spmd.use_rules(rules, mesh):
            grads, loss, _ = accumulate.accumulate(jax.value_and_grad(_loss, has_aux=True), params, batch,
                                                   jax.random.key(0), grad_accum=2, mesh=mesh, rules=rules,
                                                   param_shardings=shardings, axes=("data",))
        return grads, loss

    with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, logger="trainers.accumulate"):
        grads, loss = jax.jit(accumulated)(jax.device_put(params, shardings), batch)
    assert WARNING in caplog.text and "1 gather" in caplog.text and "manual over data" in caplog.text, caplog.text
    (want_loss, _), want = jax.value_and_grad(_loss, has_aux=True)(params, {}, batch, None)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["table"], want["table"], rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(want["table"])).max() > 1e-2  # negative control: the gradient is not all zeros


@pytest.mark.parametrize("inside", ["take", "lookup"])
def test_manual_gathers_skips_nested_regions(inside):
    mesh = meshes.make_mesh(MESH)
    rules = spmd.get_rules("fsdp_tp")
    table, ids = jnp.zeros((64, 8)), jnp.zeros((8, 4), jnp.int32)

    def local(table, ids):
        return jnp.take(table, ids, axis=0) if inside == "take" else embedding.lookup(table, ids)

    loop = jax.shard_map(with_inner_rules(local, mesh, rules, "data", ("data",)), mesh=mesh,
                         in_specs=(P(), P("data")), out_specs=P("data"), axis_names=frozenset({"data"}))
    with jax.set_mesh(mesh):
        found = accumulate.manual_gathers(loop, table, ids)
    assert found == ({"gather": 1} if inside == "take" else {}), found
