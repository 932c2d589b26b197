"""What the compiled GPT train step communicates, per layout, read from its optimised HLO.

The numbers are per device and per step, derived from the parameters (not copied from a run):
a gradient all-reduce carries the bytes of the gradients, an FSDP all-gather the bytes of the full
weight, a Megatron all-reduce the ``[B_local, L, D]`` activation. Collectives inside the layer
scan run once per layer (``count`` = n_layers, from the while loop's known trip count).

The first half pins the parser itself on hand-written HLO, one snippet per replica-group form.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.gpt_util import BATCH, CFG, LENGTH, layout, make_model

import spmd
from spmd.hlo import collectives, summarize
from spmd.models import lm_loss

F32 = 4
LOSS_BYTES = F32  # the scalar loss: a mean over the batch, so a partial sum over the batch axes


# ---------------------------------------------------------------------------------------------
# The parser on literal HLO
# ---------------------------------------------------------------------------------------------

MESH_2x4 = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

ADD = """%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def module(*body: str, extra: str = "") -> str:
    """An HLO module whose ENTRY holds these instruction lines (operand %p: f32[8,8])."""
    lines = "\n".join(f"  {b}" for b in body)
    return (f"HloModule test, entry_computation_layout={{(f32[8,8]{{1,0}})->f32[8,8]{{1,0}}}}\n\n{ADD}\n{extra}\n"
            f"ENTRY %main (p: f32[8,8]) -> f32[8,8] {{\n  %p = f32[8,8]{{1,0}} parameter(0)\n{lines}\n"
            f"  ROOT %out = f32[8,8]{{1,0}} copy(%p)\n}}\n")


def one(text: str, mesh=MESH_2x4):
    ops = collectives(text, mesh)
    assert len(ops) == 1, ops
    return ops[0]


def all_reduce(groups: str) -> str:
    return module(f"%ar = f32[8,8]{{1,0}} all-reduce(%p), channel_id=1, replica_groups={groups}, to_apply=%add")


@pytest.mark.parametrize("groups, axes, group_size", [
    ("{{0,1,2,3},{4,5,6,7}}", ("tensor",), 4),
    ("{{0,4},{1,5},{2,6},{3,7}}", ("data",), 2),
    ("{}", ("data", "tensor"), 8),  # empty list: one group of every device
    ("[2,4]<=[8]", ("tensor",), 4),
    ("[4,2]<=[2,4]T(1,0)", ("data",), 2),
    ("[1,8]<=[8]", ("data", "tensor"), 8),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_2'}", ("tensor",), 4),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", ("data",), 2),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", ("data", "tensor"), 8),
    # device ids [2,4]T(1,0) = 0,4,1,5,2,6,3,7 laid out as the [4,1,2] mesh: grouping over axis_0
    # gathers 0,1,2,3 (tensor); ignoring device_ids would give 0,2,4,6 (data and tensor).
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ("tensor",), 4),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_2'}", ("data",), 2),
])
def test_replica_group_forms(groups, axes, group_size):
    op = one(all_reduce(groups))
    assert (op.kind, op.axes, op.group_size, op.count, op.bytes) == ("all-reduce", axes, group_size, 1, 8 * 8 * F32)
    assert op.trip_count_known and op.name == "ar"


def test_tuple_all_reduce_bytes_are_summed():
    op = one(module("%ar = (f32[8,8]{1,0}, bf16[16]{0}, f32[]) all-reduce(%p, %q, %r), channel_id=1, "
                    "replica_groups=[2,4]<=[8], to_apply=%add"))
    assert op.bytes == 8 * 8 * 4 + 16 * 2 + 4
    assert op.axes == ("tensor",)


def test_reduce_scatter_counts_the_unscattered_input():
    op = one(module("%rs = f32[2,8]{1,0} reduce-scatter(%p), channel_id=1, replica_groups=[2,4]<=[8], "
                    "dimensions={0}, to_apply=%add"))
    assert (op.kind, op.axes, op.group_size) == ("reduce-scatter", ("tensor",), 4)
    assert op.bytes == 4 * 2 * 8 * F32  # the f32[8,8] input, not the f32[2,8] result


