"""Local SGD with layouts that run their own shard_map in the step: context parallelism (``seq``), pipelines,
accumulation manual over ``fsdp`` (``per_step``), MoE blocks (their region nested in the groups'). On 4 devices (``data=2`` x 2): H = 1 with plain
averaging equals data parallelism; 2 inner steps then one outer step equal each group's rows trained
alone on 2 devices, averaged; the inner step sends nothing over ``data``. Then a resumed CLI run."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from helpers.gpt_util import gpt_config

import spmd
import trainers
from spmd.models import GPTConfig
from trainers.launch import cli, command
from trainers.loop import train

SGD = ["optimizer.name=sgd", "optimizer.momentum=0.5", "optimizer.clip_norm=none", "lr.peak_lr=0.3"]  # linear in the gradient
H1 = ["local_sgd.every=1", "local_sgd.outer_optimizer=sgd", "local_sgd.outer_lr=1", "local_sgd.outer_momentum=0"]
MODEL = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, dtype="float32")
# dropless (capacity 0: no token's fate depends on the layout); the load-balancing loss is a product of batch
# means, so a group's differs from the global batch's: off where local SGD is compared with data parallelism
MOE = dataclasses.replace(MODEL, n_experts=4, experts_per_token=2, moe_d_ff=32, capacity_factor=0.0)
# name -> (the axis beside data, rule set, overrides, model); the one-group reference runs on that axis alone
COMBOS = {
    "seq": ("seq", "fsdp", [], MODEL),
    "moe": ("expert", "dp_ep", [], MOE),
    "pipe_1f1b": ("pipe", "dp", ["pipeline.schedule=1f1b", "pipeline.microbatches=2"], MODEL),
    "pipe_gpipe": ("pipe", "dp", ["pipeline.schedule=gpipe", "pipeline.microbatches=2"], MODEL),
    # accumulation gathering the FSDP weights once per step, its loop manual over fsdp inside each group
    "per_step": ("fsdp", "fsdp", ["run.grad_accum=2", "run.fsdp_gather=per_step"], MODEL),
}
# the slow tier runs each combination once across the two tests below and the CLI run with seq; the sweep
# runs the rest
TIERED = {"h1": ("moe", "pipe_1f1b"), "groups": ("moe", "per_step")}


def _tiered(test: str) -> list:
    return [pytest.param(n, marks=pytest.mark.slow if n in TIERED[test] else pytest.mark.sweep) for n in COMBOS]


STEPS, ROWS, LENGTH = 2, 8, 16


def _config(name, groups, *sets, model=None):
    axis, rules, extra, default = COMBOS[name]
    sizes = {"data": 2, axis: 2} if groups else {axis: 2}
    return gpt_config(sizes, rules, *SGD, *extra, *sets, model=model or default)


def _build(cfg):
    n = int(np.prod([s for _, s in cfg.mesh.spec.ici]))
    return trainers.build(cfg, mesh=cfg.mesh.build(jax.devices()[:n]), donate=False)  # fresh() twice: a state kept


def _batches(n, rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, MODEL.vocab_size, size=(rows, LENGTH + 1), dtype=np.int32) for _ in range(n)]
    return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def _steps(run, data, outer_every):
    """``run`` stepped over ``data``; under local SGD the outer step after every ``outer_every`` inner
    steps (0: never). ``(losses, states)``: the host state before the first step and after each."""
    state, losses = run.fresh().train, []
    states = [jax.device_get(state)]
    for i, batch in enumerate(data, 1):
        state, metrics = run.train_step(state, jax.device_put(batch, run.batch_sharding))
        if outer_every and i % outer_every == 0:
            state = run.strategy.local.outer_step(state)
        losses.append(float(run.strategy.fetch([metrics])[0]["loss"]))
        states.append(jax.device_get(state))
    return losses, states


def _max_diff(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", _tiered("h1"))
def test_h1_equals_data_parallelism_and_the_inner_step_sends_nothing_over_data(name):
    model = dataclasses.replace(MOE, aux_loss_weight=0.0) if name == "moe" else None
    dp_losses, dp_states = _steps(_build(_config(name, True, model=model)), _batches(STEPS), 0)
    local_run = _build(_config(name, True, *H1, model=model))
    losses, local_states = _steps(local_run, _batches(STEPS), 1)
    dp, local = dp_states[-1], local_states[-1]
    assert np.allclose(losses, dp_losses, rtol=1e-5, atol=0), (losses, dp_losses)
    assert _max_diff(local.outer_params, dp.params) <= 1e-5
    for g in range(2):  # every group holds the synchronised params
        assert _max_diff(jax.tree.map(lambda x: x[g], local.params), dp.params) <= 1e-5
    compiled = local_run.strategy.local.compiled["inner"]
    ops = spmd.hlo.collectives(compiled, local_run.mesh)
    assert ops and not [op for op in ops if "data" in op.axes], spmd.hlo.format_collectives(ops)
    assert _max_diff(dp_states[-2].params, dp.params) > 1e-3  # negative control: a step moves them further


@pytest.mark.parametrize("name", _tiered("groups"))
def test_groups_equal_independent_runs_on_their_rows_then_the_average(name):
    """H = 2 inner steps, then one outer step of plain averaging: each group trained alone (the ordinary
    step on a one-group mesh, its half of every batch), then the mean of their params."""
    data = _batches(STEPS)
    losses, local_states = _steps(_build(_config(name, True, *H1)), data, STEPS)
    local = local_states[-1]
    alone = _build(_config(name, False, f"data.global_batch={ROWS // 2}"))
    runs = [_steps(alone, [jax.tree.map(lambda x: x[g * ROWS // 2:(g + 1) * ROWS // 2], b) for b in data], 0)
            for g in range(2)]
    want_losses = np.mean([r[0] for r in runs], axis=0)
    assert np.allclose(losses, want_losses, rtol=1e-5, atol=0), (losses, want_losses)
    ends = [r[1][-1].params for r in runs]
    assert _max_diff(local.outer_params, jax.tree.map(lambda a, b: (a + b) / 2, *ends)) <= 1e-5
    assert _max_diff(*ends) > 1e-3  # negative control: the groups moved apart


@pytest.mark.slow
def test_a_cli_run_with_context_parallelism_resumes(tmp_path):
    """``spmd-train gpt-small --tiny`` on ``data=2,seq=2,fsdp=2``, local SGD with H = 2 over 3 steps; a copy of
    its checkpoint 1 (mid-interval) resumed: steps 2 and 3 and the final state as the straight run's."""
    args = ["gpt-small", "--tiny", "--mesh", "data=2,seq=2,fsdp=2", "--steps", "3", "--set", "rules=fsdp",
            "--set", "local_sgd.every=2", "--set", "checkpoint.every_steps=1", "--set", "run.eval_batches=0",
            "--set", "run.progress=false"]
    straight = train(command.build_config(cli.parse_args([*args, "--run-dir", str(tmp_path / "a")])), keep_state=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "1", tmp_path / "b" / "checkpoints" / "1")
    resumed = train(command.build_config(cli.parse_args([*args, "--run-dir", str(tmp_path / "b")])), keep_state=True)
    assert resumed.start_step == 1 and sorted(straight.losses) == [1, 2, 3]
    assert [resumed.losses[s] for s in (2, 3)] == [straight.losses[s] for s in (2, 3)]
    same = jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True), jax.device_get(resumed.state),
                        jax.device_get(straight.state))
    assert all(jax.tree.leaves(same))


@pytest.mark.sweep
@pytest.mark.parametrize("name", ["seq", "pipe_1f1b", "moe"])
def test_two_groups_per_data_shard_equal_data_parallelism(name):
    """``local_sgd.groups=4`` on data=2 (each data shard maps two groups) with context parallelism, a
    pipeline or MoE blocks: H = 1 with plain averaging equals data parallelism, and the inner step sends nothing over data."""
    model = dataclasses.replace(MOE, aux_loss_weight=0.0) if name == "moe" else None
    dp_losses, dp_states = _steps(_build(_config(name, True, model=model)), _batches(STEPS), 0)
    run = _build(_config(name, True, *H1, "local_sgd.groups=4", model=model))
    losses, states = _steps(run, _batches(STEPS), 1)
    assert run.strategy.local.groups == 4
    assert np.allclose(losses, dp_losses, rtol=1e-5, atol=0), (losses, dp_losses)
    assert _max_diff(states[-1].outer_params, dp_states[-1].params) <= 1e-5
    ops = spmd.hlo.collectives(run.strategy.local.compiled["inner"], run.mesh)
    assert ops and not [op for op in ops if "data" in op.axes], spmd.hlo.format_collectives(ops)
