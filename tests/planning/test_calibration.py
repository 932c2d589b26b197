"""The performance and memory model against published runs (trainers.planning.calibration), analytic only.

Every published run of the calibration table: estimated tokens/s per device within [0.8, 1.25] of the
published figure, and its published layout predicted to fit the device's HBM (MaxText's v5p batches are
the largest that fit: one more row per device must not). For a GPU run on one node,
one across nodes, one with accumulation and a TPU run with tensor parallelism, the published layout ranks
within the planner's top 5 or within 10% of its best estimate. The topology and overlap pieces are checked on
their own, each with a negative control (a flat slow ring, a model at 100% of peak with no overlap).
"""

import dataclasses
import math

import pytest
from helpers.paths import ROOT

from trainers.planning import calibration as cal
from trainers.planning import holdout
from trainers.planning.hardware import axis_levels, collective_seconds, get_hardware
from trainers.planning.perf import Work, step_time
from trainers.planning.traffic import Traffic

LO, HI = cal.RATIO_BOUNDS


@pytest.fixture(scope="module")
def points():
    return {r.name: cal.estimate(r) for r in cal.RUNS}


def test_table_covers_both_sources_and_every_layout_kind():
    runs = cal.RUNS
    assert len(runs) >= 8 and len({r.name for r in runs}) == len(runs)
    assert any("torchtitan" in r.source for r in runs) and any("maxtext" in r.source for r in runs)
    assert any(dict(r.mesh).get("tensor", 1) > 1 for r in runs)  # tensor parallelism
    assert any(r.devices > 8 and r.hardware.startswith(("h100", "a100")) for r in runs)  # FSDP across nodes
    assert {r.hardware for r in runs} >= {"h100-96gb", "a100", "tpu-v5p", "tpu-v5e"}


@pytest.mark.parametrize("run", cal.RUNS, ids=lambda r: r.name)
def test_estimate_is_within_bounds_and_the_published_layout_fits(points, run):
    p = points[run.name]
    assert LO <= p.ratio <= HI, (run.name, p.tokens_per_device, run.tokens_per_device)
    assert p.fits, (run.name, p.costs.memory, p.hbm)


@pytest.mark.parametrize("name", cal.LARGEST_BATCH)
def test_largest_published_batch_fits_and_one_more_row_does_not(points, name):
    """Two-sided: MaxText lowered these batches (7 -> 6, 4 -> 3) when its model became Llama-style; the
    count must fit the published batch in HBM and overflow it at one more row per device."""
    run = next(r for r in cal.RUNS if r.name == name)
    assert points[name].fits
    more = cal.estimate(dataclasses.replace(run, batch_per_device=run.batch_per_device + 1))
    assert not more.fits, (name, more.costs.memory.total, more.hbm)


def test_maxtext_scale_and_published_figures_are_read_as_published():
    assert cal.maxtext_model(32) == dict(vocab_size=32000, d_model=8192, n_layers=32, n_heads=64, head_dim=128,
                                         d_ff=28672)
    assert cal.maxtext_model(128)["n_heads"] == 128 and cal.maxtext_model(128)["n_layers"] == 64
    run = next(r for r in cal.RUNS if r.name == "maxtext-32b v5p-128")
    # 311 TFLOP/s/chip at 6 N + 12 n_layers H K L FLOPs per token (MaxText's and spmd.models' counting)
    assert 311e12 / run.tokens_per_device == pytest.approx(6 * 31.4e9 + 12 * 32 * 64 * 128 * 2048, rel=0.01)
    assert run.devices == 64 and run.config().data.global_batch == 6 * 64


def test_negative_control_peak_without_overlap_misses():
    """The model issue 17 found (100% of peak, collectives in series) leaves the bounds: the test can fail."""
    misses = 0
    for run in cal.RUNS:
        hw = get_hardware(run.hardware)
        ideal = dataclasses.replace(hw, matmul_eff=1.0, attention_eff=1.0, hbm_eff=1.0, overlap_cost=0.0)
        cfg = run.config()
        costs = cal.layout_costs(cfg, run.sizes, ideal)
        r = costs.roofline
        serial = r.compute_s + r.memory_s + r.comm_s
        tokens = cfg.data.global_batch * cfg.data.seq_len / serial / run.devices
        misses += not LO <= tokens / run.tokens_per_device <= HI
    assert misses >= 3


# the v5p runs with tensor=8 (128B, 256B, 512B) are left out: with remat policies searched, 13-21 layouts estimate
# faster than their published ones (steps 1.18-1.24 x the best): known misses, in docs/calibration.md and RESULTS.md
@pytest.mark.parametrize("name", ["llama3-8b fsdp8 h100", "llama3-70b fsdp64 a100", "maxtext-32b v5p-128",
                                  "mpt-30b fsdp8 a100 accum21"])
def test_published_layout_ranks_near_the_top_of_the_plan(name):
    run = next(r for r in cal.RUNS if r.name == name)
    rank, rel = cal.rank(run)
    assert rank < 5 or rel <= 1.10, (name, rank, rel)