def test_all_gather_counts_the_gathered_result():
    op = one(module("%ag = f32[8,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
                    "dimensions={0}, use_global_device_ids=true"))
    assert (op.kind, op.axes, op.bytes) == ("all-gather", ("data",), 8 * 8 * F32)


def test_async_start_ops_count_their_results():
    """``-start`` ops return (operands, results[, contexts]); only the results count (``-done`` is skipped)."""
    ops = collectives(module(
        "%ag = ((f32[2]{0}, f32[4]{0}), (f32[8]{0}, f32[16]{0})) all-gather-start(%x, %y), channel_id=1, "
        "replica_groups=[2,4]<=[8], dimensions={0}",
        "%agd = (f32[8]{0}, f32[16]{0}) all-gather-done(%ag)",
        "%cp = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, "
        "source_target_pairs={{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}",
        "%cpd = f32[8]{0} collective-permute-done(%cp)",
        "%ars = f32[8]{0} all-reduce-start(%x), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add",
        "%ard = f32[8]{0} all-reduce-done(%ars)",
    ), MESH_2x4)
    assert [(o.kind, o.axes, o.bytes) for o in ops] == [
        ("all-gather", ("tensor",), (8 + 16) * F32),
        ("collective-permute", ("data",), 8 * F32),
        ("all-reduce", ("tensor",), 8 * F32),
    ]


@pytest.mark.parametrize("pairs, axes", [
    ("{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}", ("tensor",)),  # a ring within each tensor group
    ("{{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}", ("data",)),
    ("{{0,5}}", ("data", "tensor")),
])
def test_collective_permute_pairs(pairs, axes):
    op = one(module(f"%cp = f32[8,8]{{1,0}} collective-permute(%p), channel_id=1, source_target_pairs={pairs}"))
    assert (op.kind, op.axes, op.bytes) == ("collective-permute", axes, 8 * 8 * F32)


LOOP = """%cond{i} (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  ROOT %lt = pred[] constant(true)
}}

%body{i} (b: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %b = (s32[], f32[8]{{0}}) parameter(0)
  %x = f32[8]{{0}} get-tuple-element(%b), index=1
  %ar{i} = f32[8]{{0}} all-reduce(%x), channel_id={i}, replica_groups=[2,4]<=[8], to_apply=%add, metadata={{op_name="jit(step)/transpose(jvp())/while/body/dot_general"}}
  {inner}
  ROOT %t = (s32[], f32[8]{{0}}) tuple(%k, %ar{i})
}}
"""


def while_op(i: int, trip: int | None, indent: str = "") -> str:
    config = f', backend_config={{"known_trip_count":{{"n":"{trip}"}}}}' if trip is not None else ""
    return f"{indent}%w{i} = (s32[], f32[8]{{0}}) while(%init), condition=%cond{i}, body=%body{i}{config}"


def test_while_known_trip_count_multiplies_counts():
    inner = LOOP.format(i=2, inner="")
    outer = LOOP.format(i=1, inner=while_op(2, 4))
    ops = {o.name: o for o in collectives(module(while_op(1, 3), extra=inner + "\n" + outer), MESH_2x4)}
    assert (ops["ar1"].count, ops["ar1"].bytes, ops["ar1"].total_bytes) == (3, 32, 96)
    assert (ops["ar2"].count, ops["ar2"].total_bytes) == (3 * 4, 12 * 32)  # nested loops multiply
    assert ops["ar1"].trip_count_known and ops["ar2"].trip_count_known
    assert ops["ar1"].backward  # from the op_name metadata
    assert summarize(list(ops.values())) == {("all-reduce", ("tensor",)): {"count": 15, "bytes": 15 * 32}}


