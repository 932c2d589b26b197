"""The schedules by name: GPipe, 1F1B and interleaved built here, ZB-H1, ZB-H2 and ZB-V in
:mod:`spmd.pipeline.zero_bubble`; :func:`get_schedule` picks one. Each is a table
(:class:`spmd.pipeline.schedules.Schedule`) the engine runs; see docs/pipelines.md.
"""

from __future__ import annotations

from spmd.pipeline import zero_bubble
from spmd.pipeline.schedules import BACKWARD, FORWARD, NAMES, Op, Schedule, _simulate
from spmd.pipeline.timeline import _check_sizes


def gpipe(S: int, M: int) -> Schedule:
    """All forwards, then all backwards (in microbatch order)."""
    _check_sizes(S, M)
    orders = [[(FORWARD, m, 0) for m in range(M)] + [(BACKWARD, m, 0) for m in range(M)] for _ in range(S)]
    return Schedule("gpipe", S, M, 1, _simulate(S, M, 1, orders))


def _one_f_one_b_order(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    warmup = min(warmup, len(fwd))
    order = list(fwd[:warmup])
    for f, b in zip(fwd[warmup:], bwd):
        order += [f, b]
    order += bwd[len(fwd) - warmup:]
    return order


def one_f_one_b(S: int, M: int) -> Schedule:
    """Warm-up forwards (``S - s - 1`` on stage s), then alternate one forward / one backward."""
    _check_sizes(S, M)
    orders = []
    for s in range(S):
        fwd = [(FORWARD, m, 0) for m in range(M)]
        bwd = [(BACKWARD, m, 0) for m in range(M)]
        orders.append(_one_f_one_b_order(fwd, bwd, S - s - 1))
    return Schedule("1f1b", S, M, 1, _simulate(S, M, 1, orders))


def interleaved(S: int, M: int, V: int) -> Schedule:
    """Megatron's interleaved (circular) 1F1B: V chunks per device, chunk ``c = v*S + s`` on device s."""
    _check_sizes(S, M, V)
    if M % S:
        raise ValueError(f"interleaved schedule needs microbatches M={M} to be a multiple of stages S={S}")
    fwd = [(FORWARD, g * S + i, v) for g in range(M // S) for v in range(V) for i in range(S)]
    bwd = [(BACKWARD, g * S + i, v) for g in range(M // S) for v in reversed(range(V)) for i in range(S)]
    orders = [_one_f_one_b_order(fwd, bwd, (S - s - 1) * 2 + (V - 1) * S) for s in range(S)]
    return Schedule("interleaved", S, M, V, _simulate(S, M, V, orders))


def get_schedule(name: str, S: int, M: int, V: int = 1, *, n_layers: int | None = None) -> Schedule:
    """A schedule by name (one of :data:`NAMES`); checks ``n_layers % (S*V)``."""
    if name not in NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(NAMES)}")
    _check_sizes(S, M, V)
    if name == "zb-v" and V != 2:
        raise ValueError(f"schedule 'zb-v' runs V=2 chunks per stage (placed in a V); got virtual stages V={V}")
    if name not in ("interleaved", "zb-v") and V != 1:
        raise ValueError(f"schedule {name!r} has one chunk per stage; got virtual stages V={V} (use 'interleaved')")
    if n_layers is not None and n_layers % (S * V):
        raise ValueError(f"{n_layers} layers do not split into S*V = {S}*{V} = {S * V} equal chunks")
    if name == "gpipe":
        return gpipe(S, M)
    if name == "1f1b":
        return one_f_one_b(S, M)
    if name in ("zb-h1", "zb-h2"):
        return zero_bubble.zb_h1(S, M) if name == "zb-h1" else zero_bubble.zb_h2(S, M)
    if name == "zb-v":
        return zero_bubble.zb_v(S, M)
    return interleaved(S, M, V)
