"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) as op orders.

Each backward is split into B (the gradient w.r.t. the chunk input, on the critical path) and W (the
weight gradient, which can wait and fill the bubble). With every op one tick, :func:`zb_h1` idles
``(S-1)/(3M+S-1)`` of the slots (M >= S) holding at most S inputs per stage, 1F1B's peak;
:func:`zb_h2` has the same table bubble (the floor for a synchronous step) at up to 2S inputs and
never idles once steps overlap, from M >= 2S. See docs/pipelines.md.
"""

from __future__ import annotations

from spmd.pipeline.schedules import BACKWARD, FORWARD, WEIGHT, Op, Schedule, _check_sizes, _simulate


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