def test_gpu_fsdp_across_nodes_is_a_hierarchical_ring():
    a100 = get_hardware("a100")
    levels = axis_levels({"data": 1, "fsdp": 64, "tensor": 1}, ("fsdp",), a100)
    assert levels == [(8, a100.ici_bw / 2, a100.ici_latency), (8, a100.dcn_bw, a100.dcn_latency)]
    nbytes = 436e6  # one Llama 3 8B layer in bf16
    t = collective_seconds(a100, "all-gather", nbytes, 64, dcn=True, levels=levels)
    # NVLink carries 7/8 of the buffer, the NIC 7/8 of one node's eighth; 7 ring steps on each level
    expect = 7 / 8 * nbytes / (a100.ici_bw / 2) + 7 / 8 * nbytes / 8 / a100.dcn_bw + 7 * (a100.ici_latency + a100.dcn_latency)
    assert t == pytest.approx(expect, rel=1e-9)
    flat = collective_seconds(a100, "all-gather", nbytes, 64, dcn=True)  # every byte over the NIC
    assert flat > 5 * t  # negative control: the old 'all slow' ring
    # inside one node: NVLink only; tensor innermost, fsdp strided by 8 crosses nodes from its first step
    assert axis_levels({"fsdp": 8}, ("fsdp",), a100) == [(8, a100.ici_bw / 2, a100.ici_latency)]
    assert axis_levels({"fsdp": 4, "tensor": 8}, ("fsdp",), a100) == [(4, a100.dcn_bw, a100.dcn_latency)]


def test_tpu_axes_span_torus_dimensions():
    v5e, v5p = get_hardware("tpu-v5e"), get_hardware("tpu-v5p")
    link = v5e.ici_bw / (4 * v5e.torus)  # one link, one way
    (whole,) = axis_levels({"fsdp": 256}, ("fsdp",), v5e)  # 16 x 16: both dimensions, both directions
    assert whole == (256, 2 * 2 * link, v5e.ici_latency)
    (half,) = axis_levels({"fsdp": 16, "tensor": 16}, ("tensor",), v5e)
    assert half[1] == pytest.approx(2 * link)
    (t4,) = axis_levels({"fsdp": 16, "tensor": 4}, ("tensor",), v5p)  # 4 x 4 x 4: one dimension of three
    assert t4[1] == pytest.approx(2 * v5p.ici_bw / (4 * 3))
    assert axis_levels({"data": 2, "fsdp": 256}, ("data",), v5e, dcn_axes=("data",))[0][1] == v5e.dcn_bw


def test_fsdp_collectives_hide_under_compute_and_tensor_ones_do_not():
    hw = dataclasses.replace(get_hardware("tpu-v5p"), overlap_cost=0.0)
    work = Work(matmul_flops=hw.peak_bf16 * hw.matmul_eff, attention_flops=0.0, hbm_bytes=0.0, model_flops=1.0,
                n_layers=10, passes=2)  # 1 s of matmuls over 10 layers

    def row(kind, axes, seconds):
        return Traffic(kind, axes, 1, 1, "ici", seconds)

    small = step_time(work, hw, "bfloat16", [row("all-gather", ("fsdp",), 0.4), row("reduce-scatter", ("fsdp",), 0.2)])
    assert small.step_s == pytest.approx(1.0 + (0.2 + 0.2) / 10)  # only the first gather and the last reduction
    big = step_time(work, hw, "bfloat16", [row("all-gather", ("fsdp",), 3.0)])
    assert big.step_s == pytest.approx(1.0 + (1.5 - 1 / 3) + (1.5 - 2 / 3) + 1.5 / 10)
    tensor = step_time(work, hw, "bfloat16", [row("all-reduce", ("tensor",), 0.4)])
    assert tensor.step_s == pytest.approx(1.4) and tensor.dominant == "matmuls"
    # a GPU pays part of a hidden collective's time: NCCL shares the SMs
    gpu = step_time(work, dataclasses.replace(hw, overlap_cost=0.3), "bfloat16", [row("all-gather", ("fsdp",), 0.4)])
    assert gpu.step_s == pytest.approx(1.0 + 0.02 + 0.3 * (0.4 - 0.02))
    assert math.isclose(tensor.comm_s, 0.4) and tensor.overlap_s == pytest.approx(1.0)


@pytest.fixture(scope="module")
def holdouts():
    return holdout.leave_one_source_out()


def test_leave_one_source_out_keeps_every_held_out_run_within_bounds(holdouts):
    """The compute-efficiency scale refitted without each source, then that source's runs estimated."""
    assert len({h.source for h in holdouts}) >= 5 and {h.run.name for h in holdouts} == {r.name for r in cal.RUNS}
    for h in holdouts:
        assert LO <= h.fitted <= HI and LO <= h.held_out <= HI, (h.run.name, h.fitted, h.held_out)
    assert any(h.held_out_scale != h.fitted_scale for h in holdouts)  # the refit really leaves the source out
    doc = (ROOT / "docs" / "calibration.md").read_text()
    for line in holdout.table(holdouts).splitlines():
        assert line in doc, f"docs/calibration.md is stale: {line}"


def test_a_source_that_disagrees_with_the_rest_fails_when_held_out():
    """Negative control: a source whose published figures are twice the real ones is off when held out."""
    runs = [r for r in cal.RUNS if r.name in ("llama3-8b fsdp64 a100", "llama2-13b fsdp64 a100")]
    wrong = dataclasses.replace(runs[0], name="doubled", published=2 * runs[0].published, source="a made-up table")
    rows = {h.run.name: h for h in holdout.leave_one_source_out([*runs, wrong])}
    assert not LO <= rows["doubled"].held_out <= HI
    assert holdout.source_of(wrong) == "a made-up table" and rows["doubled"].held_out_scale != 1.0
