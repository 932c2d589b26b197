"""The trainer with a pipelined model: pipe=4 x 1F1B trains like pipe=1, and checkpoints move
between the two meshes."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest

import meshes
from trainers.checkpoint import Checkpointer
from trainers.config import override
from trainers.loop import train
from trainers.recipes import recipe
from trainers.setup import build

STEPS = 4
COMMON = [f"run.steps={STEPS}", "checkpoint.every_steps=2", f"run.eval_every={STEPS}",
          "run.progress=false", "run.tensorboard=false", "model.n_layers=4", "data.global_batch=16", "rules=dp",
          "lr.peak_lr=1e-2"]
PIPE4 = ["mesh.axes=data=2,pipe=4", "pipeline.schedule=1f1b", "pipeline.microbatches=8"]
PIPE1 = ["mesh.axes=data=8"]


def cfg_for(run_dir, *sets):
    return override(recipe("gpt-small", tiny=True), [f"run.run_dir={run_dir}", *COMMON, *sets])


@functools.cache
def runs(tmp: str):
    return train(cfg_for(os.path.join(tmp, "p4"), *PIPE4), keep_state=True), \
        train(cfg_for(os.path.join(tmp, "p1"), *PIPE1), keep_state=True)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    return runs(str(tmp_path_factory.mktemp("pipeline_runs")))


def test_pipelined_training_matches_unpipelined(both):
    p4, p1 = both
    l4 = [p4.losses[s] for s in range(1, STEPS + 1)]
    l1 = [p1.losses[s] for s in range(1, STEPS + 1)]
    assert all(np.isfinite(l4)) and l4[-1] < l4[0]
    np.testing.assert_allclose(l4, l1, rtol=1e-4)
    # evaluation runs the forward-only pipeline (the custom_vjp's primal): same validation loss
    assert p4.eval_losses[STEPS] == pytest.approx(p1.eval_losses[STEPS], rel=1e-4)
    # and the trained parameters agree
    for a, b in zip(jax.tree.leaves(p4.state.params), jax.tree.leaves(p1.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-5)
    # the pipelined run really stored the block stack split over pipe
    w = p4.state.params["blocks"]["block"]["mlp"]["w_gate_up"]
    assert tuple(w.sharding.spec)[:1] == ("pipe",)


def _restore(run_dir, sizes, *sets):
    cfg = cfg_for(run_dir, *sets)
    mesh = meshes.make_mesh(sizes)
    with Checkpointer(os.path.join(run_dir, "checkpoints"), cfg.checkpoint) as ckpt:
        step, restored, _ = ckpt.restore(build(cfg, mesh=mesh).sharded.abstract)
    return step, restored


@pytest.mark.parametrize("src, dst", [("p4", "p1"), ("p1", "p4")])
def test_checkpoint_moves_between_pipe4_and_pipe1(both, tmp_path_factory, src, dst):
    p4, p1 = both
    saved = {"p4": p4, "p1": p1}[src]
    sizes, sets = ({"data": 8}, PIPE1) if dst == "p1" else ({"data": 2, "pipe": 4}, PIPE4)
    step, restored = _restore(saved.run_dir, sizes, *sets)
    assert step == STEPS
    equal = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                         restored.params, saved.state.params)
    assert all(jax.tree.leaves(equal))
    spec = restored.params["blocks"]["block"]["mlp"]["w_gate_up"].sharding.spec
    assert (tuple(spec)[:1] == ("pipe",)) == (dst == "p4")
    # negative control: the other run's params differ (the equality above is not vacuous)
    other = {"p4": p1, "p1": p4}[src]
    diff = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                        restored.params, other.state.params)
    assert max(jax.tree.leaves(diff)) > 0
