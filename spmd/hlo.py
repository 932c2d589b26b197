"""What a compiled step communicates: collectives read from its optimised HLO.

:func:`collectives` returns one :class:`Collective` per collective instruction of
``compiled.as_text()``: its kind, the mesh axes it runs over, how many times per step, and its
bytes per device. By default they are the accelerator's program: the CPU backend's rewrites
(a reduce-scatter emitted as all-reduce + dynamic-slice, bf16 all-reduces and all-gathers
promoted to f32; see :mod:`spmd.hlo_cpu`) are recognised, and each such collective also carries
what the CPU program emits (``emitted_kind``, ``emitted_axes``, ``emitted_bytes``, ``cpu_note``).
``view="emitted"`` gives the CPU program as it is. Collectives in a conditional's branches carry
``in_branch``: their count assumes the branch runs every time (an upper bound). See docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

import numpy as np
from jax.sharding import Mesh

from spmd import hlo_cpu
from spmd.units import fmt_bytes, fmt_count, format_table

VIEWS = ("accelerator", "emitted")
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
    # What the CPU program emits for it, where that differs (the accelerator's program is the fields above):
    emitted_kind: str = ""  # e.g. "all-reduce" for a reduce-scatter
    emitted_axes: tuple[str, ...] = ()  # the emitted op's axes where they differ
    emitted_bytes: int | None = None  # its bytes per execution (0: counted with another part of the same op)
    cpu_note: str = ""  # how the CPU program differs
    # in a conditional's branch (lax.switch / lax.cond): executions depend on the branch taken, and
    # count is how often the conditional runs (the most it can execute), not a certain figure
    in_branch: bool = False

    @property
    def backward(self) -> bool:
        return "transpose(" in self.op_name

    @property
    def differs(self) -> bool:
        """Whether the CPU program runs this collective differently."""
        return bool(self.emitted_kind or self.emitted_axes or self.emitted_bytes is not None)

    @property
    def emitted(self) -> tuple[str, tuple[str, ...], int, int]:
        """(kind, axes, count, bytes per execution) of what the CPU program emits for it."""
        nbytes = self.bytes if self.emitted_bytes is None else self.emitted_bytes
        count = 0 if self.emitted_bytes == 0 and self.bytes else self.count
        return self.emitted_kind or self.kind, self.emitted_axes or self.axes, count, nbytes

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution with ring algorithms: an all-reduce 2 (g-1)/g of its buffer,
        a reduce-scatter, all-gather or all-to-all (g-1)/g, a collective-permute its buffer."""
        g = max(self.group_size, 1)
        share = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(self.kind, (g - 1) / g)
        return self.bytes * share


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


def _multipliers(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str], set[str]]:
    """Executions per step of each computation (a conditional's branches: as often as the conditional
    runs, an upper bound), those under a loop of unknown trip count, and those in a conditional's branch."""
    entry = next((c for c in comps if c.startswith("ENTRY ")), None)
    mult: dict[str, int] = defaultdict(int)
    unknown: set[str] = set()
    branch: set[str] = set()
    if entry is None:
        return {c: 1 for c in comps}, unknown, branch

    def visit(name: str, times: int, uncertain: bool, in_branch: bool) -> None:
        mult[name] += times
        if uncertain:
            unknown.add(name)
        if in_branch:
            branch.add(name)
        for line in comps.get(name, ()):
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                visit(body.group(1), times * (int(trip.group(1)) if trip else 1), uncertain or not trip, in_branch)
            for callee in re.findall(r"calls=%?([\w.\-]+)", line):
                visit(callee, times, uncertain, in_branch)
            if re.search(r"\scall\(", line):  # a called computation (XLA:CPU wraps small loops in one)
                for callee in re.findall(r"to_apply=%?([\w.\-]+)", line):
                    visit(callee, times, uncertain, in_branch)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            callees = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else re.findall(
                r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)
            for callee in callees:
                visit(callee, times, uncertain, True)

    visit(entry, 1, False, False)
    strip = lambda names: {c.removeprefix("ENTRY ") for c in names}
    return {c.removeprefix("ENTRY "): m for c, m in mult.items()}, strip(unknown), strip(branch)


