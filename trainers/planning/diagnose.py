"""The static checks of one layout for the planner and the dry run, and the compiler log they read.

    diagnose(cfg.model, "dp_tp", {"data": 2, "tensor": 8}, global_batch=64) -> [Issue, ...]

:func:`diagnose` is the layout stage of the one checks pass (:func:`trainers.checks.check`); the
checks themselves live in :mod:`trainers.checks`. See docs/planning.md.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping

import spmd
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from trainers.checks import Issue, check
from trainers.model_variables import ModelVariables


def diagnose(model: GPTConfig | ModelVariables, rules: spmd.Rules | str, sizes: Mapping[str, int], *, global_batch: int,
             grad_accum: int = 1, pipeline: PipelineConfig | None = None, seq_len: int | None = None) -> list[Issue]:
    """The static checks (no compile) of one layout: divisibility, batch split, pipeline split, context
    and expert parallelism (the built-in GPT), large replicated params. ``model`` is the built-in GPT's
    config or any model's :class:`~trainers.model_variables.ModelVariables`."""
    return check(stages=("layout",), mesh_shape=sizes, model=model, rules=rules, global_batch=global_batch,
                 grad_accum=grad_accum, pipeline=pipeline, seq_len=seq_len)


@contextlib.contextmanager
def capture_stderr() -> Iterator[list[str]]:
    """Collect what C++ code (XLA) writes to file descriptor 2 inside the block; echoed afterwards.

    Yields a list that holds the captured text (one string) once the block ends.
    """
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            out.append(text)
            if text:
                sys.stderr.write(text)
