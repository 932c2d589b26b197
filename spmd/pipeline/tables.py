"""The table engine's per-device program: :func:`_build_tables` turns a :class:`Schedule` into int32
rows (op, microbatch, chunk, buffer slots, where each arriving activation goes); :func:`_sender` and
:func:`_receive` move activations between ticks: over ``pipe`` by channel (``up`` to the next stage,
``down`` to the previous one) or, where two consecutive chunks share a stage (a V's turn), locally.
See :mod:`spmd.pipeline.engine` and docs/pipelines.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd.pipeline.schedules import BACKWARD, DOWN, FORWARD, IDLE, LOCAL, UP, WEIGHT, Schedule, hop

# table fields; then per channel (UP, DOWN, LOCAL) the stash slot and the grad-buffer slot an
# activation arriving on it is written to (-1: none)
_KIND, _M, _V, _FIRST, _XSLOT, _GSLOT, _WSLOT = range(7)
_ARRIVE, N_FIELDS = 7, 13
_IDLE, _FWD, _FWD_LAST, _BWD, _WGT = range(5)  # _BWD: the whole backward, or B when the schedule has W
CHANNELS = {UP: "up", DOWN: "down", LOCAL: "local"}


def _intervals_to_slots(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Greedy interval colouring: ``(start, end, key)`` (inclusive ticks) -> slot; returns slots and count."""
    free_at: list[int] = []  # per slot: first tick it is free again
    slots = {}
    for start, end, key in sorted(intervals, key=lambda x: (x[0], x[1])):
        for i, free in enumerate(free_at):  # noqa: B007 - i is read after the loop
            if free <= start:
                break
        else:
            i = len(free_at)
            free_at.append(0)
        free_at[i] = end + 1
        slots[key] = i
    return slots, max(1, len(free_at))


def _build_tables(schedule: Schedule) -> tuple[np.ndarray, int, int, int]:
    """The per-device program of a schedule: int32 ``[ticks, S, 13]`` plus stash, grad-buffer and
    W-stash sizes.

    Per (tick, stage): kind (idle/fwd/fwd_last/bwd/wgt), m, v, first-chunk flag, the stash slot of the
    chunk input (held to the chunk's W when the schedule has W ops, else to its backward), the
    grad-buffer slot of the output gradient (held to the backward / B), the W-stash slot holding what
    W reads of B's backward, from B to W (-1: none), and per channel the stash / grad-buffer slot
    where the activation / gradient that arrives this tick (sent on the previous tick) is written.
    """
    S, C, T = schedule.n_stages, schedule.n_chunks, schedule.n_ticks
    ticks = schedule.ticks()
    has_b, split = schedule.has_backward, schedule.split_backward
    release = WEIGHT if split else BACKWARD
    x_iv: list[list[tuple[int, int, Any]]] = [[] for _ in range(S)]
    g_iv: list[list[tuple[int, int, Any]]] = [[] for _ in range(S)]
    w_iv: list[list[tuple[int, int, Any]]] = [[] for _ in range(S)]
    for (kind, m, c), t in ticks.items():
        s = schedule.stage_of(c)
        if kind == FORWARD and c > 0:
            end = ticks[(release, m, c)] if has_b else t
            x_iv[s].append((ticks[(FORWARD, m, c - 1)] + 1, end, (m, c)))
        if kind == BACKWARD:
            start = ticks[(FORWARD, m, c)] if c == C - 1 else ticks[(BACKWARD, m, c + 1)] + 1
            g_iv[s].append((start, t, (m, c)))
        if kind == WEIGHT:
            w_iv[s].append((ticks[(BACKWARD, m, c)], t, (m, c)))
    x_slots, g_slots, w_slots, n_x, n_g, n_w = {}, {}, {}, 1, 1, 1
    for s in range(S):
        xs, nx = _intervals_to_slots(x_iv[s])
        gs, ng = _intervals_to_slots(g_iv[s])
        ws, nw = _intervals_to_slots(w_iv[s])
        x_slots.update(xs)
        g_slots.update(gs)
        w_slots.update(ws)
        n_x, n_g, n_w = max(n_x, nx), max(n_g, ng), max(n_w, nw)
    table = np.full((T, S, N_FIELDS), -1, np.int32)
    table[..., _KIND] = _IDLE
    table[..., _FIRST] = 0
    for t in range(T):
        for s in range(S):
            kind, m, v = (int(x) for x in schedule.actions[t, s])
            if kind == IDLE:
                continue
            c = schedule.chunk(v, s)
            code = {BACKWARD: _BWD, WEIGHT: _WGT}.get(kind, _FWD_LAST if c == C - 1 else _FWD)
            table[t, s, :_XSLOT] = (code, m, v, int(c == 0))
            table[t, s, _XSLOT] = x_slots.get((m, c), -1)
            table[t, s, _GSLOT] = g_slots.get((m, c), -1) if has_b else -1
            table[t, s, _WSLOT] = w_slots.get((m, c), -1)
            to = hop(schedule, kind, c)
            if to is None or t + 1 >= T:
                continue
            dst, channel = to
            field = _ARRIVE + 2 * channel + (kind == BACKWARD)
            if table[t + 1, dst, field] >= 0:  # each channel is a shift: one arrival per stage and tick
                raise ValueError(f"tick {t + 1}: stage {dst} receives two activations on one channel")
            table[t + 1, dst, field] = x_slots[(m, c + 1)] if kind == FORWARD else g_slots[(m, c - 1)]
    return table, n_x, n_g, n_w if split else 0


def _arrivals(table: np.ndarray) -> tuple[tuple[str, str, int], ...]:
    """``(channel, buffer, field)`` for every channel and buffer some tick of ``table`` writes (static)."""
    return tuple((CHANNELS[ch], ("stash", "gbuf")[b], _ARRIVE + 2 * ch + b)
                 for ch in CHANNELS for b in (0, 1) if (table[..., _ARRIVE + 2 * ch + b] >= 0).any())


def _receive(c: dict, row: jax.Array, arrivals: tuple[tuple[str, str, int], ...]) -> dict:
    """Write what arrived on each channel (``c["recv"]``) into the stash / grad-buffer slot the row names."""
    for channel, buf, field in arrivals:
        slot = jnp.maximum(row[field], 0)
        c[buf] = c[buf].at[slot].set(jnp.where(row[field] >= 0, c["recv"][channel], c[buf][slot]))
    return c


def _sender(branches: tuple, axis: str, arrivals: tuple[tuple[str, str, int], ...]) -> Callable[[jax.Array, jax.Array], dict]:
    """``send(k, out) -> recv``: each stage's output of the tick (activation or input gradient) on the
    channels ``arrivals`` reads: branch 0 of the switch sends nothing, branch k the ``ppermute`` s of
    ``branches[k-1]`` (its up pairs, then its down pairs), k from the tick: the same on every device;
    ``local`` is the output itself. Both channels in one branch: as two independent conditionals, a
    program loaded back from the compile cache ran them concurrently and mixed the two exchanges
    (docs/pipelines.md)."""
    def permute(x, pairs):
        return jax.lax.ppermute(x, axis, list(pairs)) if pairs else jnp.zeros_like(x)

    def none(out):
        return jnp.zeros_like(out), jnp.zeros_like(out)

    fns = [none] + [functools.partial(lambda out, u, d: (permute(out, u), permute(out, d)), u=u, d=d)
                    for u, d in branches]
    used = {channel for channel, _, _ in arrivals}

    def send(k, out):
        up, down = jax.lax.switch(k, fns, out) if branches else none(out)
        return {name: x for name, x in (("up", up), ("down", down), ("local", out)) if name in used}

    return send
