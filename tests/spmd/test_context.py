"""Context parallelism: causal attention over a length split across ``seq`` equals one device.

``context_attend`` on load-balanced chunks (shard i holds chunks i and 2n-1-i) against the
materialised-scores reference, for the loss and the gradients of q, k and v, with grouped KV
heads; and the K/V exchange it compiles to, counted from the HLO.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from spmd.hlo import collectives
from spmd.models.attention import naive
from spmd.models.context import balanced_positions, context_attend

B, L, H, G, K = 2, 32, 4, 2, 8
F32 = 4


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, w = (jax.random.normal(kk, (B, L, h, K)) for kk, h in zip(keys, (H, G, G, H)))
    return q, k, v, w


def _mesh(n):
    return jax.make_mesh((n, 8 // n), ("seq", "data"), axis_types=(AxisType.Auto,) * 2)


def _step(n, exchange):
    """value_and_grad of a weighted sum of the attention output, inputs in natural order."""
    mesh, perm = _mesh(n), balanced_positions(L, n)
    inverse = np.argsort(perm)
    w = _inputs()[3]

    def loss(q, k, v):
        out = context_attend(q[:, perm], k[:, perm], v[:, perm], mesh=mesh, exchange=exchange, block=4)
        return jnp.sum(out[:, inverse] * w)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_balanced_positions():
    # seq=2, length 8: chunks of 2; shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2
    assert balanced_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert sorted(balanced_positions(48, 4).tolist()) == list(range(48))
    with pytest.raises(ValueError, match="divisible by 2 x seq = 8.*length 20"):
        balanced_positions(20, 4)


@pytest.mark.parametrize("n, exchange", [(2, "ring"), (4, "ring"), pytest.param(8, "ring", marks=pytest.mark.sweep), (4, "allgather")])
def test_parity_with_one_device(n, exchange):
    q, k, v, w = _inputs()
    ref_loss, ref_grads = jax.value_and_grad(lambda q, k, v: jnp.sum(naive(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    loss, grads = _step(n, exchange)(q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        err = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
        assert err < 1e-5, f"d{name}: relative error {err:.2e}"


def test_negative_control_natural_order_is_wrong():
    """Feeding natural-order positions to the balanced layout must not match: the test can fail."""
    q, k, v, w = _inputs()
    mesh = _mesh(2)
    out = jax.jit(lambda q, k, v: context_attend(q, k, v, mesh=mesh, block=4))(q, k, v)
    assert float(jnp.max(jnp.abs(out - naive(q, k, v)))) > 1e-2


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_exchange_collectives(exchange):
    """Ring: seq-1 K/V permutes forward; backward seq-1 K/V + seq dK/dV. All-gather: one gather of
    K and of V, one reduce-scatter of dK and of dV. Bytes: from the local ``[B, L/seq, G, K]``."""
    n = 4
    q, k, v, _ = _inputs()
    mesh = _mesh(n)
    ops = [op for op in collectives(_step(n, exchange).lower(q, k, v).compile(), mesh) if op.axes == ("seq",)]
    local = B * (L // n) * G * K * F32
    summary = sorted((op.kind, op.backward, op.count, op.bytes) for op in ops if op.kind != "all-reduce")
    if exchange == "ring":
        # forward: 1 permute before the loop + n-2 inside; backward: (K/V, dK/dV) x (n-1) + the dK/dV hop home
        fwd = sum(op.count for op in ops if op.kind == "collective-permute" and not op.backward)
        bwd = sum(op.count for op in ops if op.kind == "collective-permute" and op.backward)
        assert (fwd, bwd) == (n - 1, 2 * (n - 1) + 1), summary
        assert {op.bytes for op in ops if op.kind == "collective-permute"} == {2 * local}, summary
    else:
        # the backward's re-gather is the forward's gather (XLA keeps it: nothing here is rematerialised)
        gathered = sum(op.total_bytes for op in ops if op.kind == "all-gather")
        scattered = sum(op.total_bytes for op in ops if op.kind == "reduce-scatter")
        assert gathered == 2 * n * local, summary  # K and V at full length
        assert scattered == 2 * n * local, summary  # dK and dV at full length, reduced to the shard
        assert not any(op.kind == "collective-permute" for op in ops), summary


@pytest.mark.parametrize("exchange", ["ring", "allgather"])
def test_exchange_moves_only_this_devices_rows_and_heads(exchange):
    """With the batch over data and heads over tensor (dp_tp on data=2 x seq=2 x tensor=2, GQA), each device
    exchanges its own rows' and K/V heads' blocks over seq: nothing gathered over data or tensor first, and the
    all-gather's bytes are those of the local ``[B/data, L/seq, G/tensor, K]`` shard; still equal to one device."""
    import meshes
    import spmd

    n, mesh, rules = 2, meshes.make_mesh({"data": 2, "seq": 2, "tensor": 2}), spmd.get_rules("dp_tp")
    perm, q, k, v, w = balanced_positions(L, n), *_inputs()
    inverse = np.argsort(perm)

    def loss(q, k, v):
        with spmd.use_rules(rules, mesh):
            out = context_attend(q[:, perm], k[:, perm], v[:, perm], mesh=mesh, exchange=exchange, block=4)
        return jnp.sum(out[:, inverse] * w)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    ops = collectives(step.lower(q, k, v).compile(), mesh)
    exchanged = [op for op in ops if op.kind in ("all-gather", "reduce-scatter", "collective-permute")]
    assert {op.axes for op in exchanged} == {("seq",)}, [(op.kind, op.axes, op.bytes) for op in exchanged]
    local = (B // 2) * (L // n) * (G // 2) * K * F32
    if exchange == "allgather":
        assert sum(op.total_bytes for op in exchanged if op.kind == "all-gather") == 2 * n * local
    ref_loss, ref_grads = jax.value_and_grad(lambda q, k, v: jnp.sum(naive(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    loss_, grads = step(q, k, v)
    np.testing.assert_allclose(loss_, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) < 1e-5
