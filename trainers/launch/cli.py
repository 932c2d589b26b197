"""``spmd-train TARGET [--tiny] [--set key=value ...]``: the command every host of a pod runs.

TARGET is a recipe (``gpt-small``, ``gpt-125m``, ...) or ``package.module:attribute`` naming a
:class:`trainers.task.Task`.

    spmd-train gpt-small --simulate-devices 8
    spmd-train trainers.examples.digits:task --simulate-devices 8

See docs/many-hosts.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import meshes
from trainers.config import Config, RunConfig, override
from trainers.loop import train
from trainers.planning.dryrun import dry_run
from trainers.recipes import RECIPES, recipe, tiny_run
from trainers.task import load_task


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="spmd-train",
                                description="Train a recipe or a task on this host's (or every host's) devices.")
    p.add_argument("target", metavar="TARGET",
                   help=f"a recipe ({', '.join(RECIPES)}) or a task as package.module:attribute")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-step smoke run (a recipe's tiny variant also shrinks its model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,tensor=4 (-1 infers one axis)")
    p.add_argument("--dcn", help="axis sizes across slices / hosts (multi-slice), e.g. data=2")
    p.add_argument("--rules", help="rule set: dp, fsdp, tp, dp_tp, fsdp_tp")
    p.add_argument("--steps", type=int, help="shorthand for --set run.steps=N (the LR schedule ends with the run)")
    p.add_argument("--run-dir", help="shorthand for --set run.run_dir=DIR")
    p.add_argument("--simulate-devices", type=int, default=0, metavar="N",
                   help="run on N simulated CPU devices (laptops, CI); 0 = the real devices")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="compile the train step for --devices devices (abstract state, nothing allocated), print "
                        "memory, collectives and a roofline step time for --hardware, and exit")
    p.add_argument("--devices", type=int, metavar="N", help="device count of the dry run (default: this backend's)")
    p.add_argument("--hardware", default="h100", help="dry-run target: h100, h200, a100, tpu-v4, tpu-v5e, tpu-v5p, cpu")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address for a multi-host run (default: $SPMD_COORDINATOR or cluster detection)")
    p.add_argument("--num-processes", type=int, help="processes in a multi-host run (default: $SPMD_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, help="this process's id in [0, num-processes) (default: $SPMD_PROCESS_ID)")
    p.add_argument("--init-timeout", type=int, metavar="S",
                   help="seconds to wait for all processes to join (default: $SPMD_INIT_TIMEOUT or 300)")
    return p.parse_args(argv)


def is_task_target(target: str) -> bool:
    """Whether TARGET names a task (``package.module:attribute``) rather than a recipe."""
    return ":" in target


def load_target(target: str):
    """The :class:`trainers.task.Task` a ``package.module:attribute`` TARGET names (ValueError with
    what was given and what is valid otherwise)."""
    try:
        return load_task(target)
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
    sets = list(args.overrides)
    if args.mesh:
        sets.append(f"mesh.axes={args.mesh}")
    if args.dcn:
        sets.append(f"mesh.dcn={args.dcn}")
    if args.rules:
        sets.append(f"rules={args.rules}")
    if args.run_dir:
        sets.append(f"run.run_dir={args.run_dir}")
    if args.steps:
        sets += [f"run.steps={args.steps}", "lr.total_steps=0"]  # the schedule ends with the run
        if cfg.lr.warmup_steps > args.steps:
            sets.append(f"lr.warmup_steps={max(args.steps // 10, 0)}")
    return override(cfg, sets)


def _error(message: object, code: int = 2) -> int:
    print(f"spmd-train: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    is_task = is_task_target(args.target)
    if args.dry_run or args.print_config:
        task = None
        if is_task:
            devices = args.devices or args.simulate_devices
            if args.dry_run and devices and not meshes.backend_started():
                meshes.simulate_cpu_devices(devices)  # what dry_run does itself, before the task's module can start jax
            try:
                task = load_target(args.target)
            except ValueError as e:
                return _error(e)
        try:
            cfg = build_config(args, task)
        except ValueError as e:
            return _error(e)
        if args.print_config:
            print(json.dumps(dataclasses.asdict(cfg), indent=2))
            return 0
        try:
            report = dry_run(cfg, args.target if is_task else None, devices=args.devices or args.simulate_devices or None,
                             hardware=args.hardware)
        except ValueError as e:
            return _error(e)
        print(report.format())
        return 0 if report.fits else 1

    task = None
    if not is_task:  # a recipe's config is checked before any jax or network work
        try:
            cfg = build_config(args)
        except ValueError as e:
            return _error(e)

    try:  # before any other jax call; a no-op on one host
        meshes.distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.init_timeout)
    except ValueError as e:
        return _error(e)
    if args.simulate_devices:
        meshes.simulate_cpu_devices(args.simulate_devices)
    if is_task:  # imported only now: its module may start jax
        try:
            task = load_target(args.target)
            cfg = build_config(args, task)
        except ValueError as e:
            return _error(e)

    try:
        result = train(cfg, task)
    except (meshes.distributed.ConsistencyError, meshes.distributed.DistributedError) as e:
        return _error(e, 1)
    if result.eval_losses:
        first, last = min(result.eval_losses), max(result.eval_losses)
        print(f"eval loss {result.eval_losses[first]:.3f} (step {first}) -> {result.eval_losses[last]:.3f} (step {last}); "
              f"run directory {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
