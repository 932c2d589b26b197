"""Where every array of the GPT train state lives, per layout: PartitionSpecs and shard shapes.

The expectation is written here independently of the rule presets: a table of each parameter's
logical dims, and per layout the mesh axis each logical dim goes to (the presets' documented
plan). Each array is checked three ways: its ``.sharding.spec``, its shard shape (from the
sharding and from the shards actually on the devices), and the row ``spmd.inspection.sharding_table`` prints.
Optimizer moments must follow their parameter; the step count and nothing else is replicated.
"""

import math

import jax
import numpy as np
import pytest
from helpers.gpt_util import BATCH, LENGTH, batches, layout
from jax.sharding import PartitionSpec as P

import spmd

# Logical dims of every parameter of gpt_util's GPT (n_layers stacked in front of block params).
DIMS = {
    "embed": ("vocab", "embed"),
    "head": ("embed", "vocab"),
    "final_norm/scale": ("embed",),
    "blocks/block/attn_norm/scale": ("layers", "embed"),
    "blocks/block/mlp_norm/scale": ("layers", "embed"),
    "blocks/block/attn/w_q": ("layers", "embed", "heads", "head_dim"),
    "blocks/block/attn/w_kv": ("layers", "embed", "kv_heads", None, "head_dim"),
    "blocks/block/attn/w_o": ("layers", "heads", "head_dim", "embed"),
    "blocks/block/mlp/w_gate_up": ("layers", "embed", None, "mlp"),
    "blocks/block/mlp/w_down": ("layers", "mlp", "embed"),
}

_TP = {"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor", "vocab": "tensor"}
# layout -> (logical dim -> mesh axis for parameters, batch PartitionSpec)
PLAN = {
    "dp8": ({}, P("data")),
    "fsdp8": ({"embed": "fsdp"}, P("fsdp")),  # batch over ("data", "fsdp"); data has size 1 and is dropped
    "dp2_tp4": (_TP, P("data")),
    "dp2_fsdp2_tp2": ({"embed": "fsdp", **_TP}, P(("data", "fsdp"))),
}
SHARDED = list(PLAN)


