"""Megatron sequence parallelism (``dp_tp_sp``, ``fsdp_tp_sp``): what the compiled step communicates.

The residual stream and the norms (``residual_length``) split L over ``tensor``, so per layer and
per direction each row-parallel all-reduce over ``tensor`` becomes a reduce-scatter and each
column-parallel input an all-gather, all of ``[B_local, L, D]``: the same wire bytes, and the
residual activations take 1/t of the memory. Parity with one device: tests/spmd/test_parity.py (the
``*_sp`` layouts of helpers.gpt_util).

The CPU backend has no reduce-scatter: it emits the partitioner's all-reduce, and each device
dynamic-slices its ``[B_local, L/t, D]`` shard. The counts below are of the emitted program; the
shard shapes in the HLO show the slicing, and spmd.hlo's accelerator view (where it has one)
must name the same ops reduce-scatters.
"""

import functools
import inspect

import pytest
from helpers.gpt_util import BATCH, CFG, LENGTH, layout

from spmd.hlo import collectives

F32 = 4
N = CFG.n_layers
# layout -> (the same layout without SP, data x fsdp shards of the batch, tensor size)
CASES = {"dp2_tp4_sp": ("dp2_tp4", 2, 4), "dp2_fsdp2_tp2_sp": ("dp2_fsdp2_tp2", 4, 2)}


@functools.cache
def compiled(name: str):
    return layout(name).compiled()


def has_views() -> bool:
    return "view" in inspect.signature(collectives).parameters


def ops(name: str, view: str = "emitted") -> list:
    kwargs = {"view": view} if has_views() else {}
    return collectives(compiled(name), layout(name).mesh, **kwargs)


def scan_tensor(name: str, backward: bool, view: str = "emitted") -> list[tuple[str, int, int]]:
    """(kind, count, bytes) of the collectives over ``tensor`` inside the layer scan, one direction."""
    return sorted((o.kind, o.count, o.bytes) for o in ops(name, view)
                  if o.axes == ("tensor",) and "/while/body/" in o.op_name and o.backward == backward)


def bld(name: str) -> int:
    _, batch_shards, _ = CASES[name]
    return BATCH // batch_shards * LENGTH * CFG.d_model * F32


def wire(kind: str, nbytes: int, t: int) -> float:
    """Bytes one device sends on a ring: all-reduce 2 (t-1)/t of its buffer, the others (t-1)/t."""
    return nbytes * (t - 1) / t * (2 if kind == "all-reduce" else 1)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backward", [False, True])
def test_each_row_parallel_all_reduce_becomes_reduce_scatter_plus_all_gather(name, backward):
    base, _, t = CASES[name]
    x = bld(name)
    # Without SP: one all-reduce of [B_local, L, D] per sub-block (forward: the w_o and w_down
    # outputs; backward: the fused qkv and gate_up input gradients), no all-gathers.
    assert scan_tensor(base, backward) == [("all-reduce", N, x)] * 2
    # With SP, emitted: the same two reductions (all-reduce + dynamic-slice here), and two all-gathers
    # of the norm outputs into the sub-blocks (backward: of the residual gradient into the row-parallel
    # matmuls' transposes). Backward also all-reduces the two norm scales' gradients ([D] each, now
    # partial sums over the L shards).
    scale_grads = [("all-reduce", N, 2 * CFG.d_model * F32)] if backward else []
    assert scan_tensor(name, backward) == sorted([("all-gather", N, x)] * 2 + [("all-reduce", N, x)] * 2 + scale_grads)
    if has_views():  # the accelerator's program: the emitted all-reduces of [B_local, L, D] are reduce-scatters
        acc = scan_tensor(name, backward, view="accelerator")
        assert acc == sorted([("all-gather", N, x)] * 2 + [("reduce-scatter", N, x)] * 2 + scale_grads)
        # the same wire bytes per layer as the all-reduces they replace (scale gradients aside)
        sp = sum(wire(k, b, t) for k, _, b in acc if b == x)
        assert sp == sum(wire(k, b, t) for k, _, b in scan_tensor(base, backward, view="accelerator"))


@pytest.mark.parametrize("name", list(CASES))
def test_residual_stream_is_split_along_length(name):
    """The per-device residual stream ``[B_local, L/t, D]`` exists only under SP (the dynamic-slice
    of each emitted all-reduce, the residual adds and the norms run at that shape)."""
    base, batch_shards, t = CASES[name]
    shard = f"f32[{BATCH // batch_shards},{LENGTH // t},{CFG.d_model}]"
    assert shard in compiled(name).as_text()
    assert shard not in compiled(base).as_text()


def test_sequence_parallel_takes_less_temp_memory():
    """Per-device temp memory of the compiled step: the residual activations the backward pass keeps
    shrink t-fold (measured: dp2_tp4 474 KB -> dp2_tp4_sp 289 KB on this tiny GPT)."""
    for name, (base, _, _) in CASES.items():
        assert compiled(name).memory_analysis().temp_size_in_bytes < compiled(base).memory_analysis().temp_size_in_bytes