def test_while_unknown_trip_count_counts_once_and_says_so():
    ops = collectives(module(while_op(1, None), extra=LOOP.format(i=1, inner="")), MESH_2x4)
    assert [(o.count, o.trip_count_known) for o in ops] == [(1, False)]


def test_unreachable_computation_is_not_counted():
    ops = collectives(module(extra=LOOP.format(i=1, inner="")), MESH_2x4)  # body1 is never called
    assert ops == []


# The CPU backend's rewrites (spmd.hlo_cpu), as XLA's CPU pipeline prints them: the accelerator view
# undoes them, view="emitted" keeps them, and each recognised op carries both.
PROMOTED = """%add_promoted (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%to_bf16 (q: f32[8,8]) -> bf16[8,8] {
  %q = f32[8,8]{1,0} parameter(0)
  ROOT %c = bf16[8,8]{1,0} convert(%q)
}
"""
# each device keeps rows [2 * tensor index, +2) of the reduced [8,8]: a reduce-scatter over tensor (4)
SHARD = """%shard (v: f32[8,8], pid: u32[]) -> f32[2,8] {
  %v = f32[8,8]{1,0} parameter(0)
  %pid = u32[] parameter(1)
  %i = s32[] convert(%pid)
  %four = s32[] constant(4)
  %r = s32[] remainder(%i, %four)
  %two = s32[] constant(2)
  %off = s32[] multiply(%r, %two)
  %zero = s32[] constant(0)
  %sq = f32[8,8]{1,0} multiply(%v, %v)
  ROOT %ds = f32[2,8]{1,0} dynamic-slice(%sq, %off, %zero), dynamic_slice_sizes={2,8}
}
"""
AR_TENSOR = "all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%add"


def test_promoted_bf16_all_reduce_counts_half_the_bytes():
    text = module(f"%ar = f32[8,8]{{1,0}} {AR_TENSOR.replace('%add', '%add_promoted')}",
                  "%back = bf16[8,8]{1,0} fusion(%ar), kind=kLoop, calls=%to_bf16", extra=PROMOTED)
    op = one(text)
    assert (op.kind, op.axes, op.bytes) == ("all-reduce", ("tensor",), 8 * 8 * 2)  # bf16 on an accelerator
    assert op.differs and op.emitted == ("all-reduce", ("tensor",), 1, 8 * 8 * F32)
    assert "bf16 all-reduce promoted to f32" in op.cpu_note
    (raw,) = collectives(text, MESH_2x4, view="emitted")
    assert (raw.bytes, raw.differs) == (8 * 8 * F32, False)
    # negative controls: a plain f32 reduction, or a promoted one whose f32 result is used as f32
    plain = one(text.replace("to_apply=%add_promoted", "to_apply=%add"))
    used_whole = one(module(f"%ar = f32[8,8]{{1,0}} {AR_TENSOR.replace('%add', '%add_promoted')}",
                            "%n = f32[8,8]{1,0} negate(%ar)", extra=PROMOTED))
    assert (plain.bytes, plain.differs, used_whole.bytes, used_whole.differs) == (256, False, 256, False)


def test_bf16_all_gather_widened_by_the_cpu_counts_half_the_bytes():
    widen = "%w = bf16[8,8]{1,0} convert(%p)\n  %up = f32[8,8]{1,0} convert(%w)"
    gather = ("%ag = f32[8,8]{1,0} all-gather(%up), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}\n"
              "  %back = bf16[8,8]{1,0} convert(%ag)")
    op = one(module(widen, gather))
    assert (op.kind, op.bytes, op.emitted[3]) == ("all-gather", 8 * 8 * 2, 8 * 8 * F32)
    # negative control: an f32 weight gathered and only then cast to bf16 moves f32 on any backend
    op = one(module(gather.replace("%up", "%p")))
    assert (op.bytes, op.differs) == (8 * 8 * F32, False)


