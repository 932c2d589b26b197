"""The training run, as one explicit function a researcher can read in one sitting and fork.

``train(cfg)`` builds the mesh and rule set, creates the state directly sharded, resumes from
the newest valid checkpoint (state, data position and RNG), then loops: next global batch ->
train step -> metrics (loss, grad norm, LR, tokens/s, step time, MFU) -> eval every N steps ->
checkpoint every N steps and at the end. The same code runs on one CPU, a GPU node and every host
of a TPU pod: each process loads only its rows of the global batch, and only process 0 logs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, flops_per_step
from trainers.checkpoint import Checkpointer
from trainers.config import Config
from trainers.data import make_loader, to_global
from trainers.logger import RunLogger, write_config
from trainers.metrics import StepMeter, peak_flops_per_device
from trainers.optim import make_optimizer
from trainers.schedules import make_schedule
from trainers.state import create_state
from trainers.step import lm_loss_fn, make_eval_step, make_train_step

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


@dataclasses.dataclass
class Result:
    """What a run leaves behind for its caller (notebooks, tests, scripts)."""

    run_dir: str
    start_step: int
    final_step: int
    losses: dict[int, float]
    eval_losses: dict[int, float]
    skipped: int
    summary: dict[str, float]
    state: Any = None


def evaluate(eval_step, params, loader, batch_sharding, global_batch: int, n_batches: int) -> float:
    """Mean validation loss over the next ``n_batches`` batches of ``loader``."""
    losses = [eval_step(params, to_global(next(loader), batch_sharding, global_batch)) for _ in range(n_batches)]
    return float(np.mean(jax.device_get(losses)))


def train(cfg: Config, *, mesh: jax.sharding.Mesh | None = None, keep_state: bool = False) -> Result:
    """Run (or resume) the training described by ``cfg``; returns losses and a summary."""
    run, data_cfg = cfg.run, cfg.data
    mesh = mesh or meshes.make_mesh(meshes.MeshSpec.of(cfg.mesh.axes, cfg.mesh.dcn or None), axis_type=cfg.mesh.axis_type)
    rules = spmd.get_rules(cfg.rules)
    is_main = jax.process_index() == 0
    if is_main:
        write_config(run.directory, cfg.to_dict())

    schedule = make_schedule(cfg.schedule)
    tx = make_optimizer(cfg.optimizer, schedule)
    sharded = create_state(lambda: GPT(cfg.model, rngs=nnx.Rngs(run.seed)), tx, rules, mesh, seed=run.seed)
    batch_sharding = spmd.batch_sharding(rules, mesh)
    loss_fn = lm_loss_fn(run.z_loss)
    train_step = make_train_step(sharded, tx, rules, mesh, batch_sharding, schedule=schedule,
                                 grad_accum=run.grad_accum, loss_fn=loss_fn)
    eval_step = make_eval_step(sharded, rules, mesh, batch_sharding, loss_fn=loss_fn)

    train_data = make_loader(data_cfg, "train")
    eval_data = make_loader(data_cfg, "validation", shuffle=False) if run.eval_batches else None
    ckpt = Checkpointer(cfg.checkpoint.resolve_directory(run.directory), cfg.checkpoint)
    state, start = sharded.state, 0
    restored = ckpt.restore(sharded.abstract) if run.resume else None
    if restored is not None:
        start, state, data_state = restored
        train_data.set_state(data_state["train"])

    logger = RunLogger(run.directory, is_main=is_main, total_steps=run.steps,
                       use_tensorboard=run.tensorboard, progress=run.progress)
    if restored is not None:
        logger.message(f"resumed from step {start} ({ckpt.directory})")
    logger.message(meshes.describe(mesh).splitlines()[0] + f"; rules {rules.name}; "
                   f"{spmd.models.param_count(cfg.model):,} params")
    peak, peak_source = peak_flops_per_device(mesh.devices.flat[0], dtype=cfg.model.dtype)
    tokens = data_cfg.global_batch * data_cfg.seq_len
    meter = StepMeter(tokens_per_step=tokens, model_flops_per_step=flops_per_step(cfg.model, data_cfg.global_batch, data_cfg.seq_len),
                      n_devices=mesh.size, peak_per_device=peak)
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    t_last, steps_since = time.perf_counter(), 0
    try:
        for step in range(start, run.steps):
            batch = to_global(next(train_data), batch_sharding, data_cfg.global_batch)
            state, metrics = train_step(state, batch)
            steps_since += 1
            done = step + 1
            if done % run.log_every == 0 or done == run.steps or done == start + 1:
                metrics, streak = jax.device_get((metrics, state["bad_streak"]))
                now = time.perf_counter()
                timing = meter.record(now - t_last, steps=steps_since)
                t_last, steps_since = now, 0
                values = {k: float(v) for k, v in metrics.items() if k != "finite"}
                values.update(timing, skipped=float(state["skipped"]))
                losses[done] = values["loss"]
                logger.log(done, values)
                if int(streak) >= run.max_bad_steps:
                    raise DivergenceError(
                        f"{int(streak)} consecutive steps ending at step {done} had a non-finite loss or gradient norm "
                        f"(limit run.max_bad_steps={run.max_bad_steps}); last good checkpoint: {ckpt.valid_steps()[-1:] or 'none'}"
                    )
            if eval_data is not None and (done % run.eval_every == 0 or done == run.steps):
                eval_loss = evaluate(eval_step, state["params"], eval_data, batch_sharding, data_cfg.global_batch, run.eval_batches)
                eval_data = make_loader(data_cfg, "validation", shuffle=False)  # same batches every eval
                eval_losses[done] = eval_loss
                logger.log(done, {"loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0))}, prefix="eval")
                t_last = time.perf_counter()  # eval time is not step time
            if done % cfg.checkpoint.every_steps == 0 or done == run.steps:
                ckpt.save(done, state, {"train": train_data.get_state()}, force=done == run.steps)
        ckpt.wait()
    finally:
        ckpt.close()
        logger.close()
    summary = meter.summary() | {"peak_flops_per_device": peak, "peak_source": peak_source}
    skipped = int(jax.device_get(state["skipped"]))
    return Result(run.directory, start, run.steps, losses, eval_losses, skipped, summary, state if keep_state else None)
