"""LoRA dropout (``lora.dropout > 0``) under a pipeline equals one device with the same key.

An adapter element's mask is a function of (its layer's key, its row in the batch, its position) alone
(``spmd.models.lora.dropout_mask``: row b draws from ``fold_in(key, b)``), the keys are drawn per natural
layer whatever order a stack is stored in, and a pipeline carries each row's index into its stages
(``spmd.models.piped``). So the loss and every adapter gradient of the run's LoRA loss
(``trainers.lora.frozen_base_loss``) equal one device's under 1F1B, GPipe with context parallelism, ZB-H2
and interleaved, on data, FSDP x TP and seq layouts (ZB-H1 with dropout: test_lora_compose's pipe_zb_dropout
cell); a stage drawing by its own row index (the masks it drew before) is caught; and a pipelined run with accumulation equals the same run on one device
over three steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig
from spmd.models import lora as lora_lib
from spmd.models.lora import LoRASpec
from spmd.pipeline import LayerOrder, PipelineConfig
from spmd.stack import reorder_stacks

CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, d_ff=64, scan_layers="scanned")
SPEC = LoRASpec(4, 8.0, dropout=0.1)
BATCH, LENGTH, KEY, TOL = 8, 8, 5, 1e-5


def make_model(cfg: GPTConfig = CFG, spec: LoRASpec = SPEC) -> GPT:
    """A LoRA GPT whose adapters' ``b`` are non-zero (as created they are zero: dropout would not show)."""
    model = GPT(cfg, rngs=nnx.Rngs(0), lora=spec)
    for path, var in nnx.iter_graph(model):
        if path and path[-1] == "b":
            var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    return model


def batch():
    t = np.random.default_rng(0).integers(0, CFG.vocab_size, (BATCH, LENGTH + 1)).astype(np.int32)
    return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def loss_and_grads(sizes: dict[str, int], rules: str, pipeline: PipelineConfig | None = None,
                   cfg: GPTConfig = CFG, train: bool = True):
    """``(loss, {path: gradient})`` of the run's LoRA loss with key ``KEY`` on a mesh of ``sizes``, the stack
    stored in the order the pipeline runs in place (as a run stores it), the gradients in natural layer order."""
    from trainers.lora import frozen_base_loss
    from trainers.step import lm_loss_fn

    n = int(np.prod(list(sizes.values()))) if sizes else 1
    mesh = meshes.make_mesh(sizes, devices=jax.devices()[:n]) if n > 1 else meshes.single_device_mesh()
    order = pipeline.layer_order(sizes.get("pipe", 1)) if pipeline else LayerOrder()
    model = reorder_stacks(make_model(cfg), order)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rules_ = spmd.get_rules(rules)
    shardings = spmd.param_shardings(params, rules_, mesh)
    loss_fn = frozen_base_loss(lm_loss_fn(pipeline=pipeline))

    def loss(p, b):
        with spmd.use_rules(rules_, mesh):
            state = jax.tree.map(lambda a: a, params)
            nnx.replace_by_pure_dict(state, p)
            m = nnx.merge(graphdef, state, rest, copy=True)
            m.train() if train else m.eval()
            return loss_fn(m, b, nnx.Rngs(jax.random.key(KEY)))[0]

    bs = spmd.batch_sharding(rules_, mesh)
    pure = jax.device_put(jax.tree.map(np.asarray, nnx.to_pure_dict(params)), shardings)
    value, grads = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, bs))(pure, jax.device_put(batch(), bs))
    grads = jax.tree.map(np.asarray, grads)
    grads["blocks"] = order.to_natural(grads["blocks"])
    return float(value), {spmd.sharding.path_str(p, drop=()): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}


@functools.cache
def reference():
    return loss_and_grads({}, "none")


def adapter_errors(got, want) -> dict[str, float]:
    """Relative error of every adapter gradient (the base's are zero: frozen)."""
    errs = {k: float(np.linalg.norm(got[k] - w) / np.linalg.norm(w)) for k, w in want.items() if lora_lib.is_adapter(k)}
    assert len(errs) == 2 * len(SPEC.projections) and all(np.abs(want[k]).max() > 0 for k in errs)
    return errs


