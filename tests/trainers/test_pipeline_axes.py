"""MoE blocks and context parallelism under a pipeline. The pipeline's region is manual over ``pipe``, every
batch axis (``expert`` included) and the length's ``seq``: the MoE layer and the context-parallel attention
run their per-shard bodies in each stage without a shard_map of their own. The experts stay sharded over
``expert`` (each device computes its E/ep), the router's statistics ride along the activations and the head
adds the MoE losses; each device holds its shard of the length in load-balanced order, its positions riding
along, and exchanges K/V over ``seq``. A pipeline's M microbatches equal one device accumulating the same M
microbatches (the router's losses are per-microbatch means), loss and every parameter to 1e-5; through the
CLI, 3 steps equal the same run without the pipeline, accumulating M microbatches.
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
from spmd.pipeline.order import LayerOrder
from trainers.setup import build

MOE = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4)
DENSE = dataclasses.replace(MOE, n_experts=0)
M = 4


@functools.cache
def piped_step(cfg: GPTConfig, sizes: tuple, rules: str, schedule: str):
    """(params after one step, metrics, collectives of the compiled step) with M pipeline microbatches."""
    mesh = meshes.make_mesh(dict(sizes))
    run_cfg = gpt_config(dict(sizes), rules, f"data.global_batch={ROWS}", f"data.seq_len={LENGTH}",
                         f"pipeline.schedule={schedule}", f"pipeline.microbatches={M}", f"model.n_layers={cfg.n_layers}",
                         *(["pipeline.virtual_stages=2"] if schedule in ("interleaved", "zb-v") else []), model=cfg)
    run = build(run_cfg, gpt_task(cfg, run_cfg.pipeline), mesh, tx=TX, donate=False)
    t = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, LENGTH + 1)).astype(np.int32)
    bs = run.batch_sharding
    batch = {"inputs": jax.device_put(t[:, :-1], bs), "targets": jax.device_put(t[:, 1:], bs)}
    compiled = run.train_step.lower(run.stepped.state, batch).compile()
    state, metrics = compiled(run.stepped.state, batch)
    params = jax.tree.map(np.asarray, state.params)
    sched = run_cfg.pipeline.make_schedule(dict(sizes)["pipe"], cfg.n_layers)  # layers stored in its chunk order
    params["blocks"] = LayerOrder(sched.n_stages, sched.n_virtual, sched.placement).to_natural(params["blocks"])
    return (params, {k: float(v) for k, v in metrics.items()},
            spmd.hlo.collectives(compiled, mesh))


def check(sizes: tuple, rules: str, schedule: str, cfg: GPTConfig = MOE) -> None:
    params, metrics, ops = piped_step(cfg, sizes, rules, schedule)
    ref_params, ref_loss = one_step(cfg, k=M)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL
    if dict(sizes).get("seq", 1) > 1:  # each device attends its shard of the length: K/V move over seq
        assert any(o.kind == "all-gather" and o.axes == ("seq",) for o in ops)
    if not cfg.n_experts:
        return
    assert 0.9 < metrics["moe_aux_loss"] < 1.5 and metrics["moe_dropped"] == 0.0  # dropless, near balance
    # the experts stay sharded over expert: tokens move by all-to-all, the expert weights are never gathered
    assert any(o.kind == "all-to-all" and "expert" in o.axes for o in ops)
    expert_weights = 3 * cfg.n_layers * cfg.n_experts * cfg.d_model * cfg.expert_ff * 4  # f32 w_gate_up + w_down
    gathered = sum(o.bytes for o in ops if o.kind == "all-gather" and "expert" in o.axes)
    assert gathered < expert_weights / 8, (gathered, expert_weights)


def test_moe_under_1f1b_equals_one_device_accumulating_its_microbatches():
    check((("data", 2), ("expert", 2), ("pipe", 2)), "dp_ep", "1f1b")
    # control: the same step on the whole batch at once (one set of router statistics) is another step
    assert rel_err(piped_step(MOE, (("data", 2), ("expert", 2), ("pipe", 2)), "dp_ep", "1f1b")[0],
                   one_step(MOE)[0]) > TOL


@pytest.mark.slow
@pytest.mark.parametrize("layout,schedule", [
    pytest.param((("expert", 2), ("tensor", 2), ("pipe", 2)), "gpipe", marks=pytest.mark.sweep),
    pytest.param((("fsdp", 2), ("expert", 2), ("pipe", 2)), "interleaved", marks=pytest.mark.sweep),
])
def test_moe_under_more_schedules_and_layouts(layout, schedule):
    """GPipe with the scanned stack; interleaved with the ragged exchange (the routed rows only, as on GPU and
    TPU; XLA:CPU runs its bounded form) inside the table engine's branches."""
    rules = "fsdp_tp_ep" if dict(layout).get("tensor") else "fsdp_ep"
    variant = {"scan_layers": "scanned"} if schedule == "gpipe" else {"moe_exchange": "ragged"}
    check(layout, rules, schedule, dataclasses.replace(MOE, **variant))


def test_context_parallelism_under_1f1b_equals_one_device():
    check((("data", 2), ("seq", 2), ("pipe", 2)), "dp_tp", "1f1b", DENSE)


@pytest.mark.slow
@pytest.mark.parametrize("layout,schedule", [
    pytest.param((("seq", 2), ("tensor", 2), ("pipe", 2)), "zb-h1", marks=pytest.mark.sweep),
    pytest.param((("expert", 2), ("seq", 2), ("pipe", 2)), "interleaved",  # MoE and seq in one stage (the CLI test too)
                 marks=pytest.mark.sweep),
])
def test_context_parallelism_under_more_schedules_with_tensor_and_experts(layout, schedule):
    cfg = MOE if dict(layout).get("expert") else DENSE
    check(layout, "dp_ep" if cfg.n_experts else "dp_tp", schedule, cfg)


@pytest.mark.sweep
def test_through_the_cli_a_pipeline_with_moe_and_seq_equals_the_run_without_it(tmp_path):
    """gpt-moe on expert=2 x seq=2 x pipe=2 (1f1b, 4 microbatches) against expert=2 x seq=2 x data=2
    accumulating 4 microbatches: the same losses, step by step, over 3 steps."""
    from helpers.fault_worker import last_train_losses

    from trainers.launch import cli

    common = ["gpt-moe", "--tiny", "--simulate-devices", "8", "--steps", "3", "--rules", "dp_ep",
              "--set", "data.global_batch=16", "--set", "data.seq_len=32", "--set", "model.capacity_factor=0",
              "--set", "run.eval_batches=0", "--set", "run.progress=false", "--set", "run.tensorboard=false",
              "--set", "run.log_every=1", "--set", "checkpoint.every_steps=100"]
    piped, flat = tmp_path / "piped", tmp_path / "flat"
    assert cli.main([*common, "--mesh", "expert=2,seq=2,pipe=2", "--run-dir", str(piped), "--set",
                     "pipeline.schedule=1f1b", "--set", f"pipeline.microbatches={M}"]) == 0
    assert cli.main([*common, "--mesh", "data=2,expert=2,seq=2", "--run-dir", str(flat), "--set",
                     f"run.grad_accum={M}"]) == 0
    a, b = last_train_losses(str(piped)), last_train_losses(str(flat))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=TOL), (step, a[step], b[step])
