"""What ``spmd-train`` does once its arguments are parsed: resolve TARGET into a config (and a task),
join the other processes, then train or dry-run. :mod:`trainers.launch.cli` parses the arguments and
maps errors to exit statuses; it imports this module only after parsing, so ``--help`` is instant."""

from __future__ import annotations

import argparse
import dataclasses
import json

import meshes
from trainers.config import AUTO, Config, RunConfig, override
from trainers.config_files import config_file_overrides
from trainers.launch.exits import EXIT_INTERNAL, EXIT_OK, EXIT_PREEMPTED
from trainers.loop import train
from trainers.planning import oom
from trainers.planning.auto import resolve_auto
from trainers.planning.dryrun import dry_run
from trainers.planning.fresh_process import check_simulated
from trainers.recipes import RECIPES, recipe, tiny_run
from trainers.task import UserCodeError, load_task


def is_task_target(target: str) -> bool:
    """Whether TARGET names a task (``package.module:attribute``) rather than a recipe."""
    return ":" in target


def load_target(target: str):
    """The :class:`trainers.task.Task` a ``package.module:attribute`` TARGET names (ValueError with
    what was given and what is valid otherwise)."""
    try:
        return load_task(target)
    except UserCodeError:  # the task's own code failed: its message says where
        raise
    except ValueError as e:
        raise ValueError(f"{e} (TARGET is a recipe, one of {', '.join(RECIPES)}, or a task as package.module:attribute "
                         "naming a trainers.Task or a function returning one)") from None


def base_config(target: str, task=None, *, tiny: bool = False):
    """The config TARGET starts from: a recipe's (tiny variant with ``tiny``), or the task's."""
    if task is None:
        if target not in RECIPES:
            raise ValueError(f"unknown recipe {target!r}; TARGET is a recipe ({', '.join(RECIPES)}) or a task as "
                             "package.module:attribute")
        return recipe(target, tiny=tiny)
    cfg = task.config if task.config is not None else Config(run=RunConfig(name=task.name))
    return tiny_run(cfg) if tiny else cfg


def build_config(args: argparse.Namespace, task=None):
    """The resolved config of TARGET (``task``: the loaded task when TARGET names one) and the flags."""
    cfg = base_config(args.target, task, tiny=args.tiny)
    sets = config_file_overrides(args.config) if getattr(args, "config", None) else []
    sets += list(args.overrides)
    if args.mesh:
        sets.append(f"mesh.axes={args.mesh}")
    if args.dcn:
        sets.append(f"mesh.dcn={args.dcn}")
    if args.rules:
        sets.append(f"rules={args.rules}")
    if args.run_dir:
        sets.append(f"run.run_dir={args.run_dir}")
    if args.steps is not None:  # --steps 0 is refused by run.steps' own check (steps >= 1)
        sets += [f"run.steps={args.steps}", "lr.total_steps=0"]  # the schedule ends with the run
        if cfg.lr.warmup_steps > args.steps:
            sets.append(f"lr.warmup_steps={max(args.steps // 10, 0)}")
    cfg = override(cfg, sets)
    from trainers.pretrained import check_overrides, resolve  # checkpoint.init_from=hf:PATH

    check_overrides(cfg, sets)  # --set model.* must agree with its config.json, which gives the model's shapes
    return resolve(cfg, check=False)  # (read as JSON: no jax work before the processes join)


def fixed_choices(args: argparse.Namespace) -> dict:
    """What ``--mesh auto`` leaves the planner: the rule set unless --rules names one, the remat policy
    unless ``--set model.remat`` / ``model.remat_policy`` fixes it."""
    fixed: dict = {"rules": args.rules or None, "remat": None}
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key == "model.remat_policy" and value:
            fixed["remat"] = value
        elif key == "model.remat" and value.lower() in ("true", "false"):
            fixed["remat"] = value.lower() == "true"
    return fixed


def run(args: argparse.Namespace) -> int:
    """Train (or dry-run, or print the config of) what ``args`` say; the exit status. User errors
    raise (ValueError, OSError, ...); :func:`trainers.launch.cli.main` turns them into messages."""
    is_task = is_task_target(args.target)
    if args.dry_run or args.print_config:
        task = None
        if is_task:
            devices = args.devices or args.simulate_devices
            if args.dry_run and devices and not meshes.backend_started():
                check_simulated(devices)
            if args.dry_run and devices and not meshes.backend_started():
                meshes.simulate_cpu_devices(devices)  # what dry_run does itself, before the task's module can start jax
            task = load_target(args.target)
        cfg = build_config(args, task)
        if args.print_config:  # a valid --config file: every key, the same values
            print(json.dumps(dataclasses.asdict(cfg), indent=2))
            return EXIT_OK
        devices = args.devices or args.simulate_devices or None
        if cfg.mesh.axes == AUTO:  # the planner's pick for the dry run's devices and hardware
            if devices is None:
                raise ValueError("--dry-run --mesh auto needs --devices N (the device count to plan for)")
            cfg = resolve_auto(cfg, devices=devices, hardware=args.hardware, task=args.target if is_task else None,
                               **fixed_choices(args))
        report = dry_run(cfg, args.target if is_task else None, devices=devices, hardware=args.hardware)
        print(report.format())
        return EXIT_OK if report.fits else EXIT_INTERNAL  # documented: a dry run that does not fit exits 1

    task = None
    if not is_task:  # a recipe's config is checked before any jax or network work
        cfg = build_config(args)
    # before any other jax call; a no-op on one host
    meshes.distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.init_timeout)
    if args.simulate_devices:
        meshes.simulate_cpu_devices(args.simulate_devices)
    if is_task:  # imported only now: its module may start jax
        task = load_target(args.target)
        cfg = build_config(args, task)
    if cfg.mesh.axes == AUTO:  # the planner's pick for the devices this run has (or the one its run directory records)
        cfg = resolve_auto(cfg, task=args.target if is_task else None, **fixed_choices(args))
    try:
        result = train(cfg, task)
    except Exception as e:  # out of memory is the config's: say by how much and what fits
        if task is not None or not oom.is_oom(e):
            raise
        import jax

        raise oom.OutOfMemoryError(oom.explain(cfg, jax.device_count(), jax.devices()[0].device_kind, e,
                                               target=args.target)) from e
    if result.eval_losses:
        first, last = min(result.eval_losses), max(result.eval_losses)
        print(f"eval loss {result.eval_losses[first]:.3f} (step {first}) -> {result.eval_losses[last]:.3f} (step {last}); "
              f"run directory {result.run_dir}")
    if result.preempted and result.final_step < cfg.run.steps:  # stopped at the last step: the run finished
        print(f"stopped at step {result.final_step} of {cfg.run.steps} after saving a checkpoint; run the same command "
              "to resume")
        return EXIT_PREEMPTED
    return EXIT_OK