def expected_spec(dims, plan) -> P:
    entries = [plan.get(d) for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def expected_shard(shape, dims, plan, mesh) -> tuple[int, ...]:
    return tuple(n // (mesh.shape[plan[d]] if d in plan else 1) for n, d in zip(shape, dims))


def leaves_by_path(tree) -> dict:
    return {spmd.sharding.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", SHARDED)
def test_param_specs_and_shard_shapes(name):
    lay = layout(name)
    plan, _ = PLAN[name]
    params = leaves_by_path(lay.params)
    assert set(params) == set(DIMS), "the model's parameters changed: update DIMS"
    rows = {r["path"]: r for r in spmd.inspection.sharding_table(lay.params)}
    shardings = leaves_by_path(lay.param_shardings)
    for path, x in params.items():
        spec = expected_spec(DIMS[path], plan)
        shard = expected_shard(x.shape, DIMS[path], plan, lay.mesh)
        assert x.sharding.spec == spec, (name, path, x.sharding.spec, spec)
        assert shardings[path].spec == spec, (name, path)
        assert tuple(x.sharding.shard_shape(x.shape)) == shard, (name, path)
        assert {tuple(s.data.shape) for s in x.addressable_shards} == {shard}, (name, path)
        # the array is really split: as many distinct pieces as the product of its axes
        n_pieces = math.prod(lay.mesh.shape[plan[d]] for d in DIMS[path] if d in plan)
        assert len({str(s.index) for s in x.addressable_shards}) == n_pieces, (name, path)
        row = rows[path]
        assert (row["shape"], row["spec"], row["shard"]) == (tuple(x.shape), str(spec), shard), (name, row)
        assert row["bytes_per_device"] == math.prod(shard) * 4


def test_spot_checks_from_the_presets():
    """A few literal shapes, so a mistake shared by PLAN and the presets still shows."""
    fsdp, tp, both = (leaves_by_path(layout(n).params) for n in ("fsdp8", "dp2_tp4", "dp2_fsdp2_tp2"))
    w_gate = "blocks/block/mlp/w_gate_up"
    assert fsdp[w_gate].shape == (2, 64, 2, 128)
    assert fsdp[w_gate].sharding.spec == P(None, "fsdp")
    assert fsdp[w_gate].sharding.shard_shape(fsdp[w_gate].shape) == (2, 8, 2, 128)
    assert all(x.sharding.spec == P() and x.sharding.is_fully_replicated for x in leaves_by_path(layout("dp8").params).values())
    assert tp[w_gate].sharding.spec == P(None, None, None, "tensor")
    assert tp["blocks/block/mlp/w_down"].sharding.spec == P(None, "tensor")
    assert tp["blocks/block/attn/w_q"].sharding.spec == P(None, None, "tensor")
    assert tp["embed"].sharding.spec == P("tensor")
    assert tp["head"].sharding.spec == P(None, "tensor")
    assert tp["final_norm/scale"].sharding.is_fully_replicated
    assert both[w_gate].sharding.spec == P(None, "fsdp", None, "tensor")
    assert both[w_gate].sharding.shard_shape((2, 64, 2, 128)) == (2, 32, 2, 64)
    assert both["blocks/block/mlp/w_down"].sharding.spec == P(None, "tensor", "fsdp")
    assert both["embed"].sharding.spec == P("tensor", "fsdp")


@pytest.mark.parametrize("name", SHARDED)
def test_optimizer_state_follows_params(name):
    lay = layout(name)
    adam = lay.opt_state[0]  # optax.adamw = chain(scale_by_adam, add_decayed_weights, scale)
    params = leaves_by_path(lay.params)
    for moments in (adam.mu, adam.nu):
        moments = leaves_by_path(moments)
        assert set(moments) == set(params)
        for path, m in moments.items():
            p = params[path]
            assert m.sharding.spec == p.sharding.spec, (name, path)
            assert m.sharding.shard_shape(m.shape) == p.sharding.shard_shape(p.shape), (name, path)
            assert [s.device for s in m.addressable_shards] == [s.device for s in p.addressable_shards]
            assert [s.index for s in m.addressable_shards] == [s.index for s in p.addressable_shards]
    assert adam.count.shape == () and adam.count.sharding.spec == P() and adam.count.sharding.is_fully_replicated
    # everything that is not a moment is a replicated scalar
    rows = spmd.inspection.sharding_table(lay.opt_state)
    others = [r for r in rows if "/mu/" not in r["path"] and "/nu/" not in r["path"]]
    assert [(r["shape"], r["spec"]) for r in others] == [((), "P()")]
    assert len(rows) == 2 * len(params) + 1


@pytest.mark.parametrize("name", SHARDED)
def test_batch_sharding(name):
    lay = layout(name)
    _, spec = PLAN[name]
    assert lay.batch_sharding.spec == spec
    n = math.prod(lay.mesh.shape[a] for entry in spec for a in ((entry,) if isinstance(entry, str) else entry))
    assert n == {"dp8": 8, "fsdp8": 8, "dp2_tp4": 2, "dp2_fsdp2_tp2": 4}[name]
    tokens = lay.put(batches(1)[0])["inputs"]
    assert tokens.sharding.spec == spec
    assert {tuple(s.data.shape) for s in tokens.addressable_shards} == {(BATCH // n, LENGTH)}
    assert len({str(s.index) for s in tokens.addressable_shards}) == n
    np.testing.assert_array_equal(np.asarray(tokens), batches(1)[0]["inputs"])


def test_negative_control_wrong_plan_is_caught():
    """The fsdp8 arrays do not satisfy the dp_tp plan (or a plan without fsdp): the checks can fail."""
    params = leaves_by_path(layout("fsdp8").params)
    w_gate = params["blocks/block/mlp/w_gate_up"]
    assert w_gate.sharding.spec != expected_spec(DIMS["blocks/block/mlp/w_gate_up"], PLAN["dp2_tp4"][0])
    assert w_gate.sharding.shard_shape(w_gate.shape) != expected_shard(
        w_gate.shape, DIMS["blocks/block/mlp/w_gate_up"], {}, layout("fsdp8").mesh)
    mismatched = [p for p, x in params.items() if x.sharding.spec != expected_spec(DIMS[p], PLAN["dp8"][0])]
    assert set(mismatched) == set(DIMS)  # every fsdp8 parameter is sharded somewhere
