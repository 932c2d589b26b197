"""LoRA with the other features (tests/helpers/matrix.py, ``LORA_CELLS``; the table in docs/compose.md): under a
1F1B pipeline with accumulation, context parallelism (ring, with dropout), MoE over ``expert``, bf16 under
sequence parallelism, and FSDP with accumulation (with dropout), a LoRA run equals the same run on one device
(1e-5 in f32, 1e-3 / 2e-2 in bf16), and so does dropout under a ZB-H1 pipeline. DPO with LoRA and
accumulation on a sharded mesh equals one device (its loop runs under GSPMD)."""

from __future__ import annotations

import pytest
from helpers import matrix


@pytest.mark.sweep  # the tiers: LoRA under a pipeline, with DPO under seq x pipe (test_dpo_pipeline)
@pytest.mark.parametrize("name", matrix.LORA_CELLS)
def test_lora_cell(name, tmp_path):
    cell = matrix.lora_cell(name)
    reference = matrix.run_reference(cell, str(tmp_path / "ref"))
    outcome = matrix.run_cell(cell, reference, str(tmp_path / "cell"))
    assert outcome.ok, (outcome.status, outcome.detail)


@pytest.mark.sweep
def test_dpo_with_lora_and_accumulation_equals_one_device(tmp_path):
    import jax
    import numpy as np

    import meshes
    from trainers.config import override
    from trainers.examples import dpo as example
    from trainers.loop import train

    pairs = example.write_pairs(tmp_path / "pairs.jsonl", n=200)

    def run(axes, rules, *sets):
        cfg = override(example.config(pairs, tmp_path / axes, steps=3, tiny=True), [
            f"mesh.axes={axes}", f"rules={rules}", "run.eval_batches=0", "checkpoint.every_steps=100",
            "lr.warmup_steps=0", "lr.peak_lr=1e-2", "lora.rank=4", "lora.alpha=8", *sets])
        sizes = {a: int(n) for a, n in (kv.split("=") for kv in axes.split(","))}
        mesh = meshes.make_mesh(sizes, devices=jax.devices()[:1] if axes == "data=1" else None)
        return train(cfg, mesh=mesh, keep_state=True)

    one = run("data=1", "none")
    accum = run("data=2,fsdp=2,tensor=2", "fsdp_tp", "run.grad_accum=2")
    np.testing.assert_allclose([accum.losses[s] for s in (1, 2, 3)], [one.losses[s] for s in (1, 2, 3)], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(accum.state.params), jax.tree.leaves(one.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert one.losses[3] != pytest.approx(one.losses[1], abs=1e-4)  # it moved: the comparison is not vacuous
