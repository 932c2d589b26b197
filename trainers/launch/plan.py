"""``spmd-plan TARGET --devices N --hardware H``: rank layouts of a recipe or task before the pod.

    spmd-plan gpt-125m --devices 8 --hardware h100 --top 5 [--verify]

The planner itself is :func:`trainers.planning.plan`; this module is its command line.
"""

from __future__ import annotations

import argparse
import sys

from spmd.models import param_count
from trainers.config import override
from trainers.launch.command import base_config, is_task_target, load_target
from trainers.planning.dryrun import dry_run
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
    p.add_argument("--top", type=int, default=5, help="how many layouts to show")
    p.add_argument("--headroom", type=float, default=0.9, help="fraction of HBM a layout may use")
    p.add_argument("--verify", action="store_true", help="confirm the chosen layout with a dry-run compile")
    args = p.parse_args(argv)
    is_task = is_task_target(args.target)
    try:
        task = load_target(args.target) if is_task else None
        cfg = override(base_config(args.target, task, tiny=args.tiny), args.overrides)
        profile = profile_task(task, cfg) if is_task else None
        result = plan(cfg, args.devices, args.hardware, headroom=args.headroom, task=profile)
        if profile is None:
            print(f"{args.target}: {param_count(cfg.model):,} params, global batch {cfg.data.global_batch} x "
                  f"{cfg.data.seq_len} tokens")
        else:
            print(f"{args.target} (task {task.name}): {profile.variables.param_count:,} params, global batch "
                  f"{cfg.data.global_batch}, {profile.model_flops(1):.3e} FLOPs per example"
                  + (f"; {profile.note}" if profile.note else ""))
        print(result.format(args.top))
        best = result.best
    except ValueError as e:
        print(f"spmd-plan: error: {e}", file=sys.stderr)
        return 2
    print(f"spmd-train {args.target}{' --tiny' if args.tiny else ''} {best.layout.command(cfg)}"
          + "".join(f" --set {s}" for s in args.overrides))
    if args.verify:
        report = dry_run(best.layout.apply(cfg), args.target if is_task else None, devices=args.devices,
                         hardware=result.hardware, headroom=args.headroom)
        print("\nverified with a dry-run compile:\n" + report.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
