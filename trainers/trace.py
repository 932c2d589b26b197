"""Profiles of a run: a ``jax.profiler`` trace of chosen steps and device-memory profiles.

    spmd-train gpt-small --simulate-devices 8 --set run.profile_steps=5:7

writes the trace of steps 5 to 7 under ``<run_dir>/tensorboard/plugins/profile/`` (TensorBoard's
profile tab, Perfetto, ``xprof``); ``run.memory_profile_step=N`` (or ``kill -USR1 <pid>`` at any
time) writes ``<run_dir>/memory/step_<N>.prof`` (``pprof``). See docs/metrics.md, "Profiling".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import jax

log = logging.getLogger(__name__)

PROCESSES = ("first", "all")


def parse_steps(text: str) -> tuple[int, int] | None:
    """``"5:7"`` -> (5, 7), the first and last step to trace (inclusive); ``""`` -> None."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        first_i, last_i = int(first), int(last if sep else first)
    except ValueError:
        first_i = last_i = -1
    if first_i < 1 or last_i < first_i:
        raise ValueError(f"run.profile_steps={text!r} must be START:END with 1 <= START <= END (steps to trace, "
                         "inclusive), e.g. 5:7, or empty for none")
    return first_i, last_i


class StepProfiler:
    """Starts and stops the trace around the steps ``run.profile_steps`` names and writes memory profiles.

    ``before(n)`` is called before step ``n`` (1-based) runs, ``after(n, outputs)`` once it was dispatched.
    """

    def __init__(self, run_dir: str, profile_steps: str = "", processes: str = "first", memory_step: int = 0,
                 *, process_index: int | None = None):
        if processes not in PROCESSES:
            raise ValueError(f"run.profile_processes={processes!r}; valid: {', '.join(PROCESSES)}")
        here = jax.process_index() if process_index is None else process_index
        self.steps = parse_steps(profile_steps) if processes == "all" or here == 0 else None
        self.trace_dir = os.path.join(run_dir, "tensorboard")
        self.memory_dir = os.path.join(run_dir, "memory")
        self.memory_step = memory_step
        self.tracing = False
        self._memory_requested = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            self._previous = signal.signal(signal.SIGUSR1, lambda *_: self._memory_requested.set())

    def before(self, step: int) -> contextlib.AbstractContextManager:
        """Enter around the dispatch of step ``step``: starts the trace at the first traced step and
        names the step in it (TensorBoard's step-time breakdown reads the annotation)."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return contextlib.nullcontext()
        if not self.tracing:
            jax.profiler.start_trace(self.trace_dir)
            self.tracing = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, outputs: Any) -> str | None:
        """After step ``step``: stop the trace at the last traced step (once its work is done), and
        write a memory profile when due. The path written, if any."""
        written = None
        if self.tracing and step >= self.steps[1]:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.tracing = False
            written = os.path.join(self.trace_dir, "plugins", "profile")
            log.info("profile of steps %d-%d written under %s", *self.steps, written)
        if step == self.memory_step or self._memory_requested.is_set():
            self._memory_requested.clear()
            jax.block_until_ready(outputs)
            os.makedirs(self.memory_dir, exist_ok=True)
            written = os.path.join(self.memory_dir, f"step_{step}.prof")
            jax.profiler.save_device_memory_profile(written)
            log.info("device memory profile after step %d written to %s", step, written)
        return written

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)
            self._previous = None

