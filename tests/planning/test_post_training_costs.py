"""LoRA and DPO in the cost model. LoRA: only the adapters have gradients and optimizer state, the frozen
base is held (and gathered) but never reduced, and its backward computes no weight gradient. A Llama-3-8B
fine-tune on one 80 GB H100 fits with rank-16 adapters where the full fine-tune does not, and the analytic
state equals the compiled step's on a tiny model (the compiled program drops the base's zero gradients,
accumulator included). DPO: the frozen reference copy is state, its forward is model FLOPs."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import meshes
import spmd
from spmd.models import GPTConfig, flops_per_step
from trainers.config import Config, DataConfig, override
from trainers.examples import dpo as dpo_example
from trainers.planning.calibration import LLAMA3_8B
from trainers.planning.costs import memory_estimate, model_flops
from trainers.planning.hardware import get_hardware
from trainers.planning.traffic import comm_estimate
from trainers.recipes import recipe
from trainers.setup import build
from trainers.task import lm_task


def llama3_8b(*sets: str) -> Config:
    model = GPTConfig(**LLAMA3_8B, dtype="bfloat16", remat_policy="full", attention="cudnn", loss_chunk=1024)
    return override(Config(model=model, rules="fsdp", data=DataConfig(seq_len=4096, global_batch=1)),
                    ["mesh.axes=data=1", "run.spike_factor=0", *sets])


def test_llama3_8b_fits_one_h100_with_rank_16_adapters_and_not_without():
    h100 = get_hardware("h100")
    budget = h100.hbm_bytes * h100.headroom
    full, lora = (memory_estimate(cfg, {"data": 1}) for cfg in (llama3_8b(), llama3_8b("lora.rank=16")))
    print(f"full {full.total / 1e9:.1f} GB (optimizer {full.optimizer / 1e9:.1f}), lora r16 {lora.total / 1e9:.1f} GB "
          f"(optimizer {lora.optimizer / 1e9:.3f}), budget {budget / 1e9:.1f} GB")
    assert full.total > h100.hbm_bytes and lora.total < budget
    assert lora.optimizer <= 0.01 * full.optimizer and lora.grads <= 0.01 * full.grads
    assert lora.params >= full.params  # the base is held whole, the adapters on top


def test_a_frozen_base_is_gathered_but_never_reduced():
    hw, sizes = get_hardware("h100"), {"fsdp": 8}
    full, lora = (comm_estimate(dataclasses.replace(cfg, rules="fsdp"), sizes, hw)
                  for cfg in (llama3_8b("data.global_batch=8"), llama3_8b("data.global_batch=8", "lora.rank=16")))
    by = {name: {(t.kind, t.axes): t.bytes for t in traffic} for name, traffic in (("full", full), ("lora", lora))}
    assert by["lora"][("all-gather", ("fsdp",))] >= by["full"][("all-gather", ("fsdp",))]
    assert by["lora"][("reduce-scatter", ("fsdp",))] <= 0.01 * by["full"][("reduce-scatter", ("fsdp",))]


def compiled_step(*sets: str):
    """(config, compiled memory, state bytes, base parameter bytes) of a tiny GPT's real step on one device."""
    cfg = override(recipe("gpt-small", tiny=True), [
        "mesh.axes=data=1", "rules=none", "data.corpus=synthetic", "data.global_batch=4", "data.seq_len=16",
        "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=4", "model.d_ff=1024",
        "run.spike_factor=0", *sets])
    run = build(cfg, mesh=meshes.single_device_mesh(), abstract=True)
    batch = run.abstract_batch()
    memory = spmd.inspection.memory(run.train_step.lower(run.stepped.abstract, batch).compile())
    base = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.stepped.abstract.params))
    return cfg, memory, memory.argument - spmd.inspection.tree_bytes_per_device(batch), base


