"""Preemption: turn SIGTERM/SIGINT into "finish this step, checkpoint it, exit cleanly".

:class:`PreemptionWatcher` installs handlers for a ``with`` block (a signal ignored when it starts,
as SIGINT in a background job, stays ignored); every process agrees on the step to stop at.
:func:`barrier` is a bounded wait for all processes. See docs/faults.md.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import jax
import numpy as np

from meshes import compat

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatcher:
    """Context manager: records stop requests from signals (or :meth:`request`) and agrees on them.

    SIGINT is taken over at the first :meth:`should_stop` (after the first step), unless ``defer_sigint=False``:
    a Ctrl-C before it, while the state is made and the step compiles, has nothing to save and keeps the
    handler it had (``spmd-train``: exit 130 within a second, even mid-compile)."""

    def __init__(self, signals: Sequence[int] = DEFAULT_SIGNALS, *, check_every: int = 1,
                 defer_sigint: bool = True) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")
        valid = set(signal.valid_signals())
        for sig in signals:
            if sig not in valid or sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"cannot watch signal {sig!r}; use catchable signals such as SIGTERM, SIGINT")
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.check_every = check_every
        self.reason: str | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._agreed = False
        self._warned = False  # a second Ctrl-C during the stop's save was answered with a warning
        # Ctrl-C before the first step (state creation, the first compile: nothing to save yet) keeps the
        # handler it had (spmd-train: exit 130 within a second); the watcher takes SIGINT at the first should_stop
        self._deferred = defer_sigint and signal.SIGINT in self.signals
        self._inside = False

    # ------------------------------------------------------------------ handlers
    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: signal handlers not installed; only request() can stop the run")
            return self
        self._inside = True
        for sig in self.signals:
            if sig == signal.SIGINT and self._deferred:
                continue
            self._install(sig)
        return self

    def _install(self, sig: signal.Signals) -> None:
        if signal.getsignal(sig) is signal.SIG_IGN:  # ignored when we started (a background job, nohup): stays so
            return
        self._previous[sig] = signal.signal(sig, self._handle)

    def __exit__(self, *exc: object) -> None:
        self._inside = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None and signum == signal.SIGINT:
            if self._agreed and not self._warned:  # the stop's checkpoint is being written: keep it unless insisted
                self._warned = True
                log.warning("Ctrl-C: still writing the checkpoint of the step the run stops at; Ctrl-C once more "
                            "abandons it (the older checkpoints stay)")
                return
            raise KeyboardInterrupt(f"second {name} while stopping")
        if self.reason is None:
            self.reason = name
            log.warning("received %s: finishing the current step, then checkpointing and exiting", name)

    def request(self, reason: str = "requested") -> None:
        """Ask for a stop as a signal would (tests, hooks, a cluster API poller)."""
        if self.reason is None:
            self.reason = reason

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop (not yet agreed with the others)."""
        return self.reason is not None

    # ------------------------------------------------------------------ agreement
    def should_stop(self, step: int) -> bool:
        """Whether every process stops after ``step``; call it on every process after every step.

        One process: the local flag. Many: at steps that are multiples of ``check_every`` an
        allgather of the flags, True for all if any process asked (and stays True).
        """
        if self._deferred:  # a step has run: from now on Ctrl-C stops at a step and saves it
            self._deferred = False
            if self._inside and threading.current_thread() is threading.main_thread():
                self._install(signal.SIGINT)
        if self._agreed:
            return True
        if jax.process_count() == 1:
            self._agreed = self.requested
        elif step % self.check_every == 0:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.asarray(self.requested, dtype=np.int32))
            if np.any(flags):
                asked = [i for i, f in enumerate(np.ravel(flags)) if f]
                self._agreed = True
                if self.reason is None:
                    self.reason = f"stop requested on process(es) {asked}"
        return self._agreed


def barrier(name: str, timeout_s: float) -> None:
    """Wait until every process reaches ``barrier(name)``; TimeoutError after ``timeout_s`` seconds."""
    if not name or timeout_s <= 0:
        raise ValueError(f"barrier needs a non-empty name and timeout_s > 0, got {name!r}, {timeout_s!r}")
    if jax.process_count() == 1:
        return
    client = compat.distributed_client()
    if client is None:  # started without jax.distributed: fall back to a device barrier (unbounded)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as exc:  # the coordination service reports DEADLINE_EXCEEDED as a generic error
        raise TimeoutError(
            f"barrier {name!r}: not every one of {jax.process_count()} processes arrived within {timeout_s} s "
            f"(process {jax.process_index()} waited): {exc}"
        ) from exc
