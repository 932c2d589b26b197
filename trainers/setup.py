"""The one way from a config to something that steps: :func:`build` ``(cfg, task, mesh) -> Run``.

The config resolved against its ``hf:`` start and checked, then rules, LR schedule, optimizer, the
state created directly sharded (or abstractly), the guard window, the batch sharding, the train step
with its strategy (plain, or local SGD's replica groups) and the eval step. The loop trains with it,
the dry run and the planner compile its train step, the benchmarks and tests time and step it: the
dry run compiles the real step by construction. See docs/training.md and docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import spmd
from spmd.rules import Rules, RulesError
from trainers import pretrained, startup
from trainers.checkpoint import Checkpointer
from trainers.config import Config
from trainers.faults import guard as guard_lib
from trainers.local_sgd import LocalSGD, groups_of, inner_rules, step_layout
from trainers.lora import freeze_base, frozen_base_loss
from trainers.lr import make_lr_schedule
from trainers.objectives.dpo import pair_row_shapes
from trainers.optim import make_optimizer
from trainers.state import ShardedState, sharded_state
from trainers.step import eval_step_fn, train_step_fn
from trainers.strategy import LocalSteps, Plain, RunState
from trainers.task import Task, call_user, lm_task


@dataclasses.dataclass
class Run:
    """Everything a run steps with. ``sharded``: the state as created (what checkpoints hold);
    ``stepped``: what the train step carries (``sharded`` plus the guard window; local SGD: one
    group's); ``strategy``: how it steps (:class:`trainers.strategy.Plain`, or ``LocalSteps`` under
    local SGD, whose ``train_step`` steps every replica group). :meth:`fresh` is the run state at step 0,
    :meth:`start` the one a run begins from (a checkpoint, ``init_from`` params, or fresh)."""

    cfg: Config
    task: Task
    mesh: Mesh
    rules: Rules
    state_rules: Rules  # the state's rules: ``rules``, or one replica group's under local SGD
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    sharded: ShardedState
    stepped: ShardedState
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    strategy: Plain

    def abstract_batch(self, example: dict[str, Any] | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """The global batch as shapes with the batch sharding: ``example`` (one example's arrays), or
        the LM task's ``inputs``/``targets`` of ``data.seq_len`` tokens."""
        rows, length = self.cfg.data.global_batch, self.cfg.data.seq_len
        example = example or {k: jax.ShapeDtypeStruct((length,), jax.numpy.int32) for k in ("inputs", "targets")}
        if self.cfg.run.objective == "dpo" and example.keys() == {"inputs", "targets"}:  # packed pair rows
            example = {**example, **pair_row_shapes(length)}
        return {k: jax.ShapeDtypeStruct((rows, *v.shape), v.dtype, sharding=self.batch_sharding)
                for k, v in example.items()}

    def fresh(self, params: Any = None) -> RunState:
        """The run state at step 0: the state as created, or with loaded ``params`` (the task's ``start`` completes it)."""
        return RunState(0, self.strategy.fresh(params, self.task.start))

    def start(self, ckpt: Checkpointer, say: Callable[[str], None] = lambda _: None) -> RunState:
        """Where the run begins: its newest usable checkpoint (``run.resume``), else the ``init_from``
        params (``hf:PATH`` or another run's step, fresh optimizer), else fresh. ``say`` hears which."""
        restored = startup.resume(self.cfg, ckpt, self.strategy, say)
        if restored is not None:
            step, state, data = restored
            say(f"resumed from step {step} ({ckpt.directory})")
            return RunState.from_tree(step, state, data, self.strategy)
        params = startup.loaded_params(self.cfg, self.sharded, say)
        return self.fresh(params)


def build(cfg: Config, task: Task | None = None, mesh: Mesh | None = None, *, abstract: bool = False,
          donate: bool = True, tx: optax.GradientTransformation | None = None) -> Run:
    """The run of ``task`` (default: the built-in GPT task of ``cfg``) on ``mesh`` (default:
    ``cfg.mesh.build()``): ``cfg`` resolved against its ``hf:`` start, checked, then the state created
    directly sharded and the steps made (compiled on their first call). ``abstract=True`` creates
    shapes and shardings only (the dry run, the planner; its checks are theirs to report); there the
    train step is the ordinary jitted one also under local SGD, whose inner step it is.
    ``donate=False`` keeps the input state alive after a step (benchmarks that replay it). ``tx``: an
    optimizer of your own instead of ``cfg.optimizer`` and ``cfg.lr`` (the schedule is still logged)."""
    if not abstract:
        cfg = pretrained.resolve(cfg)  # checkpoint.init_from=hf:PATH: model.* from its config.json, tensors checked
    task = lm_task(cfg) if task is None else task
    if not isinstance(task, Task):
        raise TypeError(f"task must be a trainers.Task, got {type(task).__name__}")
    mesh = mesh or cfg.mesh.build()
    run = cfg.run
    rules = spmd.get_rules(cfg.rules)
    if not abstract:
        startup.check_run(cfg, task, mesh, rules)  # before any state is built or compiled
    schedule = make_lr_schedule(cfg.lr, run.steps)
    tx = make_optimizer(cfg.optimizer, schedule) if tx is None else tx
    loss_fn = task.loss
    if cfg.lora.enabled:  # the base frozen: no gradient, no optimizer state (trainers.lora)
        tx, loss_fn = freeze_base(tx), frozen_base_loss(task.loss)
    grouped = cfg.local_sgd.enabled
    state_rules = inner_rules(rules) if grouped else rules
    if grouped:
        groups_of(mesh, cfg.local_sgd)
    try:
        sharded = sharded_state(lambda: call_user(task.model, "the task's model function", nnx.Rngs(run.seed)), tx,
                                state_rules, mesh, seed=run.seed, path_rules=task.path_rules, pipeline=cfg.pipeline,
                                abstract=abstract)
    except RulesError as e:  # a dim that does not divide by its mesh axes: named as the task's config keys
        raise RulesError(task.explain(e) if task.explain is not None else str(e)) from None
    stepped = guard_lib.add_window(sharded, run.spike_window, mesh)
    batch_sharding = spmd.batch_sharding(rules, mesh, dims=("batch",))
    step_mesh, step_state = step_layout(mesh, stepped) if grouped else (mesh, stepped)
    train_step = train_step_fn(step_state, tx, state_rules, step_mesh, batch_sharding, schedule=schedule,
                               grad_accum=run.grad_accum, loss_fn=loss_fn, spike_factor=run.spike_factor,
                               fsdp_gather=run.fsdp_gather, jit=not grouped, donate=donate,
                               max_update_ratio=run.max_update_ratio, max_param_growth=run.max_param_growth)
    if grouped:
        local = LocalSGD(cfg.local_sgd, stepped, train_step, mesh, batch_sharding, steps=run.steps)
        strategy: Plain = LocalSteps(local, sharded, stepped, mesh, run.spike_window)
    else:
        strategy = Plain(sharded, stepped, train_step, mesh, run.spike_window)
    eval_step = eval_step_fn(sharded, rules, mesh, batch_sharding, loss_fn=task.loss, metrics=task.eval_metrics)
    return Run(cfg, task, mesh, rules, state_rules, schedule, tx, sharded, stepped, batch_sharding,
               strategy.train_step, eval_step, strategy)
