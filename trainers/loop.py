"""The training run, as one explicit function a researcher can read in one sitting and fork.

``train(cfg)`` builds the mesh and rule set, creates the state directly sharded, starts from the
newest valid checkpoint (state, data position and RNG) or from ``checkpoint.init_from`` (params
only) or from scratch, then loops: next global batch -> train step -> guard and metrics (loss,
grad norm, LR, tokens/s, step time, MFU) -> eval every N steps -> checkpoint every N steps and at
the end. The same code runs on one CPU, a GPU node and every host of a TPU pod: each process loads
only its rows of the global batch, and only process 0 logs.

Faults the loop handles:

- **Preemption** (SIGTERM, SIGINT): handlers are installed for the duration of ``train()`` only; the
  step in flight finishes, all processes agree on the step (``trainers.preemption``), a checkpoint
  of it is written and committed, and ``train()`` returns with ``preempted=True``.
- **Crashes** (SIGKILL, power loss): the next start resumes from the newest *complete* checkpoint
  (``trainers.checkpoint`` validates steps and falls back); it never silently starts from scratch
  when steps exist (``checkpoint.allow_fresh_start`` opts in), and ``run.resume=false`` refuses a
  directory that already holds steps.
- **Bad steps** (non-finite or spiking loss / grad norm): the update is not applied in the step;
  ``run.guard`` decides what the host does (skip, roll back to a checkpoint past the bad batches,
  or stop); see ``trainers.guard``. Per-step flags are fetched when metrics are (log steps) and
  before every checkpoint save, so the loop never blocks on the device otherwise.

Hooks for tests and research: ``batch_hook(index, local_batch) -> local_batch`` sees every batch
before it is placed on devices (``index`` is the loader position); ``step_hook(step)`` runs after each
step is dispatched.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, flops_per_step
from trainers import guard as guard_lib
from trainers.checkpoint import Checkpointer, NoUsableCheckpointError, resolve_init_from
from trainers.config import Config
from trainers.data import Loader, make_loader, to_global
from trainers.guard import DivergenceError, Guard, GuardEvent
from trainers.logger import RunLogger, write_config
from trainers.metrics import StepMeter, peak_flops_per_device
from trainers.optim import make_optimizer
from trainers.preemption import PreemptionWatcher
from trainers.schedules import make_schedule
from trainers.state import Sharded, State, create_state
from trainers.step import lm_loss_fn, make_eval_step, make_train_step

log = logging.getLogger(__name__)

BatchHook = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]
StepHook = Callable[[int], None]

__all__ = ["DivergenceError", "Result", "evaluate", "train"]


@dataclasses.dataclass
class Result:
    """What a run leaves behind for its caller (notebooks, tests, scripts).

    ``final_step`` is the step the run stopped at: ``run.steps``, or earlier when ``preempted``.
    """

    run_dir: str
    start_step: int
    final_step: int
    losses: dict[int, float]
    eval_losses: dict[int, float]
    skipped: int
    summary: dict[str, float]
    state: Any = None
    preempted: bool = False
    guard_events: list[GuardEvent] = dataclasses.field(default_factory=list)


def evaluate(eval_step, params, loader, batch_sharding, global_batch: int, n_batches: int) -> float:
    """Mean validation loss over the next ``n_batches`` batches of ``loader``."""
    losses = [eval_step(params, to_global(next(loader), batch_sharding, global_batch)) for _ in range(n_batches)]
    return float(np.mean(jax.device_get(losses)))


def _initial_state(cfg: Config, ckpt: Checkpointer, sharded: Sharded, logger: RunLogger) -> tuple[int, State, dict[str, Any]]:
    """``(start step, state, data state)``: resume, else ``init_from`` params, else fresh."""
    if not cfg.run.resume:
        if ckpt.all_steps():
            raise ValueError(
                f"run.resume=false but {ckpt.directory} already holds checkpoint steps {ckpt.all_steps()}; a fresh run "
                "would mix its checkpoints with them. Use another run.run_dir, delete them, or set run.resume=true"
            )
        restored = None
    else:
        try:
            restored = ckpt.restore(sharded.abstract)
        except NoUsableCheckpointError as exc:
            if not cfg.checkpoint.allow_fresh_start:
                raise
            text = f"no usable checkpoint; starting from scratch (checkpoint.allow_fresh_start=true): {exc}"
            log.warning("%s", text)
            logger.message(text)
            restored = None
    if restored is not None:
        start, state, data_state = restored
        logger.message(f"resumed from step {start} ({ckpt.directory})")
        return start, state, data_state
    if cfg.checkpoint.init_from:
        directory, step = resolve_init_from(cfg.checkpoint.init_from)
        with Checkpointer(directory, cfg.checkpoint, read_only=True) as source:
            step, params = source.restore_params(sharded.abstract["params"], step=step)
        logger.message(f"initialised params from step {step} of {directory}; fresh optimizer, step 0")
        return 0, {**sharded.state, "params": params}, {}
    return 0, sharded.state, {}


def _without_window(state: State) -> State:
    """The train state as ``create_state`` makes it (what checkpoints hold): without the guard window."""
    return {k: v for k, v in state.items() if k != "guard"}


def _next_batch(loader: Loader, skip: set[int]) -> tuple[int, dict[str, np.ndarray]]:
    """``(loader position, local batch)``, stepping over positions in ``skip`` (rolled-back bad batches)."""
    while loader.step in skip:
        next(loader)
    index = loader.step
    return index, next(loader)


def train(
    cfg: Config,
    *,
    mesh: jax.sharding.Mesh | None = None,
    keep_state: bool = False,
    batch_hook: BatchHook | None = None,
    step_hook: StepHook | None = None,
) -> Result:
    """Run (or resume) the training described by ``cfg``; returns losses and a summary."""
    run, data_cfg = cfg.run, cfg.data
    mesh = mesh or meshes.make_mesh(meshes.MeshSpec.of(cfg.mesh.axes, cfg.mesh.dcn or None), axis_type=cfg.mesh.axis_type)
    meshes.distributed.check_consistent(meshes.distributed.fingerprint(mesh, cfg.to_dict()))  # no-op on one process
    rules = spmd.get_rules(cfg.rules)
    is_main = jax.process_index() == 0
    if is_main:
        write_config(run.directory, cfg.to_dict())

    schedule = make_schedule(cfg.schedule)
    tx = make_optimizer(cfg.optimizer, schedule)
    sharded = create_state(lambda: GPT(cfg.model, rngs=nnx.Rngs(run.seed)), tx, rules, mesh, seed=run.seed)
    stepped = guard_lib.add_window(sharded, run.spike_window, mesh)  # what the step carries: state + guard window
    batch_sharding = spmd.batch_sharding(rules, mesh)
    loss_fn = lm_loss_fn(run.z_loss, cfg.pipeline)
    train_step = make_train_step(stepped, tx, rules, mesh, batch_sharding, schedule=schedule,
                                 grad_accum=run.grad_accum, loss_fn=loss_fn, spike_factor=run.spike_factor)
    eval_step = make_eval_step(sharded, rules, mesh, batch_sharding, loss_fn=loss_fn)

    train_data = make_loader(data_cfg, "train", sharding=batch_sharding)
    eval_data = make_loader(data_cfg, "validation", sharding=batch_sharding, shuffle=False) if run.eval_batches else None
    ckpt = Checkpointer(cfg.checkpoint.resolve_directory(run.directory), cfg.checkpoint)
    logger = RunLogger(run.directory, is_main=is_main, total_steps=run.steps,
                       use_tensorboard=run.tensorboard, progress=run.progress)
    try:
        start, state, data_state = _initial_state(cfg, ckpt, sharded, logger)
    except BaseException:
        ckpt.close()
        logger.close()
        raise
    if "train" in data_state:
        train_data.set_state(data_state["train"])
    state = {**state, "guard": guard_lib.window_from_json(data_state.get("guard"), run.spike_window, mesh)}
    skip_batches: set[int] = set(data_state.get("skip_batches", []))

    logger.message(meshes.describe(mesh).splitlines()[0] + f"; rules {rules.name}; "
                   f"{spmd.models.param_count(cfg.model):,} params")
    peak, peak_source = peak_flops_per_device(mesh.devices.flat[0], dtype=cfg.model.dtype)
    tokens = data_cfg.global_batch * data_cfg.seq_len
    meter = StepMeter(tokens_per_step=tokens, model_flops_per_step=flops_per_step(cfg.model, data_cfg.global_batch, data_cfg.seq_len),
                      n_devices=mesh.size, peak_per_device=peak)
    guard = Guard(run.guard, spike_factor=run.spike_factor, spike_window=run.spike_window,
                  max_bad_steps=run.max_bad_steps, logger=logger)
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    pending: list[tuple[int, int, dict[str, jax.Array]]] = []  # (step, batch index, metrics) not yet fetched
    preempted = False
    step = start
    t_last, steps_since = time.perf_counter(), 0
    with PreemptionWatcher(check_every=run.preemption_check_every) as watcher:
        try:
            while step < run.steps:
                index, batch = _next_batch(train_data, skip_batches)
                if batch_hook is not None:
                    batch = batch_hook(index, batch)
                state, metrics = train_step(state, to_global(batch, batch_sharding, data_cfg.global_batch))
                step += 1
                steps_since += 1
                pending.append((step, index, metrics))
                if step_hook is not None:
                    step_hook(step)
                stop = watcher.should_stop(step)
                save = step % cfg.checkpoint.every_steps == 0 or step == run.steps or stop
                log_now = step % run.log_every == 0 or step == run.steps or step == start + 1
                if log_now or save:  # fetch flags and metrics; the guard acts before anything is saved
                    fetched = jax.device_get([m for _, _, m in pending])
                    bad, error = [], None
                    try:
                        for (s, i, _), flags in zip(pending, fetched):
                            if guard.observe(s, i, flags, last_checkpoint=lambda: ckpt.valid_steps()[-1:]):
                                bad.append(i)
                    except DivergenceError as exc:  # raised after this step's metrics are logged
                        error = exc
                    pending.clear()
                    if bad and error is None and run.guard == "rollback":
                        skip_batches.update(bad)
                        ckpt.wait()
                        restored = ckpt.restore(sharded.abstract)
                        if restored is None:
                            raise DivergenceError(f"run.guard='rollback' at step {step}: no checkpoint to roll back to "
                                                  f"in {ckpt.directory}; bad batches {sorted(bad)}")
                        at, (step, state, data_state) = step, restored
                        train_data.set_state(data_state["train"])
                        state = {**state, "guard": guard_lib.window_from_json(data_state.get("guard"), run.spike_window, mesh)}
                        guard.rolled_back(step, skip_batches, at)
                        t_last, steps_since = time.perf_counter(), 0
                        continue
                    if log_now:
                        now = time.perf_counter()
                        timing = meter.record(now - t_last, steps=steps_since)
                        t_last, steps_since = now, 0
                        values = {k: float(v) for k, v in fetched[-1].items() if k not in guard_lib.FLAG_KEYS}
                        values.update(timing, skipped=float(jax.device_get(state["skipped"])))
                        losses[step] = values["loss"]
                        logger.log(step, values)
                    if error is not None:
                        raise error
                if eval_data is not None and (step % run.eval_every == 0 or step == run.steps):
                    eval_loss = evaluate(eval_step, state["params"], eval_data, batch_sharding, data_cfg.global_batch, run.eval_batches)
                    eval_data = make_loader(data_cfg, "validation", sharding=batch_sharding, shuffle=False)  # same batches every eval
                    eval_losses[step] = eval_loss
                    logger.log(step, {"loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50.0))}, prefix="eval")
                    t_last = time.perf_counter()  # eval time is not step time
                if save:
                    data_state = {"train": train_data.get_state(), "skip_batches": sorted(skip_batches),
                                  "guard": guard_lib.window_to_json(state["guard"])}
                    ckpt.save(step, _without_window(state), data_state, force=stop or step == run.steps)
                if stop:
                    ckpt.wait()
                    preempted = True
                    logger.message(f"stopping at step {step} ({watcher.reason}): checkpoint step {step} is committed in "
                                   f"{ckpt.directory}; run the same command again to resume")
                    break
            ckpt.wait()
        finally:
            ckpt.close()
            logger.close()
    summary = meter.summary() | {"peak_flops_per_device": peak, "peak_source": peak_source}
    skipped = int(jax.device_get(state["skipped"]))
    return Result(run.directory, start, step, losses, eval_losses, skipped, summary,
                  _without_window(state) if keep_state else None, preempted, list(guard.events))
