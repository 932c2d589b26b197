"""Checks on compiled programs shared by tests."""

from __future__ import annotations

import re

import spmd


def unanchored_collectives(text: str) -> list[str]:
    """Collectives of a compiled program whose operands are all constants: nothing orders them against
    the program's other collectives, so a device may run them before a loop's permutes and another after."""
    found = []
    for comp in spmd.hlo.computations(text):
        consts = {m.group(1) for line in comp.lines if (m := re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ constant\(", line))}
        for line in comp.lines:
            m = re.search(r"= .*?\b(all-reduce|collective-permute|all-gather|reduce-scatter|all-to-all)\(([^)]*)\)", line)
            operands = [o.strip().lstrip("%") for o in m.group(2).split(",")] if m else []
            if operands and all(o in consts for o in operands):
                found.append(line.strip()[:200])
    return found
