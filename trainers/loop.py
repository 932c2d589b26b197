"""The training run, as one explicit function a researcher can read in one sitting and fork.

``train(cfg, task)`` builds the mesh and rules, creates the state directly sharded, resumes or starts,
then loops: batch -> train step -> guard and metrics -> eval -> checkpoint. It handles preemption,
crashes and bad steps. See docs/training.md and docs/faults.md.
"""

from __future__ import annotations

import contextlib
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
from trainers import pretrained, run_lock
from trainers.blame import InternalError, TaskError, describe_batch, first_batch
from trainers.checkpoint import Checkpointer, NoUsableCheckpointError, resolve_init_from
from trainers.config import Config, changes_since_last_run
from trainers.data import ExampleLoader, IterLoader, process_rows, to_global
from trainers.data.checks import check_batch_ids
from trainers.data.loader import agreed_eval_batches
from trainers.data.manifest import record as record_manifest
from trainers.data.packing import per_token
from trainers.faults import guard as guard_lib
from trainers.faults.guard import DivergenceError, Guard, GuardEvent
from trainers.faults.preemption import PreemptionWatcher
from trainers.local_sgd import LocalSGD, check_resume
from trainers.logger import RunLogger, write_config
from trainers.metrics import StepMeter, peak_flops_per_device
from trainers.setup import build
from trainers.state import ShardedState, TrainState
from trainers.step import eval_view, loss_and_metrics
from trainers.task import Task, lm_task
from trainers.trace import StepProfiler
from trainers.validate import check_batch

log = logging.getLogger(__name__)

BatchHook = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]
StepHook = Callable[[int], None]

__all__ = ["DivergenceError", "InternalError", "Result", "TaskError", "describe_batch", "evaluate", "train"]


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
    eval_metrics: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)


def evaluate(eval_step, view, source, batch_sharding, global_batch: int, n_batches: int) -> dict[str, float]:
    """Means over every real row of ``n_batches`` eval batches (-1: one pass over a finite source):
    the loss, its metrics and the task's eval metrics, aggregated over batches and processes. Every
    process runs the same number of eval steps, agreed before the loop (:func:`agreed_eval_batches`)."""
    block, n_blocks = process_rows(batch_sharding, global_batch)
    source = source.for_process(block, n_blocks) if hasattr(source, "for_process") else source  # packed documents
    sums = []
    for local, mask, padded in agreed_eval_batches(source, global_batch, n_batches, process_index=block,
                                                   process_count=n_blocks):
        sums.append(eval_step(view, to_global(local, batch_sharding, global_batch),
                              to_global(mask, batch_sharding, global_batch), padded))
    if not sums:
        raise ValueError("the eval data yielded no batch")
    totals = jax.tree.map(lambda *xs: float(np.sum(np.asarray(xs, np.float64))), *jax.device_get(sums))
    count = totals.pop("count")
    return per_token({k: v / count for k, v in totals.items()})


def _loader(source, global_batch: int, seed: int, batch_sharding) -> ExampleLoader | IterLoader:
    """Random-access sources of examples are batched here; anything else yields per-process batches
    (a source with ``for_process(block, n_blocks)`` is told which rows this process loads)."""
    if hasattr(source, "for_process"):
        return IterLoader(source.for_process(*process_rows(batch_sharding, global_batch)))
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        block, n_blocks = process_rows(batch_sharding, global_batch)
        return ExampleLoader(source, global_batch, seed, block, n_blocks)
    if not hasattr(source, "__iter__"):
        raise TypeError(f"task data is a {type(source).__name__}: give a grain MapDataset (or sequence) of examples, "
                        "a grain IterDataset or an iterable of per-process batches, or a function cfg -> one of these")
    return IterLoader(source)


def _check_pipelined(cfg: Config, task: Task) -> None:
    """A pipelined config needs a task whose loss pipelines its ``spmd.Stack``: say what is missing."""
    if not cfg.pipeline.enabled or task.pipelined:
        return
    model = spmd.sharding.abstract_module(lambda: task.model(nnx.Rngs(cfg.run.seed)))
    stacks = ["/".join(map(str, path)) or "<root>" for path, node in nnx.iter_graph(model) if isinstance(node, spmd.Stack)]
    found = (f"its model has spmd.Stack blocks at {stacks}: run them in the loss with "
             "spmd.pipeline.pipelined_loss(cfg.pipeline, stage_fn, head_fn, stack_state, head_state, x, targets) "
             "(see spmd.models.GPT.loss) and set Task(pipelined=True)") if stacks else \
        "its model has no spmd.Stack: put the repeated blocks in one, pipeline them in the loss, and set Task(pipelined=True)"
    raise ValueError(f"pipeline.schedule={cfg.pipeline.schedule!r} cannot run task {task.name!r}: {found}")


