"""The training run: ``train(cfg, task)`` = ``drive(build(cfg, task, mesh))``, a short driver a researcher
can read in one sitting and fork.

:func:`trainers.setup.build` checks the config and makes the state and steps (:class:`trainers.setup.Run`);
:func:`drive` starts it (a checkpoint, ``init_from`` params, or fresh) and loops: batch -> train step
(through the run's strategy: plain, or local SGD) -> guard and log -> eval -> checkpoint. It handles
preemption, crashes and bad steps. See docs/training.md, docs/faults.md and docs/architecture.md.
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
from trainers.checkpoint import Checkpointer
from trainers.config import Config, changes_since_last_run
from trainers.data import ExampleLoader, IterLoader, process_rows, to_global
from trainers.data.checks import check_batch_ids
from trainers.data.loader import agreed_eval_batches
from trainers.data.manifest import record as record_manifest
from trainers.data.packing import per_token
from trainers.faults import guard as guard_lib
from trainers.faults.guard import DivergenceError, Guard, GuardEvent
from trainers.faults.preemption import PreemptionWatcher
from trainers.logger import RunLogger, write_config
from trainers.metrics import StepMeter, peak_flops_per_device
from trainers.setup import Run, build
from trainers.state import ShardedState
from trainers.step import loss_and_metrics
from trainers.strategy import LocalSteps, RunState
from trainers.task import Task
from trainers.trace import StepProfiler

log = logging.getLogger(__name__)

BatchHook = Callable[[int, dict[str, np.ndarray]], dict[str, np.ndarray]]
StepHook = Callable[[int], None]

__all__ = ["DivergenceError", "InternalError", "Result", "TaskError", "describe_batch", "drive", "evaluate", "train"]


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
        jax.block_until_ready(sums[-1])  # one eval step in flight (XLA:CPU deadlocked overlapping pipelined ones)
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




def _next_batch(loader: ExampleLoader | IterLoader, skip: frozenset[int]) -> tuple[int, dict[str, np.ndarray]]:
    """``(loader position, local batch)``, stepping over positions in ``skip`` (rolled-back bad batches)."""
    while loader.step in skip:
        next(loader)
    index = loader.step
    return index, next(loader)


class _Progress:
    """The guard and the log. A step's metrics are fetched at log steps, before a save and within 3 steps
    of a bad one (:func:`trainers.faults.guard.peek_bad`); the guard acts on them before anything is
    saved; at log steps they are logged with the step time, tokens/s and MFU."""

    def __init__(self, run: Run, logger: RunLogger, state: RunState) -> None:
        self.run, self.logger, self.start = run, logger, state.step
        cfg = run.cfg.run
        self.guard = Guard(cfg.guard, spike_factor=cfg.spike_factor, spike_window=cfg.spike_window,
                           max_bad_steps=cfg.max_bad_steps, logger=logger)
        self.peak, self.peak_source = peak_flops_per_device(run.mesh.devices.flat[0],
                                                            dtype=getattr(run.cfg.model, "dtype", "float32"))
        self.meter: StepMeter | None = None
        self.flops_source = ""
        self.pending: list[tuple[int, int, dict[str, jax.Array]]] = []  # (step, batch index, metrics) not yet fetched
        self.losses: dict[int, float] = {}
        self.eval_losses: dict[int, float] = {}
        self.eval_results: dict[int, dict[str, float]] = {}
        self.skipped_before = run.strategy.skipped(state.train)
        self.restart_clock()

    def restart_clock(self) -> None:
        self.t_last, self.since = time.perf_counter(), 0

    def first(self, batch: dict[str, jax.Array]) -> None:
        """Count the model FLOPs on the first batch: the MFU's numerator."""
        if self.meter is not None:
            return
        task, global_batch = self.run.task, self.run.cfg.data.global_batch
        with first_batch(task.name, batch, "tracing the loss"):
            flops, self.flops_source = _model_flops(task, self.run.sharded, batch, global_batch)
        self.meter = StepMeter(tokens_per_step=global_batch * (task.tokens_per_example or 1), model_flops_per_step=flops,
                               n_devices=self.run.mesh.size, peak_per_device=self.peak)
        self.logger.message(f"MFU from {flops:.3e} model FLOPs per step, {self.flops_source}; peak {self.peak_source}")

    def stepped(self, step: int, index: int, metrics: dict[str, jax.Array]) -> None:
        self.since += 1
        self.pending.append((step, index, metrics))

    def check(self, state: RunState, save: bool, ckpt: Checkpointer) -> list[int]:
        """Fetch and judge what is due; log at log steps. Returns the batches to roll back over (``run.guard=
        rollback``); a DivergenceError is raised after the step's metrics are logged."""
        step, cfg, strategy = state.step, self.run.cfg.run, self.run.strategy
        log_now = step % cfg.log_every == 0 or step == cfg.steps or step == self.start + 1
        if not (log_now or save or guard_lib.peek_bad(self.pending)):
            return []
        fetched = strategy.fetch([m for _, _, m in self.pending])
        bad, error = [], None
        try:
            for (s, i, _), flags in zip(self.pending, fetched):
                if self.guard.observe(s, i, flags, last_checkpoint=lambda: ckpt.valid_steps()[-1:]):
                    bad.append(i)
        except DivergenceError as exc:
            error = exc
        self.pending.clear()
        if bad and error is None and cfg.guard == "rollback":
            return bad
        if log_now:
            assert self.meter is not None
            now = time.perf_counter()
            timing = self.meter.record(now - self.t_last, steps=self.since)
            self.t_last, self.since = now, 0
            values = {k: float(v) for k, v in fetched[-1].items() if k not in guard_lib.FLAG_KEYS}
            if not self.run.task.tokens_per_example:
                timing["examples_per_s"] = timing.pop("tokens_per_s")
            values.update(timing, skipped=float(strategy.skipped(state.train)), **strategy.log_values())
            self.losses[step] = values["loss"]
            self.logger.log(step, values)
        if error is not None:
            raise error
        return []

    def evaluate(self, state: RunState, source: Any) -> None:
        cfg = self.run.cfg
        results = evaluate(self.run.eval_step, self.run.strategy.eval_view(state.train), source,
                           self.run.batch_sharding, cfg.data.global_batch, cfg.run.eval_batches)
        self.eval_losses[state.step], self.eval_results[state.step] = results["loss"], results
        if "ce" in results:  # a language model's cross-entropy: perplexity too
            results = {**results, "perplexity": math.exp(min(results["ce"], 50.0))}
        self.logger.log(state.step, results, prefix="eval")
        self.t_last = time.perf_counter()  # eval time is not step time

    def summary(self, steps: int) -> dict[str, Any]:
        summary: dict[str, Any] = self.meter.summary() if self.meter is not None else {}
        if not self.run.task.tokens_per_example and "tokens_per_s" in summary:
            summary["examples_per_s"] = summary.pop("tokens_per_s")
        return summary | {"peak_flops_per_device": self.peak, "peak_source": self.peak_source,
                          "flops_source": self.flops_source} | self.run.strategy.summary(steps)


