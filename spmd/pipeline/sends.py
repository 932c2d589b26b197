"""What the table engine sends over ``pipe``: one activation per chunk boundary a microbatch crosses.

A forward of chunk c < C-1 (C = S*V) sends its output ``x[B/M, L, D]`` to chunk c+1's device, a
backward of chunk c > 0 its input gradient to chunk c-1's (none where both are on one device):
M*(C-1) activations each way in a loop, M*(C-2) in ZB-V's V, the minimum.
:func:`spmd.pipeline.schedules.send_plan` lists each tick's (source, target) pairs; the engine runs
a tick's ``ppermute`` s with exactly those pairs, both channels in one ``lax.switch`` branch picked
by the tick (the same on every device), none on a tick without sends; ``sent_bytes`` counts that
from the table. :func:`hlo_sent_bytes` reads the compiled program and weighs each switch branch by
how often the table takes it; :func:`hlo_branch_counts` weighs the collectives of the compute switch
by the ticks each stage runs each op. See docs/pipelines.md.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from jax.sharding import Mesh

from spmd import hlo
from spmd.pipeline.schedules import BACKWARD, IDLE, WEIGHT, Schedule, send_plan

_PERMUTE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\bcollective-permute(?:-start)?\(")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _branches(comps: list[hlo.Computation]) -> dict[str, tuple[str, int]]:
    """branch computation -> (conditional instruction, branch index)."""
    out = {}
    for comp in comps:
        for line in comp.lines:
            if " conditional(" not in line:
                continue
            instr = line.split("=", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = re.findall(r"%?([\w.\-]+)", m.group(1)) if m else [
                re.search(rf"{k}=%?([\w.\-]+)", line).group(1) for k in ("false_computation", "true_computation")]
            out.update({name: (instr, i) for i, name in enumerate(names)})
    return out


def gpipe_sends(S: int, M: int) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """GPipe's forward ticks ``0 .. M+S-2`` in runs that send over the same stage pairs: ``(first, end, pairs)``.

    At tick t stage s sends microbatch t - s on to s + 1 only when it is one (0 <= t - s < M, s < S - 1):
    the fill ticks send from fewer stages, the drain ticks too, the last from none. So a pass sends exactly
    ``M (S - 1)`` activations (a permute on every tick over every pair sent ``(M + S - 1)(S - 1)``)."""
    runs: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    for t in range(M + S - 1):
        pairs = tuple((s, s + 1) for s in range(max(0, t - M + 1), min(t, S - 2) + 1))
        if runs and runs[-1][2] == pairs:
            runs[-1] = (runs[-1][0], t + 1, pairs)
        else:
            runs.append((t, t + 1, pairs))
    return runs


def hlo_sent_bytes(compiled: Any, schedule: Schedule, mesh: Mesh, axis: str = "pipe") -> dict[str, int]:
    """Collective-permute bytes over ``axis`` per step in a compiled program, summed over the stage pairs
    of one pipeline (``{"executed": ..., "unattributed": ...}``).

    A permute in branch k of a conditional counts once per tick the table takes that branch (its pairs
    must be the plan's pattern k for one direction); any other permute counts its pairs on every
    execution XLA's loop trip counts give (``unattributed``: the engine should have none).
    """
    names = list(mesh.axis_names)
    pipe_dim, n_pipes = names.index(axis), mesh.devices.size // mesh.shape[axis]
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    branches, index = send_plan(schedule).branches()
    comps = hlo.computations(compiled)
    branch_of = _branches(comps)
    nbytes = {op.name: op.bytes for op in hlo.collectives(compiled, mesh) if op.kind == "collective-permute"}
    executed = unattributed = 0
    for comp in comps:
        for line in comp.lines:
            m = _PERMUTE.match(line)
            if not m or m.group(1) not in nbytes or not comp.count:
                continue
            raw = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", _PAIRS.search(line).group(1))]
            pairs = tuple(sorted({(int(coords[a][pipe_dim]), int(coords[b][pipe_dim])) for a, b in raw}))
            if comp.name not in branch_of:
                unattributed += comp.count * len(raw) // n_pipes * nbytes[m.group(1)]
                continue
            instr, k = branch_of[comp.name]
            if not 0 < k <= len(branches) or pairs not in branches[k - 1]:
                raise ValueError(f"collective-permute {m.group(1)} in branch {k} of conditional {instr} sends {pairs}, "
                                 f"which the send plan's branch {k} does not send; cannot attribute it")
            if comp.count % schedule.n_ticks:
                raise ValueError(f"conditional {instr} runs {comp.count} times per step, not a multiple of the "
                                 f"schedule's {schedule.n_ticks} ticks: it is not the engine's tick loop")
            executed += int((index == k).sum()) * (comp.count // schedule.n_ticks) * len(pairs) * nbytes[m.group(1)]
    return {"executed": executed, "unattributed": unattributed}


_CALLS = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*\b(?:all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def _callees(comp: hlo.Computation) -> list[str]:
    """The computations ``comp`` calls: loop bodies and conditions, calls, branches."""
    out = []
    for line in comp.lines:
        out += _CALLS.findall(line)
        for group in _BRANCHES.findall(line):
            out += re.findall(r"%?([\w.\-]+)", group)
    return out


def branch_ticks(schedule: Schedule) -> np.ndarray:
    """``[S, 5]``: per stage, the ticks the table engine's compute switch takes each branch (idle, forward,
    last chunk's forward with the head, backward or B, W), as :mod:`spmd.pipeline.engine` codes its ops."""
    out = np.zeros((schedule.n_stages, 5), np.int64)
    for t in range(schedule.n_ticks):
        for s in range(schedule.n_stages):
            kind, _, v = (int(x) for x in schedule.actions[t, s])
            last = schedule.chunk(v, s) == schedule.n_chunks - 1
            out[s, {IDLE: 0, BACKWARD: 3, WEIGHT: 4}.get(kind, 2 if last else 1)] += 1
    return out


def compute_branches(comps: dict[str, hlo.Computation], schedule: Schedule) -> tuple[np.ndarray, dict[str, set[int]]]:
    """``(ticks[S, branches], {computation: the compute branches it runs under})`` of the table engine's
    compute switch (a conditional with one branch per op kind, run a multiple of the ticks per step);
    ``ticks`` as :func:`branch_ticks`, the op codes past the switch's last branch counted in it."""
    n_branches = 5 if schedule.split_backward else 4
    ticks = branch_ticks(schedule)
    ticks[:, n_branches - 1] += ticks[:, n_branches:].sum(1)  # the engine clamps the op code to its last branch
    under: dict[str, set[int]] = {}
    for comp in comps.values():
        if not comp.count or comp.count % schedule.n_ticks:
            continue
        for line in comp.lines:
            found = _BRANCHES.search(line) if " conditional(" in line else None
            names = re.findall(r"%?([\w.\-]+)", found.group(1)) if found else []
            if len(names) != n_branches:
                continue
            for k, name in enumerate(names):
                todo = [name]
                while todo:
                    c = todo.pop()
                    if c in comps and k not in under.setdefault(c, set()):
                        under[c].add(k)
                        todo += _callees(comps[c])
    return ticks, under


def hlo_branch_counts(compiled: Any, schedule: Schedule) -> dict[str, tuple[int, ...]]:
    """Per stage, the executions per step of each collective instruction (by name) inside the compute
    switch of the table engine's tick loop (a conditional with one branch per op kind, run a multiple
    of the ticks per step): its every-branch-every-tick count divided by the ticks, times the ticks that
    stage takes the branch holding it (:func:`branch_ticks`). Collectives elsewhere are absent."""
    comps = {c.name: c for c in hlo.computations(compiled)}
    ticks, under = compute_branches(comps, schedule)
    out = {}
    for name, ks in under.items():
        comp = comps[name]
        for line in comp.lines:
            m = _COLLECTIVE.match(line)
            if m and comp.count:
                per_tick = comp.count / schedule.n_ticks
                out[m.group(1)] = tuple(int(round(per_tick * sum(int(ticks[s, k]) for k in ks)))
                                        for s in range(schedule.n_stages))
    return out
