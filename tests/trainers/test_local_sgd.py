"""Local SGD / DiLoCo (trainers.local_sgd): H = 1 with outer SGD(lr 1) is data parallelism, the inner step
sends nothing over ``data`` and the outer step one gradient-sized all-reduce, the outer update against a
host reference, exact resume mid-interval, refused restores and configs, and a 2-process run."""

import io
import os
import shutil
import sys

import jax
import numpy as np
import optax
import pytest
from helpers.paths import REPO

import spmd
import trainers.setup as setup_lib
from trainers.config import override
from trainers.launch import cli, command
from trainers.launch.local import launch
from trainers.local_sgd import LocalSGDConfig, groups_of, outer_optimizer
from trainers.logger import read_metrics
from trainers.loop import train
from trainers.recipes import recipe

MESH = "mesh.axes=data=2,fsdp=2,tensor=2"
SGD = ["optimizer.name=sgd", "optimizer.momentum=0.5", "optimizer.clip_norm=none"]  # linear in the gradient
H1 = ["local_sgd.every=1", "local_sgd.outer_optimizer=sgd", "local_sgd.outer_lr=1", "local_sgd.outer_momentum=0"]
H2 = ["local_sgd.every=2", "local_sgd.outer_optimizer=nesterov"]  # DiLoCo's outer step (auto picks it from H = 100)
_made: list = []  # every trainers.local_sgd.LocalSGD the runs below built, to inspect its compiled steps


