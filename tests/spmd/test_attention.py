"""Attention implementations: every CPU path equals ``naive`` in output and in q/k/v gradients
(MHA, GQA, MQA; lengths that are and are not a multiple of the block), ``auto`` picks as
documented, the blockwise step's memory grows linearly in L, and a sharded GPT trained through
the blockwise path gives the naive loss and gradients."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig, attention, lm_loss

TOL = 1e-5
CPU_PATHS = ("naive", "xla", "blockwise", "auto")


def qkv(b: int, l: int, h: int, g: int, k: int, seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shapes = ((b, l, h, k), (b, l, g, k), (b, l, g, k), (b, l, h, k))
    return tuple(jnp.asarray(rng.normal(size=s), dtype) for s in shapes)  # q, k, v, cotangent


@functools.cache
def outputs_and_grads(block: int):
    """jit((q, k, v, ct) -> {path: (out, dq, dk, dv)}) for every CPU path: one compile per shape."""

    def one(fn, q, k, v, ct):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(ct))

    def all_paths(q, k, v, ct):
        res = {p: one(functools.partial(attention.attend, impl=p, block=block), q, k, v, ct) for p in CPU_PATHS}
        # negative controls: no causal mask; GQA heads mapped to the wrong KV head (h = r * G + g)
        res["non-causal"] = one(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
                                q, k, v, ct)
        r = q.shape[2] // k.shape[2]
        tiled = lambda x: jnp.tile(x, (1, 1, r, 1))
        res["wrong-groups"] = one(lambda q, k, v: attention.naive(q, tiled(k), tiled(v)), q, k, v, ct)
        return res

    return jax.jit(all_paths)


def max_err(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("b, l, h, g, k, block", [
    (2, 16, 4, 4, 8, 4),  # MHA, L a multiple of the block
    (2, 13, 4, 2, 8, 4),  # GQA (R=2), L=13: 4 blocks of 4, padded by 3
    (1, 13, 4, 1, 8, 5),  # MQA (G=1), 3 blocks of 5, padded by 2
])
def test_paths_match_naive_in_output_and_gradients(b, l, h, g, k, block):
    res = outputs_and_grads(block)(*qkv(b, l, h, g, k))
    ref = res["naive"]
    errs = {p: max_err(res[p], ref) for p in CPU_PATHS}
    assert max(errs.values()) < TOL, errs
    assert [x.shape for x in res["blockwise"]] == [(b, l, h, k), (b, l, h, k), (b, l, g, k), (b, l, g, k)]
    # auto at L > block is blockwise, bit for bit
    assert all(bool(jnp.array_equal(x, y)) for x, y in zip(res["auto"], res["blockwise"]))
    # negative controls: a wrong mask or a wrong GQA grouping is caught far beyond the tolerance
    assert max_err(res["non-causal"], ref) > 100 * TOL
    if g not in (1, h):
        assert max_err(res["wrong-groups"], ref) > 100 * TOL


def test_auto_keeps_naive_for_short_sequences_bit_for_bit():
    q, k, v, _ = qkv(2, 8, 4, 2, 8)
    assert attention.resolve("auto", q, k, block=8) == "naive"
    assert attention.resolve("auto", q, k, block=7) == "blockwise"
    assert attention.resolve("xla", q, k, block=7) == "xla"
    auto = jax.jit(functools.partial(attention.attend, impl="auto", block=8))
    assert bool(jnp.array_equal(auto(q, k, v), jax.jit(attention.naive)(q, k, v)))


def test_block_layout_pads_less_than_one_position_per_block():
    assert attention.block_layout(16, 4) == (4, 4)
    assert attention.block_layout(13, 4) == (4, 4)  # 16 positions, 3 padded
    assert attention.block_layout(600, 512) == (2, 300)  # no padding, blocks shrunk
    assert attention.block_layout(7, 16) == (1, 7)
    for l, block in [(13, 4), (600, 512), (1000, 64), (8191, 512)]:
        n, size = attention.block_layout(l, block)
        assert size <= block and 0 <= n * size - l < n
    with pytest.raises(ValueError, match="block must be >= 1"):
        attention.block_layout(8, 0)


def test_errors_name_the_problem():
    q, k, v, _ = qkv(1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="'cudnn' cannot run: it needs a GPU and the backend is 'cpu'"):
        attention.attend(q, k, v, impl="cudnn")
    with pytest.raises(ValueError, match="'flash' is not one of"):
        attention.attend(q, k, v, impl="flash")
    with pytest.raises(ValueError, match="GPTConfig.attention 'flash'"):
        GPTConfig(attention="flash")


def test_blockwise_bfloat16_is_close_to_f32():
    q, k, v, ct = qkv(1, 24, 4, 2, 8)

    def fn(q, k, v, ct):
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v, ct)]
        out, vjp = jax.vjp(functools.partial(attention.blockwise, block=8), *bf16[:3])
        ref, ref_vjp = jax.vjp(attention.naive, q, k, v)
        return (out, *vjp(bf16[3])), (ref, *ref_vjp(ct))

    got, ref = jax.jit(fn)(q, k, v, ct)
    assert all(x.dtype == jnp.bfloat16 for x in got)
    for x, y in zip(got, ref):
        err = float(jnp.linalg.norm(x.astype(jnp.float32) - y) / jnp.linalg.norm(y))
        assert err < 2e-2, err


def step_temp(impl: str, length: int) -> int:
    """Compiled temp bytes of value_and_grad through attention alone at ``length`` (never run)."""
    q, k, v = (jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32) for _ in range(3))
    loss = lambda q, k, v: jnp.sum(attention.attend(q, k, v, impl=impl, block=64) ** 2)
    return spmd.inspection.memory(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()).temp


def test_blockwise_memory_grows_linearly_forward_and_backward():
    blockwise = step_temp("blockwise", 1024) / step_temp("blockwise", 256)
    naive = step_temp("naive", 1024) / step_temp("naive", 256)
    assert blockwise <= 4.5, blockwise  # 4x the length: linear is 4
    assert naive > 10, naive  # control: the scores make naive quadratic (16 in the limit)


# --- the GPT through the seam, sharded ------------------------------------------------------------
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention="naive",
                attention_block=4)
B, L = 4, 14  # 4 blocks of 4, padded by 2


@functools.cache
def gpt_setup():
    """(mesh, params, batch) on data=2 x fsdp=2 x tensor=2 with the fsdp_tp rules (params built once)."""
    mesh = meshes.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    _, params, _ = spmd.init_params(lambda: GPT(CFG, rngs=nnx.Rngs(0)), "fsdp_tp", mesh)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(B, L + 1), dtype=np.int32)
    return mesh, params, jax.device_put(tokens, spmd.batch_sharding(spmd.get_rules("fsdp_tp"), mesh))


@functools.cache
def gpt_value_and_grad(impl: str):
    """(compiled (params, tokens) -> (loss, grads), its jaxpr) with ``GPTConfig.attention=impl``."""
    mesh, params, batch = gpt_setup()
    cfg = dataclasses.replace(CFG, attention=impl)
    graphdef = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]

    def loss(p, tokens_BL):
        with spmd.use_rules("fsdp_tp", mesh):
            return lm_loss(nnx.merge(graphdef, p)(tokens_BL[:, :-1]), tokens_BL[:, 1:])[0]

    traced = jax.jit(jax.value_and_grad(loss)).trace(params, batch)
    return traced.lower().compile(), str(traced.jaxpr)


def test_sharded_gpt_blockwise_matches_naive_loss_and_grads():
    _, params, batch = gpt_setup()
    (naive, jaxpr0), (blockwise, jaxpr1) = gpt_value_and_grad("naive"), gpt_value_and_grad("blockwise")
    loss0, grads0 = naive(params, batch)
    loss1, grads1 = blockwise(params, batch)
    assert abs(float(loss1) - float(loss0)) < TOL, (loss0, loss1)
    errs = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads1, grads0))
    assert max(errs) < TOL, max(errs)
    assert "while[" in jaxpr1 and "while[" not in jaxpr0  # the blockwise loops really ran
    # negative control: a 1e-2 change of every parameter moves loss and grads far beyond the tolerance
    loss2, grads2 = naive(jax.tree.map(lambda x: x + 1e-2, params), batch)
    assert abs(float(loss2) - float(loss0)) > 100 * TOL
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads2, grads0))) > 100 * TOL
