"""The task seam: any model, loss and data through ``train(cfg, task)``, and clear errors at its edges."""

import dataclasses
import json
import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.hlo_checks import unanchored_collectives
from test_variables import Plain

import meshes
import spmd
import trainers.setup as setup_lib
from trainers import Config, Task, lm_task, load_task, override, recipe, train
from trainers.logger import read_metrics
from trainers.loop import TaskError


def _examples(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    return [{"x": x[i], "y": np.int32(int(x[i, 0] > 0) + 2 * int(x[i, 1] > 0))} for i in range(n)]


def _loss(model, batch, rngs):  # a scalar loss: no metrics dict needed
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


TASK = Task(model=lambda rngs: Plain(rngs, rate=0.1), loss=_loss, data=_examples(), eval_data=_examples(20, seed=1),
            eval_metrics={"accuracy": lambda m, b: m(b["x"]).argmax(-1) == b["y"]}, name="plain")


def _cfg(run_dir, steps=4, *sets):
    return override(Config(), [f"run.run_dir={run_dir}", f"run.steps={steps}", "lr.warmup_steps=1", "mesh.axes=data=2,fsdp=2,tensor=2", "data.global_batch=16",
                               "run.progress=false", "run.tensorboard=false", "run.log_every=1", "run.eval_every=2",
                               "run.eval_batches=-1", "checkpoint.every_steps=2", "checkpoint.async_save=false", *sets])


def test_a_user_task_trains_evaluates_and_logs(tmp_path):
    result = train(_cfg(tmp_path), TASK)
    assert sorted(result.losses) == [1, 2, 3, 4] and sorted(result.eval_metrics) == [2, 4]
    assert 0.0 <= result.eval_metrics[4]["accuracy"] <= 1.0
    rows = read_metrics(str(tmp_path))
    assert any(r.get("split") == "eval" and "accuracy" in r for r in rows) or \
        any("eval/accuracy" in json.dumps(r) for r in rows)
    text = open(os.path.join(tmp_path, "metrics.jsonl")).read() + "".join(
        open(os.path.join(tmp_path, f)).read() for f in os.listdir(tmp_path) if f.endswith(".log"))
    assert "examples_per_s" in text
    assert "flops_source" in result.summary and "jaxpr" in result.summary["flops_source"]


def test_per_process_batches_from_a_grain_iter_dataset(tmp_path):
    ds = grain.MapDataset.source(_examples()).repeat().batch(16).to_iter_dataset()
    whole = train(_cfg(tmp_path / "a", 4, "run.eval_batches=0"), dataclasses.replace(TASK, data=ds))
    train(_cfg(tmp_path / "b", 2, "run.eval_batches=0"), dataclasses.replace(TASK, data=ds))
    resumed = train(_cfg(tmp_path / "b", 4, "run.eval_batches=0"), dataclasses.replace(TASK, data=ds))
    assert resumed.start_step == 2
    assert [resumed.losses[s] for s in (3, 4)] == [whole.losses[s] for s in (3, 4)]  # iterator position restored


def test_contract_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(TypeError, match="Task.model must be callable"):
        Task(model=None, loss=_loss, data=[])
    with pytest.raises(TypeError, match="one value per example|eval_metrics must map"):
        Task(model=TASK.model, loss=_loss, data=[], eval_metrics={"acc": 1})
    with pytest.raises(TypeError, match="give a grain MapDataset"):
        train(_cfg(tmp_path), dataclasses.replace(TASK, data=lambda cfg: 42))
    bad_batch = [{"x": np.zeros((3,), np.float32), "y": np.int32(0)}] * 32
    with pytest.raises(TaskError, match=r"task 'plain'.*first batch \{'x': float32\[16, 3\], 'y': int32\[16\]\}"):
        train(_cfg(tmp_path / "shape", 1), dataclasses.replace(TASK, data=bad_batch))
    renamed = [{"image": e["x"], "y": e["y"]} for e in _examples()]
    with pytest.raises(TaskError, match=r"KeyError: 'x'.*loss\(model, batch, rngs\)"):
        train(_cfg(tmp_path / "key", 1), dataclasses.replace(TASK, data=renamed))


def test_pipelined_config_names_what_the_task_lacks(tmp_path):
    cfg = recipe("gpt-small-pp", tiny=True)
    with pytest.raises(ValueError, match=r"spmd.Stack blocks at \['blocks'\]"):
        train(cfg, dataclasses.replace(lm_task(cfg), pipelined=False))
    plain = override(cfg, [f"run.run_dir={tmp_path}"])
    with pytest.raises(ValueError, match="has no spmd.Stack"):
        train(plain, TASK)


def test_load_task_errors():
    assert load_task("test_task:TASK") is TASK
    with pytest.raises(ValueError, match="package.module:attribute"):
        load_task("test_task")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_task("no_such_module:task")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_task("test_task:nope")
    with pytest.raises(ValueError, match="not a trainers.Task"):
        load_task("test_task:_examples")


# ----------------------------------------------------------------------------- a user model, pipelined
class _Block(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.lin = nnx.Linear(16, 16, kernel_init=init, bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
                              rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class _StackLM(nnx.Module):
    """A user's own LM: embedding, an spmd.Stack of 4 residual blocks, a head."""

    def __init__(self, rngs):
        self.embed = nnx.Param(nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))(rngs.params(), (32, 16)))
        self.blocks = spmd.Stack(_Block, 4, rngs=rngs)
        self.head = nnx.Param(nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"))(rngs.params(), (16, 32)))


def _onehot_ce(logits, targets):
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1]), -1))


