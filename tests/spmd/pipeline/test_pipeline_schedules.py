"""Pipeline schedules as tables: exact bubbles, validation (with a corrupted-table control),
stash depth, timeline text, Gantt chart, and errors that name the bad numbers."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.pipeline import PipelineConfig, get_schedule
from spmd.pipeline.schedules import BACKWARD, FORWARD, IDLE, Schedule

CASES = [("gpipe", S, M, 1) for S in (2, 3, 4) for M in (1, 3, 8)] + \
        [("1f1b", S, M, 1) for S in (2, 3, 4) for M in (1, 3, 8)] + \
        [("interleaved", S, M, V) for S in (2, 4) for M in (S, 2 * S, 3 * S) for V in (2, 3)]


@pytest.mark.parametrize("name, S, M, V", CASES)
def test_bubble_is_exact_and_schedule_valid(name, S, M, V):
    sch = get_schedule(name, S, M, V)
    sch.validate()
    assert sch.bubble_fraction == pytest.approx((S - 1) / (V * M + S - 1), abs=1e-12)
    assert sch.n_ticks == 2 * (V * M + S - 1)  # one chunk-op per tick: 2*V*M busy ticks per stage
    assert sch.busy == 2 * V * M * S
    # forward-only (evaluation) version keeps the order and drops every backward
    fo = sch.forward_only()
    fo.validate()
    assert not fo.has_backward and fo.busy == V * M * S


def test_interleaved_has_smaller_bubble_than_1f1b():
    assert get_schedule("interleaved", 4, 8, 2).bubble_fraction < get_schedule("1f1b", 4, 8).bubble_fraction


@pytest.mark.parametrize("S, M", [(2, 8), (4, 8), (4, 16), (3, 7)])
def test_stash_depth_1f1b_bounded_by_stages_gpipe_grows_with_microbatches(S, M):
    assert get_schedule("gpipe", S, M).max_in_flight == M
    one = get_schedule("1f1b", S, M)
    assert one.max_in_flight <= S
    # stage s holds its S - s warm-up inputs plus (s > 0) the one that arrived ahead of its forward
    assert list(one.in_flight()) == [min(S, M)] + [min(S - s + 1, M) for s in range(1, S)]
    # the engine's stash (inputs received from the previous stage) never needs more slots than that
    n_x, n_g = one.stash_sizes()
    assert n_x <= S and n_g <= S
    n_x_g, _ = get_schedule("gpipe", S, M).stash_sizes()
    assert n_x_g == M


def _corrupt_swap(sch: Schedule, t1: int, t2: int, s: int) -> Schedule:
    a = sch.actions.copy()
    a[[t1, t2], s] = a[[t2, t1], s]
    return Schedule(sch.name, sch.n_stages, sch.n_microbatches, sch.n_virtual, a)


def test_validate_catches_corrupted_tables():
    sch = get_schedule("1f1b", 4, 8)
    sch.validate()
    # stage 1 runs its first forward one tick *before* stage 0 produced its input
    t0 = int(np.nonzero(sch.actions[:, 1, 0] == FORWARD)[0][0])
    with pytest.raises(ValueError, match=r"F0 of chunk 1 at tick 0 runs before F0 of chunk 0 finished"):
        _corrupt_swap(sch, 0, t0, 1).validate()
    # a backward moved before its forward
    a = sch.actions.copy()
    tb = int(np.nonzero((a[:, 3, 0] == BACKWARD) & (a[:, 3, 1] == 0))[0][0])
    a[0, 3], a[tb, 3] = a[tb, 3].copy(), (IDLE, -1, -1)
    with pytest.raises(ValueError, match=r"B0 of chunk 3 at tick 0 precedes its forward"):
        Schedule("bad", 4, 8, 1, a).validate()
    # a dropped op
    a = sch.actions.copy()
    a[tb, 3] = (IDLE, -1, -1)
    with pytest.raises(ValueError, match=r"B0 of chunk 3 is missing"):
        Schedule("bad", 4, 8, 1, a).validate()
    # an op run twice
    a = sch.actions.copy()
    a[-1, 3] = a[tb, 3]
    with pytest.raises(ValueError, match=r"B0 of chunk 3 runs twice"):
        Schedule("bad", 4, 8, 1, a).validate()


def test_timeline_text():
    text = str(get_schedule("1f1b", 2, 3))
    lines = text.splitlines()
    assert lines[0] == "1f1b: S=2 M=3 V=1, 8 ticks, bubble 0.250"
    assert lines[1].split() == ["s0:", "F0", "F1", ".", "B0", "F2", "B1", ".", "B2"]
    assert lines[2].split() == ["s1:", ".", "F0", "B0", "F1", "B1", "F2", "B2", "."]
    inter = get_schedule("interleaved", 2, 2, 2).timeline()
    assert "F0.1" in inter and "B1.0" in inter


def test_gantt_draws_one_bar_per_busy_slot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sch = get_schedule("interleaved", 2, 4, 2)
    ax = sch.gantt()
    bars = [c for c in ax.collections]
    assert sum(len(c.get_paths()) for c in bars) == sch.busy == 2 * 2 * 4 * 2
    assert len(ax.texts) == sch.busy
    plt.close(ax.figure)


@pytest.mark.parametrize("args, kwargs, match", [
    (("zigzag", 2, 4), {}, r"unknown pipeline schedule 'zigzag'; valid: gpipe, 1f1b, interleaved"),
    (("interleaved", 4, 6, 2), {}, r"microbatches M=6 to be a multiple of stages S=4"),
    (("1f1b", 2, 0), {}, r"microbatches M >= 1, got 0"),
    (("gpipe", 0, 4), {}, r"stages S >= 1, got 0"),
    (("1f1b", 2, 4, 2), {}, r"virtual stages V=2 \(use 'interleaved'\)"),
    (("interleaved", 2, 4, 2), {"n_layers": 6}, r"6 layers do not split into S\*V = 2\*2 = 4 equal chunks"),
])
def test_bad_inputs_name_the_numbers(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_schedule(*args, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "pipedream"}, r"'pipedream' is not one of none, gpipe, 1f1b, interleaved"),
    ({"schedule": "1f1b", "microbatches": 0}, r"microbatches must be >= 1, got 0"),
    ({"schedule": "1f1b", "virtual_stages": 2}, r"virtual_stages=2 needs schedule 'interleaved'"),
])
def test_pipeline_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)
