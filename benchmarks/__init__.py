"""Benchmarks of the toolkit's own cost, run with ``python -m benchmarks`` (all) and written to RESULTS.md.

- ``benchmarks.overhead``: the trainer's step time against a minimal hand-written ``jax.jit`` step.
"""
