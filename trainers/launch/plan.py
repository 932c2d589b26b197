"""``spmd-plan TARGET --devices N --hardware H``: rank layouts of a recipe or task before the pod.

    spmd-plan gpt-125m --devices 8 --hardware h100 --top 3 [--no-compile] [--verify]

The planner itself is :func:`trainers.planning.plan`; this module is its command line. The top picks
are compiled (abstract state) and only those that fit are printed as choices.
"""

from __future__ import annotations

import argparse
import sys

from spmd.models import param_count
from trainers.config import override
from trainers.launch.command import base_config, is_task_target, load_target
from trainers.planning.fresh_process import MAX_SIMULATED_DEVICES
from trainers.planning.planner import plan
from trainers.planning.profile import profile_task
from trainers.recipes import RECIPES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spmd-plan", description="Rank layouts of a recipe or task for N devices of a hardware.")
    p.add_argument("target", metavar="TARGET",
                   help=f"a recipe ({', '.join(RECIPES)}) or a task as package.module:attribute")
    p.add_argument("--devices", type=int, required=True, help="number of devices (GPUs, TPU chips)")
    p.add_argument("--hardware", default="h100", help="h100, h200, a100, tpu-v4, tpu-v5e, tpu-v5p, cpu")
    p.add_argument("--tiny", action="store_true", help="the recipe's tiny variant (a task's: 2 steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--top", type=int, default=3,
                   help="how many picks to compile and show (default 3); a pick that does not fit is dropped and "
                        "the next one compiled")
    p.add_argument("--no-compile", action="store_true", help="rank analytically only: compile nothing")
    p.add_argument("--headroom", type=float, default=None,
                   help="fraction of HBM a layout may use (default: the hardware's, 0.9 on GPUs, 0.98 on TPUs)")
    p.add_argument("--verify", action="store_true", help="also print the chosen pick's full dry-run report")
    args = p.parse_args(argv)
    if args.top < 1:
        print(f"spmd-plan: error: --top must be >= 1, got {args.top}", file=sys.stderr)
        return 2
    is_task = is_task_target(args.target)
    if args.devices > MAX_SIMULATED_DEVICES and not args.no_compile:  # compiling would simulate them all: rank only
        print(f"spmd-plan: {args.devices} devices are more than the {MAX_SIMULATED_DEVICES} a compile check simulates; "
              "ranking analytically (as --no-compile)", file=sys.stderr)
        args.no_compile = True
    try:
        task = load_target(args.target) if is_task else None
        cfg = override(base_config(args.target, task, tiny=args.tiny), args.overrides)
        profile = profile_task(task, cfg) if is_task else None
        result = plan(cfg, args.devices, args.hardware, headroom=args.headroom, task=profile,
                      confirm=0 if args.no_compile else args.top, task_name=args.target if is_task else None)
    except ValueError as e:
        print(f"spmd-plan: error: {e}", file=sys.stderr)
        return 2
    if profile is None:
        print(f"{args.target}: {param_count(cfg.model):,} params, global batch {cfg.data.global_batch} x "
              f"{cfg.data.seq_len} tokens")
    else:
        print(f"{args.target} (task {task.name}): {profile.variables.param_count:,} params, global batch "
              f"{cfg.data.global_batch}, {profile.model_flops(1):.3e} FLOPs per example"
              + (f"; {profile.note}" if profile.note else ""))
    print(result.format(args.top))
    if not result.picks:
        print(f"spmd-plan: error: {result.why_none()}", file=sys.stderr)
        return 2
    best = result.best
    print(f"spmd-train {args.target}{' --tiny' if args.tiny else ''} {best.layout.command(cfg)}"
          + "".join(f" --set {s}" for s in args.overrides))
    if args.verify:
        report = next((r for e, r in zip(result.ranked, result.compiled) if e is best), None)
        print("\nthe chosen pick's dry run:\n" + (report.format() if report else "not compiled (--no-compile)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
