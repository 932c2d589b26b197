"""What a compiled step communicates: collectives read from its optimised HLO.

:func:`collectives` returns one :class:`Collective` per collective instruction of
``compiled.as_text()``: its kind, the mesh axes it runs over, how many times per step, and its
bytes per device. See docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|[\w]+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>(?:" + "|".join(KINDS) + r")(?:-start)?)\("
)
_ARRAY_RE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int
    group_size: int
    name: str = ""
    trip_count_known: bool = True
    op_name: str = ""  # the jax operation it came from (metadata); "transpose(" marks the backward pass

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes


def _array_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY_RE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(n * DTYPE_BYTES[dtype]))
    return out


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape ``(a, (b, c), d)``; a non-tuple shape is one element."""
    shape = shape.strip()
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [p for p in parts if p]


def _iota(spec: str) -> np.ndarray:
    """``[2,4]<=[8]``, ``[4,2]<=[2,4]T(1,0)`` or ``[2,4]T(1,0)`` -> an id array."""
    m = re.match(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", spec.strip())
    if not m:
        raise ValueError(f"unparsed iota {spec!r}")
    dims = [int(x) for x in m.group(1).split(",")]
    base = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(base)).reshape(base)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(dims)


def _groups(line: str, n: int) -> list[list[int]] | None:
    """Replica groups of an instruction as lists of partition ids (None: unparsed)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:
        named = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, shape = [a for a, _ in named], [int(s) for _, s in named]
        ids = _iota(m.group(2)).reshape(shape) if m.group(2) else np.arange(math.prod(shape)).reshape(shape)
        group_axes = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        other = [i for i in range(len(names)) if i not in group_axes]
        return ids.transpose(other + group_axes).reshape(-1, math.prod(shape[i] for i in group_axes) or 1).tolist()
    m = re.search(r"replica_groups=(\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?)", line)
    if m:
        return _iota(m.group(1)).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups if groups and any(groups) else [list(range(n))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def _axes(groups: list[list[int]], mesh: Mesh) -> tuple[str, ...]:
    shape = mesh.devices.shape
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group, dtype=int), shape)).T
        varying |= {i for i in range(len(shape)) if len(set(coords[:, i])) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(varying))


def _split_computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            current = comps.setdefault(("ENTRY " if line.startswith("ENTRY") else "") + m.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return comps


def _multipliers(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str]]:
    """Executions per step of each computation, and those under a loop of unknown trip count."""
    entry = next((c for c in comps if c.startswith("ENTRY ")), None)
    mult: dict[str, int] = defaultdict(int)
    unknown: set[str] = set()
    if entry is None:
        return {c: 1 for c in comps}, unknown

    def visit(name: str, times: int, uncertain: bool) -> None:
        mult[name] += times
        if uncertain:
            unknown.add(name)
        for line in comps.get(name, ()):
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                visit(body.group(1), times * (int(trip.group(1)) if trip else 1), uncertain or not trip)
            for callee in re.findall(r"(?:calls|true_computation|false_computation)=%?([\w.\-]+)", line):
                visit(callee, times, uncertain)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                    visit(callee, times, uncertain)

    visit(entry, 1, False)
    return {c.removeprefix("ENTRY "): m for c, m in mult.items()}, {c.removeprefix("ENTRY ") for c in unknown}


@dataclasses.dataclass(frozen=True)
class Computation:
    """One computation of an HLO module: its instruction lines and how often it runs per step."""

    name: str
    lines: tuple[str, ...]
    count: int  # executions per step (a while body: once per loop trip; 0: never called)
    trip_count_known: bool = True  # False under a loop whose trip count XLA does not know (counted once)


def computations(compiled: Any) -> list[Computation]:
    """Every computation of a compiled function (or its HLO text), with its executions per step."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps = _split_computations(text)
    mult, unknown = _multipliers(comps)
    out = []
    for comp, lines in comps.items():
        name = comp.removeprefix("ENTRY ")
        out.append(Computation(name, tuple(lines), mult.get(name, 0), name not in unknown))
    return out


def collectives(compiled: Any, mesh: Mesh) -> list[Collective]:
    """Every collective instruction of a compiled function (``jit(f).lower(...).compile()``)."""
    n = mesh.devices.size
    out = []
    for comp in computations(compiled):
        name, times = comp.name, comp.count
        if not times:
            continue
        for line in comp.lines:
            m = _INSTR_RE.match(line)
            if not m:
                continue
            op = m.group("op")
            kind = op.removesuffix("-start")
            sizes = _array_bytes(m.group("shape"))
            elements = _tuple_elements(m.group("shape"))
            if op.endswith("-start") and kind in ("all-gather", "collective-permute", "all-to-all") and len(elements) > 1:
                sizes = _array_bytes(elements[1])  # (operands, results[, contexts]) -> results
            groups = _groups(line, n)
            group_size = len(groups[0]) if groups else n
            nbytes = sum(sizes)
            if kind == "reduce-scatter":
                nbytes *= group_size
            axes = _axes(groups, mesh) if groups else ("?",)
            instr = line.split("=", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
            meta = re.search(r'op_name="([^"]*)"', line)
            out.append(Collective(kind, axes, times, nbytes, group_size, instr, comp.trip_count_known,
                                  meta.group(1) if meta else ""))
    return out


def summarize(ops: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """{(kind, axes): {"count": executions per step, "bytes": total bytes per device per step}}."""
    table: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for op in ops:
        row = table.setdefault((op.kind, op.axes), {"count": 0, "bytes": 0})
        row["count"] += op.count
        row["bytes"] += op.total_bytes
    return dict(sorted(table.items()))


def format_collectives(ops: list[Collective]) -> str:
    """A table: kind, axes, executions per step, bytes per device per step."""
    rows = [f"{'collective':<20}{'axes':<18}{'count':>7}{'bytes/device':>16}"]
    for (kind, axes), row in summarize(ops).items():
        rows.append(f"{kind:<20}{','.join(axes) or '-':<18}{row['count']:>7}{row['bytes']:>16,}")
    return "\n".join(rows)
