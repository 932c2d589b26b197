"""Gradient accumulation: k microbatches equal one device's full batch, and each FSDP mode
communicates what it says (ZeRO-3 per microbatch, per_step once).

Numbers against one device (1e-5 relative, f32): the loss and the params after one SGD step
(lr 1: the update is the gradient). Collectives read from the compiled step; ``count`` includes
the accumulation loop's trip count, so a collective in the loop counts k times (or more).
"""

import jax
import pytest
from helpers.accum_util import TX, accum_step, reference
from helpers.gpt_util import CFG, gpt_config, gpt_task, rel_err

import meshes
import spmd
from spmd.hlo import summarize
from trainers.config import Config, RunConfig, override

K = 4
CASES = [("dp8", "per_microbatch"), ("dp2_fsdp2_tp2", "per_microbatch"), ("dp2_fsdp2_tp2", "per_step"),
         ("fsdp8", "per_step"), ("dp4_pipe2", "per_microbatch")]


SWEEP = [("dp2_fsdp2_tp2", "per_microbatch"), ("fsdp8", "per_step")]  # the sweep; the fast tier runs the other three


@pytest.mark.parametrize("name, mode", [pytest.param(*c, marks=pytest.mark.sweep) if c in SWEEP else c for c in CASES])
def test_accumulated_step_equals_one_device_full_batch(name, mode):
    ref_params, ref_metrics = reference()
    k = 2 if name == "dp4_pipe2" else K
    params, metrics = accum_step(name, k, mode).run()
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(float(ref_metrics["grad_norm"]), rel=1e-5)
    assert rel_err(params, ref_params) < 1e-5
    # negative control: another batch moves the params visibly elsewhere
    other, _ = accum_step(name, k, mode).run(seed=1)
    assert rel_err(other, ref_params) > 1e-3


def test_pipelined_accumulation_reduces_per_microbatch():
    """A pipelined loss runs its own shard_map over the batch axes and reduces once per call; the
    accumulation loop around it stays under GSPMD: one data all-reduce per microbatch (the pipeline's
    own microbatches, pipeline.microbatches, are the way to accumulate with one reduction)."""
    data = [o for o in accum_step("dp4_pipe2", 2).ops if o.axes == ("data",)]
    assert data and sum(o.count for o in data) == 2, data


def gathers(name: str, k: int, mode: str = "per_microbatch") -> dict:
    return summarize(accum_step(name, k, mode).ops).get(("all-gather", ("fsdp",)), {"count": 0, "bytes": 0})


def scatters(name: str, k: int, mode: str = "per_microbatch") -> dict:
    return summarize(accum_step(name, k, mode).ops).get(("reduce-scatter", ("fsdp",)), {"count": 0, "bytes": 0})


def test_per_step_gathers_and_reduce_scatters_once_over_fsdp():
    one = gathers("fsdp8", 1)
    # per_step: every weight gathered once (the same bytes as a single-microbatch step), and every
    # gradient reduce-scattered once, outside the accumulation loop
    ops = accum_step("fsdp8", K, "per_step").ops
    for kind in ("all-gather", "reduce-scatter"):
        sel = [o for o in ops if o.kind == kind and o.axes == ("fsdp",)]
        assert sel and all(o.count == 1 for o in sel), sel
    assert gathers("fsdp8", K, "per_step")["bytes"] == one["bytes"]
    assert scatters("fsdp8", K, "per_step")["bytes"] == one["bytes"]  # the full gradients, once
    # per_microbatch (ZeRO-3): the gradients are reduce-scattered in every microbatch (k x the bytes);
    # weights are re-gathered per microbatch (XLA hoists a few loop-invariant gathers out of the loop)
    assert scatters("fsdp8", K)["bytes"] == K * one["bytes"]
    assert gathers("fsdp8", K)["bytes"] > 2 * one["bytes"]
    assert any(o.kind == "all-gather" and o.count >= K for o in accum_step("fsdp8", K).ops)