def _model_flops(task: Task, sharded: ShardedState, batch, global_batch: int) -> tuple[float, str]:
    """Model FLOPs per step (all devices) and where the number came from."""
    if task.flops_per_example is not None:
        return task.flops_per_example * global_batch, "the task's flops_per_example"
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (sharded.state, batch))

    def forward(state, batch):
        model = sharded.model.merge(state.params, state.model_state or {})
        model.train()
        return loss_and_metrics(task.loss(model, batch, nnx.Rngs(0)))[0]

    return 3 * spmd.inspection.jaxpr_flops(forward, *abstract), "counted from the loss's jaxpr (3 x forward matmul FLOPs)"


def _initial_state(cfg: Config, ckpt: Checkpointer, sharded: ShardedState, logger: RunLogger,
                   local: LocalSGD | None, fresh: Callable[[Any], TrainState]) -> tuple[int, TrainState, dict[str, Any]]:
    """``(start step, state, data state)``: resume, else ``init_from`` params, else ``fresh(None)``."""
    if not cfg.run.resume:
        if ckpt.all_steps():
            raise ValueError(
                f"run.resume=false but {ckpt.directory} already holds checkpoint steps {ckpt.all_steps()}; a fresh run "
                "would mix its checkpoints with them. Use another run.run_dir, delete them, or set run.resume=true"
            )
        restored = None
    else:
        newest = ckpt.newest_tree()  # written in the other mode or with another number of replica groups: refused
        if newest is not None:
            check_resume(newest[1], local.groups if local else None, newest[0])
        try:
            restored = ckpt.restore(local.abstract if local else sharded.abstract)
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
    if pretrained.hf_path(cfg.checkpoint.init_from) is not None:  # a Hugging Face folder, read shard by shard
        params = pretrained.init_params(cfg, sharded.abstract["params"])
        logger.message(f"initialised params from {cfg.checkpoint.init_from}; fresh optimizer, step 0")
        return 0, fresh(params), {}
    if cfg.checkpoint.init_from:
        directory, step = resolve_init_from(cfg.checkpoint.init_from)
        with Checkpointer(directory, cfg.checkpoint, read_only=True, layer_orders=sharded.layer_orders) as source:
            step, params = source.restore_params(sharded.abstract["params"], step=step)
        logger.message(f"initialised params from step {step} of {directory}; fresh optimizer, step 0")
        return 0, fresh(params), {}
    return 0, fresh(None), {}


def _loaded(task: Task, state: TrainState, params: Any) -> TrainState:
    """A fresh state with loaded params (``checkpoint.init_from``), as ``task.start`` completes it (DPO: its reference)."""
    state = state.replace(params=params)
    return state if task.start is None else task.start(state)


def _saved(state: TrainState, local: LocalSGD | None) -> TrainState:
    """What checkpoints hold: the state as ``create_state`` makes it, without the guard window
    (local SGD: every group's state with its window, the outer params and outer optimizer state)."""
    return state if local is not None else guard_lib.detach(state)


def _skipped(state: TrainState, local: LocalSGD | None) -> int:
    return local.skipped(state) if local is not None else int(jax.device_get(state.skipped))


def _next_batch(loader: ExampleLoader | IterLoader, skip: set[int]) -> tuple[int, dict[str, np.ndarray]]:
    """``(loader position, local batch)``, stepping over positions in ``skip`` (rolled-back bad batches)."""
    while loader.step in skip:
        next(loader)
    index = loader.step
    return index, next(loader)


def train(
    cfg: Config,
    task: Task | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    keep_state: bool = False,
    batch_hook: BatchHook | None = None,
    step_hook: StepHook | None = None,
) -> Result:
    """Run (or resume) ``task`` (default: the built-in GPT task of ``cfg``) as ``cfg`` describes; returns losses and
    a summary. One run per run directory: process 0 holds its lock throughout (:mod:`trainers.run_lock`)."""
    with run_lock.claim(cfg.run.directory, enabled=jax.process_index() == 0):
        return _train(cfg, task, mesh=mesh, keep_state=keep_state, batch_hook=batch_hook, step_hook=step_hook)


