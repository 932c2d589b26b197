"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as op orders.

Each backward is split into B (the gradient w.r.t. the chunk input, on the critical path) and W (the
weight gradient, which can wait and fill the bubble). With every op one tick, :func:`zb_h1` idles
``(S-1)/(3M+S-1)`` of the slots (M >= S) holding at most S inputs per stage, 1F1B's peak;
:func:`zb_h2` has the same table bubble (the floor for a synchronous step) at up to 2S inputs and
never idles once steps overlap, from M >= 2S. :func:`zb_v` puts two chunks on each device in a V
(chunks s and 2S-1-s) and idles ``(S-1)/(6M+S-1)`` (M a multiple of S) at 1F1B's activation memory.
See docs/pipelines.md.
"""

from __future__ import annotations

import numpy as np

from spmd.pipeline.schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Op, Schedule, _simulate
from spmd.pipeline.timeline import _check_sizes


def _zb_h1_order(S: int, M: int, s: int) -> list[Op]:
    """Stage s: 1F1B's ``S - s - 1`` warm-up forwards; ``s`` rounds of F, B with W deferred; F, B, W
    while forwards remain; then B, W; then the ``s`` deferred W's fill the tail."""
    f = b = w = 0
    order: list[Op] = []

    def op(kind: int, m: int) -> int:
        order.append((kind, m, 0))
        return m + 1

    for _ in range(min(S - s - 1, M)):
        f = op(FORWARD, f)
    for _ in range(s):
        if f < M:
            f, b = op(FORWARD, f), op(BACKWARD, b)
    while f < M:
        f, b, w = op(FORWARD, f), op(BACKWARD, b), op(WEIGHT, w)
    while b < M:
        b, w = op(BACKWARD, b), op(WEIGHT, w)
    while w < M:
        w = op(WEIGHT, w)
    return order


def zb_h1(S: int, M: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2024): 1F1B with each backward split into B and a deferred W that
    fills the cool-down; at most S inputs held per stage (1F1B's peak). Bubble (S-1)/(3M+S-1), M >= S."""
    _check_sizes(S, M)
    return Schedule("zb-h1", S, M, 1, _simulate(S, M, 1, [_zb_h1_order(S, M, s) for s in range(S)]))


def _zb_h2_orders(S: int, M: int, limit: int) -> list[list[Op]]:
    """List scheduling, tick by tick: each stage runs its next B when its gradient has arrived, else
    its next F when its input has arrived and fewer than ``limit`` microbatches wait for their W,
    else its oldest pending W."""
    orders: list[list[Op]] = [[] for _ in range(S)]
    done: dict[tuple[int, int, int], int] = {}
    nf, nb, nw = [0] * S, [0] * S, [0] * S
    t = 0
    while any(n < M for n in nw):
        row = []
        for s in range(S):
            if nb[s] < nf[s] and (s == S - 1 or done.get((BACKWARD, nb[s], s + 1), t) < t):
                row.append((BACKWARD, nb[s]))
            elif nf[s] < M and nf[s] - nw[s] < limit and (s == 0 or done.get((FORWARD, nf[s], s - 1), t) < t):
                row.append((FORWARD, nf[s]))
            elif nw[s] < nb[s]:
                row.append((WEIGHT, nw[s]))
            else:
                row.append(None)
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], op[1], s)] = t
                orders[s].append((op[0], op[1], 0))
                counter = {FORWARD: nf, BACKWARD: nb, WEIGHT: nw}[op[0]]
                counter[s] += 1
        t += 1
    return orders


def zb_h2(S: int, M: int) -> Schedule:
    """Zero-bubble ZB-H2: B first, else a forward while fewer than 2S-1 microbatches wait for their W,
    else a W. Same table bubble as ZB-H1 (the floor with a synchronous step), more memory; with steps
    overlapping its stages never idle once M >= 2S (:attr:`Schedule.overlapped_bubble_fraction`)."""
    _check_sizes(S, M)
    return Schedule("zb-h2", S, M, 1, _simulate(S, M, 1, _zb_h2_orders(S, M, 2 * S - 1)))


def _zb_v_rows(S: int, M: int) -> list[list[Op]]:
    """List scheduling over the V, tick by tick: each device runs, in this order of preference, the
    oldest W of the microbatch that keeps the next one from starting (at most S microbatches are in
    flight: microbatch m enters when m - S is done everywhere), the B of either chunk whose gradient
    has arrived, the forward of its second chunk, then of its first, the oldest W; else it idles."""
    C = 2 * S
    rows: list[list[Op]] = []
    done: dict[tuple[int, int, int], int] = {}
    nxt = {k: [[0, 0] for _ in range(S)] for k in (FORWARD, BACKWARD, WEIGHT)}  # per device and v: next m

    def ready(kind: int, s: int, v: int, t: int) -> bool:
        m, c = nxt[kind][s][v], (s, C - 1 - s)[v]
        if kind == FORWARD:
            return m < M and (c == 0 or done.get((FORWARD, m, c - 1), t) < t)
        if kind == BACKWARD:
            return m < nxt[FORWARD][s][v] and done[(FORWARD, m, c)] < t and (
                c == C - 1 or done.get((BACKWARD, m, c + 1), t) < t)
        return m < nxt[BACKWARD][s][v] and done[(BACKWARD, m, c)] < t

    while any(m < M for per in nxt[WEIGHT] for m in per):
        t = len(rows)
        oldest = min(min(per) for per in nxt[WEIGHT])  # microbatches below it are done on every device
        full = oldest + S <= nxt[FORWARD][0][0] < M
        row: list[Op] = []
        for s in range(S):
            urgent = [(WEIGHT, v) for v in (0, 1) if full and nxt[WEIGHT][s][v] == oldest and ready(WEIGHT, s, v, t)]
            bs = [(BACKWARD, v) for v in (0, 1) if ready(BACKWARD, s, v, t)]
            fs = [(FORWARD, v) for v in (1, 0) if ready(FORWARD, s, v, t) and not (s == v == 0 and full)]
            ws = [(WEIGHT, v) for _, v in sorted((nxt[WEIGHT][s][v], v) for v in (0, 1) if ready(WEIGHT, s, v, t))]
            kind, v = (urgent + bs + fs + ws + [(IDLE, -1)])[0]
            row.append((kind, nxt[kind][s][v] if kind != IDLE else -1, v))
        for s, (kind, m, v) in enumerate(row):
            if kind != IDLE:
                done[(kind, m, (s, C - 1 - s)[v])] = t
                nxt[kind][s][v] += 1
        rows.append(row)
    return rows


def zb_v(S: int, M: int) -> Schedule:
    """Zero-bubble ZB-V (Qi et al., 2024): V = 2 chunks per device placed in a V, chunk c on device c
    for c < S and on ``2S-1-c`` after, so the last chunk and its loss head sit on device 0 and the
    turn S-1 -> S stays on device S-1; backward split into B and W, ops chosen by :func:`_zb_v_rows`.
    With every chunk op one tick: ``6M + S - 1`` ticks, bubble ``(S-1)/(6M+S-1)`` (half ZB-H1's in
    stage units), at most 2S chunk inputs held per device, 1F1B's S stage inputs. Needs M % S == 0."""
    _check_sizes(S, M)
    if M % S:
        raise ValueError(f"schedule 'zb-v' needs microbatches M={M} to be a multiple of stages S={S} (M >= S)")
    actions = np.asarray(_zb_v_rows(S, M), np.int32).reshape(-1, S, 3)
    schedule = Schedule("zb-v", S, M, 2, actions, placement="v")
    schedule.validate()
    return schedule