def test_hybrid_reduces_over_data_once_in_both_modes():
    for mode in ("per_microbatch", "per_step"):
        data = [o for o in accum_step("dp2_fsdp2_tp2", K, mode).ops if o.axes == ("data",)]
        assert data and all(o.kind == "all-reduce" and o.count == 1 for o in data), data
    # the data all-reduce of a single-microbatch step runs inside the layer scan: the counter sees loops
    one = [o for o in accum_step("dp2_fsdp2_tp2", 1).ops if o.axes == ("data",)]
    assert sum(o.count for o in one) > 1
    # per_step moves the fsdp gathers and reduce-scatters out of the loop: k times fewer bytes
    assert gathers("dp2_fsdp2_tp2", K, "per_step")["bytes"] == gathers("dp2_fsdp2_tp2", 1)["bytes"]
    once = scatters("dp2_fsdp2_tp2", K, "per_step")
    assert once["count"] == 1 and once["bytes"] == gathers("dp2_fsdp2_tp2", 1)["bytes"]  # one tuple op, all grads
    assert scatters("dp2_fsdp2_tp2", K)["bytes"] > (K - 1) * once["bytes"]


@pytest.mark.parametrize("name, mode, axis", [("dp2_seq2_tp2", "per_microbatch", "data"), ("fsdp2_seq4", "per_step", "fsdp")])
def test_context_parallelism_reduces_once_over_the_batch_axes(name, mode, axis):
    """Context attention's region (manual over seq) opens nested in the loop's (manual over the batch axes),
    both typed unchecked: one gradient reduction over the batch axis per step, equal to one device."""
    ref_params, ref_metrics = reference()
    step = accum_step(name, 2, mode)
    params, metrics = step.run()
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-5)
    assert rel_err(params, ref_params) < 1e-5
    reduced = [o for o in step.ops if o.kind in ("all-reduce", "reduce-scatter") and axis in o.axes and o.bytes > 1000]
    assert reduced and all(o.count == 1 for o in reduced), spmd.hlo.format_collectives(step.ops)


def test_per_step_holds_full_weights_and_accumulator():
    """The trade-off in memory: per_step keeps every gathered weight and a full-size accumulator."""
    temp = {m: accum_step("fsdp8", K, m).compiled.memory_analysis().temp_size_in_bytes for m in ("per_microbatch", "per_step")}
    full_params = sum(x.nbytes for x in jax.tree.leaves(reference()[0]))
    assert temp["per_step"] - temp["per_microbatch"] > full_params  # gathered weights + accumulator > 1 copy


def test_fsdp_gather_config_key():
    cfg = override(Config(), ["run.fsdp_gather=per_step"])
    assert cfg.run.fsdp_gather == "per_step" and RunConfig().fsdp_gather == "per_microbatch"
    with pytest.raises(ValueError, match=r"run.fsdp_gather='zero2'; valid: per_microbatch, per_step"):
        override(Config(), ["run.fsdp_gather=zero2"])
    assert CFG.n_layers == 2  # the byte relations above assume the tiny GPT


def test_train_loop_passes_fsdp_gather(tmp_path):
    """``run.fsdp_gather`` reaches the step through ``trainers.train``: both modes train alike, and a
    resume may switch modes (the state's layout does not depend on it)."""
    from trainers.loop import train
    from trainers.recipes import recipe

    def cfg(where, *sets):
        return override(recipe("gpt-small", tiny=True), [
            f"run.run_dir={tmp_path / where}", "run.progress=false", "run.tensorboard=false", "run.eval_batches=0",
            "mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp", "data.global_batch=16", "run.grad_accum=2",
            "checkpoint.every_steps=1", *sets])

    zero3 = train(cfg("a", "run.steps=2"))
    first = train(cfg("b", "run.steps=1", "run.fsdp_gather=per_step"))
    resumed = train(cfg("b", "run.steps=2", "run.fsdp_gather=per_microbatch"))
    assert resumed.start_step == 1
    assert first.losses[1] == pytest.approx(zero3.losses[1], rel=1e-5)
    assert resumed.losses[2] == pytest.approx(zero3.losses[2], rel=1e-5)
    assert resumed.losses[2] != pytest.approx(zero3.losses[1], rel=1e-5)  # the step moved the loss


