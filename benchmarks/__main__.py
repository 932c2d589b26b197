"""``python -m benchmarks [--quick] [--real-devices] [--output PATH] [--only NAME ...]``: run every benchmark.

Devices are configured once, before the first benchmark starts the jax backend, so every
benchmark here sees the same devices (``benchmarks.scaling`` runs its device counts in
subprocesses). Each benchmark replaces its own section of the results file; the run's wall time
per benchmark and in all is printed at the end.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Sequence

from benchmarks import (
    attention,
    calibration,
    checkpoint,
    common,
    comms,
    context,
    decode_gpu,
    gpu,
    gpu_train,
    guard,
    interchange,
    local_sgd,
    loss,
    memory,
    mfu,
    moe,
    moe_gpu,
    overhead,
    packing,
    peer,
    pipeline,
    remat,
    scaling,
    stack,
    steptime,
)

BENCHMARKS: dict[str, Callable[..., int]] = {
    "overhead": overhead.main,
    "comms": comms.main,
    "steptime": steptime.main,
    "stack": stack.main,
    "peer": peer.main,
    "memory": memory.main,
    "attention": attention.main,
    "context": context.main,
    "loss": loss.main,
    "remat": remat.main,
    "pipeline": pipeline.main,
    "moe": moe.main,
    "mfu": mfu.main,
    "checkpoint": checkpoint.main,
    "guard": guard.main,
    "scaling": scaling.main,
    "local_sgd": local_sgd.main,
    "gpu": gpu.main,
    "gpu_train": gpu_train.main,
    "calibration": calibration.main,
    "packing": packing.main,
    "interchange": interchange.main,
    "decode_gpu": decode_gpu.main,
    "moe_gpu": moe_gpu.main,
}
assert tuple(BENCHMARKS) == common.ORDER


def main(argv: Sequence[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", default=list(BENCHMARKS), metavar="NAME",
                   help="benchmarks to run (default all): " + "; ".join(
                       f"{name}: {(sys.modules[fn.__module__].__doc__ or '').strip().splitlines()[0]}"
                       for name, fn in BENCHMARKS.items()))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    unknown = [name for name in args.only if name not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}")
    forward = (["--quick"] if args.quick else []) + (["--real-devices"] if args.real_devices else []) + (
        ["--output", args.output] if args.output != str(common.RESULTS) else [])
    common.setup_devices(args.real_devices)
    status, walls, start = 0, {}, time.perf_counter()
    for name in args.only:
        print(f"== {name} ==", flush=True)
        t0 = time.perf_counter()
        try:
            status |= BENCHMARKS[name](forward, command="python -m benchmarks")
        except Exception:  # one broken benchmark must not hide the others' results
            traceback.print_exc()
            print(f"{name}: FAILED (its section of the results file is left as it was)", flush=True)
            status = 1
        walls[name] = time.perf_counter() - t0
    print("\nwall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())
          + f"; total {time.perf_counter() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
