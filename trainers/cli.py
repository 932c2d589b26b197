"""``spmd-train RECIPE [--tiny] [--set key=value ...]``: the command every host of a pod runs.

Examples::

    spmd-train gpt-small --simulate-devices 8                  # the README's main job, on a laptop
    spmd-train gpt-small --tiny --simulate-devices 8           # a 2-step smoke run
    spmd-train gpt-125m --mesh fsdp=8 --set run.steps=2000     # one 8-GPU node
    spmd-train gpt-350m --mesh data=-1,fsdp=8 --dcn data=4     # 4 nodes / slices

The device count for ``--simulate-devices`` must be set before jax starts, so this module
imports jax-using packages only after parsing arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from trainers.recipes import RECIPES

    p = argparse.ArgumentParser(prog="spmd-train", description="Train a recipe on this host's (or every host's) devices.")
    p.add_argument("recipe", help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--tiny", action="store_true", help="the recipe's tiny variant (2 steps, small model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set model.d_model=256 (repeatable)")
    p.add_argument("--mesh", help="mesh axis sizes, e.g. data=2,tensor=4 (-1 infers one axis)")
    p.add_argument("--dcn", help="axis sizes across slices / hosts (multi-slice), e.g. data=2")
    p.add_argument("--rules", help="rule set: dp, fsdp, tp, dp_tp, fsdp_tp")
    p.add_argument("--steps", type=int, help="shorthand for --set run.steps=N (also sets the schedule's total)")
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


def build_config(args: argparse.Namespace):
    from trainers.config import override
    from trainers.recipes import recipe

    cfg = recipe(args.recipe, tiny=args.tiny)
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
        sets += [f"run.steps={args.steps}", f"schedule.total_steps={args.steps}"]
        if cfg.schedule.warmup_steps > args.steps:
            sets.append(f"schedule.warmup_steps={max(args.steps // 10, 0)}")
    return override(cfg, sets)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ValueError as e:
        print(f"spmd-train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import json

        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    if args.dry_run:
        from trainers.dryrun import dry_run

        try:
            report = dry_run(cfg, devices=args.devices or args.simulate_devices or None, hardware=args.hardware)
        except ValueError as e:
            print(f"spmd-train: error: {e}", file=sys.stderr)
            return 2
        print(report.format())
        return 0 if report.fits else 1

    import meshes

    try:  # before any other jax call; a no-op on one host
        meshes.distributed.initialize(args.coordinator, args.num_processes, args.process_id, timeout_s=args.init_timeout)
    except ValueError as e:
        print(f"spmd-train: error: {e}", file=sys.stderr)
        return 2
    if args.simulate_devices:
        meshes.simulate_cpu_devices(args.simulate_devices)

    from trainers.loop import train

    try:
        result = train(cfg)
    except (meshes.distributed.ConsistencyError, meshes.distributed.DistributedError) as e:
        print(f"spmd-train: error: {e}", file=sys.stderr)
        return 1
    if result.eval_losses:
        first, last = min(result.eval_losses), max(result.eval_losses)
        print(f"eval loss {result.eval_losses[first]:.3f} (step {first}) -> {result.eval_losses[last]:.3f} (step {last}); "
              f"run directory {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
