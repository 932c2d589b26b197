"""trainers: sharded model + data -> a training run (optimizer, schedule, checkpoints, metrics, CLI).

    from trainers import Config, Task, recipe, override, train
    result = train(override(recipe("gpt-small", tiny=True), ["run.run_dir=/tmp/run"]))  # the built-in GPT task
    result = train(Config(...), Task(model=..., loss=..., data=..., eval_metrics=...))   # any model
"""

from trainers import dryrun, guard, hardware, launch, plan, pods, preemption
from trainers.checkpoint import CheckpointConfig, Checkpointer, CheckpointTimeoutError, NoUsableCheckpointError
from trainers.config import Config, MeshConfig, RunConfig, override, valid_keys
from trainers.corpus import npy_corpus, stdlib_corpus, synthetic_corpus, text_corpus
from trainers.data import DataConfig, ExampleLoader, IterLoader, Loader, load_corpus, make_loader, process_rows, to_global
from trainers.dryrun import DryRunReport, dry_run
from trainers.guard import GuardEvent, read_events
from trainers.hardware import HARDWARE, Hardware, get_hardware
from trainers.logger import RunLogger, read_metrics, write_config
from trainers.loop import DivergenceError, Result, evaluate, train
from trainers.metrics import StepMeter, measure_cpu_matmul_peak, mfu, peak_flops_per_device
from trainers.preemption import PreemptionWatcher
from trainers.optim import OptimizerConfig, decay_mask, global_norm, make_optimizer
from trainers.recipes import RECIPES, recipe
from trainers.schedules import ScheduleConfig, make_schedule, scale_lr
from trainers.state import Sharded, create_state
from trainers.step import lm_loss_fn, make_eval_step, make_train_step
from trainers.task import Task, lm_task, load_task

__all__ = [
    # submodules: dry run and planner, fault tolerance, many hosts
    "dryrun", "guard", "hardware", "launch", "plan", "pods", "preemption",
    "CheckpointTimeoutError", "DryRunReport", "GuardEvent", "HARDWARE", "Hardware", "PreemptionWatcher", "dry_run",
    "get_hardware", "process_rows", "read_events",
    "Task", "lm_task", "load_task", "ExampleLoader", "IterLoader",
    "CheckpointConfig", "Checkpointer", "Config", "DataConfig", "DivergenceError", "Loader", "MeshConfig",
    "NoUsableCheckpointError", "OptimizerConfig", "RECIPES", "Result", "RunConfig", "RunLogger", "ScheduleConfig",
    "Sharded", "StepMeter", "create_state", "decay_mask", "evaluate", "global_norm", "lm_loss_fn", "load_corpus",
    "make_eval_step", "make_loader", "make_optimizer", "make_schedule", "make_train_step", "measure_cpu_matmul_peak",
    "mfu", "npy_corpus", "override", "peak_flops_per_device", "read_metrics", "recipe", "scale_lr", "stdlib_corpus",
    "synthetic_corpus", "text_corpus", "to_global", "train", "valid_keys", "write_config",
]