def test_per_microbatch_note_names_rows_and_axes():
    """The note the step logs when the loop cannot reduce once per step: rows that do not divide over
    the batch axes (named with their sizes), a reason from the model; none when the rows divide."""
    from trainers.accumulate import per_microbatch_note

    mesh, dp8 = meshes.make_mesh({"data": 4, "fsdp": 2}), meshes.make_mesh({"data": 8})
    dp, fsdp = spmd.get_rules("dp"), spmd.get_rules("fsdp")
    note = per_microbatch_note(dp8, dp, 24, 2, "per_microbatch")
    assert note and "over data=8 every microbatch (2 per step)" in note
    assert "a microbatch of 12 rows (24 rows / grad_accum=2) does not divide over the batch axes data=8" in note
    assert "a multiple of 16" in note
    assert per_microbatch_note(dp8, dp, 32, 2, "per_microbatch") is None  # 16 rows divide over 8 devices
    assert per_microbatch_note(dp8, dp, 24, 1, "per_microbatch") is None  # no accumulation
    # per_step: both axes; 12 rows divide over data=4 (manual) but not over fsdp=2 after it
    note = per_microbatch_note(mesh, fsdp, 24, 2, "per_step")
    assert "over fsdp=2 every" in note and "batch axes data=4 x fsdp=2" in note
    # per_microbatch: fsdp shards the parameters and reduces per microbatch by design; data=4 divides 12 rows
    assert per_microbatch_note(mesh, fsdp, 24, 2, "per_microbatch") is None
    why = per_microbatch_note(mesh, fsdp, 32, 2, "per_step", "a layer runs its own shard_map")
    assert why.endswith("not once per step: a layer runs its own shard_map") and "data=4 x fsdp=2" in why


def test_step_logs_when_it_cannot_reduce_once_per_step(caplog):
    """dp8 with 8 rows in 2 microbatches: 4 rows do not divide over data=8; the step says so when traced."""
    step = accum_step("dp8", 2)
    batch = {k: jax.ShapeDtypeStruct((8, v.shape[1]), v.dtype, sharding=step.batch_sharding)
             for k, v in step.batch().items()}
    with caplog.at_level("WARNING", logger="trainers.step"):
        step.step.lower(step.state, batch)
    assert "a microbatch of 4 rows (8 rows / grad_accum=2) does not divide over the batch axes data=8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="trainers.step"):
        step.step.lower(step.state, step.batch())  # 32 rows: 16 per microbatch divide
    assert "gradient accumulation" not in caplog.text


def test_accumulation_note_for_a_layer_with_its_own_shard_map():
    """What the dry run reports (from the abstract state): an MoE model's loop, its layer's region nested in
    the loop's, reduces once per step as a dense model's does; a microbatch that does not divide is named."""
    import dataclasses

    from trainers.setup import build
    from trainers.step import accumulation_note

    sizes = {"data": 2, "expert": 4}
    mesh = meshes.make_mesh(sizes)

    def abstract(model):
        return build(gpt_config(sizes, "dp_ep", model=model), gpt_task(model), mesh, abstract=True, tx=TX).sharded

    moe = abstract(dataclasses.replace(CFG, n_experts=4))
    assert accumulation_note(moe, "dp_ep", mesh, 32, grad_accum=2) is None
    assert accumulation_note(abstract(CFG), "dp_ep", mesh, 32, grad_accum=2) is None
    assert "over data=2 every microbatch" in accumulation_note(moe, "dp_ep", mesh, 2, grad_accum=2)
