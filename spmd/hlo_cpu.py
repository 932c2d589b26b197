"""The CPU backend's rewrites of collectives, recognised so that counts show the accelerator's program.

After SPMD partitioning XLA's CPU pipeline changes collectives (read from its pass dumps, jax
0.10): ``all-reduce-promotion`` runs a bf16 all-reduce in f32 (its reduction computation is
renamed ``*_promoted``; the result is converted back to bf16), ``float-normalization-bf16``
does the same to a bf16 all-gather (convert to f32 before, back to bf16 after), and no pass
forms reduce-scatters, so the partitioner's all-reduce stays and each device dynamic-slices
its shard (offsets from ``partition-id``). GPU and TPU backends run bf16 collectives and
reduce-scatters. :class:`Graph` answers, per element of a collective's result, whether it only
round-trips bf16 and whether it is only sliced to a 1/k shard; :mod:`spmd.hlo` uses it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

_LINE_RE = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
                      r"(?P<shape>\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+(?P<op>[\w\-]+)\((?P<rest>.*)$")
_LAYOUT_OPS = frozenset({"bitcast", "copy", "reshape", "transpose"})  # move elements, never change them
# elementwise ops: a value that is sliced after one of these is still only needed as its shard
_ELEMENTWISE = frozenset({"convert", "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                          "sqrt", "rsqrt", "exp", "log", "power", "select", "compare", "clamp", "sign", "tanh"})
NARROW = "bf16"  # the dtype the CPU backend promotes to f32


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: str
    op: str
    operands: tuple[str, ...]
    attrs: str
    root: bool
    args: str = ""  # the text between the op's parentheses

    @property
    def dtype(self) -> str:
        return self.shape.split("[", 1)[0].lstrip("(")

    @property
    def elements(self) -> int:
        dims = re.match(r"\w+\[([\d,]*)\]", self.shape)
        return math.prod(int(d) for d in dims.group(1).split(",") if d) if dims else 0

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


def parse_instr(line: str) -> Instr | None:
    m = _LINE_RE.match(line)
    if not m:
        return None
    rest, depth = m.group("rest"), 1
    for i, ch in enumerate(rest):  # noqa: B007 - i is read after the loop
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:i]))
    return Instr(m.group("name"), m.group("shape"), m.group("op"), operands, rest[i + 1:], bool(m.group("root")),
                 rest[:i])


# A use of a value: (computation, the instruction using it, the operand position, the fusions entered to get there)
Use = tuple[str, Instr, int, tuple[tuple[str, Instr], ...]]


class Graph:
    """Instructions, users and parameters of every computation of an HLO module."""

    def __init__(self, comps: dict[str, list[str]]):
        self.instrs: dict[str, dict[str, Instr]] = {}
        self.users: dict[str, dict[str, list[tuple[Instr, int]]]] = {}
        self.params: dict[str, dict[int, str]] = {}
        self.roots: dict[str, str] = {}
        self.loops: dict[str, tuple[str, Instr]] = {}  # while body -> (computation, the while instruction)
        for comp, lines in comps.items():
            comp = comp.removeprefix("ENTRY ")
            instrs = {i.name: i for i in map(parse_instr, lines) if i is not None}
            users: dict[str, list[tuple[Instr, int]]] = {}
            for ins in instrs.values():
                for pos, operand in enumerate(ins.operands):
                    users.setdefault(operand, []).append((ins, pos))
                if ins.op == "parameter":
                    self.params.setdefault(comp, {})[_param_index(ins)] = ins.name
                if ins.root:
                    self.roots[comp] = ins.name
                if ins.op == "while" and ins.attr("body"):
                    self.loops[ins.attr("body")] = (comp, ins)
            self.instrs[comp], self.users[comp] = instrs, users

    def uses(self, comp: str, name: str, index: int | None = None, through: frozenset[str] = _LAYOUT_OPS,
             stack: tuple[tuple[str, Instr], ...] = ()) -> Iterator[Use]:
        """The uses of ``name`` (element ``index`` of a tuple) that are not in ``through``, looking into
        fusions (and out of a fused computation's root) and through get-tuple-element."""
        if name == self.roots.get(comp):
            if stack:  # flows out of the fusion: continue at the fusion's users
                outer, fusion = stack[-1]
                yield from self.uses(outer, fusion.name, None, through, stack[:-1])
            else:  # the computation's result: used whole
                yield comp, self.instrs[comp][name], -1, stack
        for user, pos in self.users.get(comp, {}).get(name, ()):
            if user.op == "get-tuple-element" and index is not None:
                if user.attr("index") == str(index):
                    yield from self.uses(comp, user.name, None, through, stack)
            elif user.op == "fusion" and user.attr("calls") in self.params:
                callee = user.attr("calls")
                yield from self.uses(callee, self.params[callee][pos], None, through, (*stack, (comp, user)))
            elif user.op in through:
                yield from self.uses(comp, user.name, None, through, stack)
            else:
                yield comp, user, pos, stack

    def round_trips_narrow(self, comp: str, name: str, index: int | None) -> bool:
        """Every use of the (f32) value converts it to bf16 first: the program needs only bf16."""
        uses = list(self.uses(comp, name, index))
        return bool(uses) and all(u.op == "convert" and u.dtype == NARROW for _, u, _, _ in uses)

    def widened_from_narrow(self, comp: str, name: str) -> bool:
        """The value is a convert of a bf16 value (through layout ops and into a fusion's root)."""
        for _ in range(64):
            ins = self.instrs.get(comp, {}).get(name)
            if ins is None:
                return False
            if ins.op == "convert":
                src = self.instrs[comp].get(ins.operands[0]) if ins.operands else None
                return src is not None and src.dtype == NARROW
            if ins.op == "fusion" and ins.attr("calls") in self.roots:
                comp = ins.attr("calls")
                name = self.roots[comp]
            elif ins.op in _LAYOUT_OPS and ins.operands:
                name = ins.operands[0]
            else:
                return False
        return False

    def shard_factor(self, comp: str, name: str, index: int | None) -> int | None:
        """k when every use of the value (after elementwise ops and static slices) is a dynamic-slice of 1/k
        at offsets computed from ``partition-id`` (each device keeps its shard: a reduce-scatter); else None."""
        factors = set()
        for where, use, pos, stack in self.uses(comp, name, index, _LAYOUT_OPS | _ELEMENTWISE | {"slice"}):
            source = self.instrs[where].get(use.operands[0]) if use.operands else None
            whole = source.elements if source is not None else 0  # a static slice may come first (a fused q/k/v)
            if use.op != "dynamic-slice" or pos != 0 or not use.elements or not whole or whole % use.elements:
                return None
            if not any(self._from_partition(where, o, stack) for o in use.operands[1:]):
                return None
            factors.add(whole // use.elements)
        return factors.pop() if len(factors) == 1 and next(iter(factors)) > 1 else None

    def _from_partition(self, comp: str, name: str, stack: tuple[tuple[str, Instr], ...], depth: int = 0) -> bool:
        """Whether the value is computed from the device's ``partition-id`` (or ``replica-id``)."""
        ins = self.instrs.get(comp, {}).get(name)
        if ins is None or depth > 40:
            return False
        if ins.op in ("partition-id", "replica-id"):
            return True
        if ins.op == "parameter" and stack:
            outer, fusion = stack[-1]
            pos = _param_index(ins)
            return pos < len(fusion.operands) and self._from_partition(outer, fusion.operands[pos], stack[:-1], depth + 1)
        source = self.instrs[comp].get(ins.operands[0]) if ins.operands else None
        if ins.op == "get-tuple-element" and source is not None and source.op == "parameter" and comp in self.loops:
            outer, loop = self.loops[comp]  # a loop-carried value: where the while loop's initial tuple got it
            init = self.instrs[outer].get(loop.operands[0]) if loop.operands else None
            j = int(ins.attr("index") or 0)
            return (init is not None and init.op == "tuple" and j < len(init.operands)
                    and self._from_partition(outer, init.operands[j], (), depth + 1))
        return any(self._from_partition(comp, o, stack, depth + 1) for o in ins.operands)


def _param_index(ins: Instr) -> int:
    return int(ins.args.strip() or 0)