def _rolled_back(run: Run, ckpt: Checkpointer, state: RunState, bad: list[int], loader: ExampleLoader | IterLoader,
                 progress: _Progress) -> RunState:
    """``run.guard=rollback``: the run state of the last checkpoint, stepping over the ``bad`` batches from now on."""
    ckpt.wait()
    restored = ckpt.restore(run.strategy.abstract)
    if restored is None:
        raise DivergenceError(f"run.guard='rollback' at step {state.step}: no checkpoint to roll back to "
                              f"in {ckpt.directory}; bad batches {sorted(bad)}")
    back = RunState.from_tree(*restored, run.strategy)
    back.skip_batches = state.skip_batches | set(bad)
    loader.set_state(back.data)
    progress.logger.resume_at(back.step, keep_splits=(guard_lib.SPLIT_PREFIX,))  # the events stay
    progress.guard.rolled_back(back.step, set(back.skip_batches), state.step)
    progress.restart_clock()
    return back


def _begin(run: Run, ckpt: Checkpointer, logger: RunLogger, loader: ExampleLoader | IterLoader,
           changes: list) -> RunState:
    """Where the run starts (a checkpoint, ``init_from`` params, or fresh), recorded and described."""
    try:
        state = run.start(ckpt, logger.message)
    except BaseException:
        ckpt.close()
        logger.close()
        raise
    cfg, sharded = run.cfg, run.sharded
    if jax.process_index() == 0:  # every check has passed, the checkpoint's included: record the config
        write_config(cfg.run.directory, cfg.to_dict())
        record_manifest(cfg.run.directory, cfg.data)  # the data by content, for the next resume (trainers.data.manifest)
    logger.resume_at(state.step)  # steps after the start are logged again: their old records are dropped
    if state.data is not None:
        loader.set_state(state.data)
    if isinstance(run.strategy, LocalSteps):  # the one group's state the groups were made from is not used again
        run.strategy.release_template(state.train)
    if changes:
        logger.message("config changed since this run directory's last run (the old one is kept as config.<n>.json): "
                       + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes))
    n_params = sum(x.size for x in jax.tree.leaves(sharded.state.params))
    logger.message(meshes.describe(run.mesh).splitlines()[0]
                   + f"; rules {run.rules.name}; task {run.task.name}; {n_params:,} params")
    if any(d.source != "annotation" and d.kind == "Param" for d in sharded.model.decisions):
        logger.message("sharding of variables without logical dims:\n" + spmd.variables.format_decisions(
            [d for d in sharded.model.decisions if d.source != "annotation"]))
    return state


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
        return drive(build(cfg, task, mesh), keep_state=keep_state, batch_hook=batch_hook, step_hook=step_hook)


