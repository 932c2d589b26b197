"""A stack stored in the interleaved schedule's chunk order: same model, single-device gradients, no
per-step regrouping over ``pipe``, sends at the table's minimum, and checkpoints in natural order."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.gpt_util import gpt_config, gpt_task
from test_pipeline import BATCH, CFG, LENGTH, TOL, mesh_of, reference, rel_errs, tokens

import meshes
import spmd
from spmd.models import GPT
from spmd.pipeline import LayerOrder, PipelineConfig, get_schedule
from spmd.pipeline.sends import hlo_sent_bytes, send_plan
from spmd.stack import reorder_stacks
from trainers.checkpoint import CheckpointConfig, Checkpointer
from trainers.setup import build

M = 4


def test_layer_order_permutation():
    order = LayerOrder(2, 2)
    assert list(order.natural_index(8)) == [0, 1, 4, 5, 2, 3, 6, 7]  # device 0: chunks 0, 2; device 1: 1, 3
    assert list(LayerOrder(4, 2).natural_index(8)) == [0, 4, 1, 5, 2, 6, 3, 7]
    x = np.arange(24).reshape(12, 2)
    assert np.array_equal(LayerOrder(2, 3).to_natural(LayerOrder(2, 3).to_stored(x)), x)
    assert not np.array_equal(LayerOrder(2, 3).to_stored(x), x)
    assert LayerOrder(4, 1) == LayerOrder(1, 3) == LayerOrder() and LayerOrder(4, 1).natural
    a, b = LayerOrder(2, 2), LayerOrder(4, 2)
    assert np.array_equal(a.convert(a.to_stored(x[:8]), b), b.to_stored(x[:8]))
    with pytest.raises(ValueError, match=r"LayerOrder.virtual must be an integer >= 1, got 0"):
        LayerOrder(2, 0)
    with pytest.raises(ValueError, match=r"6 layers do not split into S\*V = 2\*2 = 4 equal chunks"):
        LayerOrder(2, 2).check(6)


def test_a_local_sgd_state_converts_each_group_along_its_layers_dim():
    """Local SGD's leaves ``X[G, L, ...]`` (every leaf but the outer ones): the layers dim is second."""
    from trainers.checkpoint import layer_order

    order, stacks = LayerOrder(2, 2), ((("blocks",), 8, LayerOrder(2, 2)),)
    natural = np.arange(16.0).reshape(8, 2)
    groups = np.stack([natural, natural + 100])  # G = 2 groups
    stored = {"params": {"blocks": np.stack([order.to_stored(g) for g in groups])},
              "outer_params": {"blocks": order.to_stored(natural)}}
    out = jax.device_get(layer_order.to_natural(stored, stacks))
    assert np.array_equal(out["params"]["blocks"], groups) and np.array_equal(out["outer_params"]["blocks"], natural)
    back = jax.device_get(layer_order.from_natural(out, stacks))
    assert np.array_equal(back["params"]["blocks"], stored["params"]["blocks"])
    # negative control: without the outer keys (an ordinary state) a leaf [8, ...] along its first dim
    plain = jax.device_get(layer_order.to_natural({"params": {"blocks": stored["outer_params"]["blocks"]}}, stacks))
    assert np.array_equal(plain["params"]["blocks"], natural)
    assert not np.array_equal(stored["params"]["blocks"], groups)


def chunked_gpt(order: LayerOrder):
    return reorder_stacks(GPT(CFG, rngs=nnx.Rngs(0)), order)


def test_chunk_order_keeps_every_layer_and_the_plain_call():
    """Same seed, same model: each natural layer keeps its values, and calling the model (the plain
    scan) applies the layers in natural order."""
    plain, chunked = GPT(CFG, rngs=nnx.Rngs(0)), chunked_gpt(LayerOrder(2, 2))
    assert chunked.blocks.order == LayerOrder(2, 2) and plain.blocks.order.natural
    a, b = (nnx.to_pure_dict(nnx.state(m.blocks, nnx.Param)) for m in (plain, chunked))
    same = jax.tree.map(lambda x, y: bool(np.array_equal(x, LayerOrder(2, 2).to_natural(y))), a, b)
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)
    assert not all(jax.tree.leaves(moved))  # control: the stored order really differs
    x, _ = tokens()
    np.testing.assert_array_equal(np.asarray(plain(x)), np.asarray(chunked(x)))