# ------------------------------------------------------------------------------------------------- the mask
def test_a_row_draws_its_mask_of_the_whole_batch_wherever_it_is_held():
    """The mask of rows 4..7 drawn with their indices in the batch (a microbatch's keys: ``row_keys``) is
    their mask in the whole batch's; drawn with indices 0..3 (the rows' places in the microbatch) it is not."""
    key = jax.random.key_data(jax.random.key(3))
    p, shape = 0.25, (8, 16, 6)
    whole = np.asarray(lora_lib.dropout_mask(key, p, shape))
    assert abs((whole == 0).mean() - p) < 0.05 and set(np.unique(whole)) == {0.0, np.float32(1 / (1 - p))}
    rows = jnp.arange(4, 8)
    held = np.asarray(lora_lib.dropout_mask(lora_lib.row_keys(key, rows), p, (4, *shape[1:])))
    np.testing.assert_array_equal(held, whole[4:])
    local = np.asarray(lora_lib.dropout_mask(lora_lib.row_keys(key, jnp.arange(4)), p, (4, *shape[1:])))
    np.testing.assert_array_equal(local, whole[:4])
    assert (local != whole[4:]).mean() > 0.1  # negative control: the row's index is what places the mask


def test_keys_travel_through_a_pipeline_exactly_and_fold_per_row():
    """``carried_keys`` (the f32 halves a pipeline's engine moves) read back by ``stage_keys`` are the keys,
    bit for bit, each folded with each row (``row_keys``), over the full uint32 range."""
    keys = jax.random.bits(jax.random.key(0), (3, 2), jnp.uint32).at[0].set(jnp.uint32(0xFFFFFFFF))
    state = nnx.State({"k": lora_lib.DropoutKey(keys), "w": nnx.Param(jnp.ones((3, 4)))})
    carried = lora_lib.carried_keys(state)
    assert carried["k"].get_value().dtype == jnp.float32 and carried["w"].get_value().shape == (3, 4)
    rows = jnp.array([5, 2])
    back = lora_lib.stage_keys(carried, rows)["k"].get_value()
    np.testing.assert_array_equal(back, lora_lib.row_keys(keys, rows))
    assert back.shape == (3, 2, 2) and not np.array_equal(back[:, 0], back[:, 1])


def test_keys_are_drawn_per_natural_layer_in_any_stored_order():
    """An interleaved pipeline stores the stack in chunk order; each natural layer keeps the key it has in
    natural order (so the pipeline draws one device's masks). Negative control: the stored order differs."""
    natural, chunked = make_model(), reorder_stacks(make_model(), LayerOrder(2, 2))
    key = jax.random.key(1)
    lora_lib.draw_dropout(natural, key)
    lora_lib.draw_dropout(chunked, key)
    a = natural.blocks.block.attn.q_proj.key.get_value()
    b = chunked.blocks.block.attn.q_proj.key.get_value()
    np.testing.assert_array_equal(LayerOrder(2, 2).to_natural(b), a)
    assert not np.array_equal(a, b)


# ----------------------------------------------------------------------------------- equal to one device
@pytest.mark.sweep
def test_scanned_and_unrolled_stacks_draw_the_same_masks():
    """The stack's two forms slice the per-layer keys alike, and a pipeline config on a mesh without ``pipe``
    (the stack as one stage, the keys carried) draws them too: loss and adapter gradients equal (with dropout
    on: eval mode, p = 0's computation, gives another loss)."""
    import dataclasses

    ref_loss, ref_grads = reference()
    for loss, grads in (loss_and_grads({}, "none", cfg=dataclasses.replace(CFG, scan_layers="unrolled")),
                        loss_and_grads({}, "none", PipelineConfig("1f1b", 2))):
        assert loss == pytest.approx(ref_loss, rel=TOL)
        assert max(adapter_errors(grads, ref_grads).values()) <= TOL
    assert abs(loss_and_grads({}, "none", train=False)[0] - ref_loss) > 1e-3  # the masks act


