"""The dry run compiles the same step as the real run: its state bytes and collectives must match it.

For three layouts of a tiny GPT on 8 simulated devices, the dry run (abstract state, nothing
allocated) is compared with the real run's step compiled on real arrays (both come from ``trainers.setup.build``, so this
checks abstract against real, not two assemblies): per-device state bytes within 5%
(the analytic formula as well as the compiled numbers), collective lists identical. Negative
controls: two different layouts must differ in both. A pipelined layout (pipe=2, 1F1B, M=4) is
compared the same way, and its collective-permutes over ``pipe`` against the analytic count.
"""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshes
import spmd
from trainers import override, recipe
from trainers.planning.dryrun import dry_run
from trainers.planning.hardware import HARDWARE, Hardware, custom, get_hardware, networks, wire_factor
from trainers.planning.report import DryRunReport
from trainers.setup import build

LAYOUTS = {"dp8": ("data=8", "dp"), "fsdp8": ("fsdp=8", "fsdp"), "dp2_tp4": ("data=2,tensor=4", "dp_tp")}


def config(name: str):
    axes, rules = LAYOUTS[name]
    return override(recipe("gpt-small", tiny=True), [f"mesh.axes={axes}", f"rules={rules}"])


@pytest.fixture(scope="module")
def reports() -> dict[str, DryRunReport]:
    return {name: dry_run(config(name), devices=8, hardware="h100") for name in LAYOUTS}


PIPE = ["mesh.axes=data=4,pipe=2", "rules=dp", "data.global_batch=16", "pipeline.schedule=1f1b",
        "pipeline.microbatches=4"]


def real_step(cfg):
    """The real run's step, compiled on real arrays: trainers.setup.build, as trainers.loop.train calls it."""
    setup = build(cfg, mesh=meshes.make_mesh(meshes.MeshSpec.of(cfg.mesh.axes)))
    tokens = np.zeros((cfg.data.global_batch, cfg.data.seq_len), np.int32)
    batch = {k: jax.device_put(tokens, setup.batch_sharding) for k in ("inputs", "targets")}
    compiled = setup.train_step.lower(setup.stepped.state, batch).compile()
    batch_bytes = spmd.inspection.tree_bytes_per_device(batch)
    return (spmd.inspection.memory(compiled), batch_bytes, spmd.hlo.collectives(compiled, setup.mesh),
            (compiled, setup.mesh))


