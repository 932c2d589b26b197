"""Chunked cross-entropy (spmd.models.loss) = the loss over whole logits: value, aux and gradients
(wrt the hidden states and the head), chunk dividing the length or not, with and without z-loss;
the same inside GPT on a data x fsdp x tensor mesh (vocab sharded over tensor); and that the
compiled step really keeps less: no [B, L, V] logits among its temporaries."""

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
from spmd.models import GPT, GPTConfig, lm_loss
from spmd.models.loss import chunked_lm_loss

TOL = 1e-5
B, L, D, V = 2, 12, 8, 32


def head(w_DV):
    return lambda x_BLD: jnp.einsum("bld,dv->blv", x_BLD, w_DV)


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    w_DV = jnp.asarray(rng.normal(0.0, D**-0.5, (D, V)), jnp.float32)
    x_BLD = jnp.asarray(rng.normal(size=(B, L, D)), jnp.float32)
    targets_BL = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
    return w_DV, x_BLD, targets_BL


@functools.cache
def value_and_grad(chunk: int, z_loss: float):
    """jit(value_and_grad) wrt (head weight, hidden states); chunk 0: the loss over whole logits."""
    def loss(w_DV, x_BLD, targets_BL):
        if chunk:
            return chunked_lm_loss(x_BLD, head(w_DV), targets_BL, chunk=chunk, z_loss=z_loss)
        return lm_loss(head(w_DV)(x_BLD), targets_BL, z_loss=z_loss)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a),
                                                                                     jax.tree.leaves(b)))


@pytest.mark.parametrize("chunk,z_loss", [(4, 0.0), (4, 0.1), (5, 0.0), (5, 0.1), (1, 0.1), (64, 0.0)])
def test_chunked_equals_whole_logits(chunk, z_loss):
    """4 divides L=12, 5 leaves a padded last chunk, 1 is one position per chunk, 64 > L is one chunk."""
    args = data()
    (loss, aux), grads = value_and_grad(chunk, z_loss)(*args)
    (ref, ref_aux), ref_grads = value_and_grad(0, z_loss)(*args)
    assert set(aux) == set(ref_aux) == ({"ce", "z_loss"} if z_loss else {"ce"})
    assert abs(float(loss) - float(ref)) < TOL and max_diff(aux, ref_aux) < TOL
    assert max_diff(grads, ref_grads) < TOL
    assert min(float(jnp.max(jnp.abs(g))) for g in grads) > 1e-3  # the gradients compared are not all zero


def test_negative_control_shifted_targets_and_z_loss():
    """The comparison catches a wrong loss: targets shifted by one position, or the z-loss left out."""
    w_DV, x_BLD, targets_BL = data()
    (ref, _), ref_grads = value_and_grad(0, 0.1)(w_DV, x_BLD, targets_BL)
    (shifted, _), shifted_grads = value_and_grad(5, 0.1)(w_DV, x_BLD, jnp.roll(targets_BL, 1, axis=1))
    assert abs(float(shifted) - float(ref)) > 100 * TOL
    assert max_diff(shifted_grads, ref_grads) > 100 * TOL
    (no_z, _), _ = value_and_grad(5, 0.0)(w_DV, x_BLD, targets_BL)
    assert abs(float(no_z) - float(ref)) > 100 * TOL


def test_chunk_must_be_a_positive_integer():
    w_DV, x_BLD, targets_BL = data()
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="chunk="):
            chunked_lm_loss(x_BLD, head(w_DV), targets_BL, chunk=bad)
    with pytest.raises(ValueError, match=r"targets \(2, 11\)"):
        chunked_lm_loss(x_BLD, head(w_DV), targets_BL[:, 1:], chunk=4)


def test_compiled_step_keeps_one_chunk_of_logits_not_all():
    """XLA's temp bytes of value_and_grad: whole logits [1, 512, 4096] f32 are 8 MiB, and the
    step without chunks holds several such buffers; with chunks of 64 (1 MiB) it must stay below
    two whole-logits buffers (it holds a few chunks' worth plus the hidden states)."""
    length, vocab, d = 512, 4096, 16
    shapes = (jax.ShapeDtypeStruct((d, vocab), jnp.float32), jax.ShapeDtypeStruct((1, length, d), jnp.float32),
              jax.ShapeDtypeStruct((1, length), jnp.int32))

    def temp(chunk: int) -> int:
        def loss(w_DV, x_BLD, targets_BL):
            if chunk:
                return chunked_lm_loss(x_BLD, head(w_DV), targets_BL, chunk=chunk)[0]
            return lm_loss(head(w_DV)(x_BLD), targets_BL)[0]
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = length * vocab * 4
    whole, chunked = temp(0), temp(64)
    assert whole >= 2 * logits_bytes, whole  # the control: without chunks the logits are held whole
    assert chunked < logits_bytes, (chunked, logits_bytes)


# --- inside GPT, on a sharded mesh ----------------------------------------------------------------
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64)
BATCH, LENGTH = 4, 16


@functools.cache
def gpt_case():
    """fsdp_tp on data=2, fsdp=2, tensor=2: params, batch and jitted value_and_grad for loss_chunk 0 and 5."""
    mesh, rules = meshes.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), spmd.get_rules("fsdp_tp")
    graphdef, params, shardings = spmd.init_params(lambda: GPT(CFG, rngs=nnx.Rngs(0)), rules, mesh)
    bs = spmd.batch_sharding(rules, mesh)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (BATCH, LENGTH + 1)).astype(np.int32)
    x, y = jax.device_put(tokens[:, :-1], bs), jax.device_put(tokens[:, 1:], bs)

    def step(chunk: int):
        cfg = dataclasses.replace(CFG, loss_chunk=chunk)
        gdef = graphdef if not chunk else nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))[0]

        def loss(p, x, y):
            with spmd.use_rules(rules, mesh):
                return nnx.merge(gdef, p).loss(x, y, z_loss=1e-2)

        return jax.jit(jax.value_and_grad(loss, has_aux=True), in_shardings=(shardings, bs, bs))

    return params, x, y, step(0), step(5)


def test_gpt_loss_chunk_equals_whole_logits_on_fsdp_tp():
    params, x, y, whole, chunked = gpt_case()
    head_spec = params["head"].sharding.spec
    assert "tensor" in jax.tree.leaves(tuple(head_spec)), head_spec  # the vocab dim really is sharded
    (ref, ref_aux), ref_grads = whole(params, x, y)
    (loss, aux), grads = chunked(params, x, y)
    assert set(aux) == set(ref_aux) == {"ce", "z_loss"}
    assert abs(float(loss) - float(ref)) < TOL
    assert max_diff(grads, ref_grads) < TOL
    # negative control: the same chunked step on targets shifted by one position
    (shifted, _), shifted_grads = chunked(params, x, jnp.roll(y, 1, axis=1))
    assert abs(float(shifted) - float(ref)) > 100 * TOL and max_diff(shifted_grads, ref_grads) > 100 * TOL