def test_all_reduce_sliced_to_the_shard_is_a_reduce_scatter():
    text = module(f"%ar = f32[8,8]{{1,0}} {AR_TENSOR}", "%pid = u32[] partition-id()",
                  "%mine = f32[2,8]{1,0} fusion(%ar, %pid), kind=kLoop, calls=%shard", extra=SHARD)
    op = one(text)
    assert (op.kind, op.axes, op.group_size, op.bytes) == ("reduce-scatter", ("tensor",), 4, 8 * 8 * F32)
    assert op.emitted == ("all-reduce", ("tensor",), 1, 8 * 8 * F32) and "dynamic-slice" in op.cpu_note
    assert summarize([op]) == {("reduce-scatter", ("tensor",)): {"count": 1, "bytes": 256}}
    assert summarize([op], "emitted") == {("all-reduce", ("tensor",)): {"count": 1, "bytes": 256}}
    # negative controls: the result also used whole; a slice at a constant offset (not the device's shard)
    whole = one(text.replace("ROOT %out = f32[8,8]{1,0} copy(%p)", "ROOT %out = f32[8,8]{1,0} copy(%ar)"))
    fixed = one(text.replace("%mine = f32[2,8]{1,0} fusion(%ar, %pid)", "%c = u32[] constant(1)\n  "
                             "%mine = f32[2,8]{1,0} fusion(%ar, %c)"))
    assert (whole.kind, whole.differs, fixed.kind, fixed.differs) == ("all-reduce", False, "all-reduce", False)


def test_tuple_all_reduce_over_two_axes_splits_per_element():
    """(grad, loss) over data x tensor; grad sliced 1/4 (tensor): reduce-scatter over tensor and an
    all-reduce of the shard over data; the loss, used whole, stays an all-reduce over both."""
    text = module("%l = f32[] constant(1)",
                  "%ar = (f32[8,8]{1,0}, f32[]) all-reduce(%p, %l), channel_id=1, replica_groups={}, to_apply=%add",
                  "%g = f32[8,8]{1,0} get-tuple-element(%ar), index=0", "%pid = u32[] partition-id()",
                  "%mine = f32[2,8]{1,0} fusion(%g, %pid), kind=kLoop, calls=%shard",
                  "%loss = f32[] get-tuple-element(%ar), index=1", "%n = f32[] negate(%loss)", extra=SHARD)
    ops = {(o.kind, o.axes): o for o in collectives(text, MESH_2x4)}
    assert {k: (o.bytes, o.group_size, o.emitted) for k, o in ops.items()} == {
        ("reduce-scatter", ("tensor",)): (256, 4, ("all-reduce", ("data", "tensor"), 1, 260)),  # the emitted op
        ("all-reduce", ("data",)): (64, 2, ("all-reduce", ("data", "tensor"), 0, 0)),  # counted with the row above
        ("all-reduce", ("data", "tensor")): (4, 8, ("all-reduce", ("data", "tensor"), 0, 0)),
    }
    assert all(o.differs and "one of 3 parts" in o.cpu_note for o in ops.values())
    assert summarize(list(ops.values()), "emitted") == summarize(collectives(text, MESH_2x4, view="emitted")) == {
        ("all-reduce", ("data", "tensor")): {"count": 1, "bytes": 260}}
    table = spmd.hlo.format_collectives(list(ops.values()))
    assert "reduce-scatter" in table and "CPU program as compiled: 1 collectives, 260 B" in table
    with pytest.raises(ValueError, match="view='cpu'; valid: accelerator, emitted"):
        collectives(text, MESH_2x4, view="cpu")


def test_format_collectives_keeps_columns_apart_at_pod_scale():
    ops = [spmd.hlo.Collective("all-gather", ("fsdp",), 74511, 981 * 2**30, 256),
           spmd.hlo.Collective("all-reduce", ("data", "fsdp"), 3, 12, 2048)]
    lines = spmd.hlo.format_collectives(ops).splitlines()
    assert "74,511" in lines[1] and f"{74511 * 981 / 2**20:.2f} PiB" in lines[1], lines
    header, row = lines[0], lines[1]
    for col in ("count", "bytes/device"):  # right-aligned under their header, one space apart at least
        end = header.index(col) + len(col)
        assert row[end - 1] != " " and row[end:end + 1] in ("", " "), lines
    assert re.search(r"74,511\s{2,}\S", row)


