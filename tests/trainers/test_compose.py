"""Features that each worked alone also work together: the train step with gradient accumulation equals one device
with blockwise attention (a sequence longer than ``attention_block``) and with MoE blocks.

SGD at lr 1 without clipping, so the params after one step compare the gradients themselves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from helpers.gpt_util import gpt_config, gpt_task, rel_err

import meshes
from spmd.models import GPTConfig
from trainers.setup import build

TOL = 1e-5
ROWS, LENGTH = 16, 32
TX = optax.sgd(1.0)
BLOCKWISE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention_block=8)
MOE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4)


@functools.cache
def one_step(cfg: GPTConfig, sizes: tuple = (), rules: str = "none", k: int = 1):
    """(params after one step, loss) for the tiny GPT ``cfg`` on a mesh of ``sizes`` with ``k`` microbatches."""
    mesh = meshes.make_mesh(dict(sizes)) if sizes else meshes.single_device_mesh()
    run_cfg = gpt_config(dict(sizes), rules, f"data.global_batch={ROWS}", f"data.seq_len={LENGTH}", f"run.grad_accum={k}",
                         model=cfg)
    run = build(run_cfg, gpt_task(cfg), mesh, tx=TX, donate=False)
    bs = run.batch_sharding
    t = np.random.default_rng(0).integers(0, cfg.vocab_size, (ROWS, LENGTH + 1)).astype(np.int32)
    state, metrics = run.train_step(run.stepped.state, {"inputs": jax.device_put(t[:, :-1], bs),
                                                        "targets": jax.device_put(t[:, 1:], bs)})
    return jax.tree.map(np.asarray, state.params), float(metrics["loss"])


def test_accumulation_with_blockwise_attention_equals_one_device():
    """Used to crash: the blockwise loop's carry was not typed varying inside the accumulation shard_map."""
    params, loss = one_step(BLOCKWISE, (("data", 4), ("tensor", 2)), "dp_tp", 2)
    ref_params, ref_loss = one_step(BLOCKWISE)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL


@pytest.mark.sweep  # the slow tier: test_moe_accum, and MoE x accumulation under a pipeline here
def test_accumulation_with_moe_over_expert_equals_one_device():
    """Used to crash: the MoE's own shard_map nested in the accumulation loop's. The router's losses are
    per-microbatch means, so the reference accumulates the same 2 microbatches on one device."""
    params, loss = one_step(MOE, (("data", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep", 2)
    ref_params, ref_loss = one_step(MOE, k=2)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel_err(params, ref_params) < TOL
    assert rel_err(params, one_step(MOE)[0]) > TOL  # negative control: the whole batch at once differs (router losses)


# ------------------------------------------------------------------------------------ the matrix
def test_the_design_covers_every_pair_of_factor_levels():
    from helpers import matrix

    cells = matrix.design()
    covered, possible = matrix.coverage(cells)
    print(f"pairs covered / pairs possible = {covered}/{possible} = {covered / possible:.3f} in {len(cells)} cells")
    assert covered == possible and possible > 250
    assert all(matrix.applicable(c) for c in cells) and matrix.design() == cells  # deterministic


REPRESENTATIVE = {  # a few cells of the design that cross the most loop-and-collective features
    "pipe_expert-moe-accum": dict(layout="pipe_expert", model="moe", grad_accum=2),  # pipe x expert x seq x accum
    "seq_ring-blockwise-accum": dict(layout="seq_ring", model="gpt", length="blockwise", grad_accum=2),
    "expert-moe-accum-resume": dict(layout="expert", model="moe", grad_accum=2, resume="other_mesh"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sweep) for n in REPRESENTATIVE])
def test_representative_cells(name, tmp_path):
    from helpers import matrix

    base = dict(layout="dp", model="gpt", length="short", grad_accum=1, fsdp_gather="per_microbatch", remat="none",
                dtype="float32", loss_chunk=0, local_sgd=0, resume="no")
    cell = {**base, **REPRESENTATIVE[name]}
    outcome = matrix.run_cell(cell, lambda: matrix.run_reference(cell, str(tmp_path / "ref")), str(tmp_path / "cell"))
    assert outcome.ok, (outcome.status, outcome.detail)


# ------------------------------------------------------------------------------------ who is blamed
def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("no exception")


def test_errors_are_blamed_on_whoever_raised_them():
    from spmd.models import attention
    from trainers.blame import InternalError, TaskError, attribute

    def users_loss():
        return {}["x"]

    user = _raised(users_loss)
    assert isinstance(attribute(user, "t", "the loss", "{}"), TaskError)
    refusal = _raised(lambda: attention.block_layout(16, 0))  # the toolkit refuses, in its own words
    assert attribute(refusal, "t", "the loss", "{}") is refusal
    q = np.zeros((1, 4, 2, 8), np.float32)
    bug = _raised(lambda: attention.naive(q, q[:, :, :, :3], q))  # jax raises inside toolkit code: a bug
    internal = attribute(bug, "t", "the loss", "{}")
    assert isinstance(internal, InternalError) and "bug in spmd" in str(internal)


# ------------------------------------------------------------------------------------ eval with padding
def test_eval_over_a_padded_last_batch_counts_real_rows_only(tmp_path):
    """10 eval examples in batches of 8 (run.eval_batches=-1): the loss's own metric (accuracy computed in the
    loss) equals the exact per-example eval metric; it used to be averaged over the 6 padding rows too."""
    import dataclasses as dc

    import optax as ox
    from helpers import byom_task

    from trainers.config import override
    from trainers.loop import train

    def loss(model, batch, rngs):
        logits = model(batch["x"])
        ce = ox.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return ce, {"loss_accuracy": (logits.argmax(-1) == batch["label"]).mean()}

    task = dc.replace(byom_task.make_task(), loss=loss, eval_data=byom_task.examples(10, 1))
    cfg = override(task.config, [f"run.run_dir={tmp_path}", "run.steps=1", "run.eval_every=1", "run.eval_batches=-1",
                                 "data.global_batch=8", "run.progress=false", "run.tensorboard=false",
                                 "lr.warmup_steps=0"])
    metrics = train(cfg, task).eval_metrics[1]
    assert metrics["loss_accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-6)
    assert metrics["accuracy"] * 10 == pytest.approx(round(metrics["accuracy"] * 10), abs=1e-6)  # k of 10 examples


@pytest.mark.slow
@pytest.mark.parametrize("sizes, rules", [pytest.param((("data", 8),), "dp", marks=pytest.mark.sweep),
                                          pytest.param((("fsdp", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep",
                                                       marks=pytest.mark.sweep)])
def test_moe_in_bfloat16_compiles_on_sharded_layouts_and_equals_one_device(sizes, rules):
    """Used to abort XLA (CPU): the experts' weight gradient was summed over the token axes in bf16 by a
    psum_invariant whose combiner the bf16 all-reduce promotion cannot clone. bf16 tolerances."""
    cfg = dataclasses.replace(MOE, dtype="bfloat16")
    params, loss = one_step(cfg, sizes, rules)
    ref_params, ref_loss = one_step(cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    assert rel_err(params, ref_params) < 2e-2