class _Recorded(setup_lib.LocalSGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _made.append(self)


def tiny(run_dir, *sets):
    return override(recipe("gpt-small", tiny=True), [f"run.run_dir={run_dir}", "run.progress=false", "run.tensorboard=false",
                                                     MESH, "run.log_every=1", *sets])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Data parallelism and local SGD with H = 1 over 5 steps (inner SGD with momentum; the groups accumulate
    2 microbatches, which must not change the result), and H = 2 with
    Nesterov over 5 steps (checkpoints at 3 and 5): each run's result and its LocalSGD."""
    root = tmp_path_factory.mktemp("local_sgd")
    common = ["run.steps=5", "run.eval_every=5", "run.eval_batches=1", "checkpoint.every_steps=3", *SGD]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(setup_lib, "LocalSGD", _Recorded)  # trainers.setup.build makes it
        dp = train(tiny(root / "dp", *common), keep_state=True)
        h1 = train(tiny(root / "h1", *common, *H1, "run.grad_accum=2"), keep_state=True)  # 2 microbatches per group
        h1_local = _made[-1]
        h2 = train(tiny(root / "h2", *common, *H2), keep_state=True)
        h2_local = _made[-1]
        int8 = train(tiny(root / "int8", *common, *H2, "local_sgd.outer_dtype=int8"))
    return {"root": root, "dp": dp, "h1": h1, "h1_local": h1_local, "h2": h2, "h2_local": h2_local, "common": common,
            "int8": int8, "int8_local": _made[-1]}


def _close(a, b, tol=1e-5):
    return all(np.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_h1_with_outer_sgd_lr1_equals_data_parallelism(runs):
    dp, h1, h2 = runs["dp"], runs["h1"], runs["h2"]
    assert sorted(h1.losses) == [1, 2, 3, 4, 5]
    assert all(abs(h1.losses[s] - dp.losses[s]) <= 1e-5 * abs(dp.losses[s]) for s in dp.losses), (h1.losses, dp.losses)
    assert abs(h1.eval_losses[5] - dp.eval_losses[5]) <= 1e-5 * dp.eval_losses[5]
    dp_params = jax.device_get(dp.state.params)
    assert _close(jax.device_get(h1.state.outer_params), dp_params)
    for g in range(2):  # every group holds the synchronised params
        assert _close(jax.tree.map(lambda x: x[g], jax.device_get(h1.state.params)), dp_params)
    # negative control: H = 2 with Nesterov moves the params away from data parallelism's
    assert not _close(jax.device_get(h2.state.outer_params), dp_params, tol=1e-4)
    assert h2.losses[1] == pytest.approx(dp.losses[1], rel=1e-6)  # the same first step: the same start and data


def _param_bytes(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_inner_step_sends_nothing_over_data_and_outer_step_one_gradient_sized_all_reduce(runs):
    local, h1 = runs["h1_local"], runs["h1"]
    inner = spmd.hlo.collectives(local.compiled["inner"], local.mesh)
    outer = spmd.hlo.collectives(local.compiled["outer"], local.mesh)
    assert inner and all("data" not in op.axes for op in inner)  # the groups' own fsdp/tensor collectives only
    over_data = [op for op in outer if "data" in op.axes]
    assert len(outer) == len(over_data) == 1, spmd.hlo.format_collectives(outer)
    (op,) = over_data
    assert (op.kind, op.axes, op.count) == ("all-reduce", ("data",), 1)
    assert op.bytes == _param_bytes(h1.state.outer_params)  # gradient-sized: every parameter shard once
    assert local.bytes_per_call["inner"] == 0 and local.bytes_per_call["outer"] == op.bytes
    # the run summary counts them: 5 outer steps, the metrics' few scalars at each fetch
    assert 5 * op.bytes <= h1.summary["data_bytes"] < 5 * op.bytes + 1000
    assert h1.summary["data_bytes_outer"] == op.bytes
    h2 = runs["h2"]  # H = 2 over 5 steps: outer steps at 2, 4 and the last step
    assert 3 * op.bytes <= h2.summary["data_bytes"] < 3 * op.bytes + 1000


def test_outer_step_equals_a_host_reference(runs):
    """Groups moved apart by known offsets; the outer step against numpy and optax on one device."""
    local, state = runs["h2_local"], runs["h2"].state
    rng = np.random.default_rng(0)
    outer = jax.device_get(state.outer_params)
    group_params = jax.tree.map(lambda x: np.stack([x + rng.normal(0, 0.01, x.shape).astype(x.dtype) for _ in range(2)]),
                                outer)
    moved = jax.device_put(jax.device_get(state).replace(params=group_params), local.shardings)  # donated: a copy
    opt_host = jax.device_get(state.outer_opt_state)
    after = jax.device_get(local.outer_step(moved))
    tx = outer_optimizer(local.cfg)
    pseudo = jax.tree.map(lambda o, g: o - g.mean(0), outer, group_params)
    updates, want_opt = tx.update(pseudo, opt_host, outer)
    want = optax.apply_updates(outer, updates)
    assert _close(after.outer_params, want, tol=1e-6) and _close(after.outer_opt_state, want_opt, tol=1e-6)
    assert all(np.array_equal(p[0], p[1]) for p in jax.tree.leaves(after.params))
    assert _close(jax.tree.map(lambda x: x[0], after.params), want, tol=1e-6)
    assert not _close(after.outer_params, outer, tol=1e-4)  # negative control: the update moved them


def test_resume_mid_interval_is_exact(runs):
    """Crash after step 4 (checkpoint 3 is mid-interval: H = 2), resume: the same losses and state as straight."""
    straight, run_dir = runs["h2"], runs["root"] / "h2-crash"

    def crash(step):
        if step == 4:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        train(tiny(run_dir, *runs["common"], *H2), step_hook=crash)
    resumed = train(tiny(run_dir, *runs["common"], *H2), keep_state=True)
    assert resumed.start_step == 3
    assert [resumed.losses[s] for s in (4, 5)] == [straight.losses[s] for s in (4, 5)]
    same = jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True), jax.device_get(resumed.state), jax.device_get(straight.state))
    assert all(jax.tree.leaves(same))


def test_restores_onto_another_group_count_or_mode_are_refused(runs, tmp_path):
    source = runs["root"] / "h2"
    for name, sets, match in [
        ("g4", ["mesh.axes=data=4,fsdp=2", *H2], r"holds 2 replica groups but this run has 4 .*local_sgd.groups=2"),
        ("dp", [], r"written by local SGD with 2 replica groups; resume it with local_sgd.every >= 1"),
    ]:
        shutil.copytree(source / "checkpoints", tmp_path / name / "checkpoints")
        with pytest.raises(ValueError, match=match):
            train(tiny(tmp_path / name, *runs["common"], *sets))
    shutil.copytree(runs["root"] / "dp" / "checkpoints", tmp_path / "to-local" / "checkpoints")
    with pytest.raises(ValueError, match=r"written without local SGD; .*checkpoint.init_from"):
        train(tiny(tmp_path / "to-local", *runs["common"], "local_sgd.every=2"))


def test_groups_beyond_the_data_size_equal_data_parallelism_and_resume_onto_another_data_size(runs, tmp_path):
    """``local_sgd.groups=4`` on data=2 (two groups per data shard), and 2 on a mesh without data: H = 1
    with plain averaging equals data parallelism; an H = 2 run's mid-interval checkpoint (groups apart) resumes on data=4 as the
    run that was not stopped; without the key a resume onto data=8 is refused, naming it."""
    g4, common = ["local_sgd.groups=4"], runs["common"]
    h1 = train(tiny(tmp_path / "h1", *common, *H1, *g4), keep_state=True)
    dp = runs["dp"]
    assert all(abs(h1.losses[s] - dp.losses[s]) <= 1e-5 * abs(dp.losses[s]) for s in dp.losses), (h1.losses, dp.losses)
    assert _close(jax.device_get(h1.state.outer_params), jax.device_get(dp.state.params))
    assert jax.tree.leaves(h1.state.params)[0].shape[0] == 4
    flat = train(tiny(tmp_path / "flat", *common, *H1, "local_sgd.groups=2", "mesh.axes=fsdp=4,tensor=2"), keep_state=True)
    assert all(abs(flat.losses[s] - dp.losses[s]) <= 1e-5 * abs(dp.losses[s]) for s in dp.losses)  # no data axis
    assert _close(jax.device_get(flat.state.outer_params), jax.device_get(dp.state.params))
    straight = train(tiny(tmp_path / "h2", *common, *H2, *g4), keep_state=True)
    shutil.copytree(tmp_path / "h2" / "checkpoints" / "3", tmp_path / "moved" / "checkpoints" / "3")
    resumed = train(tiny(tmp_path / "moved", *common, *H2, *g4, "mesh.axes=data=4,fsdp=2"), keep_state=True)
    assert resumed.start_step == 3
    assert all(abs(resumed.losses[s] - straight.losses[s]) <= 1e-5 * straight.losses[s] for s in (4, 5))
    assert _close(jax.device_get(resumed.state.params), jax.device_get(straight.state.params))
    # negative control: H = 2 had moved the groups apart by the checkpoint (H = 1 keeps them together)
    assert abs(straight.losses[4] - h1.losses[4]) > 1e-4 * h1.losses[4]
    shutil.copytree(tmp_path / "h2" / "checkpoints" / "3", tmp_path / "d8" / "checkpoints" / "3")
    with pytest.raises(ValueError, match=r"holds 4 replica groups but this run has 8 .* set local_sgd.groups=4"):
        train(tiny(tmp_path / "d8", *common, *H2, "mesh.axes=data=8"))


@pytest.mark.parametrize("sets, match", [
    (["local_sgd.every=-1"], r"local_sgd.every=-1 must be an integer >= 0"),
    (["local_sgd.every=2", "local_sgd.outer_optimizer=adam"], r"outer_optimizer='adam'; valid: auto, nesterov, sgd"),
    (["local_sgd.every=2", "local_sgd.outer_optimizer=nesterov", "local_sgd.outer_momentum=0"],
     r"'nesterov' needs local_sgd.outer_momentum > 0"),
    (["local_sgd.every=200", "local_sgd.outer_momentum=0"], r"'nesterov' needs local_sgd.outer_momentum > 0"),
    (["local_sgd.every=2", "local_sgd.outer_lr=0"], r"local_sgd.outer_lr=0.0 must be a finite number > 0"),
    (["local_sgd.every=2", "local_sgd.outer_momentum=1"], r"outer_momentum=1.0 must be a number in \[0, 1\)"),
    (["local_sgd.every=2", "local_sgd.outer_dtype=fp8"], r"outer_dtype='fp8'; valid: float32, bfloat16, int8"),
    (["local_sgd.every=2", "mesh.axes=fsdp=4,tensor=2"], r"needs replica groups over the data axis, .* gives data=1"),
    (["local_sgd.every=2", "local_sgd.groups=1"], r"local_sgd.groups=1 must be 0 \(the data axis's size\) or an integer >= 2"),
    (["local_sgd.every=2", "local_sgd.groups=3"], r"local_sgd.groups=3 does not divide over data=2 .* a multiple of 2"),
])
def test_bad_configs_are_refused(sets, match):
    with pytest.raises(ValueError, match=match):
        override(recipe("gpt-small", tiny=True), sets)


def test_groups_split_the_batch_as_data_would():
    """The layout check splits each microbatch over G groups in place of data: 8 rows into 8 groups on
    fsdp=2 is refused, naming local_sgd.groups; into 4 groups it passes (control)."""
    from trainers import checks

    cfg = override(recipe("gpt-small", tiny=True), [MESH, "local_sgd.every=2", "local_sgd.groups=8"])
    (issue,) = [i for i in checks.check(cfg, stages=("layout",), mesh_shape=cfg.mesh.build().shape) if i.fatal]
    assert "batch of 8 per microbatch" in str(issue) and "local_sgd.groups=8 x fsdp=2" in str(issue), str(issue)
    ok = override(cfg, ["local_sgd.groups=4"])
    assert not [i for i in checks.check(ok, stages=("layout",), mesh_shape=ok.mesh.build().shape) if i.fatal]


def test_auto_outer_optimizer_depends_on_h():
    """The default: plain model averaging (sgd, lr 1, momentum 0) below H = 100, DiLoCo's Nesterov
    (lr 0.7, momentum 0.9) from there on; set values win."""
    for every, want in [(1, ("sgd", 1.0, 0.0)), (10, ("sgd", 1.0, 0.0)), (50, ("sgd", 1.0, 0.0)),
                        (99, ("sgd", 1.0, 0.0)), (100, ("nesterov", 0.7, 0.9)), (500, ("nesterov", 0.7, 0.9))]:
        cfg = LocalSGDConfig(every=every)
        assert (cfg.outer, cfg.lr, cfg.momentum) == want, every
    assert LocalSGDConfig(every=10).describe() == "sgd lr 1 momentum 0 (auto at H=10)"
    mine = LocalSGDConfig(every=10, outer_optimizer="nesterov", outer_lr=0.5)
    assert (mine.outer, mine.lr, mine.momentum) == ("nesterov", 0.5, 0.9)
    assert LocalSGDConfig(every=500, outer_momentum=0.5).momentum == 0.5
    # the optax optimizer follows: averaging has no state, Nesterov a trace
    params = {"w": np.ones(3, np.float32)}
    assert jax.tree.leaves(outer_optimizer(LocalSGDConfig(every=10)).init(params)) == []
    assert len(jax.tree.leaves(outer_optimizer(LocalSGDConfig(every=100)).init(params))) == 1


def test_a_mesh_without_data_groups_is_refused():
    override(recipe("gpt-moe", tiny=True), ["local_sgd.every=4", "run.grad_accum=2"])  # control: MoE on data=2 runs
    mesh = jax.make_mesh((1, 8), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"this mesh has data=1 .* give data >= 2"):
        groups_of(mesh, LocalSGDConfig(every=3))


TRAIN_ARGS = ["gpt-small", "--tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "4", "--set", "local_sgd.every=2",
              "--set", "checkpoint.every_steps=4", "--set", "run.eval_batches=0", "--set", "run.progress=false",
              "--set", "run.log_every=1"]


@pytest.mark.parametrize("groups", [pytest.param(0, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.sweep)])
def test_two_processes_one_group_each_match_one_process(tmp_path, groups):
    """spmd-launch: 2 processes x 4 devices, data=2 across them (one replica group per process; with
    local_sgd.groups=4, two)."""
    one, two = str(tmp_path / "1x8"), str(tmp_path / "2x4")
    args = [*TRAIN_ARGS, "--set", f"local_sgd.groups={groups}"]
    reference = train(command.build_config(cli.parse_args([*args, "--run-dir", one])))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    out = io.StringIO()
    code = launch([sys.executable, "-m", "trainers", *args, "--run-dir", two], processes=2,
                  devices_per_process=4, env=env, out=out)
    assert code == 0, out.getvalue()[-3000:]
    losses = {r["step"]: r["loss"] for r in read_metrics(two) if r["split"] == "train"}
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(abs(losses[s] - reference.losses[s]) <= 1e-5 * reference.losses[s] for s in losses), (losses, reference.losses)
    bytes_two = [r["data_bytes"] for r in read_metrics(two) if r["split"] == "train"][-1]
    assert bytes_two == reference.summary["data_bytes"] > 0  # 2 outer steps, the same compiled programs


@pytest.mark.parametrize("dtype, tol, share", [("bfloat16", 1e-2, 0.5), ("int8", 2e-2, 0.25)])
def test_compressed_outer_all_reduce_against_a_host_mean(runs, dtype, tol, share):
    """local_sgd.outer_dtype: the pseudo-gradient mean moved in bf16 / int8 (one f32 scale per chunk)
    is the host mean within the format's rounding, for the bytes over ``data`` of that format."""
    from trainers.local_sgd import compressed_mean

    local, state = runs["h2_local"], runs["h2"].state
    rng = np.random.default_rng(1)
    outer = jax.device_get(state.outer_params)
    sh = local.shardings
    for groups in (2, 4):  # one group per data shard, and two (local_sgd.groups=4 on data=2)
        group_params = jax.tree.map(
            lambda x: np.stack([x + rng.normal(0, 0.01, x.shape).astype(x.dtype) for _ in range(groups)]), outer)
        fn = jax.jit(lambda o, p, G=groups: compressed_mean(o, p, sh.params, sh.outer_params, local.mesh, G, dtype))
        args = jax.device_put(outer, sh.outer_params), jax.device_put(group_params, sh.params)
        got = jax.device_get(fn(*args))
        for g, o, p in zip(jax.tree.leaves(got), jax.tree.leaves(outer), jax.tree.leaves(group_params)):
            want = o - p.mean(0)
            assert np.abs(g - want).max() <= tol * np.abs(want).max() and np.abs(want).max() > 0

    def wire(compiled):  # bytes one device sends over data (ring algorithms)
        return sum(op.count * op.wire_bytes for op in spmd.hlo.collectives(compiled, local.mesh) if "data" in op.axes)

    ops = spmd.hlo.collectives(fn.lower(*args).compile(), local.mesh)
    moved, f32 = wire(fn.lower(*args).compile()), wire(local.compiled["outer"])
    assert share * 0.9 <= moved / f32 <= share * 1.1, (moved, f32, spmd.hlo.format_collectives(ops))


def test_a_run_with_int8_outer_steps_tracks_the_float32_run(runs):
    """local_sgd.outer_dtype=int8 in a run: the same steps until the first outer step, then within the
    rounding of the int8 pseudo-gradients; its outer step sends about a quarter of the f32 one's bytes."""
    h2, int8 = runs["h2"], runs["int8"]
    assert [int8.losses[s] for s in (1, 2)] == [h2.losses[s] for s in (1, 2)]
    assert all(int8.losses[s] == pytest.approx(h2.losses[s], rel=1e-2) for s in (3, 4, 5))
    assert int8.losses[3] != h2.losses[3]  # the outer step after step 2 ran in int8
    share = runs["int8_local"].bytes_per_call["outer"] / runs["h2_local"].bytes_per_call["outer"]
    assert 0.24 <= share <= 0.27, share