# ---------------------------------------------------------------------------------------------
# The GPT train step per layout
# ---------------------------------------------------------------------------------------------

N_LAYERS = CFG.n_layers


@functools.cache
def compiled(name: str):
    return layout(name).compiled()


@functools.cache
def step_ops(name: str) -> list:
    return collectives(compiled(name), layout(name).mesh)


def in_scan(op) -> bool:
    return "/while/body/" in op.op_name


def grad_bytes(name: str) -> int:
    """Per-device bytes of the gradients = of the parameters, as this layout shards them."""
    return spmd.inspection.tree_bytes_per_device(layout(name).params)


def block_bytes_per_layer(name: str) -> int:
    blocks = layout(name).params["blocks"]
    return spmd.inspection.tree_bytes_per_device(blocks) // N_LAYERS


def full_bytes(tree) -> list[int]:
    return [x.nbytes for x in jax.tree.leaves(tree)]


def test_dp8_all_reduces_exactly_the_gradients():
    ops, grads = step_ops("dp8"), grad_bytes("dp8")
    assert grads == sum(full_bytes(layout("dp8").params))  # replicated: a device holds everything
    # One tuple all-reduce per layer inside the backward scan (that layer's weight gradients), one
    # after it (embed, head, final norm and the scalar loss, merged by XLA's combiner): the bytes
    # are the gradient bytes plus the 4-byte f32 loss, and nothing else crosses the network.
    assert summarize(ops) == {("all-reduce", ("data",)): {"count": N_LAYERS + 1, "bytes": grads + LOSS_BYTES}}
    assert sorted((in_scan(o), o.count, o.bytes) for o in ops) == [
        (False, 1, grads - N_LAYERS * block_bytes_per_layer("dp8") + LOSS_BYTES),
        (True, N_LAYERS, block_bytes_per_layer("dp8")),
    ]
    assert all(o.backward and o.group_size == 8 for o in ops)


