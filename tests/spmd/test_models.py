"""Reference models: GPT shapes and dtypes, parameter counts, config errors, causality, RoPE,
FLOP formulas (and XLA's count), the MLP, and Stack's rematerialisation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import spmd
from spmd.models import GPT, MLP, GPTConfig, flops_per_step, flops_per_token, lm_loss, mse_loss, param_count
from spmd.models.counts import matmul_params
from spmd.models.layers import rope

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64)
B, L = 2, 8
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(B, L)), dtype=jnp.int32)


def abstract(cfg: GPTConfig) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as ShapeDtypeStructs) without running any initializer."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)


@functools.cache
def params_for(cfg: GPTConfig) -> dict:
    """Concrete parameters filled from numpy: norm scales 1, weights N(0, 1/D) (compiling the
    model's own random init costs seconds on CPU, and these tests need only some weights)."""
    rng = np.random.default_rng(0)
    _, shapes = abstract(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = [
        np.ones(x.shape, np.float32) if spmd.sharding.path_str(path).endswith("scale")
        else rng.normal(0.0, cfg.d_model**-0.5, x.shape).astype(np.float32)
        for path, x in flat
    ]
    return jax.tree.unflatten(treedef, leaves)


@functools.cache
def forward_for(cfg: GPTConfig):
    graphdef, _ = abstract(cfg)
    return jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))


def logits(cfg: GPTConfig, tokens) -> jax.Array:
    # Parameters are f32 whatever the compute dtype, so every variant reuses CFG's.
    return forward_for(cfg)(params_for(CFG), tokens)


# --- forward --------------------------------------------------------------------------------------


def test_forward_shape_and_dtype():
    out = logits(CFG, TOKENS)
    assert out.shape == (B, L, CFG.vocab_size)
    assert out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()


def test_bfloat16_compute_gives_f32_logits_close_to_f32():
    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(abstract(bf16)[1])} == {jnp.dtype(jnp.float32)}  # params stay f32
    out16, out32 = np.asarray(logits(bf16, TOKENS)), np.asarray(logits(CFG, TOKENS))
    assert logits(bf16, TOKENS).dtype == jnp.float32
    err = np.linalg.norm(out16 - out32) / np.linalg.norm(out32)
    assert 0 < err < 0.05, err  # not identical (bf16 ran), but close


# --- parameter counts -----------------------------------------------------------------------------


def real_params(cfg: GPTConfig) -> dict[str, np.ndarray]:
    state = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {spmd.sharding.path_str(p): v for p, v in flat}


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,  # multi-head
        GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64),  # grouped-query
        GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=16, tie_embeddings=True),
    ],
    ids=["mha", "gqa", "mqa_tied"],
)
def test_param_count_matches_the_model(cfg):
    params = real_params(cfg)
    total = sum(int(np.prod(v.shape)) for v in params.values())
    assert param_count(cfg) == total
    assert param_count(cfg, embedding=False) == total - cfg.vocab_size * cfg.d_model
    assert ("head" in params) == (not cfg.tie_embeddings)
    # Matmul parameters: everything but norm scales and the lookup table, plus the tied head's matmul.
    norms = sum(int(np.prod(v.shape)) for k, v in params.items() if k.endswith("scale"))
    assert matmul_params(cfg) == total - norms - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    assert params["blocks/block/attn/w_kv"].shape == (cfg.n_layers, cfg.d_model, cfg.kv_heads, 2, cfg.k)


def test_gqa_has_fewer_params_than_mha():
    gqa = dataclasses.replace(CFG, n_kv_heads=2)
    assert param_count(CFG) - param_count(gqa) == CFG.n_layers * 2 * CFG.d_model * 2 * CFG.k


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"dtype": "float16"}, r"dtype 'float16' is not one of \['bfloat16', 'float32'\]"),
        ({"n_heads": 4, "n_kv_heads": 3}, r"n_heads 4 is not a multiple of n_kv_heads 3"),
        ({"d_model": 30, "n_heads": 4}, r"d_model 30 does not divide by n_heads 4"),
        ({"vocab_size": 0}, r"vocab_size must be >= 1, got 0"),
    ],
)
def test_config_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GPTConfig(**kwargs)


# --- causality ------------------------------------------------------------------------------------


def test_causal():
    base = np.asarray(logits(CFG, TOKENS))
    t = 5
    later = TOKENS.at[:, t].set((TOKENS[:, t] + 1) % CFG.vocab_size)
    out = np.asarray(logits(CFG, later))
    np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=1e-6, atol=1e-6)
    assert np.abs(out[:, t:] - base[:, t:]).max(axis=-1).min() > 1e-4  # position t onwards all see it
    # Negative control: an earlier token changes every later position.
    earlier = TOKENS.at[:, 1].set((TOKENS[:, 1] + 1) % CFG.vocab_size)
    out = np.asarray(logits(CFG, earlier))
    np.testing.assert_allclose(out[:, :1], base[:, :1], rtol=1e-6, atol=1e-6)
    assert np.abs(out[:, 1:] - base[:, 1:]).max(axis=-1).min() > 1e-4


# --- RoPE -----------------------------------------------------------------------------------------