@dataclasses.dataclass(frozen=True)
class Computation:
    """One computation of an HLO module: its instruction lines and how often it runs per step."""

    name: str
    lines: tuple[str, ...]
    count: int  # executions per step (a while body: once per loop trip; 0: never called)
    trip_count_known: bool = True  # False under a loop whose trip count XLA does not know (counted once)
    in_branch: bool = False  # in a conditional's branch: count is how often the conditional runs, an upper bound


def computations(compiled: Any) -> list[Computation]:
    """Every computation of a compiled function (or its HLO text), with its executions per step."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps = _split_computations(text)
    mult, unknown, branch = _multipliers(comps)
    out = []
    for comp, lines in comps.items():
        name = comp.removeprefix("ENTRY ")
        out.append(Computation(name, tuple(lines), mult.get(name, 0), name not in unknown, name in branch))
    return out


def collectives(compiled: Any, mesh: Mesh, *, view: str = "accelerator") -> list[Collective]:
    """Every collective instruction of a compiled function (``jit(f).lower(...).compile()``) or its HLO text.

    ``view="accelerator"`` (default): the CPU backend's rewrites are undone (a tuple all-reduce may
    become a reduce-scatter and an all-reduce record, each with the instruction's ``name``);
    ``view="emitted"``: the instructions as the compiled program has them.
    """
    if view not in VIEWS:
        raise ValueError(f"view={view!r}; valid: {', '.join(VIEWS)}")
    n = mesh.devices.size
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps = _split_computations(text)
    graph = hlo_cpu.Graph(comps) if view == "accelerator" else None
    out = []
    for comp in computations(text):
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
            found = Collective(kind, axes, times, nbytes, group_size, instr, comp.trip_count_known,
                               meta.group(1) if meta else "", in_branch=comp.in_branch)
            if graph is None or op != kind or kind not in ("all-reduce", "all-gather") or axes == ("?",):
                out.append(found)
            else:
                out += _accelerator(found, graph, name, line, elements, mesh)
    return out


def _accelerator(op: Collective, graph: hlo_cpu.Graph, comp: str, line: str, elements: list[str],
                 mesh: Mesh) -> list[Collective]:
    """The collectives an all-reduce or all-gather of the CPU program stands for on an accelerator."""
    size = dict(zip(mesh.axis_names, mesh.devices.shape))
    is_tuple = len(elements) > 1 or line.split("=", 1)[1].strip().startswith("(")
    reduction = re.search(r"to_apply=%?([\w.\-]+)", line)
    promoted = op.kind == "all-reduce" and bool(reduction) and reduction.group(1).endswith("_promoted")
    operands = (hlo_cpu.parse_instr(line) or hlo_cpu.Instr("", "", "", (), "", False)).operands
    parts: dict[tuple[str, tuple[str, ...]], list] = {}  # (kind, axes) -> [bytes, emitted bytes, notes]

    def add(kind: str, axes: tuple[str, ...], nbytes: int, emitted: int, *notes: str) -> None:
        row = parts.setdefault((kind, axes), [0, 0, []])
        row[0], row[1] = row[0] + nbytes, row[1] + emitted
        row[2] += [note for note in notes if note and note not in row[2]]

    for i, element in enumerate(elements):
        index = i if is_tuple else None
        nbytes = sum(_array_bytes(element))
        count = math.prod(int(d) for d in re.findall(r"\d+", element.split("[", 1)[1].split("]")[0])) \
            if "[" in element else 0
        narrow = element.startswith("f32[") and graph.round_trips_narrow(comp, op.name, index) and (
            promoted if op.kind == "all-reduce" else i < len(operands) and graph.widened_from_narrow(comp, operands[i]))
        acc = nbytes // 2 if narrow else nbytes
        why = f"bf16 {op.kind} promoted to f32" if narrow else ""
        k = graph.shard_factor(comp, op.name, index) if op.kind == "all-reduce" and count else None
        split = _split_axes(op.axes, size, k) if k else None
        if split is None:
            add(op.kind, op.axes, acc, nbytes, why)
            continue
        scattered, rest = split
        add("reduce-scatter", scattered, acc, nbytes, "reduce-scatter emitted as all-reduce + dynamic-slice", why)
        if rest:
            add("all-reduce", rest, acc // k, 0, f"the shard's all-reduce is part of the emitted all-reduce over "
                                                  f"{','.join(op.axes)}", why)
    if len(parts) == 1 and next(iter(parts)) == (op.kind, op.axes) and op.bytes == next(iter(parts.values()))[0]:
        return [op]  # the accelerator runs it as emitted
    out = []
    for j, ((kind, axes), (nbytes, _, notes)) in enumerate(parts.items()):
        if len(parts) > 1:
            notes = [*notes, f"one of {len(parts)} parts of one emitted {op.kind}"]
        out.append(dataclasses.replace(
            op, kind=kind, axes=axes, bytes=nbytes, group_size=math.prod(size[a] for a in axes),
            emitted_kind="" if kind == op.kind else op.kind, emitted_axes=() if axes == op.axes else op.axes,
            emitted_bytes=op.bytes if j == 0 else 0, cpu_note="; ".join(notes)))  # the first part carries the op
    return out


def _split_axes(axes: tuple[str, ...], size: dict[str, int], k: int) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(scattered, reduced) axes of an all-reduce whose result is sliced 1/k: the innermost axes whose
    sizes multiply to k are scattered, the others all-reduce the shard; None if no such axes."""
    prod = 1
    for j in range(len(axes) - 1, -1, -1):
        prod *= size.get(axes[j], 1)
        if prod == k:
            return axes[j:], axes[:j]
        if prod > k:
            return None
    return None


