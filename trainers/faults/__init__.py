"""Fault tolerance inside a run: the loss-spike / non-finite guard and preemption signals.

    from trainers.faults import DivergenceError, PreemptionWatcher, read_events
"""

from trainers.faults.guard import DivergenceError, GuardEvent, read_events
from trainers.faults.preemption import PreemptionWatcher

__all__ = ["DivergenceError", "GuardEvent", "PreemptionWatcher", "read_events"]
