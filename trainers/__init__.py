"""trainers: a sharded model + data -> a training run (optimizer, LR schedule, checkpoints, metrics, CLI).

    from trainers import Config, Task, recipe, override, train
    result = train(override(recipe("gpt-small", tiny=True), ["run.run_dir=/tmp/run"]))  # the built-in GPT task
    result = train(Config(...), Task(model=..., loss=..., data=..., eval_metrics=...))   # any model
    run = build(cfg, task)  # the one way in: checked state, compiled-on-first-call steps, to step by hand
    model = load_model("runs/x")  # or "hf:PATH": a trained or pretrained GPT, sharded

Subpackages: ``data``, ``checkpoint``, ``faults`` (guard, preemption), ``launch`` (CLI, launcher),
``planning`` (dry run, cost model, planner, diagnostics; imported by nothing else in ``trainers``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it. Loaded on first use, so ``spmd-train --help`` and the launcher
# answer without importing jax; ``from trainers import train`` works as usual.
_FACE = {
    "Checkpointer": "trainers.checkpoint", "Config": "trainers.config", "override": "trainers.config",
    "ExampleLoader": "trainers.data", "IterLoader": "trainers.data", "DivergenceError": "trainers.faults",
    "Result": "trainers.loop", "evaluate": "trainers.loop", "train": "trainers.loop",
    "make_lr_schedule": "trainers.lr", "load_model": "trainers.pretrained", "make_optimizer": "trainers.optim", "recipe": "trainers.recipes",
    "Run": "trainers.setup", "build": "trainers.setup", "RunState": "trainers.strategy",
    "Task": "trainers.task", "lm_task": "trainers.task", "load_task": "trainers.task",
}
__all__ = sorted(_FACE)

if TYPE_CHECKING:
    from trainers.checkpoint import Checkpointer
    from trainers.config import Config, override
    from trainers.data import ExampleLoader, IterLoader
    from trainers.faults import DivergenceError
    from trainers.loop import Result, evaluate, train
    from trainers.lr import make_lr_schedule
    from trainers.optim import make_optimizer
    from trainers.pretrained import load_model
    from trainers.recipes import recipe
    from trainers.setup import Run, build
    from trainers.strategy import RunState
    from trainers.task import Task, lm_task, load_task


def __getattr__(name: str):
    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule: trainers.config, trainers.planning, ...
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE))
