"""A schedule's timeline: op kinds, where each chunk runs, and the op placer the schedule builders share.

:func:`_simulate` places each stage's ops, in order, on the first tick whose inputs exist; the
result, ``actions[tick, stage]``, is the table of a :class:`spmd.pipeline.schedules.Schedule`.
"""

from __future__ import annotations

import numpy as np

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
PLACEMENTS = ("loop", "v")

Op = tuple[int, int, int]  # (kind, microbatch, virtual stage)


def _check_sizes(S: int, M: int, V: int = 1) -> None:
    for name, value in (("stages S", S), ("microbatches M", M), ("virtual stages V", V)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"pipeline schedule needs {name} >= 1, got {value!r}")


def chunk_at(S: int, V: int, placement: str, v: int, s: int) -> int:
    """The chunk that virtual stage v of device s runs: ``v*S + s`` in a loop; in a V (V = 2) chunk s
    for v = 0 and chunk ``2S-1-s`` for v = 1, so the stack goes down the devices and back up."""
    return 2 * S - 1 - s if placement == "v" and v == 1 else v * S + s


def device_of(S: int, placement: str, c: int) -> tuple[int, int]:
    """``(stage, v)`` running chunk c (inverse of :func:`chunk_at`)."""
    if placement == "v" and c >= S:
        return 2 * S - 1 - c, 1
    return c % S, c // S


def _simulate(S: int, M: int, V: int, orders: list[list[Op]], placement: str = "loop") -> np.ndarray:
    """Place each stage's ops, in order, on the first tick whose inputs exist."""
    C = S * V
    done: dict[tuple[int, int, int], int] = {}
    ptr = [0] * S
    rows: list[list[Op]] = []
    limit = 4 * sum(len(o) for o in orders) + 4 * C
    while any(ptr[s] < len(orders[s]) for s in range(S)):
        t = len(rows)
        if t > limit:
            raise ValueError(f"schedule deadlocks (S={S}, M={M}, V={V}): an op waits on one that never runs")
        row = [(IDLE, -1, -1)] * S
        for s in range(S):
            if ptr[s] >= len(orders[s]):
                continue
            kind, m, v = orders[s][ptr[s]]
            c = chunk_at(S, V, placement, v, s)
            if kind == FORWARD:
                ready = c == 0 or done.get((FORWARD, m, c - 1), t) < t
            elif kind == WEIGHT:
                ready = done.get((BACKWARD, m, c), t) < t
            else:
                ready = done.get((FORWARD, m, c), t) < t and (c == C - 1 or done.get((BACKWARD, m, c + 1), t) < t)
            if ready:
                row[s] = (kind, m, v)
        for s, (kind, m, v) in enumerate(row):
            if kind != IDLE:
                done[(kind, m, chunk_at(S, V, placement, v, s))] = t
                ptr[s] += 1
        rows.append(row)
    return np.asarray(rows, dtype=np.int32).reshape(len(rows), S, 3)