class ChunkedCase:
    """A compiled ``value_and_grad`` of the interleaved loss with the stack stored in chunk order."""

    def __init__(self, sizes: dict[str, int], rules: str, S: int, V: int):
        self.mesh, self.rules, self.order = mesh_of(sizes), spmd.get_rules(rules), LayerOrder(S, V)
        pipeline = PipelineConfig("interleaved", M, V)
        graphdef, self.params, shardings = spmd.init_params(lambda: chunked_gpt(self.order), self.rules, self.mesh)
        rules_, mesh = self.rules, self.mesh

        def loss(params, x, y):
            with spmd.use_rules(rules_, mesh):
                return nnx.merge(graphdef, params).loss(x, y, pipeline=pipeline)[0]

        self.bs = spmd.batch_sharding(self.rules, self.mesh)
        abstract = jax.ShapeDtypeStruct((BATCH, LENGTH), np.int32, sharding=self.bs)
        self.compiled = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, self.bs, self.bs)).lower(
            self.params, abstract, abstract).compile()
        self.schedule = get_schedule("interleaved", S, M, V)

    def __call__(self):
        x, y = (jax.device_put(a, self.bs) for a in tokens())
        return jax.tree.map(np.asarray, self.compiled(self.params, x, y))


@functools.cache
def chunked_case(sizes: tuple, rules: str, S: int, V: int) -> ChunkedCase:
    return ChunkedCase(dict(sizes), rules, S, V)


CASES = [((("pipe", 2),), "none", 2, 2), ((("fsdp", 2), ("pipe", 2)), "fsdp", 2, 2)]


@pytest.mark.parametrize("sizes, rules, S, V", CASES)
def test_chunk_ordered_interleaved_matches_single_device(sizes, rules, S, V):
    c = chunked_case(sizes, rules, S, V)
    loss, grads = c()
    ref_loss, ref_grads = reference()
    assert loss == pytest.approx(ref_loss, rel=TOL)
    natural = {**grads, "blocks": c.order.to_natural(grads["blocks"])}  # gradients come in the params' order
    errs = rel_errs(natural, ref_grads)
    assert not {k: e for k, e in errs.items() if e > TOL}, errs
    # negative control: read in stored order, the block gradients do not match
    assert max(rel_errs(grads, ref_grads).values()) > 100 * TOL


@pytest.mark.parametrize("sizes, rules, S, V", CASES)
def test_chunk_ordered_step_sends_only_the_table_minimum(sizes, rules, S, V):
    """No regrouping of the stack over ``pipe`` (no all-to-all, no all-gather over it), and the
    collective-permutes move 2*M*(S*V-1) activations per step: what the table sends."""
    c = chunked_case(sizes, rules, S, V)
    ops = spmd.hlo.collectives(c.compiled, c.mesh)
    over_pipe = [x for x in ops if "pipe" in x.axes and x.kind != "collective-permute"]
    assert all(x.kind == "all-reduce" and x.count == 1 for x in over_pipe), spmd.hlo.format_collectives(ops)
    act = (BATCH // M) * LENGTH * CFG.d_model * 4 // (2 if "fsdp" in dict(sizes) else 1)  # rows split over fsdp
    table = c.schedule.sent_bytes(act)
    assert table.executed == table.minimum == 2 * M * (S * V - 1) * act
    assert send_plan(c.schedule).count == 2 * M * (S * V - 1)
    assert hlo_sent_bytes(c.compiled, c.schedule, c.mesh) == {"executed": table.executed, "unattributed": 0}


def _state(sizes: dict[str, int], pipeline: PipelineConfig | None, seed: int):
    """The state as a run of the GPT on a mesh of ``sizes`` with ``pipeline`` creates it (its layer order)."""
    mesh = meshes.make_mesh(sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])
    cfg = gpt_config(sizes, "dp", f"run.seed={seed}", f"data.global_batch={BATCH}", model=CFG)
    cfg = dataclasses.replace(cfg, pipeline=pipeline or PipelineConfig())
    return build(cfg, gpt_task(CFG, pipeline), mesh, tx=optax.adamw(1e-3)).sharded


