"""``python -m benchmarks [--real-devices] [options]``: run every benchmark in this package.

Options go to each benchmark's ``main``. Devices are configured once, before the first
benchmark starts the jax backend, so every benchmark here sees the same devices.
"""

from __future__ import annotations

import sys

from benchmarks import overhead

BENCHMARKS = {"overhead": overhead.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    status = 0
    for name, run in BENCHMARKS.items():
        print(f"== {name} ==", flush=True)
        status |= run(argv, command="python -m benchmarks")
    return status


if __name__ == "__main__":
    sys.exit(main())
