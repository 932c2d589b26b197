"""The ragged expert exchange: ``spmd.collectives.ragged_all_to_all`` as ``jax.lax.ragged_all_to_all`` documents it,
and the dropless MoE layer moving routed rows only (``exchange="ragged"``) equal to one device.

On XLA:CPU the collective runs as its bounded form (slices padded to a static bound, one all-to-all); the
test of its semantics pins what GPU and TPU run natively: each slice ``operand[input_offsets[j]:][:send_sizes[j]]``
written on device j at the offset this device names, the rest of ``output`` kept.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.gpt_util import rel_err
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd import collectives
from spmd.models import GPTConfig, MoE

N, BOUND, OUT, W = 4, 3, 16, 2  # devices, the most rows one device sends another, output rows, row width


def documented(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """``ragged_all_to_all`` per its docstring's pseudocode, over all devices at once (numpy)."""
    result = output.copy()
    for src in range(N):
        for dst in range(N):
            rows = operand[src, input_offsets[src, dst]:input_offsets[src, dst] + send_sizes[src, dst]]
            assert len(rows) == recv_sizes[dst, src]
            result[dst, output_offsets[src, dst]:output_offsets[src, dst] + len(rows)] = rows
    return result


def exchange_args(seed):
    """Per-device arguments with internal padding in the operand and gaps in the output."""
    rng = np.random.default_rng(seed)
    send = rng.integers(0, BOUND + 1, (N, N)).astype(np.int32)  # [src, dst]
    gaps = rng.integers(0, 2, (N, N))
    input_offsets = (np.cumsum(send + gaps, axis=1) - (send + gaps)).astype(np.int32)
    output_offsets = (np.cumsum(send + 1, axis=0) - (send + 1)).astype(np.int32)  # on dst, in source order
    operand = rng.standard_normal((N, OUT, W)).astype(np.float32)
    output = np.full((N, OUT, W), -7.0, np.float32)
    return operand, output, input_offsets, send, output_offsets, send.T.copy()


@functools.cache
def exchange_fn():
    mesh = meshes.make_mesh({"expert": N}, devices=jax.devices()[:N])

    def body(operand, output, input_offsets, send, output_offsets, recv):
        return collectives.ragged_all_to_all(operand[0], output[0], input_offsets[0], send[0], output_offsets[0],
                                             recv[0], "expert", bound=BOUND)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_all_to_all_follows_the_documented_semantics(seed):
    args = exchange_args(seed)
    got = np.asarray(exchange_fn()(*args))
    np.testing.assert_array_equal(got, documented(*args))
    # not vacuous: rows moved between devices, and rows outside every slice kept output's value
    assert args[3].sum() > 0 and np.sum(got == -7.0) > 0
    # negative control: the receivers' own offsets (not the senders') put rows elsewhere
    wrong = args[:4] + (args[4].T.copy(), args[5])
    assert not np.array_equal(documented(*wrong), got)


D, F, E, K, B, L = 16, 32, 8, 2, 8, 8


@functools.cache
def layer_result(sizes, rules, exchange):
    sizes = dict(sizes)
    n = int(np.prod(list(sizes.values()))) if sizes else 1
    mesh = meshes.make_mesh(sizes, devices=jax.devices()[:n]) if sizes else meshes.single_device_mesh()
    rules = spmd.get_rules(rules)
    graphdef, params, _ = spmd.init_params(lambda: MoE(D, F, E, K, rngs=nnx.Rngs(0), exchange=exchange), rules, mesh)

    def loss_fn(params, x_BLD, target_BLD):
        with spmd.use_rules(rules, mesh):
            y_BLD, stats = nnx.merge(graphdef, params)(x_BLD)
        return jnp.mean((y_BLD - target_BLD) ** 2) + 0.01 * stats["aux_loss"], y_BLD

    rng = np.random.default_rng(0)
    tokens = spmd.batch_sharding(rules, mesh)
    x, target = (jax.device_put(rng.standard_normal((B, L, D)).astype(np.float32), tokens) for _ in range(2))
    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    (loss, y), grads = step(params, x, target)
    return float(loss), np.asarray(y), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("sizes, rules", [
    ((("data", 2), ("expert", 4)), "dp_ep"),
    ((("fsdp", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep"),
], ids=["data2_expert4", "fsdp2_expert2_tensor2"])
def test_ragged_layer_matches_single_device(sizes, rules):
    ref_loss, ref_y, ref_grads = layer_result((), "none", None)
    loss, y, grads = layer_result(sizes, rules, "ragged")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5 * np.abs(ref_y).max())
    assert rel_err(grads, ref_grads) < 1e-5
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))


def test_exchange_settings_are_checked():
    with pytest.raises(ValueError, match="exchange 'sparse' is not one of"):
        MoE(D, F, E, K, rngs=nnx.Rngs(0), exchange="sparse")
    with pytest.raises(ValueError, match="moe_exchange 'sparse' is not one of"):
        GPTConfig(n_experts=8, moe_exchange="sparse")
