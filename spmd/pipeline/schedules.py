"""Pipeline schedules as data: which stage does what on which tick.

A :class:`Schedule` is a table ``actions[tick, stage] = (kind, m, v)``, built in
:mod:`spmd.pipeline.builders` (GPipe, 1F1B, interleaved) or :mod:`spmd.pipeline.zero_bubble`
(whose backward is split into B, the input gradient, and W, the weight gradient); the bubble is
what the order of ops implies. Its ``placement`` says which device runs chunk c: ``"loop"``
(``c % S``) or ``"v"`` (ZB-V). :func:`send_plan` / :func:`sent_bytes`: what a table sends.

    print(get_schedule("1f1b", 4, 8).timeline())

See docs/pipelines.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from spmd.pipeline.timeline import (
    BACKWARD,
    FORWARD,
    IDLE,
    NAMES,
    PLACEMENTS,
    WEIGHT,
    Op,
    _simulate,
    chunk_at,
    device_of,
)

__all__ = ["BACKWARD", "FORWARD", "IDLE", "NAMES", "PLACEMENTS", "WEIGHT", "Op", "Schedule", "SendPlan", "SentBytes",
           "chunk_at", "device_of", "hop", "minimum_sends", "send_plan", "sent_bytes"]
_LETTER = {FORWARD: "F", BACKWARD: "B", WEIGHT: "W"}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """``actions[tick, stage] = (kind, m, v)`` (kind IDLE/FORWARD/BACKWARD/WEIGHT; m, v = -1 when idle).

    With WEIGHT ops (a split schedule) BACKWARD is the input-gradient half B only and WEIGHT the
    deferred weight gradient W; without them BACKWARD is the whole backward."""

    name: str
    n_stages: int
    n_microbatches: int
    n_virtual: int
    actions: np.ndarray  # int32 [n_ticks, n_stages, 3]
    placement: str = "loop"  # chunk c on device c % S ("loop") or in a V ("v", V = 2): :func:`chunk_at`

    def __post_init__(self) -> None:
        a = np.asarray(self.actions, dtype=np.int32)
        if a.ndim != 3 or a.shape[1:] != (self.n_stages, 3):
            raise ValueError(f"schedule actions must have shape [ticks, {self.n_stages}, 3], got {a.shape}")
        if self.placement not in PLACEMENTS or (self.placement == "v" and self.n_virtual != 2):
            raise ValueError(f"schedule placement {self.placement!r} with V={self.n_virtual}: valid are 'loop' "
                             f"(any V) and 'v' (V = 2)")
        object.__setattr__(self, "actions", a)

    def chunk(self, v: int, s: int) -> int:
        """The chunk virtual stage v of stage s runs (:func:`chunk_at`)."""
        return chunk_at(self.n_stages, self.n_virtual, self.placement, v, s)

    def stage_of(self, c: int) -> int:
        """The stage that runs chunk c: ``c % S`` in a loop, ``min(c, 2S-1-c)`` in a V."""
        return device_of(self.n_stages, self.placement, c)[0]

    @property
    def n_ticks(self) -> int:
        return int(self.actions.shape[0])

    @property
    def n_chunks(self) -> int:
        return self.n_stages * self.n_virtual

    @property
    def busy(self) -> int:
        return int((self.actions[..., 0] != IDLE).sum())

    @property
    def bubble_fraction(self) -> float:
        """Idle (tick, stage) slots / all slots."""
        total = self.n_ticks * self.n_stages
        return (total - self.busy) / total

    @property
    def has_backward(self) -> bool:
        return bool((self.actions[..., 0] == BACKWARD).any())

    @property
    def split_backward(self) -> bool:
        """True when the backward runs as B (input gradient) + W (weight gradient) ops."""
        return bool((self.actions[..., 0] == WEIGHT).any())

    @property
    def overlapped_bubble_fraction(self) -> float:
        """Idle share if every stage started the next step as soon as it finished this one (steps
        overlapping, as the zero-bubble paper's optimizer post-validation allows): 1 - busy / (S x the
        longest first-to-last-op span of a stage). This engine's steps are synchronous: what it runs
        is :attr:`bubble_fraction`."""
        busy = self.actions[..., 0] != IDLE
        spans = [np.nonzero(busy[:, s])[0] for s in range(self.n_stages)]
        period = max(int(t[-1] - t[0] + 1) for t in spans if len(t))
        return 1 - self.busy / (period * self.n_stages)

    def op_costs(self) -> dict[int, int]:
        """Cost of each op kind as the table engine runs it, in forwards of one chunk: F = 1; the
        whole backward B = 3 (recompute + input and weight gradients); split, B = 2 (recompute +
        input gradient) and W = 1 (weight gradient from B's residuals). gpipe (autodiff): B = 2."""
        if self.split_backward:
            return {FORWARD: 1, BACKWARD: 2, WEIGHT: 1}
        return {FORWARD: 1, BACKWARD: 2 if self.name == "gpipe" else 3}

    def lockstep_time(self, costs: Mapping[int, float] | None = None) -> float:
        """Step time in chunk forwards when all stages advance tick by tick (each tick as long as its
        slowest op, as the engine's scan runs): sum over ticks of the max op cost (:meth:`op_costs`)."""
        costs = self.op_costs() if costs is None else costs
        lut = np.zeros(4)
        for kind, cost in costs.items():
            lut[kind] = cost
        return float(lut[self.actions[..., 0]].max(axis=1).sum())

    def ticks(self) -> dict[tuple[int, int, int], int]:
        """{(kind, m, chunk): tick} for every op in the table."""
        out = {}
        for t, s in zip(*np.nonzero(self.actions[..., 0])):
            kind, m, v = (int(x) for x in self.actions[t, s])
            out[(kind, m, self.chunk(v, int(s)))] = int(t)
        return out

    def _release(self) -> int:
        """The op after which a chunk input is no longer needed: W when split, else B."""
        return WEIGHT if self.split_backward else BACKWARD

    def in_flight(self) -> np.ndarray:
        """Per stage, the most chunk inputs held at once (one per microbatch and chunk): from the tick
        an input arrives (or, for the first chunk, its forward) to the tick of its W (split), else its
        backward (or its forward, without one). A chunk holds ``L/(S*V)`` layers, so with V > 1 an
        input stands for a V-th of a one-chunk stage's activations: compare ``in_flight() / V``."""
        S, ticks, rel = self.n_stages, self.ticks(), self._release()
        count = np.zeros((self.n_ticks + 1, S), np.int64)
        for (kind, m, c), t in ticks.items():
            if kind != FORWARD:
                continue
            start = t if c == 0 else ticks[(FORWARD, m, c - 1)] + 1
            end = ticks.get((rel, m, c), t)
            count[start:end + 1, self.stage_of(c)] += 1
        return count.max(axis=0)

    @property
    def max_in_flight(self) -> int:
        return int(self.in_flight().max())

    def stash_sizes(self) -> tuple[int, int]:
        """Buffer slots a stage of the table engine needs (at least 1 each): stashed chunk inputs, held
        from the tick one arrives to its chunk's W (split) or backward (its forward, without one);
        output gradients, from the tick one arrives to its backward. The most held at once on any stage."""
        S, C, ticks, rel = self.n_stages, self.n_chunks, self.ticks(), self._release()
        x_held, g_held = (np.zeros((self.n_ticks + 1, S), np.int64) for _ in range(2))
        for (kind, m, c), t in ticks.items():
            if kind == FORWARD and c > 0:
                x_held[ticks[(FORWARD, m, c - 1)] + 1:ticks.get((rel, m, c), t) + 1, self.stage_of(c)] += 1
            elif kind == BACKWARD:
                start = ticks[(FORWARD, m, c)] if c == C - 1 else ticks[(BACKWARD, m, c + 1)] + 1
                g_held[start:t + 1, self.stage_of(c)] += 1
        return max(1, int(x_held.max())), max(1, int(g_held.max()))

    def weight_stash_size(self) -> int:
        """Split schedules: the most microbatches between their B and W on any stage (each holds
        what its W reads of B's backward, :class:`spmd.pipeline.split.SplitBackward`); 0 without W ops."""
        if not self.split_backward:
            return 0
        ticks = self.ticks()
        held = np.zeros((self.n_ticks + 1, self.n_stages), np.int64)
        for (kind, m, c), t in ticks.items():
            if kind == WEIGHT:
                held[ticks[(BACKWARD, m, c)]:t + 1, self.stage_of(c)] += 1
        return int(held.max())

    def sent_bytes(self, activation_bytes: int):
        """Bytes per step the table engine sends over ``pipe`` for activations of ``activation_bytes``
        (``[B/M, L, D]``), with the minimum and per stage: :func:`sent_bytes`."""
        return sent_bytes(self, activation_bytes)

    def validate(self) -> None:
        """Raise ValueError unless every op appears once and every data dependency is met."""
        S, M, C = self.n_stages, self.n_microbatches, self.n_chunks
        seen: dict[tuple[int, int, int], int] = {}
        for t in range(self.n_ticks):
            for s in range(S):
                kind, m, v = (int(x) for x in self.actions[t, s])
                if kind == IDLE:
                    continue
                if kind not in _LETTER or not (0 <= m < M) or not (0 <= v < self.n_virtual):
                    raise ValueError(f"tick {t} stage {s}: invalid action {(kind, m, v)} for M={M}, V={self.n_virtual}")
                key = (kind, m, self.chunk(v, s))
                if key in seen:
                    raise ValueError(f"{_LETTER[kind]}{m} of chunk {key[2]} runs twice (ticks {seen[key]} and {t})")
                seen[key] = t
        kinds: tuple[int, ...] = (FORWARD, BACKWARD) if self.has_backward else (FORWARD,)
        kinds += (WEIGHT,) if self.split_backward else ()
        for kind in kinds:
            for m in range(M):
                for c in range(C):
                    if (kind, m, c) not in seen:
                        raise ValueError(f"{_LETTER[kind]}{m} of chunk {c} is missing from the schedule")
        for (kind, m, c), t in seen.items():
            if kind == FORWARD and c > 0 and seen[(FORWARD, m, c - 1)] >= t:
                raise ValueError(f"F{m} of chunk {c} at tick {t} runs before F{m} of chunk {c - 1} "
                                 f"finished (tick {seen[(FORWARD, m, c - 1)]})")
            if kind == BACKWARD:
                if seen[(FORWARD, m, c)] >= t:
                    raise ValueError(f"B{m} of chunk {c} at tick {t} precedes its forward (tick {seen[(FORWARD, m, c)]})")
                if c < C - 1 and seen[(BACKWARD, m, c + 1)] >= t:
                    raise ValueError(f"B{m} of chunk {c} at tick {t} runs before B{m} of chunk {c + 1} "
                                     f"finished (tick {seen[(BACKWARD, m, c + 1)]})")
            if kind == WEIGHT and seen.get((BACKWARD, m, c), t) >= t:
                raise ValueError(f"W{m} of chunk {c} at tick {t} does not follow its B (tick "
                                 f"{seen.get((BACKWARD, m, c), 'missing')})")

    def timeline(self) -> str:
        """Rows = stages, columns = ticks: ``F3`` forward of microbatch 3, ``B0.1`` backward of m=0, v=1,
        ``W2`` weight gradient of microbatch 2."""
        cells = [[self._cell(t, s) for t in range(self.n_ticks)] for s in range(self.n_stages)]
        width = max(len(c) for row in cells for c in row)
        head = (f"{self.name}: S={self.n_stages} M={self.n_microbatches} V={self.n_virtual}, "
                f"{self.n_ticks} ticks, bubble {self.bubble_fraction:.3f}")
        rows = [f"s{s}: " + " ".join(c.ljust(width) for c in row).rstrip() for s, row in enumerate(cells)]
        return "\n".join([head, *rows])

    def _cell(self, t: int, s: int) -> str:
        kind, m, v = (int(x) for x in self.actions[t, s])
        if kind == IDLE:
            return "."
        return f"{_LETTER[kind]}{m}" + (f".{v}" if self.n_virtual > 1 else "")

    __str__ = timeline

    def gantt(self, ax=None):
        """Draw the table as a Gantt chart (one bar per busy slot); returns the matplotlib Axes."""
        import matplotlib.pyplot as plt  # lazily: plotting is optional

        if ax is None:
            _, ax = plt.subplots(figsize=(max(4.0, 0.35 * self.n_ticks), 0.5 * self.n_stages + 1))
        colors = {FORWARD: "tab:blue", BACKWARD: "tab:orange", WEIGHT: "tab:green"}
        for t, s in zip(*np.nonzero(self.actions[..., 0])):
            kind = int(self.actions[t, s, 0])
            ax.broken_barh([(int(t), 1)], (int(s) - 0.4, 0.8), facecolors=colors[kind], edgecolor="k", linewidth=0.3)
            ax.text(int(t) + 0.5, int(s), self._cell(int(t), int(s)), ha="center", va="center", fontsize=6)
        ax.set_xlim(0, self.n_ticks)
        ax.set_ylim(self.n_stages - 0.5, -0.5)
        ax.set_yticks(range(self.n_stages), [f"stage {s}" for s in range(self.n_stages)])
        ax.set_xlabel("tick")
        ax.set_title(f"{self.name} S={self.n_stages} M={self.n_microbatches} V={self.n_virtual}")
        return ax

    def forward_only(self) -> Schedule:
        """The same per-stage forward order with the backwards removed (for evaluation)."""
        orders: list[list[Op]] = []
        for s in range(self.n_stages):
            col = self.actions[:, s]
            orders.append([(int(a[0]), int(a[1]), int(a[2])) for a in col if a[0] == FORWARD])
        table = _simulate(self.n_stages, self.n_microbatches, self.n_virtual, orders, self.placement)
        return Schedule(self.name + "-forward", self.n_stages, self.n_microbatches, self.n_virtual, table, self.placement)


Pairs = tuple[tuple[int, int], ...]  # (source stage, target stage)


@dataclasses.dataclass(frozen=True)
class SendPlan:
    """Per tick, the stage pairs that carry a forward activation / a backward gradient, and the same
    sends by channel: ``up`` (to the next stage: 1F1B's forwards) and ``down`` (to the previous one)."""

    n_stages: int
    forward: tuple[Pairs, ...]
    backward: tuple[Pairs, ...]
    up: tuple[Pairs, ...]
    down: tuple[Pairs, ...]

    def branches(self) -> tuple[tuple[tuple[Pairs, Pairs], ...], np.ndarray]:
        """The distinct non-empty ``(up pairs, down pairs)`` of the ticks, in order of first use, and per
        tick the switch branch: 0 for no send, k for ``branches[k - 1]``. Each channel is a shift, so a
        stage receives at most one activation per channel and tick (a V's stage gets forwards both ways).

        The engine sends both channels of a tick from one branch of one conditional, so that the two
        ``ppermute`` s of a tick are ordered on every device (see :func:`spmd.pipeline.engine.run_schedule`)."""
        found: list[tuple[Pairs, Pairs]] = []
        index = np.zeros(len(self.up), np.int32)
        for t, pairs in enumerate(zip(self.up, self.down)):
            if any(pairs):
                if pairs not in found:
                    found.append(pairs)
                index[t] = found.index(pairs) + 1
        return tuple(found), index

    @property
    def count(self) -> int:
        """Activations sent per step (all pairs, both directions)."""
        return sum(len(p) for p in self.forward + self.backward)

    def per_stage(self) -> np.ndarray:
        """Activations each stage sends per step."""
        out = np.zeros(self.n_stages, np.int64)
        for pairs in self.forward + self.backward:
            for src, _ in pairs:
                out[src] += 1
        return out


UP, DOWN, LOCAL = range(3)  # how an op's output reaches the next op of its microbatch


def hop(schedule: Schedule, kind: int, c: int) -> tuple[int, int] | None:
    """``(target stage, channel)`` of the output of op ``kind`` on chunk c, None when nothing is sent
    (the last chunk's forward, the first chunk's backward, W). Channel LOCAL: the next chunk is on the
    same stage (a V's turn), handed over without a send; in a loop forwards go UP and backwards DOWN
    (also S = 2, where both reach the same stage), in a V the way the stage index moves."""
    C = schedule.n_chunks
    if (kind == FORWARD and c == C - 1) or (kind == BACKWARD and c == 0) or kind not in (FORWARD, BACKWARD):
        return None
    src, dst = schedule.stage_of(c), schedule.stage_of(c + 1 if kind == FORWARD else c - 1)
    if src == dst:
        return dst, LOCAL
    if schedule.placement == "loop":
        return dst, UP if kind == FORWARD else DOWN
    return dst, UP if dst > src else DOWN


def send_plan(schedule: Schedule) -> SendPlan:
    """Who sends to whom on each tick of ``schedule`` run by the table engine."""
    lists: tuple[list[Pairs], ...] = ([], [], [], [])
    for t in range(schedule.n_ticks):
        f, b, chan = [], [], ([], [])  # type: ignore[var-annotated]
        for s in range(schedule.n_stages):
            kind, _, v = (int(x) for x in schedule.actions[t, s])
            to = hop(schedule, kind, schedule.chunk(v, s)) if kind != IDLE else None
            if to is None or to[1] == LOCAL:
                continue
            (f if kind == FORWARD else b).append((s, to[0]))
            chan[to[1]].append((s, to[0]))
        for out, pairs in zip(lists, (f, b, *chan)):
            out.append(tuple(pairs))
    return SendPlan(schedule.n_stages, *(tuple(x) for x in lists))


@dataclasses.dataclass(frozen=True)
class SentBytes:
    """Bytes over ``pipe`` per step, summed over all (source, target) stage pairs of one pipeline."""

    executed: int  # what the table engine sends
    minimum: int  # M per stage-crossing chunk boundary each way (forward only: one way)
    per_stage: tuple[int, ...]  # what each stage sends

    @property
    def ratio(self) -> float:
        return self.executed / self.minimum if self.minimum else 1.0


def minimum_sends(schedule: Schedule) -> int:
    """M activations forward per chunk boundary between two stages (M*(C-1) in a loop of S > 1; a V's
    turn is on one stage, M*(C-2)), as many gradients backward when the schedule has backwards."""
    C = schedule.n_chunks
    one_way = schedule.n_microbatches * sum(schedule.stage_of(c) != schedule.stage_of(c + 1) for c in range(C - 1))
    return one_way * (2 if schedule.has_backward else 1)


def sent_bytes(schedule: Schedule, activation_bytes: int) -> SentBytes:
    """Executed and minimum bytes per step for activations of ``activation_bytes`` (``[B/M, L, D]``)."""
    plan = send_plan(schedule)
    return SentBytes(plan.count * activation_bytes, minimum_sends(schedule) * activation_bytes,
                     tuple(int(n) * activation_bytes for n in plan.per_stage()))