@pytest.fixture(scope="module")
def real():
    return {name: real_step(config(name)) for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_state_bytes_match_the_real_compiled_step(name, reports, real):
    memory, batch_bytes, *_ = real[name]
    real_state = memory.argument - batch_bytes
    report = reports[name]
    assert report.compiled is not None and report.fits
    for what, value in (("abstract shards", report.state_bytes), ("compiled", report.compiled.argument - report.batch_bytes),
                        ("analytic", report.analytic.state)):
        assert abs(value - real_state) <= 0.05 * real_state, (name, what, value, real_state)


def test_state_bytes_tell_layouts_apart(reports, real):
    """Negative control: dp8 replicates the state, fsdp8 shards it 8 ways; 5% cannot confuse them."""
    dp_state = real["dp8"][0].argument - real["dp8"][1]
    assert abs(reports["fsdp8"].analytic.state - dp_state) > 0.05 * dp_state
    assert reports["dp8"].analytic.state > 6 * reports["fsdp8"].analytic.state


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_match_the_real_compiled_step_exactly(name, reports, real):
    dry, real_ops = list(reports[name].collectives), real[name][2]
    assert dry and dry == real_ops
    assert spmd.hlo.summarize(dry) == spmd.hlo.summarize(real_ops)


def test_collectives_tell_layouts_apart(reports):
    """Negative control, and what each layout should communicate over which axis."""
    axes = {name: {op.axes for op in r.collectives} for name, r in reports.items()}
    assert ("data",) in axes["dp8"] and not any("fsdp" in a for a in axes["dp8"])
    assert any(op.kind == "all-gather" and op.axes == ("fsdp",) for op in reports["fsdp8"].collectives)
    assert ("tensor",) in axes["dp2_tp4"]
    assert spmd.hlo.summarize(list(reports["dp8"].collectives)) != spmd.hlo.summarize(list(reports["fsdp8"].collectives))


def test_pipelined_dry_run_matches_the_real_pipelined_step(reports):
    cfg = override(recipe("gpt-small", tiny=True), PIPE)
    report = dry_run(cfg, devices=8, hardware="h100")
    memory, batch_bytes, real_ops, (compiled, mesh) = real_step(cfg)
    assert report.compiled is not None and report.fits
    assert list(report.collectives) == real_ops and spmd.hlo.summarize(list(report.collectives)) == spmd.hlo.summarize(real_ops)
    assert abs(report.compiled.argument - report.batch_bytes - (memory.argument - batch_bytes)) == 0
    # the pipeline's sends sit in the branches of one switch, each listing the stage pairs of a tick (forward
    # only, backward only, both: 4 permutes): the HLO's count (every branch on each of the 2(M+S-1) = 10
    # ticks) is an upper bound, flagged in_branch
    sends, act = report.pipe_permutes, 16 // 4 // 4 * 16 * 32 * 4  # x[B/M, L, D] per device
    assert sends and all(op.in_branch and op.bytes == act for op in sends)
    assert sum(op.count for op in sends) == 4 * 10
    # the report's pipe bytes are the branches weighed by the schedule table, exactly
    schedule = spmd.pipeline.get_schedule("1f1b", 2, 4)
    table = schedule.sent_bytes(act)
    assert report.pipe_sent == spmd.pipeline.hlo_sent_bytes(compiled, schedule, mesh)["executed"] == table.executed
    assert table.executed == table.minimum == 2 * 4 * act < sum(op.total_bytes for op in sends)
    # per device, the busiest stage (each sends M = 4): the compiled row equals the analytic one
    (analytic,) = [x for x in report.analytic_traffic if x.kind == "collective-permute"]
    assert (report.pipe_traffic.count, report.pipe_traffic.bytes) == (analytic.count, analytic.bytes) == (4, max(table.per_stage))
    assert report.pipeline == "1f1b S=2 M=4 V=1" and report.bubble == pytest.approx(1 / 5)
    text = report.format()
    assert "pipeline: 1f1b S=2 M=4 V=1, bubble 20.0%" in text and "hlo_sent_bytes" in text
    assert "busiest stage 4 sends" in text and "<=40" in text  # the upper bound, marked
    # negative control: the unpipelined step on the same mesh sends nothing over pipe
    assert not reports["dp8"].pipe_permutes and reports["dp8"].pipeline == "" and reports["dp8"].bubble == 0
    assert spmd.hlo.summarize(list(reports["dp8"].collectives)) != spmd.hlo.summarize(real_ops)


def test_report_roofline_and_format(reports):
    r = reports["dp2_tp4"]
    cfg = config("dp2_tp4")
    assert r.model_flops == pytest.approx(spmd.models.flops_per_step(cfg.model, cfg.data.global_batch, cfg.data.seq_len))
    roof = r.roofline
    # compute + memory-bound work + the exposed part of the collectives (tensor all-reduces: all exposed)
    assert roof.step_s == pytest.approx(roof.compute_s + roof.memory_s + roof.exposed_s)
    assert 0 < roof.exposed_s <= roof.comm_s
    assert roof.step_s_overlap <= roof.step_s and 0 < roof.mfu < 1
    assert sum(t.bytes for t in r.traffic) == sum(op.total_bytes for op in r.collectives)
    text = r.format()
    for needle in ("state (params + optimizer)", "all-reduce", "tensor", "estimated step", "MFU", "fits"):
        assert needle in text, needle
    # the stack form the target runs (auto on a GPU: unrolled at this depth), compiled and named in the header
    assert r.layer_stack == f"layer stack unrolled (model.scan_layers=auto; auto: {cfg.model.n_layers} layers on gpu)"
    assert r.layer_stack in text.splitlines()[0]


def test_fit_verdict_is_the_accelerator_memory_model_for_a_gpu_and_the_compile_for_a_cpu(reports, real):
    """A GPU/TPU target fits by the accelerator memory model on the compiled shapes (compiled state and batch +
    gradients and activations in the compute dtype), never by the CPU compile's temporaries; a CPU target by
    the compiled program. A budget between the two figures tells the verdicts apart (negative control)."""
    from trainers.planning.report import is_cpu_target

    r = reports["fsdp8"]
    mem, batch_bytes = real["fsdp8"][:2]
    assert r.verdict == "accelerator" and not is_cpu_target(r.hardware) and is_cpu_target(custom("cpu", name="x"))
    assert r.state_bytes == mem.argument - batch_bytes and r.batch_bytes == batch_bytes  # compiled shard shapes
    assert r.model_bytes == r.state_bytes + r.batch_bytes + r.analytic.grads + r.analytic.activations
    assert r.peak_bytes == r.model_bytes and r.model_bytes != r.compiled.total
    lo, hi = sorted((r.model_bytes, r.compiled.total))
    between = (lo + hi) / 2 / r.headroom
    gpu = dataclasses.replace(r, hardware=custom("h100", hbm_bytes=between, name="mid"))
    cpu = dataclasses.replace(r, hardware=custom("cpu", hbm_bytes=between, name="mid-cpu"), verdict="compiled")
    assert gpu.fits == (r.model_bytes < r.compiled.total) and cpu.fits == (r.compiled.total < r.model_bytes)
    assert gpu.fits != cpu.fits and cpu.peak_bytes == r.compiled.total
    text = gpu.format()
    assert re.search(r"per device\s+analytic\s+accelerator\s+CPU compile", text)
    assert "verdict from the accelerator memory model on the compiled shapes" in text
    assert "the compiled program's total (a CPU target" in cpu.format()


def test_a_layout_that_cannot_be_built_is_diagnosed_without_compiling():
    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=data=1,tensor=8", "rules=tp", "model.d_ff=68"])
    report = dry_run(cfg, devices=8, hardware="h100")
    assert report.compiled is None and not report.fits
    messages = [str(i) for i in report.issues]
    assert any("blocks/block/mlp/w_gate_up dim mlp=68 does not divide by tensor=8" in m and "model.d_ff a multiple of 8" in m
               for m in messages), messages
    assert "diagnostics" in report.format()


def test_cli_dry_run(capsys):
    from trainers.launch.cli import main

    # the fsdp8 layout again: its compile comes from the persistent cache
    assert main(["gpt-small", "--tiny", "--dry-run", "--devices", "8", "--mesh", "fsdp=8", "--rules", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "mesh fsdp=8, rules fsdp" in out and "fits" in out and "estimated step" in out
    assert main(["gpt-small", "--tiny", "--dry-run", "--devices", "8", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_dry_run_in_a_fresh_process():
    """The documented command, as a user runs it: jax not started, so it simulates 8 devices itself."""
    proc = subprocess.run([sys.executable, "-m", "trainers", "gpt-small", "--tiny", "--dry-run", "--devices", "8"],
                          capture_output=True, text=True, env=_env_without_device_count(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh data=2,fsdp=2,tensor=2, rules fsdp_tp" in proc.stdout and "8 simulated devices" in proc.stdout


@pytest.mark.slow
def test_other_device_counts_run_in_a_subprocess():
    """This process has 8 devices; a 4-device dry run re-executes itself with 4 simulated devices."""
    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=fsdp=2,tensor=2"])
    report = dry_run(cfg, devices=4, hardware="tpu-v5e")
    assert report.devices == 4 and dict(report.mesh)["fsdp"] == 2 and dict(report.mesh)["tensor"] == 2
    assert report.hardware.name == "tpu-v5e" and "4 simulated" in report.backend
    assert {("tensor",), ("fsdp",)} <= {op.axes for op in report.collectives}


@pytest.mark.sweep  # the tiers: the dry run on 8 and on other device counts
def test_a_1b_parameter_gpt_on_256_devices():
    """~20 s and ~0.6 GB RSS on 2 cores: the abstract state of a 1.07B-parameter GPT, compiled for 256 devices."""
    cfg = override(recipe("gpt-350m"), ["model.d_model=2048", "model.n_layers=16", "model.n_heads=16",
                                        "data.global_batch=256", "mesh.axes=data=32,fsdp=8", "rules=fsdp"])
    report = dry_run(cfg, devices=256, hardware="h100")
    assert report.params > 1_000_000_000 and report.fits and "256 simulated" in report.backend
    assert abs(report.analytic.state - (report.compiled.argument - report.batch_bytes)) < 0.05 * report.analytic.state
    traffic = {(t.kind, t.axes): t for t in report.traffic}
    assert traffic[("all-reduce", ("data", "fsdp"))].network == "dcn"  # 32 nodes of 8 GPUs
    assert traffic[("all-gather", ("fsdp",))].network == "ici"  # inside one NVLink node


def _env_without_device_count() -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    if flags:  # XLA reads a blank XLA_FLAGS as a file name
        env["XLA_FLAGS"] = flags
    env.pop("JAX_PLATFORMS", None)
    return env


def test_mesh_resolution_and_bad_inputs():
    cfg = recipe("gpt-small", tiny=True)
    assert override(cfg, ["mesh.axes=data=-1,tensor=2"]).mesh.sizes(8)["data"] == 4
    mesh = override(cfg, ["mesh.axes=fsdp=4", "mesh.dcn=data=2"]).mesh
    sizes, dcn = mesh.sizes(8), mesh.dcn_axes(8)
    assert sizes["data"] == 2 and sizes["fsdp"] == 4 and dcn == ("data",)
    with pytest.raises(ValueError, match="multiply to 8, but there are 4"):
        dry_run(cfg, devices=4)
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        dry_run(cfg, devices=0)
    with pytest.raises(ValueError, match="headroom"):
        dry_run(cfg, devices=8, headroom=1.5)


def test_hardware_table():
    h100 = get_hardware("h100")
    assert (h100.peak_bf16, h100.hbm_bytes, h100.hbm_bw, h100.ici_bw) == (989.4e12, 80e9, 3.35e12, 900e9)  # the PEAK_FLOPS H100 SXM entry
    assert get_hardware("h200").hbm_bytes == 141e9 and get_hardware("tpu-v5p").hbm_bytes == 95 * 2**30
    assert all(isinstance(h, Hardware) and h.source for h in HARDWARE.values())
    with pytest.raises(ValueError, match="unknown hardware 'h300'; valid: h100"):
        get_hardware("h300")
    with pytest.raises(ValueError, match="hbm_bytes must be a positive"):
        dataclasses.replace(h100, hbm_bytes=-1)
    with pytest.raises(ValueError, match="unknown Hardware fields"):
        custom("h100", hbm=1)
    assert custom("h100", hbm_bytes=1e6).hbm_bytes == 1e6
    assert wire_factor("all-reduce", 8) == pytest.approx(2 * 7 / 8) and wire_factor("all-gather", 1) == 0
    # 256 H100s as data=32 x fsdp=8: fsdp stays inside an 8-GPU NVLink node, data crosses InfiniBand
    assert networks({"data": 32, "fsdp": 8, "tensor": 1}, h100) == {"data": "dcn", "fsdp": "ici", "tensor": "ici"}
    assert networks({"data": 4, "fsdp": 2, "tensor": 8}, h100)["fsdp"] == "dcn"


def test_subprocess_hand_off_is_json_and_rebuilds_only_toolkit_types():
    import json

    from trainers.planning.fresh_process import decode, encode

    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=data=2,tensor=4"])
    assert decode(json.loads(json.dumps(encode([cfg, 8, get_hardware("h100"), 0.9])))) == [cfg, 8, get_hardware("h100"), 0.9]
    with pytest.raises(ValueError, match="refusing to rebuild 'os:system'"):
        decode({"__dataclass__": "os:system", "fields": {}})


def test_context_and_expert_parallel_dry_run_matches_the_analytic_exchange():
    """One compile of data=2 x seq=2 x expert=2 (dp_ep, 4 experts, dropless): the ring's K/V permutes
    over seq and the MoE all-to-alls over expert equal the analytic counts and bytes. The stack is scanned:
    unrolled, XLA may reuse a layer's forward K/V exchange in its backward pass (fewer sends than counted)."""
    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=data=2,seq=2,expert=2", "rules=dp_ep",
                                                    "model.n_experts=4", "model.scan_layers=scanned",
                                                    "model.moe_exchange=padded"])  # what XLA:CPU compiles
    report = dry_run(cfg, devices=8, hardware="h100")
    assert report.compiled is not None and report.fits
    compiled = spmd.hlo.summarize(list(report.collectives))
    analytic = {(x.kind, x.axes): x for x in report.analytic_traffic}
    for key in (("collective-permute", ("seq",)), ("all-to-all", ("expert",))):
        assert (compiled[key]["count"], compiled[key]["bytes"]) == (analytic[key].count, analytic[key].bytes), key
    m, b, length = cfg.model, 8 // 4, cfg.data.seq_len // 2  # rows per device (data x expert), positions per device
    # dispatch + combine, forward + backward, and the rows' expert ids beside the forward dispatch: with E = 4 over
    # expert = 2 and k = 2, each destination's T x min(k, E/ep) rows make E x T in all
    rows = m.n_experts * b * length
    assert compiled[("all-to-all", ("expert",))]["count"] == 5 * m.n_layers
    assert compiled[("all-to-all", ("expert",))]["bytes"] == m.n_layers * (4 * rows * m.d_model * 4 + rows * 4)
    kv = 2 * b * length * m.kv_heads * m.k * 4  # [2, B, L/seq, G, K] f32
    assert compiled[("collective-permute", ("seq",))]["bytes"] == m.n_layers * (2 * kv + 2 * kv)  # K/V fwd, bwd + dK/dV x2
    # the MoE's own all_to_alls are no reshard: nothing flagged; the table shows both exchanges
    assert not [i for i in report.issues if i.kind == "all-to-all"], report.issues
    text = report.format()
    assert re.search(r"collective-permute\s+seq\s", text) and re.search(r"all-to-all\s+expert\s", text)


def test_a_local_sgd_dry_run_costs_every_group_and_the_outer_state():
    """Local SGD (4 replica groups on data=2, DiLoCo's Nesterov): the dry run compiles the inner step on every
    group's state. Its state bytes equal the real run's fresh state on the devices (two groups per device plus
    the outer params and momentum), it sends nothing over data, and its note gives the outer step's bytes, as
    the outer step compiled on the real state sends them."""
    from trainers.local_sgd import data_bytes

    sets = ["mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp", "local_sgd.every=4", "local_sgd.groups=4",
            "local_sgd.outer_optimizer=nesterov"]
    cfg = override(recipe("gpt-small", tiny=True), sets)
    report = dry_run(cfg, devices=8, hardware="h100")
    setup = build(cfg, mesh=meshes.make_mesh(meshes.MeshSpec.of(cfg.mesh.axes)))
    state = setup.strategy.fresh()
    assert report.state_bytes == spmd.inspection.tree_bytes_per_device(state)
    assert not [o for o in report.collectives if "data" in o.axes], report.collectives
    outer = data_bytes(setup.strategy.local._outer.lower(state).compile(), setup.mesh)
    note = [str(i) for i in report.issues if i.kind == "local_sgd"]
    assert outer > 0 and note and f"every 4 steps, {outer} " in note[0] and "2 group(s) per device" in note[0], note
    # negative control: the same layout without local SGD holds one state and reduces gradients over data
    dp = dry_run(override(recipe("gpt-small", tiny=True), sets[:2]), devices=8, hardware="h100")
    assert report.state_bytes > 2 * dp.state_bytes and [o for o in dp.collectives if "data" in o.axes]