def test_fsdp8_gathers_each_weight_once_and_all_reduces_gradients():
    lay, ops = layout("fsdp8"), step_ops("fsdp8")
    full = sum(full_bytes(lay.params))
    assert grad_bytes("fsdp8") * 8 == full
    # All-gathers: each weight once per step, in the forward pass, over fsdp, at its full size.
    # The backward pass does not gather again: the forward scan stores the gathered per-layer
    # weights as residuals (dynamic-update-slice into a stacked buffer) and the backward scan reads
    # them (no remat): temp memory holds the gathered weights instead of a second round of gathers.
    gathers = [o for o in ops if o.kind == "all-gather"]
    assert all(o.axes == ("fsdp",) and o.group_size == 8 and not o.backward for o in gathers)
    # attention's w_q and w_kv are joined on their shards and gathered as one fused q/k/v weight
    blocks = {spmd.sharding.path_str(p): x.nbytes for p, x in jax.tree_util.tree_leaves_with_path(lay.params["blocks"])}
    fused = sum(blocks.pop(k) for k in [k for k in blocks if k.endswith(("w_q", "w_kv"))])
    per_layer = sorted(b // N_LAYERS for b in [*blocks.values(), fused])
    assert sorted(o.bytes for o in gathers if in_scan(o)) == per_layer
    assert {o.count for o in gathers if in_scan(o)} == {N_LAYERS}
    top = {k: v for k, v in lay.params.items() if k != "blocks"}  # embed, head, final_norm
    assert sorted(o.bytes for o in gathers if not in_scan(o)) == sorted(full_bytes(top))
    assert {o.count for o in gathers if not in_scan(o)} == {1}
    # Gradients: this CPU backend has no reduce-scatter pass, so the reduce-scatter is emitted as an
    # all-reduce of the *full* gradients (8x the shard bytes) over fsdp, after which each device
    # dynamic-slices its own shard. Same grouping as dp8: one per layer in the scan plus one after.
    # spmd.hlo counts them as the reduce-scatters they stand for (the scalar loss, used whole, stays an
    # all-reduce) and keeps the emitted program as the "emitted" view.
    gathered = {"count": len(per_layer) * N_LAYERS + len(top), "bytes": full}
    assert summarize(ops) == {
        ("all-gather", ("fsdp",)): gathered,
        ("all-reduce", ("fsdp",)): {"count": 1, "bytes": LOSS_BYTES},
        ("reduce-scatter", ("fsdp",)): {"count": N_LAYERS + 1, "bytes": full},
    }
    assert summarize(ops, "emitted") == {
        ("all-gather", ("fsdp",)): gathered,
        ("all-reduce", ("fsdp",)): {"count": N_LAYERS + 1, "bytes": full + LOSS_BYTES},
    }
    text = compiled("fsdp8").as_text()
    assert "reduce-scatter" not in text
    shard_slices = backward_dynamic_slice_shapes(text)
    # the w_down gradient shard [F, D/8] and a norm-scale gradient shard [D/8]; XLA may slice one layer's
    # (with or without its unit layer dim) or the stacked layers' [n_layers, F, D/8] at once
    w_down_shard = {f"f32[{lead}{CFG.ff},{CFG.d_model // 8}]" for lead in ("", "1,", f"{N_LAYERS},")}
    scale_shard = {f"f32[{lead}{CFG.d_model // 8}]" for lead in ("", "1,")}
    assert w_down_shard & shard_slices and scale_shard & shard_slices, shard_slices
    # negative control: the dp8 step keeps whole gradients and slices no such shards
    dp_slices = backward_dynamic_slice_shapes(compiled("dp8").as_text())
    assert not (w_down_shard | scale_shard) & dp_slices, dp_slices


def backward_dynamic_slice_shapes(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"= (\w+\[[\d,]*\])\S* dynamic-slice\(.*transpose\(jvp", text)}


B_LOCAL_DP2 = BATCH // 2
BLD = B_LOCAL_DP2 * LENGTH * CFG.d_model * F32  # one [B_local, L, D] f32 activation: 16 KiB
BL = B_LOCAL_DP2 * LENGTH * F32  # one [B_local, L] f32 row statistic


