"""The planner on what it has not seen: a failing compile drops only its candidate, gradient
accumulation's memory, pipelined tensor all-reduces, remat policies as a plan dimension.

A candidate whose build or compile raises is listed as rejected with the error's first line and the
next pick is compiled (in this process, and in the fresh process a dry run for another device count
uses); the negative control is the same plan without the failure, which confirms the first pick.
"""

import dataclasses
import json

import pytest

import spmd
from trainers import override, recipe
from trainers.launch.plan import main
from trainers.planning import calibration as cal
from trainers.planning import confirm as confirm_lib
from trainers.planning import dryrun as dryrun_lib
from trainers.planning.fresh_process import encode
from trainers.planning.planner import estimate_layout, plan


def test_a_compile_that_raises_drops_only_its_candidate(monkeypatch, capsys):
    cfg = recipe("gpt-small", tiny=True)
    real, calls = confirm_lib.dry_run, []

    def first_fails(c, *args, **kwargs):
        calls.append(c.mesh.axes)
        if len(calls) == 1:
            raise RuntimeError("XLA compilation failed: boom\nsecond line of the trace")
        return real(c, *args, **kwargs)

    control = plan(cfg, 8, "h100", confirm=1)  # negative control: nothing fails, the first pick is confirmed
    assert control.confirmed[0] is control.ranked[0]
    monkeypatch.setattr(confirm_lib, "dry_run", first_fails)
    result = plan(cfg, 8, "h100", confirm=1)
    failed, ok = result.compiled[:2]
    assert failed.error == "RuntimeError: XLA compilation failed: boom" and not failed.fits and ok.fits
    assert result.best is result.ranked[1] and result.confirmed == (result.ranked[1],)
    text = result.format(top=1)
    assert f"{result.ranked[0].layout}: compile failed: RuntimeError: XLA compilation failed: boom" in text
    assert "second line" not in text
    calls.clear()
    assert main(["gpt-small", "--tiny", "--devices", "8", "--hardware", "h100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "compile failed: RuntimeError: XLA compilation failed: boom" in out and "chosen:" in out


def test_a_failing_config_in_the_fresh_process_gets_its_own_report():
    """4 devices on a backend of 8: the dry runs run in a child; one config that raises there does not end it."""
    good = recipe("gpt-small", tiny=True)
    bad = dataclasses.replace(good, mesh=dataclasses.replace(good.mesh, axes="data=3"))

    class Fixed:
        def __init__(self, cfg):
            self.cfg = cfg

        def apply(self, _):
            return self.cfg

    reports = confirm_lib.compile_layouts(good, [Fixed(bad), Fixed(override(good, ["mesh.axes=data=4"]))], 4, "h100")
    assert [bool(r.error) for r in reports] == [True, False]
    assert "{'data': 3}" in reports[0].error and "\n" not in reports[0].error and not reports[0].fits
    assert reports[1].fits and reports[1].compiled is not None


def test_accumulation_holds_one_gradient_copy_and_the_published_30b_run_fits():
    """MPT-30B on 8 A100s (FSDP, 21 microbatches of 3): it ran, so it must fit; a second f32 copy would not."""
    run = next(r for r in cal.RUNS if r.grad_accum > 1 and r.hardware == "a100")
    point = cal.estimate(run)
    mem = point.costs.memory
    assert point.fits and mem.grads == mem.params  # f32 parameters: one f32 gradient copy
    assert mem.total + mem.grads > point.budget  # negative control: two copies would be rejected
    result = plan(run.config(), 8, "a100", nearest=0)
    assert result.ranked and any(e.layout.rules == "fsdp" and e.layout.sizes.get("fsdp") == 8 for e in result.ranked)


@pytest.mark.sweep  # compiles a pipelined step: the sweep
def test_pipelined_tensor_all_reduces_count_the_ticks_each_stage_runs(monkeypatch):
    """pipe=2 x tensor=4, 1F1B: the compiled step's tensor all-reduces sit in the tick loop's switch; weighed by
    the ticks the busiest stage runs each branch they match the analytic count (bytes within 10%).
    Negative control: counted on every tick of every branch they are several times more."""
    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=pipe=2,tensor=4", "rules=tp", "model.remat=false",
                                                    "pipeline.schedule=1f1b", "pipeline.microbatches=4",
                                                    "data.global_batch=8", "model.dtype=bfloat16", "model.n_layers=8"])
    report = dryrun_lib.dry_run(cfg, devices=8, hardware="a100")
    (compiled,) = [x for x in report.traffic if x.kind == "all-reduce" and x.axes == ("tensor",)]
    (analytic,) = [x for x in report.analytic_traffic if x.kind == "all-reduce" and x.axes == ("tensor",)]
    assert 0.9 <= compiled.bytes / analytic.bytes <= 1.1, (compiled, analytic)
    # time: the loss's few small reductions, which the analytic count leaves out, weigh in a tiny model's latency
    assert 0.9 <= compiled.seconds / analytic.seconds <= 1.15, (compiled, analytic)
    upper = sum(op.count * op.bytes for op in report.collectives if op.axes == ("tensor",) and op.kind == "all-reduce")
    assert upper == compiled.bytes  # the report's collectives carry the weighed counts
    ticks = spmd.pipeline.sends.branch_ticks(spmd.pipeline.get_schedule("1f1b", 2, 4))
    assert ticks.sum(1).tolist() == [ticks.sum() // 2] * 2 and (ticks[:, 1] + ticks[:, 2]).tolist() == [4, 4]
    monkeypatch.setattr(dryrun_lib, "branch_weighted", lambda ops, *_: ops)  # every branch on every tick
    (upper,) = [x for x in dryrun_lib.dry_run(cfg, devices=8, hardware="a100").traffic
                if x.kind == "all-reduce" and x.axes == ("tensor",)]
    assert upper.bytes > 2 * analytic.bytes


def test_remat_policies_are_searched_and_the_8b_run_gets_selective_remat():
    """Llama 3 8B on 8 H100s (torchtitan, FSDP, selective AC): the planner proposes a selective policy at or
    under the published step; the memory model prunes: for the published mesh the policies that keep more
    are rejected for memory, and full (more recompute than the first that fits) is never estimated."""
    run = next(r for r in cal.RUNS if r.name == "llama3-8b fsdp8 h100")
    cfg = run.config()
    published_step = cfg.data.global_batch * cfg.data.seq_len / run.devices / run.tokens_per_device
    result = plan(cfg, 8, run.hardware, nearest=0)
    best = result.best
    assert best.layout.remat in ("save_dots", "save_all_but_gathered"), best.layout
    assert best.roofline.step_s <= published_step
    mine = [e for e in result.ranked + result.rejected if e.layout.mesh_arg == "fsdp=8" and e.layout.rules == "fsdp"]
    assert [e.layout.remat for e in mine if not e.fits] == [False, "save_all_but_gathered"]
    assert [e.layout.remat for e in mine if e.fits] == ["save_dots"]
    assert all(e.memory.total > e.budget for e in mine if not e.fits)
    # negative control: the on/off search's answer, full remat, is slower than the selective pick
    full = estimate_layout(cfg, dataclasses.replace(best.layout, remat=True), run.hardware)
    assert full.fits and full.roofline.step_s > 1.1 * best.roofline.step_s


def test_a_compiling_process_that_dies_loses_only_the_config_it_died_on(monkeypatch):
    """The child appends each finished report to its progress file; when it dies (an XLA abort), the parent keeps
    those, reports the next config as failed with the signal, and compiles the rest in a new child."""
    good = recipe("gpt-small", tiny=True)
    configs = [override(good, [f"run.name=c{i}"]) for i in range(4)]
    calls = []

    def child(function, args, kwargs, devices, path=None):
        todo = args[0]
        calls.append([c.run.name for c in todo])
        if len(calls) == 1:  # finishes c0, dies on c1
            first = confirm_lib.failed_report(todo[0], devices, args[3], args[4], "")
            with open(kwargs["progress"], "a") as f:
                f.write(json.dumps(encode(first)) + "\n")
            raise RuntimeError(f"{function} in a subprocess with {devices} simulated CPU devices failed (exit -6):\n")
        return [confirm_lib.failed_report(c, devices, args[3], args[4], "") for c in todo]

    monkeypatch.setattr(confirm_lib, "call_with_devices", child)

    class Fixed:
        def __init__(self, cfg):
            self.cfg = cfg

        def apply(self, _):
            return self.cfg

    reports = confirm_lib.compile_layouts(good, [Fixed(c) for c in configs], 4, "h100")
    assert calls == [["c0", "c1", "c2", "c3"], ["c2", "c3"]]
    assert [r.name for r in reports] == ["c0", "c1", "c2", "c3"]
    assert reports[1].error == "the compiling process was killed by SIGABRT, with no message"
    assert [bool(r.error) for r in reports] == [False, True, False, False]
    assert confirm_lib._crash_line("x failed (exit 1):\nF1126 12:00:00 hlo.cc:1] Check failed: a == b\nAborted") == \
        "F1126 12:00:00 hlo.cc:1] Check failed: a == b"
