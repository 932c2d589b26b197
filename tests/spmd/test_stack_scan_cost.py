"""A scanned stack under remat ``none`` keeps matmul outputs and redoes elementwise ops in its backward loop.

The residuals a scan keeps are written into stacked ``[layers, ...]`` buffers and read back; ``spmd.remat.wrap(...,
loop=True)`` keeps only the matmul outputs (and constrained values) there. Checked on one device: the same
gradients as keeping everything, the same matmul FLOPs (nothing but elementwise work redone), and a smaller loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd import remat as remat_lib

N, B, D, F = 4, 8, 32, 128


def body(x_BD, w):
    w1_DF, w2_FD = w
    h_BF = x_BD @ w1_DF
    a_BF = jax.nn.gelu(h_BF) * jax.nn.sigmoid(h_BF)  # elementwise residuals of a gated MLP
    return x_BD + jnp.tanh(a_BF @ w2_FD), None


def loss(loop: bool):
    def f(w, x_BD):
        y_BD, _ = jax.lax.scan(remat_lib.wrap(body, "none", loop=loop), x_BD, w)
        return jnp.sum(y_BD ** 2)
    return f


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    w = (jnp.asarray(rng.normal(0, D ** -0.5, (N, D, F)), jnp.float32),
         jnp.asarray(rng.normal(0, F ** -0.5, (N, F, D)), jnp.float32))
    return w, jnp.asarray(rng.normal(size=(B, D)), jnp.float32)


def test_loop_none_gives_the_same_gradients(inputs):
    w, x = inputs
    kept = jax.jit(jax.grad(loss(False)))(w, x)
    redone = jax.jit(jax.grad(loss(True)))(w, x)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(redone)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)  # elementwise ops fused differently: last bits
    # negative control: other weights move the gradients far beyond that tolerance
    other = jax.jit(jax.grad(loss(True)))(jax.tree.map(lambda v: v * 1.01, w), x)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(other))) > 1e-4


def test_loop_none_redoes_no_matmul_and_keeps_less(inputs):
    w, x = inputs
    flops = {loop: spmd.inspection.jaxpr_flops(jax.grad(loss(loop)), w, x) for loop in (False, True)}
    assert flops[True] == flops[False]
    temp = {loop: jax.jit(jax.grad(loss(loop))).lower(w, x).compile().memory_analysis().temp_size_in_bytes
            for loop in (False, True)}
    # kept: h and the two matmul inputs' partners; not: gelu(h), sigmoid(h), their product, tanh's output
    assert temp[True] < temp[False], temp


def test_unrolled_none_is_the_body_itself():
    assert remat_lib.wrap(body, "none") is body and remat_lib.wrap(body, False, loop=False) is body