def test_rope():
    x = np.random.default_rng(0).normal(size=(2, 6, 3, 8)).astype(np.float32)
    positions = jnp.arange(6)
    y = np.asarray(jax.jit(rope)(x, positions))
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0: identity
    assert np.abs(np.asarray(y[:, 1] - x[:, 1])).max() > 1e-2  # position 1 rotates (negative control)
    # Relative: <rope(q, m), rope(k, n)> depends on m - n only.
    q, k = x[:1, :1], x[1:, :1]
    rotate = jax.jit(rope)

    def score(m, n):
        return float(np.sum(np.asarray(rotate(q, jnp.array([m]))) * np.asarray(rotate(k, jnp.array([n])))))

    assert score(3, 1) == pytest.approx(score(5, 3), rel=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        rope(jnp.ones((1, 2, 1, 7)), jnp.arange(2))


# --- FLOPs ----------------------------------------------------------------------------------------


def test_flops_per_token_formula():
    cfg = GPTConfig(vocab_size=100, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=40)
    d, k, seq = 16, 8, 12
    per_block = d * 2 * k + 2 * d * 1 * k + 2 * k * d + 3 * d * 40  # q, k+v, o, gate+up+down
    n_matmul = 3 * per_block + d * 100  # blocks + output head
    assert matmul_params(cfg) == n_matmul
    attention = 12 * 3 * 2 * k * seq
    assert flops_per_token(cfg, seq) == 6 * n_matmul + attention
    assert flops_per_step(cfg, 4, seq) == 4 * seq * (6 * n_matmul + attention)
    assert flops_per_token(cfg, 2 * seq) - flops_per_token(cfg, seq) == attention  # linear in length


def test_flops_match_xla_for_one_training_step():
    # One block: XLA's cost analysis counts a while loop's body once, so a scanned stack of n
    # blocks would be counted as one.
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, params = abstract(cfg)
    seq = 16

    def loss(p, tokens_BL):
        return lm_loss(nnx.merge(graphdef, p)(tokens_BL[:, :-1]), tokens_BL[:, 1:])[0]

    tokens = jnp.zeros((B, seq + 1), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    ratio = spmd.inspection.compiled_flops(compiled) / flops_per_step(cfg, B, seq)
    assert 0.8 < ratio < 1.3, ratio  # measured: ~1.08 (XLA adds softmax, norms, elementwise work)


# --- MLP ------------------------------------------------------------------------------------------


def test_mlp_runs_and_matches_numpy():
    @jax.jit
    def run(x):
        model = MLP(8, 16, rngs=nnx.Rngs(1))
        return model(x), [v[...] for v in (model.w_in, model.b_in, model.w_out, model.b_out)]

    x = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    y, weights = run(jnp.asarray(x))
    w_in, b_in, w_out, b_out = (np.asarray(w) for w in weights)
    want = np.maximum(x @ w_in + b_in, 0) @ w_out + b_out
    assert y.shape == (4, 8)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    assert float(mse_loss(y, y)) == 0.0
    assert float(mse_loss(y, jnp.zeros_like(y))) == pytest.approx(float(np.mean(want**2)), rel=1e-5)


# --- Stack and remat ------------------------------------------------------------------------------


class Residual(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.w = spmd.models.param(rngs, nnx.initializers.normal(0.5), (d, d), ("embed", "mlp"))

    def __call__(self, x, scale):
        return x + jnp.tanh(x @ self.w[...]) * scale


@functools.cache
def stack_step(remat: bool):
    """jit(weights -> (loss, grads)) and the jaxprs of the loss and of its gradient."""
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: spmd.Stack(lambda r: Residual(4, rngs=r), 3, rngs=nnx.Rngs(0), remat=remat)))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

    def loss(w):
        return jnp.sum(nnx.merge(graphdef, {"block": {"w": w}})(x, 0.5) ** 2)

    w = jax.ShapeDtypeStruct(nnx.to_pure_dict(state)["block"]["w"].shape, jnp.float32)
    return jax.jit(jax.value_and_grad(loss)), (jax.make_jaxpr(loss)(w), jax.make_jaxpr(jax.grad(loss))(w))


def stack_loss_and_grads(remat: bool, seed: int = 0):
    step, jaxprs = stack_step(remat)
    w = np.random.default_rng(seed).normal(0.0, 0.5, (3, 4, 4)).astype(np.float32)
    value, grad_w = step(w)
    return float(value), {"block": {"w": np.asarray(grad_w)}}, jaxprs


def test_stack_remat_gives_the_same_loss_and_grads():
    loss0, grads0, jaxpr0 = stack_loss_and_grads(remat=False)
    loss1, grads1, jaxpr1 = stack_loss_and_grads(remat=True)
    assert grads0["block"]["w"].shape == (3, 4, 4)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads1, grads0)
    # Remat really ran: the forward carries a remat primitive and the backward recomputes tanh.
    assert "remat" in str(jaxpr1[0]) and "remat" not in str(jaxpr0[0])
    assert str(jaxpr1[1]).count("tanh") == 2 * str(jaxpr0[1]).count("tanh")
    # Negative control: another init gives another loss and other grads.
    loss2, grads2, _ = stack_loss_and_grads(remat=False, seed=1)
    assert loss2 != pytest.approx(loss0, rel=1e-3)
    assert not np.allclose(grads2["block"]["w"], grads0["block"]["w"], rtol=1e-3)


def test_stack_stacks_logical_dims_and_rejects_empty():
    stack = nnx.eval_shape(lambda: spmd.Stack(lambda r: Residual(4, rngs=r), 2, rngs=nnx.Rngs(0)))
    assert spmd.sharding.logical_dims(stack) == {"block/w": ("layers", "embed", "mlp")}
    with pytest.raises(ValueError, match="at least one block, got n=0"):
        spmd.Stack(lambda r: Residual(4, rngs=r), 0, rngs=nnx.Rngs(0))
