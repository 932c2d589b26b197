"""trainers: a sharded model + data -> a training run (optimizer, LR schedule, checkpoints, metrics, CLI).

    from trainers import Config, Task, recipe, override, train
    result = train(override(recipe("gpt-small", tiny=True), ["run.run_dir=/tmp/run"]))  # the built-in GPT task
    result = train(Config(...), Task(model=..., loss=..., data=..., eval_metrics=...))   # any model

Subpackages: ``data``, ``checkpoint``, ``faults`` (guard, preemption), ``launch`` (CLI, launcher),
``planning`` (dry run, cost model, planner, diagnostics; imported by nothing else in ``trainers``).
"""

from trainers.checkpoint import Checkpointer
from trainers.config import Config, override
from trainers.data import ExampleLoader, IterLoader
from trainers.faults import DivergenceError
from trainers.loop import Result, evaluate, train
from trainers.lr import make_lr_schedule
from trainers.optim import make_optimizer
from trainers.recipes import recipe
from trainers.state import create_state
from trainers.step import make_eval_step, make_train_step
from trainers.task import Task, lm_task, load_task

__all__ = [
    "Checkpointer", "Config", "DivergenceError", "ExampleLoader", "IterLoader", "Result", "Task", "create_state",
    "evaluate", "lm_task", "load_task", "make_eval_step", "make_optimizer", "make_lr_schedule", "make_train_step",
    "override", "recipe", "train",
]