def _stack_lm_task(pipeline):
    def loss(model, batch, rngs):
        x = jnp.take(model.embed[...], batch["inputs"], axis=0)
        apply, stack_state = model.blocks.split()

        def head_fn(head, y, targets):
            return _onehot_ce(y @ head[...], targets), {}

        return spmd.pipeline.pipelined_loss(pipeline, apply, head_fn, stack_state, model.head, x, batch["targets"])

    tokens = np.random.default_rng(0).integers(0, 32, size=(64, 9)).astype(np.int32)
    data = [{"inputs": t[:-1], "targets": t[1:]} for t in tokens]
    return Task(model=_StackLM, loss=loss, data=data, name="stack-lm", pipelined=True)


def test_a_user_stack_model_runs_as_a_pipeline(tmp_path):
    pipe = spmd.pipeline.PipelineConfig("gpipe", microbatches=2)
    sets = ["run.eval_batches=0", "checkpoint.every_steps=100", "optimizer.name=sgd", "rules=dp"]
    piped = train(override(_cfg(tmp_path / "pp", 3, *sets), ["mesh.axes=data=4,pipe=2", "pipeline.schedule=gpipe",
                                                              "pipeline.microbatches=2"]), _stack_lm_task(pipe))
    plain = train(_cfg(tmp_path / "one", 3, *sets, "mesh.axes=data=1"), _stack_lm_task(pipe),
                  mesh=meshes.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    assert piped.losses == pytest.approx(plain.losses, rel=1e-5)
    assert piped.losses[3] != pytest.approx(piped.losses[1], rel=1e-3)  # it trains: the comparison is not vacuous
    # every collective is anchored to the step's data: GPipe's loss mean over data was a psum of a constant in
    # the backward, which an executable loaded back from the compile cache ran on either side of the loop's
    # permutes on different devices, until XLA aborted the waiting process
    built = setup_lib.build(override(_cfg(tmp_path / "pp2", 3, *sets), ["mesh.axes=data=4,pipe=2", "pipeline.schedule=gpipe",
                                                                         "pipeline.microbatches=2"]), _stack_lm_task(pipe),
                            abstract=True)
    text = built.train_step.lower(built.stepped.abstract, built.abstract_batch()).compile().as_text()
    assert "collective-permute" in text and not unanchored_collectives(text), unanchored_collectives(text)