def _train(
    cfg: Config,
    task: Task | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    keep_state: bool = False,
    batch_hook: BatchHook | None = None,
    step_hook: StepHook | None = None,
) -> Result:
    """Run (or resume) ``task`` (default: the built-in GPT task of ``cfg``) as ``cfg`` describes; returns losses and a summary."""
    cfg = pretrained.resolve(cfg)  # checkpoint.init_from=hf:PATH: model.* from its config.json, tensors checked
    run, data_cfg = cfg.run, cfg.data
    task = lm_task(cfg) if task is None else task
    if not isinstance(task, Task):
        raise TypeError(f"task must be a trainers.Task, got {type(task).__name__}")
    _check_pipelined(cfg, task)
    mesh = mesh or cfg.mesh.build()  # the run's one mesh; everything below takes it as an argument
    meshes.distributed.check_consistent(meshes.distributed.fingerprint(mesh, cfg.to_dict()))  # no-op on one process
    rules = spmd.get_rules(cfg.rules)
    layout = task.checks(cfg, rules, dict(mesh.shape)) if task.checks is not None else []
    for issue in layout + check_batch(data_cfg.global_batch, run.grad_accum, rules, dict(mesh.shape)):
        raise ValueError(str(issue))  # before any state is built or compiled
    is_main = jax.process_index() == 0
    changes = changes_since_last_run(cfg)  # refuses what cannot be resumed before anything is written

    setup = build(cfg, task, mesh)
    sharded, stepped, local = setup.sharded, setup.stepped, setup.local
    train_step, eval_step, batch_sharding = setup.train_step, setup.eval_step, setup.batch_sharding
    if local is not None:
        fresh = lambda params: local.start(stepped.state if params is None else _loaded(task, stepped.state, params))
    else:
        fresh = lambda params: sharded.state if params is None else _loaded(task, sharded.state, params)
    eval_source = task.eval_source(cfg) if run.eval_batches else None

    train_data = _loader(task.train_source(cfg), data_cfg.global_batch, data_cfg.seed, batch_sharding)
    ckpt = Checkpointer(cfg.checkpoint.resolve_directory(run.directory), cfg.checkpoint,
                        layer_orders=sharded.layer_orders)  # steps hold stacks in natural layer order
    logger = RunLogger(run.directory, is_main=is_main, total_steps=run.steps,
                       use_tensorboard=run.tensorboard, progress=run.progress)
    try:
        start, state, data_state = _initial_state(cfg, ckpt, sharded, logger, local, fresh)
    except BaseException:
        ckpt.close()
        logger.close()
        raise
    if is_main:  # every check has passed, the checkpoint's included: record the config
        write_config(run.directory, cfg.to_dict())
        record_manifest(run.directory, cfg.data)  # the data by content, for the next resume (trainers.data.manifest)
    logger.resume_at(start)  # steps after `start` are logged again: their old records are dropped
    if "train" in data_state:
        train_data.set_state(data_state["train"])
    if local is None:  # local SGD keeps each group's window in the checkpointed state
        state = guard_lib.attach(state, data_state.get("guard"), run.spike_window, mesh)
    else:  # the one group's state the groups were made from is not used again (unless passed through)
        kept = {id(x) for x in jax.tree.leaves(state)}
        [x.delete() for x in jax.tree.leaves(stepped.state) if id(x) not in kept]
    skip_batches: set[int] = set(data_state.get("skip_batches", []))

    if changes:
        logger.message("config changed since this run directory's last run (the old one is kept as config.<n>.json): "
                       + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes))
    n_params = sum(x.size for x in jax.tree.leaves(sharded.state.params))
    logger.message(meshes.describe(mesh).splitlines()[0] + f"; rules {rules.name}; task {task.name}; {n_params:,} params")
    if any(d.source != "annotation" and d.kind == "Param" for d in sharded.model.decisions):
        logger.message("sharding of variables without logical dims:\n" + spmd.variables.format_decisions(
            [d for d in sharded.model.decisions if d.source != "annotation"]))
    peak, peak_source = peak_flops_per_device(mesh.devices.flat[0], dtype=getattr(cfg.model, "dtype", "float32"))
    meter, flops_source = None, ""
    step_hook = pretrained.sampling_hook(cfg, task, sharded, mesh, rules, logger, step_hook, lambda: state)  # run.sample_every
    guard = Guard(run.guard, spike_factor=run.spike_factor, spike_window=run.spike_window,
                  max_bad_steps=run.max_bad_steps, logger=logger)
    losses: dict[int, float] = {}
    eval_losses: dict[int, float] = {}
    eval_results: dict[int, dict[str, float]] = {}
    pending: list[tuple[int, int, dict[str, jax.Array]]] = []  # (step, batch index, metrics) not yet fetched
    preempted = False
    profiler = StepProfiler(run.directory, run.profile_steps, run.profile_processes, run.memory_profile_step)
    step = start
    skipped_before = _skipped(state, local)
    t_last, steps_since = time.perf_counter(), 0
    with PreemptionWatcher(check_every=run.preemption_check_every) as watcher:
        try:
            while step < run.steps:
                index, batch = _next_batch(train_data, skip_batches)
                if batch_hook is not None:
                    batch = batch_hook(index, batch)
                if task.vocab_size is not None:  # ids outside the vocab are refused before they reach the model
                    check_batch_ids(batch, task.vocab_size, task.token_keys, where=f"task {task.name!r}, batch {index}")
                batch = to_global(batch, batch_sharding, data_cfg.global_batch)
                if meter is None:
                    with first_batch(task.name, batch, "tracing the loss"):
                        flops, flops_source = _model_flops(task, sharded, batch, data_cfg.global_batch)
                    per_example = task.tokens_per_example or 1
                    meter = StepMeter(tokens_per_step=data_cfg.global_batch * per_example, model_flops_per_step=flops,
                                      n_devices=mesh.size, peak_per_device=peak)
                    logger.message(f"MFU from {flops:.3e} model FLOPs per step, {flops_source}; peak {peak_source}")
                with first_batch(task.name, batch, "the train step") if step == start else contextlib.nullcontext():
                    with profiler.before(step + 1):  # run.profile_steps
                        state, metrics = train_step(state, batch)  # contract errors surface at its trace, before any compile
                step += 1
                if local is not None and local.due(step):
                    state = local.outer_step(state)  # groups synchronise: one all-reduce over data
                profiler.after(step, metrics)
                steps_since += 1
                pending.append((step, index, metrics))
                if step_hook is not None:
                    step_hook(step)
                stop = watcher.should_stop(step)
                save = ckpt.should_save(step, force=stop or step == run.steps)
                log_now = step % run.log_every == 0 or step == run.steps or step == start + 1
                if log_now or save or guard_lib.peek_bad(pending):  # fetch flags and metrics; the guard acts
                    # before anything is saved, and within 3 steps of a bad one
                    fetched = (local.fetch if local else jax.device_get)([m for _, _, m in pending])
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
                        restored = ckpt.restore(local.abstract if local else sharded.abstract)
                        if restored is None:
                            raise DivergenceError(f"run.guard='rollback' at step {step}: no checkpoint to roll back to "
                                                  f"in {ckpt.directory}; bad batches {sorted(bad)}")
                        at, (step, state, data_state) = step, restored
                        train_data.set_state(data_state["train"])
                        if local is None:
                            state = guard_lib.attach(state, data_state.get("guard"), run.spike_window, mesh)
                        logger.resume_at(step, keep_splits=(guard_lib.SPLIT_PREFIX,))  # the events stay
                        guard.rolled_back(step, skip_batches, at)
                        t_last, steps_since = time.perf_counter(), 0
                        continue
                    if log_now:
                        now = time.perf_counter()
                        timing = meter.record(now - t_last, steps=steps_since)
                        t_last, steps_since = now, 0
                        values = {k: float(v) for k, v in fetched[-1].items() if k not in guard_lib.FLAG_KEYS}
                        if not task.tokens_per_example:
                            timing["examples_per_s"] = timing.pop("tokens_per_s")
                        values.update(timing, skipped=float(_skipped(state, local)))
                        if local is not None:
                            values["data_bytes"] = float(local.bytes_sent)
                        losses[step] = values["loss"]
                        logger.log(step, values)
                    if error is not None:
                        raise error
                if eval_source is not None and (step % run.eval_every == 0 or step == run.steps):
                    results = evaluate(eval_step, (local.eval_view(state) if local else eval_view(state)), eval_source, batch_sharding, data_cfg.global_batch,
                                       run.eval_batches)
                    eval_losses[step], eval_results[step] = results["loss"], results
                    if "ce" in results:  # a language model's cross-entropy: perplexity too
                        results = {**results, "perplexity": math.exp(min(results["ce"], 50.0))}
                    logger.log(step, results, prefix="eval")
                    t_last = time.perf_counter()  # eval time is not step time
                if save:
                    data_state = {"train": train_data.get_state(), "skip_batches": sorted(skip_batches)}
                    if local is None:
                        data_state["guard"] = guard_lib.window_to_json(state.guard)
                    ckpt.save(step, _saved(state, local), data_state, force=True)  # due: decided above
                if stop:
                    ckpt.wait()
                    preempted = True
                    logger.message(f"stopping at step {step} ({watcher.reason}): checkpoint step {step} is committed in "
                                   f"{ckpt.directory}; run the same command again to resume")
                    break
            ckpt.wait()
        finally:
            profiler.close()
            ckpt.close()
            logger.close()
    if not preempted:
        guard_lib.check_learned(start, step, _skipped(state, local) - skipped_before, guard.events, run.guard)
    summary: dict[str, Any] = meter.summary() if meter is not None else {}
    if not task.tokens_per_example and "tokens_per_s" in summary:
        summary["examples_per_s"] = summary.pop("tokens_per_s")
    summary = summary | {"peak_flops_per_device": peak, "peak_source": peak_source,
                                                                "flops_source": flops_source}
    if local is not None:
        summary |= local.summary(step - start)
    return Result(run.directory, start, step, losses, eval_losses, _skipped(state, local), summary,
                  _saved(state, local) if keep_state else None, preempted, list(guard.events), eval_results)
