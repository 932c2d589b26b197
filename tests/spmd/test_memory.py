"""Per-device memory of the GPT train state: FSDP over 8 devices holds 1/8 of what DP replicates.

Two independent measures, which must agree: the shards of the placed arrays
(``spmd.inspection.tree_bytes_per_device`` on params + optimizer state) and XLA's own accounting of the
compiled step's arguments (``spmd.inspection.memory(compiled).argument``: params, optimizer state and the
batch shard). The negative control, dp2_tp4, shards most weights 4 ways and replicates the norm
scales over tensor and everything over data, so its ratio is near 1/4, not 1/8.
"""

import functools

import jax
import pytest
from helpers.gpt_util import BATCH, LENGTH, layout

import spmd

REPLICATED = "dp8"


def state_bytes(name: str) -> int:
    lay = layout(name)
    return spmd.inspection.tree_bytes_per_device(lay.params) + spmd.inspection.tree_bytes_per_device(lay.opt_state)


@functools.cache
def step_memory(name: str) -> spmd.inspection.Memory:
    return spmd.inspection.memory(layout(name).compiled())


def test_replicated_state_is_the_whole_model():
    lay = layout(REPLICATED)
    n_params = sum(x.size for x in jax.tree.leaves(lay.params))
    # f32 params + two f32 Adam moments + the int32 step count, all on every device
    assert state_bytes(REPLICATED) == 3 * 4 * n_params + 4


def test_fsdp8_state_is_an_eighth_of_replicated():
    ratio = state_bytes("fsdp8") / state_bytes(REPLICATED)
    assert ratio == pytest.approx(1 / 8, rel=0.10)
    # exactly: everything divides by 8 except the replicated step count
    assert state_bytes("fsdp8") - 4 == (state_bytes(REPLICATED) - 4) // 8


def test_compiled_step_arguments_show_the_same_ratio():
    fsdp, dp = step_memory("fsdp8"), step_memory(REPLICATED)
    assert fsdp.argument / dp.argument == pytest.approx(1 / 8, rel=0.10)
    # the arguments are exactly the state plus this device's batch shard (inputs and targets, int32)
    for name, m in (("fsdp8", fsdp), (REPLICATED, dp)):
        batch_shard = 2 * (BATCH // 8) * LENGTH * 4
        assert m.argument == state_bytes(name) + batch_shard, name
    # the step returns a new state of the same layout (no donation here), so its outputs scale alike
    assert fsdp.output / dp.output == pytest.approx(1 / 8, rel=0.10)


def test_negative_control_dp2_tp4_is_not_an_eighth():
    for ratio in (state_bytes("dp2_tp4") / state_bytes(REPLICATED),
                  step_memory("dp2_tp4").argument / step_memory(REPLICATED).argument):
        assert ratio != pytest.approx(1 / 8, rel=0.10)
        assert ratio == pytest.approx(1 / 4, rel=0.05)  # TP over 4; the norm scales stay replicated
