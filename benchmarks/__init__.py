"""Benchmarks: how close each parallel layout is to its limit, run with ``python -m benchmarks``.

Each compares a measured figure with a limit (theory, hardware peak or a minimal baseline) and
writes its own section of ``benchmarks/RESULTS.md``; each also runs alone as
``python -m benchmarks.NAME [--quick]``.

The benchmarks and their order are ``benchmarks.common.ORDER``; what each measures is the first line
of its module's docstring (``python -m benchmarks --help`` lists them).

Shared parts (devices, machine description, timing, the GPT step, the results file) are in
``benchmarks.common``.
"""
