"""Bring your own model: ``spmd-train``, ``--dry-run`` and ``spmd-plan`` with ``package.module:task`` targets.

The task is :mod:`tests.helpers.byom_task` (an MLP classifier with an annotated kernel, a path rule, the
FSDP default, BatchNorm statistics and a dropout RNG stream). What is checked:

- the CLI trains it (2 steps with ``--tiny``) in this process, and on 2 processes x 4 devices
  through ``spmd-launch`` with the same losses (slow);
- the dry run builds the state with the run's state builder and compiles the task's step: the
  analytic state bytes equal the compiled ones, and with activations dominating (a large batch)
  the analytic temporaries are within 30% of the compiled ones, for a replicated and a sharded
  layout; negative control: the two layouts' state bytes differ by far more than the tolerance;
- a layout that cannot be built is diagnosed per parameter with a fix naming the dim and the axis;
  compiled temporaries that look like the whole batch's activations on every device are flagged;
- the planner ranks ``data x fsdp x tensor`` layouts of the task: a known answer (weights too big
  to replicate: the chosen layout shards them, every replicated layout is rejected), confirmed by
  compiling the chosen layout (fits) and a rejected one (does not);
- bad targets give ``spmd-train: error: ...`` with exit status 2, naming what was given and what is valid.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
from helpers.paths import REPO

from tests.helpers.byom_task import big, task
from trainers import override
from trainers.launch import cli, command
from trainers.launch.local import launch
from trainers.launch.plan import main as plan_main
from trainers.logger import read_metrics
from trainers.planning.dryrun import dry_run
from trainers.planning.hardware import custom
from trainers.planning.planner import plan

TARGET = "tests.helpers.byom_task:task"


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["split"] == "train"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("byom") / "run")
    code = cli.main([TARGET, "--tiny", "--simulate-devices", "8", "--run-dir", run_dir, "--set", "run.progress=false"])
    return code, run_dir


def test_spmd_train_trains_a_task(tiny_run, capsys):
    code, run_dir = tiny_run
    assert code == 0
    losses = _losses(run_dir)
    assert sorted(losses) == [1, 2] and all(0 < v < 10 for v in losses.values())
    evals = [r for r in read_metrics(run_dir) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2] and 0 <= evals[0]["accuracy"] <= 1
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2"]  # --tiny: the last step (task: every 100)


def test_task_config_is_the_base_and_flags_apply():
    args = cli.parse_args([TARGET, "--tiny", "--mesh", "fsdp=8", "--rules", "fsdp", "--set", "data.global_batch=32"])
    cfg = command.build_config(args, task)
    assert (cfg.mesh.axes, cfg.rules, cfg.data.global_batch) == ("fsdp=8", "fsdp", 32)
    assert (cfg.run.name, cfg.run.steps, cfg.run.eval_batches, cfg.checkpoint.async_save) == ("byom-tiny", 2, 1, False)
    assert cfg.checkpoint.every_steps == task.config.checkpoint.every_steps  # the task's cadence, and the last step
    assert cfg.optimizer == task.config.optimizer and cfg.model == task.config.model  # the task's, not shrunk
    full = command.build_config(cli.parse_args([TARGET]), task)
    assert full == task.config  # negative control: without flags the task's config as it is


@pytest.mark.parametrize("argv, needles", [
    (["tests.helpers.byom_task:nope"], ["'tests.helpers.byom_task:nope'", "has no attribute 'nope'", "make_task", "gpt-small"]),
    (["tests.no_such_module:task"], ["cannot import module 'tests.no_such_module'", "package.module:attribute"]),
    (["tests.helpers.byom_task:not_a_task"], ["is of type int, not a trainers.Task"]),
    (["tests.helpers.byom_task:"], ["not of the form package.module:attribute"]),
    (["gpt-huge"], ["unknown recipe 'gpt-huge'", "gpt-small", "package.module:attribute"]),
])
def test_bad_targets_are_clear_errors(argv, needles, capsys):
    for extra in ([], ["--dry-run", "--devices", "8"], ["--print-config"]):
        assert cli.main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("spmd-train: error: ") and all(n in err for n in needles), (extra, err)
    assert plan_main(argv + ["--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmd-plan: error: ") and all(n in err for n in needles), err


def test_cli_dry_run_of_a_task(capsys):
    assert cli.main([TARGET, "--dry-run", "--devices", "8", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    for needle in ("dry run: byom, 5,636 params, mesh data=2,fsdp=4, rules fsdp", "state (params + optimizer + variables)",
                   "model variables (batch stats, RNG, ...)",
                   "activations", "collectives (compiled step", "all-gather", "fits", "estimated step"):
        assert needle in out, (needle, out)


@pytest.fixture(scope="module")
def reports():
    """A replicated and a sharded layout, with a batch large enough for activations to dominate."""
    return {name: dry_run(override(task.config, [f"mesh.axes={axes}", f"rules={rules}", "data.global_batch=1024"]),
                          task, devices=8)
            for name, (axes, rules) in {"dp8": ("data=8", "dp"), "fsdp8": ("fsdp=8", "fsdp")}.items()}


@pytest.mark.parametrize("name", ["dp8", "fsdp8"])
def test_dry_run_analytic_memory_matches_the_compiled_step(reports, name):
    r = reports[name]
    a, c = r.analytic, r.compiled
    compiled_state = c.argument - r.batch_bytes
    assert r.fits and a.batch == r.batch_bytes
    assert abs(a.state - compiled_state) <= 0.01 * compiled_state and abs(r.state_bytes - compiled_state) <= 64
    assert abs(a.grads + a.activations - c.temp) <= 0.3 * c.temp, (a, c)
    assert a.other == 4 * (64 + 64 + 1 + 2)  # BatchNorm mean and var, RNG count and key data


def test_dry_run_layouts_differ_and_collectives_follow_the_sharding(reports):
    dp, fsdp = reports["dp8"], reports["fsdp8"]
    assert dp.analytic.state > 3 * fsdp.analytic.state  # negative control for the 1% above
    assert {op.axes for op in dp.collectives} == {("data",)} and {op.kind for op in dp.collectives} == {"all-reduce"}
    assert any(op.kind == "all-gather" and op.axes == ("fsdp",) for op in fsdp.collectives)
    analytic = {(t.kind, t.axes) for t in fsdp.analytic_traffic}
    assert {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("fsdp",))} == analytic
    assert dp.model_flops == fsdp.model_flops == pytest.approx(3 * 1024 * 2 * (16 * 64 + 64 * 64 + 64 * 4))


def test_a_layout_that_cannot_be_built_names_the_dim_and_axis():
    report = dry_run(override(task.config, ["mesh.axes=tensor=8", "rules=tp", "data.global_batch=16"]),
                     "tests.helpers.byom_task:wide", devices=8)
    assert report.compiled is None and not report.fits
    messages = [str(i) for i in report.issues]
    assert any(m.startswith("hidden/kernel dim mlp=100 does not divide by tensor=8: make dim 1 (mlp) of hidden/kernel "
                            "a multiple of 8") and "model." not in m for m in messages), messages
    assert any(m.startswith("out/kernel dim mlp=100") for m in messages)  # the path rule's dims too
    ok = dry_run(override(task.config, ["mesh.axes=tensor=8", "rules=tp"]), task, devices=8)
    assert ok.compiled is not None and not any(i.fatal for i in ok.issues)  # negative control: 64 divides


def test_activations_left_whole_on_every_device_are_flagged(reports):
    from trainers.checks.compiled import check_activation_split

    mib = 2**20
    # trainers.examples.decoder under fsdp=8 (no activation constraints): 171 MiB compiled, 177 whole, 22 split
    (issue,) = check_activation_split(171 * mib, 22 * mib, 177 * mib, 2 * mib, 2, ("fsdp",))
    assert "not split over fsdp" in str(issue) and "spmd.constrain" in str(issue) and not issue.fatal
    # negative controls: temporaries near the split estimate; the batch not split; fixed costs explain the gap
    assert check_activation_split(30 * mib, 22 * mib, 177 * mib, 2 * mib, 2, ("fsdp",)) == []
    assert check_activation_split(171 * mib, 22 * mib, 177 * mib, 2 * mib, 16, ()) == []
    assert check_activation_split(40_000, 5_500, 33_000, 21_000, 2, ("fsdp",)) == []
    for r in reports.values():  # the byom task constrains nothing, but its activations do follow the batch
        assert not any(i.kind == "activations" for i in r.issues)


def test_a_task_object_cannot_cross_into_a_subprocess():
    with pytest.raises(ValueError, match="pass its 'package.module:attribute' name instead of the Task object"):
        dry_run(override(task.config, ["mesh.axes=data=4", "rules=dp"]), task, devices=4)


@pytest.mark.slow
def test_dry_run_for_another_device_count_rebuilds_the_task_in_a_subprocess():
    report = dry_run(override(task.config, ["mesh.axes=data=2,fsdp=2"]), TARGET, devices=4, hardware="a100")
    assert report.devices == 4 and "4 simulated" in report.backend and report.fits
    assert report.name == "byom" and report.params == 5636 and report.analytic.other > 0


def test_planner_known_answer_for_a_task():
    """1 MiB of f32 weights (+ Adam) cannot be replicated on 2.7 MB devices: the planner must shard them."""
    hw = custom("h100", hbm_bytes=3e6, name="small")
    result = plan(big.config, 8, hw, task=big)
    assert result.ranked and all(e.layout.pipe == 1 and e.layout.remat is None for e in result.ranked + result.rejected)
    assert len(result.ranked) + len(result.rejected) == 10  # data x fsdp x tensor factorisations with their rules
    assert result.best.layout.sizes["fsdp"] > 1
    unsharded = [e for e in result.rejected if e.layout.sizes["fsdp"] == 1]
    assert {e.layout.rules for e in unsharded} == {"dp", "tp", "dp_tp"}
    assert all(e.memory.state > e.budget for e in unsharded)
    steps = [e.roofline.step_s for e in result.ranked]
    assert steps == sorted(steps)
    # confirmed by the compiler: the chosen layout fits, a rejected one does not
    chosen = dry_run(result.best.layout.apply(big.config), "tests.helpers.byom_task:big", devices=8, hardware=hw)
    compiled_state = chosen.compiled.argument - chosen.batch_bytes
    assert chosen.fits and abs(chosen.analytic.state - compiled_state) < 0.01 * compiled_state
    rejected = next(e for e in unsharded if e.layout.rules == "dp")
    report = dry_run(rejected.layout.apply(big.config), "tests.helpers.byom_task:big", devices=8, hardware=hw)
    assert report.compiled.total > report.budget and not report.fits
    # negative control: roomy devices take the replicated layouts too
    assert any(e.layout.rules == "dp" for e in plan(big.config, 8, "h100", task=big).ranked)


def test_spmd_plan_cli_for_a_task(capsys):
    assert plan_main([TARGET, "--devices", "8", "--hardware", "h100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tests.helpers.byom_task:task (task byom): 5,636 params, global batch 16")
    assert "10 of 10 layouts of 8 devices fit h100" in out and "dominant cost" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"spmd-train {TARGET} --mesh ") and "--rules " in last
    assert "remat" not in out and "pipe" not in out  # not choices for a task


@pytest.mark.slow
def test_spmd_launch_runs_a_task_on_two_processes(tiny_run, tmp_path):
    """2 processes x 4 devices, the same 8-device mesh: the same losses as one process."""
    _, one = tiny_run
    two = str(tmp_path / "2x4")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = io.StringIO()
    cmd = [sys.executable, "-m", "trainers", TARGET, "--tiny", "--run-dir", two, "--set", "run.progress=false"]
    code = launch(cmd, processes=2, devices_per_process=4, env=env, out=out, timeout_s=120)
    assert code == 0, out.getvalue()[-3000:]
    ref, got = _losses(one), _losses(two)
    assert ref.keys() == got.keys() == {1, 2}
    assert all(abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]) for k in ref), (got, ref)
    assert "[p0] Mesh: 8 device(s) = data=2 x fsdp=4" in out.getvalue() and "task byom" in out.getvalue()
