"""The planner on what it has not seen: a failing compile drops only its candidate, gradient
accumulation's memory, pipelined tensor all-reduces, remat policies as a plan dimension.

A candidate whose build or compile raises is listed as rejected with the error's first line and the
next pick is compiled (in this process, and in the fresh process a dry run for another device count
uses); the negative control is the same plan without the failure, which confirms the first pick.
"""

import dataclasses

import pytest

from trainers import override, recipe
from trainers.launch.plan import main
from trainers.planning import calibration as cal
from trainers.planning import confirm as confirm_lib
from trainers.planning.planner import plan


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