def test_dp2_tp4_megatron_pattern():
    ops = step_ops("dp2_tp4")
    tensor = [o for o in ops if o.axes == ("tensor",)]
    assert all(o.kind == "all-reduce" and o.group_size == 4 for o in tensor)
    # Forward, inside the layer scan: exactly one all-reduce per row-parallel matmul (attention
    # output w_o, MLP down w_down), of the [B_local, L, D] partial sums: 2 per block x n_layers.
    fwd_scan = [o for o in tensor if not o.backward and in_scan(o)]
    assert sorted((o.op_name.rsplit("/", 2)[-2], o.count, o.bytes) for o in fwd_scan) == [
        ("blf,fd->bld", N_LAYERS, BLD),
        ("blhk,hkd->bld", N_LAYERS, BLD),
    ]
    # Forward, outside the scan: the vocab-parallel embedding (each device looks up the rows of its
    # vocab shard; partial [B, L, D] sums), and the cross-entropy over vocab-sharded logits (max and
    # sum-of-exp over V: two [B_local, L] all-reduces).
    fwd_rest = [o for o in tensor if not o.backward and not in_scan(o)]
    assert sorted((o.op_name.rsplit("/", 1)[-1], o.count, o.bytes) for o in fwd_rest) == [
        ("gather", 1, BLD),  # jvp(jit(_take))/gather: the embedding lookup
        ("reduce_max", 1, BL),
        ("reduce_sum", 1, BL),
    ]
    # Backward: the input gradients of the column-parallel matmuls are partial sums over tensor.
    # q/k/v and gate/up are each one fused matmul (spmd.models.layers), so exactly one [B_local, L, D]
    # all-reduce each per layer, as in Megatron's hand-written plan. After the scan: the head's input
    # gradient (BLD) merged with the forward target-logit gather of the loss (BL).
    bwd = [o for o in tensor if o.backward]
    assert sorted((o.op_name.rsplit("/", 2)[-2], o.count, o.bytes) for o in bwd if in_scan(o)) == [
        ("bld,dcf->blcf", N_LAYERS, BLD),  # the fused w_gate_up's input gradient
        ("bld,dnsk->blnsk", N_LAYERS, BLD),  # the fused q/k/v weight's input gradient
    ]
    assert sorted((o.count, o.bytes) for o in bwd if not in_scan(o)) == [(1, BLD + BL)]
    assert len(tensor) == len(fwd_scan) + len(fwd_rest) + len(bwd) == 8
    # Data parallel: the gradient all-reduce over data carries this device's gradient shard bytes.
    grads = grad_bytes("dp2_tp4")
    data = [o for o in ops if o.axes == ("data",)]
    assert all(o.kind == "all-reduce" and o.backward and o.group_size == 2 for o in data)
    assert sorted((in_scan(o), o.count, o.bytes) for o in data) == [
        (False, 1, grads - N_LAYERS * block_bytes_per_layer("dp2_tp4") + LOSS_BYTES),
        (True, N_LAYERS, block_bytes_per_layer("dp2_tp4")),
    ]
    assert set(summarize(ops)) == {("all-reduce", ("data",)), ("all-reduce", ("tensor",))}
    assert summarize(ops)[("all-reduce", ("data",))]["bytes"] == grads + LOSS_BYTES
    # TP shards every weight 4 ways except the norm scales: a little over a quarter of dp8's gradients
    assert grad_bytes("dp8") / 4 < grads < grad_bytes("dp8") / 3


def test_negative_control_unsharded_mlp_has_no_mlp_all_reduce():
    """With ``mlp`` left unsharded the MLP is not row-parallel: its forward all-reduce disappears,
    while the attention one (heads still over tensor) stays. Were both present here, the Megatron
    test above could not tell a row-parallel MLP from a replicated one."""
    rules = spmd.rules.DP_TP.replace(name="dp_tp_no_mlp", params={"mlp": None}, activations={"mlp": None})
    mesh = layout("dp2_tp4").mesh
    graphdef, params, _ = spmd.init_params(make_model, rules, mesh)
    assert params["blocks"]["block"]["mlp"]["w_down"].sharding.is_fully_replicated
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32, sharding=spmd.batch_sharding(rules, mesh))

    def loss(params, inputs, targets):  # the forward pass of the step: enough for forward collectives
        with spmd.use_rules(rules, mesh):
            logits = nnx.merge(graphdef, params)(inputs)
        return lm_loss(logits, targets)[0]

    ops = collectives(jax.jit(loss).lower(params, tokens, tokens).compile(), mesh)
    fwd_scan = sorted((o.op_name.rsplit("/", 2)[-2], o.count, o.bytes)
                      for o in ops if o.axes == ("tensor",) and in_scan(o) and o.kind == "all-reduce")
    assert fwd_scan == [("blhk,hkd->bld", N_LAYERS, BLD)]
    # the same selection on the dp_tp step finds both row-parallel matmuls
    assert sorted((o.op_name.rsplit("/", 2)[-2], o.count, o.bytes) for o in step_ops("dp2_tp4")
                  if o.axes == ("tensor",) and in_scan(o) and not o.backward) == [
        ("blf,fd->bld", N_LAYERS, BLD), ("blhk,hkd->bld", N_LAYERS, BLD)]