def summarize(ops: list[Collective], view: str = "accelerator") -> dict[tuple[str, tuple[str, ...]], dict[str, int]]:
    """{(kind, axes): {"count": executions per step, "bytes": total bytes per device per step}}.

    ``view="emitted"``: grouped as the CPU program runs them (each op's ``emitted``). Collectives in a
    conditional's branches (``in_branch``) count as if their branch always ran: an upper bound.
    """
    if view not in VIEWS:
        raise ValueError(f"view={view!r}; valid: {', '.join(VIEWS)}")
    table: dict[tuple[str, tuple[str, ...]], dict[str, int]] = {}
    for op in ops:
        kind, axes, count, nbytes = (op.kind, op.axes, op.count, op.bytes) if view == "accelerator" else op.emitted
        if not count and view == "emitted":
            continue
        row = table.setdefault((kind, axes), {"count": 0, "bytes": 0})
        row["count"] += count
        row["bytes"] += count * nbytes
    return dict(sorted(table.items()))


def format_collectives(ops: list[Collective]) -> str:
    """A table: kind, axes, executions per step, bytes per device per step (as an accelerator runs the
    program), and where the CPU program differs, what it emits instead. Columns are as wide as their
    widest cell (counts with thousands separators, bytes up to PiB), so pod-scale figures stay aligned."""
    cells = [("collective", "axes", "count", "bytes/device", "CPU program emits")]
    for (kind, axes), row in summarize(ops).items():
        diff = [o for o in ops if o.kind == kind and o.axes == axes and o.differs]
        cpu = ""
        if diff:
            emitted = summarize(diff, "emitted")
            notes = sorted({note for o in diff for note in o.cpu_note.split("; ") if note})
            cpu = "; ".join(f"{k} over {','.join(a) or '-'} {fmt_bytes(r['bytes'])}" for (k, a), r in emitted.items())
            cpu = (cpu or "nothing more (part of another row's emitted all-reduce)") + (f" ({'; '.join(notes)})" if notes else "")
        at_most = "<=" if any(o.in_branch for o in ops if o.kind == kind and o.axes == axes) else ""
        cells.append((kind, ",".join(axes) or "-", at_most + fmt_count(row["count"]), at_most + fmt_bytes(row["bytes"]),
                      cpu))
    lines = format_table(cells, "<<>><").splitlines()
    if any(o.in_branch for o in ops):
        lines.append("<= at most: collectives in a conditional's branches (lax.switch / lax.cond), counted as if "
                     "their branch ran every time the conditional does")
    total, cpu_total = summarize(ops), summarize(ops, "emitted")
    if total != cpu_total:
        lines.append(f"CPU program as compiled: {fmt_count(sum(r['count'] for r in cpu_total.values()))} collectives, "
                     f"{fmt_bytes(sum(r['bytes'] for r in cpu_total.values()))} per device per step; above, as an "
                     f"accelerator runs it: {fmt_bytes(sum(r['bytes'] for r in total.values()))}")
    return "\n".join(lines)
