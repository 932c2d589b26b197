"""Features that each worked alone also work together: the train step with gradient accumulation equals one device
with blockwise attention (a sequence longer than ``attention_block``) and with MoE blocks.

SGD at lr 1 without clipping, so the params after one step compare the gradients themselves.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import meshes
import spmd
from helpers.gpt_util import rel_err
from spmd.models import GPT, GPTConfig
from trainers.state import create_state
from trainers.step import lm_loss_fn, make_train_step

TOL = 1e-5
ROWS, LENGTH = 16, 32
TX = optax.sgd(1.0)
BLOCKWISE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention_block=8)
MOE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4)


@functools.cache
def one_step(cfg: GPTConfig, sizes: tuple = (), rules: str = "none", k: int = 1):
    """(params after one step, loss) for the tiny GPT ``cfg`` on a mesh of ``sizes`` with ``k`` microbatches."""
    mesh = meshes.make_mesh(dict(sizes)) if sizes else meshes.single_device_mesh()
    sharded = create_state(lambda: GPT(cfg, rngs=nnx.Rngs(0)), TX, rules, mesh)
    bs = spmd.batch_sharding(rules, mesh, dims=("batch",))
    step = make_train_step(sharded, TX, rules, mesh, bs, grad_accum=k, donate=False, loss_fn=lm_loss_fn())
    t = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, LENGTH + 1)).astype(np.int32)
    state, metrics = step(sharded.state, {"inputs": jax.device_put(t[:, :-1], bs),
                                          "targets": jax.device_put(t[:, 1:], bs)})
    return jax.tree.map(np.asarray, state["params"]), float(metrics["loss"])


def test_accumulation_with_blockwise_attention_equals_one_device():
    """Used to crash: the blockwise loop's carry was not typed varying inside the accumulation shard_map."""
    params, loss = one_step(BLOCKWISE, (("data", 4), ("tensor", 2)), "dp_tp", 2)
    ref_params, ref_loss = one_step(BLOCKWISE)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL


def test_accumulation_with_moe_over_expert_equals_one_device():
    """Used to crash: the MoE's own shard_map nested in the accumulation loop's. The router's losses are
    per-microbatch means, so the reference accumulates the same 2 microbatches on one device."""
    params, loss = one_step(MOE, (("data", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep", 2)
    ref_params, ref_loss = one_step(MOE, k=2)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL
    assert rel_err(params, one_step(MOE)[0]) > TOL  # negative control: the whole batch at once differs (router losses)