def test_analytic_state_and_gradients_match_the_compiled_lora_step():
    runs = {(lora, accum): compiled_step(*(["lora.rank=4"] if lora else []), f"run.grad_accum={accum}")
            for lora in (True, False) for accum in (1, 2)}
    for (lora, accum), (cfg, _, state, base) in runs.items():
        analytic = memory_estimate(cfg, {"data": 1})
        assert abs(analytic.state - state) <= 0.05 * state, (lora, accum, analytic.state, state)
        assert (analytic.grads < 0.05 * base) if lora else (analytic.grads >= base * 0.95), (lora, analytic.grads, base)
    base = runs[(False, 1)][3]
    added = {lora: runs[(lora, 2)][1].temp - runs[(lora, 1)][1].temp for lora in (True, False)}
    # the full fine-tune's accumulator is a base-sized buffer (the negative control); the compiled LoRA step
    # drops the base's zero gradients, accumulator included, as the memory model counts them
    assert added[False] > 0.5 * base and added[True] < 0.05 * base, (added, base)


def test_llama3_8b_lora_flops_skip_the_base_weight_gradients():
    full, lora = (model_flops(cfg) for cfg in (llama3_8b(), llama3_8b("lora.rank=16")))
    # the base's backward computes the input gradient only: 4 of 6 per weight, attention unchanged
    assert 0.6 < lora / full < 0.75, lora / full


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_dpo_reference_is_state_and_its_forward_is_counted(lora, tmp_path):
    pairs = dpo_example.write_pairs(tmp_path / "pairs.jsonl", n=40)
    cfg = override(dpo_example.config(pairs, tmp_path / "run", steps=2, tiny=True),
                   ["mesh.axes=data=1", "rules=none", "run.spike_factor=0", "model.n_layers=1",
                    *(["lora.rank=4"] if lora else [])])
    assert lm_task(cfg).flops_per_example * cfg.data.global_batch == pytest.approx(model_flops(cfg))
    plain = flops_per_step(cfg.model, cfg.data.global_batch, cfg.data.seq_len, lora=cfg.lora.spec)
    assert model_flops(cfg) > 1.3 * plain  # + the reference's forward (2 per weight, attention's forward)
    run = build(cfg, mesh=meshes.single_device_mesh(), abstract=True)
    batch = run.abstract_batch()
    memory = spmd.inspection.memory(run.train_step.lower(run.stepped.abstract, batch).compile())
    state = memory.argument - spmd.inspection.tree_bytes_per_device(batch)
    analytic = memory_estimate(cfg, {"data": 1})
    assert abs(analytic.state - state) <= 0.05 * state, (analytic.state, state)
    assert (analytic.other == 0) if lora else (analytic.other == analytic.params)


def test_dpo_under_a_pipeline_sends_and_stashes_both_models(tmp_path):
    """The pipeline carries the policy's and the reference's activations side by side: the planner's sends over
    pipe are twice the LM loss's, as the compiled DPO step's are (its carried position and segment digits
    aside: 4 channels beside 2 x 32), and its stash grows too."""
    pairs = dpo_example.write_pairs(tmp_path / "pairs.jsonl", n=40)
    sets = ["mesh.axes=data=2,pipe=2", "rules=dp", "run.spike_factor=0", "model.n_layers=2",
            "pipeline.schedule=1f1b", "pipeline.microbatches=2"]
    cfg = override(dpo_example.config(pairs, tmp_path / "run", steps=2, tiny=True), sets)
    lm = override(cfg, ["run.objective=lm"])
    sizes, hw = {"data": 2, "pipe": 2}, get_hardware("h100")

    def sends(c):  # the busiest stage's bytes over pipe per step
        return sum(t.bytes for t in comm_estimate(c, sizes, hw) if t.kind == "collective-permute")

    assert sends(cfg) == 2 * sends(lm) > 0
    assert memory_estimate(cfg, sizes).activations > memory_estimate(lm, sizes).activations
    run = build(cfg, mesh=meshes.make_mesh(sizes, devices=jax.devices()[:4]), abstract=True)
    compiled = run.train_step.lower(run.stepped.abstract, run.abstract_batch()).compile()
    schedule = spmd.pipeline.get_schedule("1f1b", 2, 2)
    per_stage = spmd.pipeline.hlo_sent_bytes(compiled, schedule, run.mesh)["executed"] / 2  # each stage sends M
    d = cfg.model.d_model
    assert per_stage == sends(cfg) * (2 * d + 4) / (2 * d), (per_stage, sends(cfg))
    assert per_stage > 1.9 * sends(lm)  # negative control: the LM loss's count is caught
