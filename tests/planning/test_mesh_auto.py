"""``--mesh auto`` / ``mesh.axes="auto"``: the planner's compile-confirmed pick trains, and a resume keeps it.

The pick printed is the plan's first confirmed layout, the run's config.json records it, and a second
run in the same directory resumes with the recorded layout instead of planning again. Negative
controls: a config with explicit axes passes through unchanged, and the run itself refuses an
unresolved ``auto`` with a message naming what resolves it.
"""

import json

import pytest

from trainers import override, recipe, train
from trainers.launch import cli
from trainers.planning.auto import choose_layout, detect_hardware, resolve_auto


@pytest.mark.sweep
def test_mesh_auto_trains_with_the_planners_pick_and_resume_keeps_it(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    # a checkpoint at each run's last step only (tiny saves every step): the resume reads step 2's
    args = ["gpt-small", "--tiny", "--mesh", "auto", "--run-dir", run_dir, "--set", "run.progress=false",
            "--set", "checkpoint.every_steps=100"]
    assert cli.main([*args, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "mesh auto: chose " in out and "runner-up " in out and "as flags: --mesh " in out
    recorded = json.load(open(f"{run_dir}/config.json"))
    chosen = out.split("as flags: --mesh ", 1)[1].split()[0]
    assert recorded["mesh"]["axes"] == chosen != "auto"
    # the Python API gives the same pick for the same config and devices
    cfg = override(recipe("gpt-small", tiny=True), ["mesh.axes=auto"])
    assert choose_layout(cfg, hardware=detect_hardware()).config.mesh.axes == chosen
    assert cli.main([*args, "--steps", "4"]) == 0  # resume: the recorded layout, no new plan
    out = capsys.readouterr().out
    assert f"mesh auto: resuming {run_dir} with the layout its config.json records: mesh {chosen}" in out
    assert "chose" not in out and json.load(open(f"{run_dir}/config.json"))["mesh"]["axes"] == chosen


def test_explicit_axes_pass_through_and_the_run_refuses_an_unresolved_auto(tmp_path):
    cfg = override(recipe("gpt-small", tiny=True), [f"run.run_dir={tmp_path}"])
    assert resolve_auto(cfg, say=lambda _: pytest.fail("nothing to resolve")) is cfg
    auto = override(cfg, ["mesh.axes=auto"])
    with pytest.raises(ValueError, match=r"mesh.axes='auto' is a layout the planner has not chosen yet.*resolve_auto"):
        train(auto)
    with pytest.raises(ValueError, match="mesh.axes='auto' with mesh.dcn='data=2'"):
        override(cfg, ["mesh.axes=auto", "mesh.dcn=data=2"])
    with pytest.raises(ValueError, match="no layout of 8 devices of cpu with rules 'dp_ep' fits when compiled"):
        choose_layout(auto, hardware="cpu", rules="dp_ep")  # no expert axis without experts: nothing to pick