def _blocks_equal(a, b, order: LayerOrder) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), order.to_natural(
        np.asarray(y)))), a.params["blocks"], b.params["blocks"])))


def test_checkpoints_hold_natural_order_and_restore_across_orders(tmp_path):
    """A natural-order checkpoint restores into an interleaved run (chunk order) and back."""
    order, pipeline = LayerOrder(2, 2), PipelineConfig("interleaved", M, 2)
    natural = _state({"data": 2}, None, seed=0)
    interleaved = _state({"data": 2, "pipe": 2}, pipeline, seed=1)  # other values: the restore must replace them
    assert natural.layer_orders == () and interleaved.layer_orders == ((("blocks", "block"), 8, order),)
    config = CheckpointConfig(every_steps=1, keep=2, async_save=False)
    with Checkpointer(tmp_path / "natural", config) as ckpt:
        ckpt.save(1, natural.state, {}, force=True)
    with Checkpointer(tmp_path / "natural", config, layer_orders=interleaved.layer_orders) as ckpt:
        _, restored, _ = ckpt.restore(interleaved.abstract)
    assert _blocks_equal(natural.state, restored, order)
    assert not _blocks_equal(natural.state, interleaved.state, order)  # control: seed 1 differs
    mu = restored.opt_state[0].mu["blocks"]["block"]["attn_norm"]["scale"]
    assert mu.sharding == interleaved.shardings.opt_state[0].mu["blocks"]["block"]["attn_norm"]["scale"]
    # and an interleaved run's checkpoint restores onto the plain mesh in natural order
    with Checkpointer(tmp_path / "interleaved", config, layer_orders=interleaved.layer_orders) as ckpt:
        ckpt.save(1, restored, {}, force=True)
    with Checkpointer(tmp_path / "interleaved", config) as ckpt:
        _, back, _ = ckpt.restore(natural.abstract)
    assert all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))),
                                            back.params, natural.state.params)))


def test_an_interleaved_state_starts_from_one_devices_numbers_bit_for_bit():
    """``sharded_state`` creates a chunk-ordered stack in natural order on its natural shards and then moves
    it: every layer holds one device's init exactly. (Created in the chunk order's sharding at once, each
    device computed the random init of layers it does not keep, and at LLVM -O0 about 40% of the block
    weights came out 1 ulp apart: an interleaved run that trained from other numbers than one device.)"""
    from trainers.state import sharded_state

    make, tx = (lambda: GPT(CFG, rngs=nnx.Rngs(0))), optax.sgd(0.1)
    one = sharded_state(make, tx, "none", mesh_of({}))
    piped = sharded_state(make, tx, "dp", mesh_of({"data": 4, "pipe": 2}), pipeline=PipelineConfig("interleaved", M, 2))
    order = LayerOrder(2, 2)
    assert piped.layer_orders and piped.layer_orders[0][2] == order
    got, want = (jax.tree.map(np.asarray, s.state.params) for s in (piped, one))
    got["blocks"] = jax.tree.map(order.to_natural, got["blocks"])
    same = jax.tree.map(np.array_equal, got, want)
    assert all(jax.tree.leaves(same)), same
    stored = jax.tree.map(np.array_equal, jax.tree.map(np.asarray, piped.state.params["blocks"]), want["blocks"])
    assert not all(jax.tree.leaves(stored))  # control: the stacks are stored in chunk order