def test_negative_control_wrong_gradient_expectations_fail():
    """The gradient relations are tight: the bytes of the optimizer state, or of another layout's
    gradients, or the gradients without the loss scalar, do not match."""
    got = summarize(step_ops("dp8"))[("all-reduce", ("data",))]["bytes"]
    assert got == grad_bytes("dp8") + LOSS_BYTES
    for wrong in (grad_bytes("dp8"), spmd.inspection.tree_bytes_per_device(layout("dp8").opt_state),
                  grad_bytes("fsdp8") + LOSS_BYTES, grad_bytes("dp2_tp4") + LOSS_BYTES):
        assert got != wrong
    assert not np.isclose(got, grad_bytes("dp2_tp4"), rtol=0.5)


# A conditional's branches (the pipeline's per-tick sends are a lax.switch over pair sets): each branch's
# collectives count as often as the conditional runs, flagged in_branch (an upper bound, not a certain figure).
BRANCH = """%branch{k} (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  ROOT %cp{k} = f32[8]{{0}} collective-permute(%x), channel_id=1{k}, source_target_pairs={pairs}
}}
"""
IDLE = """%idle (x: f32[8]) -> f32[8] {
  ROOT %x = f32[8]{0} parameter(0)
}
"""


def test_collectives_in_conditional_branches_are_flagged_as_upper_bounds():
    branches = BRANCH.format(k=1, pairs="{{0,4},{1,5},{2,6},{3,7}}") + BRANCH.format(k=2, pairs="{{4,0},{5,1},{6,2},{7,3}}")
    switch = ("%sw = f32[8]{0} conditional(%i, %x), branch_computations={%idle, %branch1, %branch2}")
    body = LOOP.format(i=1, inner=switch)
    cond = "%c = f32[8]{0} conditional(%pred, %p, %p), true_computation=%branch1, false_computation=%idle"
    ops = {o.name: o for o in collectives(module(while_op(1, 6), cond, extra=IDLE + branches + body), MESH_2x4)}
    # the loop's own all-reduce runs on every trip: certain
    assert (ops["ar1"].count, ops["ar1"].in_branch, ops["ar1"].trip_count_known) == (6, False, True)
    # branch1 is reached from the switch in the loop (6) and from the cond in the entry (1); branch2 from the switch
    assert (ops["cp1"].count, ops["cp1"].in_branch, ops["cp1"].axes) == (6 + 1, True, ("data",))
    assert (ops["cp2"].count, ops["cp2"].in_branch, ops["cp2"].trip_count_known) == (6, True, True)
    text = spmd.hlo.format_collectives(list(ops.values()))
    permute_row = next(line for line in text.splitlines() if line.startswith("collective-permute"))
    assert "<=13" in permute_row and "at most" in text
    assert "<=" not in next(line for line in text.splitlines() if line.startswith("all-reduce"))  # negative control
    # negative control: the same module without conditionals flags nothing
    plain = collectives(module(while_op(1, 6), extra=LOOP.format(i=1, inner="")), MESH_2x4)
    assert plain and not any(o.in_branch for o in plain) and "at most" not in spmd.hlo.format_collectives(plain)


def test_accumulation_reduces_gradients_over_data_once_per_step():
    """The run's train step (``trainers.build``) with k = 4 microbatches on dp8: one all-reduce over data per step (the
    gradients and the loss), outside every loop (``count`` 1), carrying the same bytes as one
    microbatch's step. The k = 1 step above reduces per layer inside the backward scan (count > 1):
    the counter sees collectives in loops, so count 1 here is not vacuous."""
    from helpers.accum_util import accum_step

    ops = accum_step("dp8", 4).ops
    grads = grad_bytes("dp8")
    assert summarize(ops) == {("all-reduce", ("data",)): {"count": 1, "bytes": grads + LOSS_BYTES}}
    assert summarize(step_ops("dp8"))[("all-reduce", ("data",))]["count"] == N_LAYERS + 1