def drive(run: Run, *, keep_state: bool = False, batch_hook: BatchHook | None = None,
          step_hook: StepHook | None = None) -> Result:
    """The loop over a built run: batch -> train step -> guard and log -> eval -> checkpoint, until
    ``run.steps`` or a preemption (a checkpoint, then ``Result(preempted=True)``)."""
    cfg, task, strategy = run.cfg, run.task, run.strategy
    changes = changes_since_last_run(cfg)  # refuses what cannot be resumed before anything is written
    eval_source = task.eval_source(cfg) if cfg.run.eval_batches else None
    loader = _loader(task.train_source(cfg), cfg.data.global_batch, cfg.data.seed, run.batch_sharding)
    ckpt = Checkpointer(cfg.checkpoint.resolve_directory(cfg.run.directory), cfg.checkpoint,
                        layer_orders=run.sharded.layer_orders)  # steps hold stacks in natural layer order
    logger = RunLogger(cfg.run.directory, is_main=jax.process_index() == 0, total_steps=cfg.run.steps,
                       use_tensorboard=cfg.run.tensorboard, progress=cfg.run.progress)
    state = _begin(run, ckpt, logger, loader, changes)
    start, progress, preempted = state.step, _Progress(run, logger, state), False
    current = state  # the sampling hook reads the state as it is when it runs
    step_hook = pretrained.sampling_hook(cfg, task, run.sharded, run.mesh, run.rules, logger, step_hook,
                                         lambda: current.train)  # run.sample_every
    profiler = StepProfiler(cfg.run.directory, cfg.run.profile_steps, cfg.run.profile_processes,
                            cfg.run.memory_profile_step)
    with PreemptionWatcher(check_every=cfg.run.preemption_check_every) as watcher:
        try:
            while state.step < cfg.run.steps:
                index, batch = _next_batch(loader, state.skip_batches)
                if batch_hook is not None:
                    batch = batch_hook(index, batch)
                if task.vocab_size is not None:  # ids outside the vocab are refused before they reach the model
                    check_batch_ids(batch, task.vocab_size, task.token_keys, where=f"task {task.name!r}, batch {index}")
                batch = to_global(batch, run.batch_sharding, cfg.data.global_batch)
                progress.first(batch)
                with first_batch(task.name, batch, "the train step") if state.step == start else contextlib.nullcontext():
                    with profiler.before(state.step + 1):  # run.profile_steps
                        state.train, metrics = run.train_step(state.train, batch)  # contract errors surface at its trace
                state.step += 1
                state.train = strategy.after_step(state.train, state.step)  # local SGD: the groups synchronise
                profiler.after(state.step, metrics)
                progress.stepped(state.step, index, metrics)
                if step_hook is not None:
                    step_hook(state.step)
                stop = watcher.should_stop(state.step)
                save = ckpt.should_save(state.step, force=stop or state.step == cfg.run.steps)
                bad = progress.check(state, save, ckpt)
                if bad:
                    state = current = _rolled_back(run, ckpt, state, bad, loader, progress)
                    continue
                if eval_source is not None and (state.step % cfg.run.eval_every == 0 or state.step == cfg.run.steps):
                    progress.evaluate(state, eval_source)
                if save:
                    state.data = loader.get_state()
                    ckpt.save(state.step, *state.to_tree(strategy), force=True)  # due: decided above
                if stop:
                    ckpt.wait()
                    preempted = True
                    logger.message(f"stopping at step {state.step} ({watcher.reason}): checkpoint step {state.step} is "
                                   f"committed in {ckpt.directory}; run the same command again to resume")
                    break
            ckpt.wait()
        finally:
            profiler.close()
            ckpt.close()
            logger.close()
    skipped = strategy.skipped(state.train)
    if not preempted:
        guard_lib.check_learned(start, state.step, skipped - progress.skipped_before, progress.guard.events, cfg.run.guard)
    return Result(cfg.run.directory, start, state.step, progress.losses, progress.eval_losses, skipped,
                  progress.summary(state.step - start), strategy.kept(state.train) if keep_state else None, preempted,
                  list(progress.guard.events), progress.eval_results)