CASES = {  # name -> (mesh sizes, rules, pipeline)
    "data2_pipe2_1f1b": ({"data": 2, "pipe": 2}, "dp", PipelineConfig("1f1b", 2)),
    "fsdp2_tensor2_pipe2_interleaved": ({"fsdp": 2, "tensor": 2, "pipe": 2}, "fsdp_tp",
                                        PipelineConfig("interleaved", 2, 2)),
    "seq2_pipe2_gpipe": ({"pipe": 2, "seq": 2}, "dp", PipelineConfig("gpipe", 2)),
    "pipe2_zb-h2": ({"pipe": 2}, "none", PipelineConfig("zb-h2", 4)),
}


@pytest.mark.sweep  # the slow tier: interleaved in the 3-step run below
@pytest.mark.parametrize("name", CASES)
def test_pipeline_equals_one_device(name):
    loss, grads = loss_and_grads(*CASES[name])
    ref_loss, ref_grads = reference()
    assert loss == pytest.approx(ref_loss, rel=TOL)
    bad = {k: e for k, e in adapter_errors(grads, ref_grads).items() if e > TOL}
    assert not bad, f"adapter gradients differ from one device's: {bad}"


@pytest.mark.sweep
def test_a_stage_drawing_by_its_own_row_index_is_caught(monkeypatch):
    """Negative control: stages that fold the keys with the row's index in the microbatch (every microbatch
    then draws the same masks, what a stage drew without the carried row index) differ from one device."""
    stage_keys = lora_lib.stage_keys
    monkeypatch.setattr(lora_lib, "stage_keys", lambda state, rows: stage_keys(state, jnp.arange(rows.shape[0])))
    loss, grads = loss_and_grads(*CASES["data2_pipe2_1f1b"])
    ref_loss, ref_grads = reference()
    assert abs(loss - ref_loss) > 100 * TOL * abs(ref_loss)
    assert max(adapter_errors(grads, ref_grads).values()) > 100 * TOL


# ------------------------------------------------------------------------------------------------- a run
@pytest.mark.sweep
def test_a_pipelined_run_equals_the_run_on_one_device(tmp_path):
    """Three steps of ``spmd-train gpt-small`` (tiny) with ``lora.dropout=0.1`` and ``run.grad_accum=2``:
    interleaved over ``fsdp=2 x tensor=2 x pipe=2`` (the stack stored in chunk order) equals one device
    accumulating the same two microbatches (each draws with its own key; the pipeline's microbatches within it
    the accumulation microbatch's masks), losses and adapters."""
    from trainers import override, recipe, train

    def run(name, *sets):
        cfg = override(recipe("gpt-small", tiny=True), [
            f"run.run_dir={tmp_path / name}", "run.steps=3", "run.eval_batches=0", "run.progress=false",
            "run.tensorboard=false", "checkpoint.every_steps=1000", "checkpoint.async_save=false",
            "optimizer.name=sgd", "optimizer.clip_norm=null", "optimizer.weight_decay=0", "lr.kind=constant",
            "lr.peak_lr=0.1", "lr.warmup_steps=0", "data.corpus=synthetic", "data.global_batch=8", "data.seq_len=16",
            "model.n_layers=4", "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "run.grad_accum=2", *sets])
        mesh = meshes.single_device_mesh() if cfg.mesh.axes == "data=1" else None
        return train(cfg, mesh=mesh, keep_state=True)

    one = run("one", "mesh.axes=data=1", "rules=none")
    piped = run("piped", "mesh.axes=fsdp=2,tensor=2,pipe=2", "rules=fsdp_tp", "pipeline.schedule=interleaved",
                "pipeline.virtual_stages=2", "pipeline.microbatches=2")
    assert piped.losses == pytest.approx(one.losses, rel=TOL, abs=0)
    assert one.losses[3] != pytest.approx(one.losses[1], abs=1e-4)  # it trained: the comparison is not vacuous
    ours, want = dict(piped.state.params), dict(one.state.params)
    ours["blocks"] = LayerOrder(2, 2).to_natural(jax.tree.map(np.asarray, ours["blocks"]))
    flat = {spmd.sharding.path_str(p, drop=()): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(ours)[0]}
    for path, x in jax.tree_util.tree_flatten_with_path(want)[0]:
        k = spmd.sharding.path_str(path, drop=())
        if lora_lib.is_adapter(k):
            np.testing.assert_allclose(flat[k], np.asarray(x), atol=TOL, rtol=0, err_msg=k)
