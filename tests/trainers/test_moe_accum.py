"""MoE under gradient accumulation with ``fsdp_gather=per_step``: the loop's region is manual over every batch
axis, ``expert`` included, so the MoE layer runs its per-shard body there (no shard_map of its own) and the
gradient is reduced once per step; it equals one device accumulating the same 2 microbatches (the router's
losses are per-microbatch means). With ``per_microbatch`` the loop is manual over ``data`` and the layer's
region over ``expert`` opens nested in it (both typed unchecked): reduced once over ``data`` as well.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from helpers.gpt_util import gpt_config, gpt_task, rel_err
from test_compose import LENGTH, ROWS, TOL, TX, one_step

import meshes
import spmd
from spmd.models import GPTConfig
from trainers.setup import build
from trainers.step import accumulation_note

MOE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4)
DP_EP = ((("data", 4), ("expert", 2)), "dp_ep")
FSDP_TP_EP = ((("data", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep")
PER_STEP = "run.fsdp_gather=per_step"


@functools.cache
def accum_step(cfg: GPTConfig, sizes: tuple, rules: str, *sets: str):
    """(params after one step, loss, collectives of the compiled step, run) with 2 microbatches."""
    mesh = meshes.make_mesh(dict(sizes))
    run = build(gpt_config(dict(sizes), rules, f"data.global_batch={ROWS}", f"data.seq_len={LENGTH}", "run.grad_accum=2",
                           *sets, model=cfg), gpt_task(cfg), mesh, tx=TX, donate=False)
    t = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, LENGTH + 1)).astype(np.int32)
    batch = {"inputs": jax.device_put(t[:, :-1], run.batch_sharding), "targets": jax.device_put(t[:, 1:], run.batch_sharding)}
    compiled = run.train_step.lower(run.stepped.state, batch).compile()
    state, metrics = compiled(run.stepped.state, batch)
    return jax.tree.map(np.asarray, state.params), float(metrics["loss"]), spmd.hlo.collectives(compiled, mesh), run


def check(cfg: GPTConfig, sizes: tuple, rules: str) -> None:
    params, loss, ops, _ = accum_step(cfg, sizes, rules, PER_STEP)
    ref_params, ref_loss = one_step(cfg, k=2)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL
    # once per step: every reduction over a batch axis that moves more than the router's statistics runs once
    # (outside the loop); inside it (count 2) only the router's f_E, P_E, z means (E + E + 1 floats per layer)
    batch_axes = {a for a, _ in sizes} - {"tensor"}
    reductions = [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and batch_axes & set(o.axes)]
    in_loop = [o for o in reductions if o.count > 1]
    assert reductions and all(o.bytes <= cfg.n_layers * (2 * cfg.n_experts + 1) * 4 for o in in_loop), in_loop
    assert sum(o.bytes for o in reductions if o.count == 1) > 100 * sum(o.bytes for o in in_loop)


def test_moe_accumulates_once_per_step_equal_to_one_device():
    check(MOE, *DP_EP)
    ref_params, _ = one_step(MOE, k=2)
    assert rel_err(accum_step(MOE, *DP_EP, PER_STEP)[0], one_step(MOE)[0]) > TOL  # control: the whole batch at once
    # per_microbatch: expert (it shards the experts) stays automatic in the loop's region, manual over data; the
    # layer's region over expert nests in it. Over data: once per step; over expert alone: every microbatch
    params, _, ops, _ = accum_step(MOE, *DP_EP)
    assert rel_err(params, ref_params) < TOL
    reductions = [o for o in ops if o.kind in ("all-reduce", "reduce-scatter") and o.bytes > 1000]
    assert [o for o in reductions if o.count == 1 and "data" in o.axes], spmd.hlo.format_collectives(ops)
    assert not [o for o in reductions if o.count > 1 and "data" in o.axes], spmd.hlo.format_collectives(ops)
    assert [o for o in reductions if o.count == 2 and o.axes == ("expert",)], spmd.hlo.format_collectives(ops)


def test_no_note_under_either_fsdp_gather():
    sizes, rules = DP_EP
    sharded = accum_step(MOE, sizes, rules, PER_STEP)[3].sharded
    mesh = meshes.make_mesh(dict(sizes))
    assert accumulation_note(sharded, rules, mesh, ROWS, grad_accum=2, fsdp_gather="per_step") is None
    assert accumulation_note(sharded, rules, mesh, ROWS, grad_accum=2) is None
    # negative control: a microbatch that does not divide over data is named
    assert "over data=4 every microbatch" in accumulation_note(sharded, rules, mesh, 4, grad_accum=2)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [pytest.param(s, marks=pytest.mark.sweep) for s in ("unrolled", "scanned")])
def test_moe_accumulates_once_per_step_under_fsdp_tp_ep(scan):
    check(dataclasses.replace(MOE, scan_layers=scan), *FSDP_TP_EP)
