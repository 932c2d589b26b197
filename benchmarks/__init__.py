"""Benchmarks: how close each parallel layout is to its limit, run with ``python -m benchmarks``.

Each compares a measured figure with a limit (theory, hardware peak or a minimal baseline) and
writes its own section of ``benchmarks/RESULTS.md``; each also runs alone as
``python -m benchmarks.NAME [--quick]``.

- ``overhead``: the trainer's step time against a minimal hand-written ``jax.jit`` step.
- ``comms``: collective bytes of each layout's compiled step against the layout's minimum.
- ``steptime``: each comms layout's step time against the same step at the base commit.
- ``memory``: per-device training state against the ZeRO formulas; activation (temp) bytes.
- ``pipeline``: schedules' useful-work fraction against theory; step time against microbatches.
- ``mfu``: single-device model FLOP/s against the measured f32 GEMM peak; wasted matmul work.
- ``checkpoint``: save/restore throughput against raw disk bandwidth; loop blocking by a save.
- ``scaling``: compile time and per-device state as the device count grows 1 -> 8.
- ``gpu``: bf16 MFU of gpt-125m and gpt-350m on one GPU (skipped without one).

Shared parts (devices, machine description, timing, the GPT step, the results file) are in
``benchmarks.common``.
"""
