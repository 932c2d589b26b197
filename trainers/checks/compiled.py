"""What a compiled step shows that no static check can: unplanned all-to-alls, activations not split
over the batch, XLA's involuntary rematerialisations. Compiled-stage checks.

    check_collectives(spmd.hlo.collectives(compiled, mesh)) -> [Issue("all-to-all", ...)]

See docs/planning.md.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import spmd
from spmd.units import fmt_bytes
from trainers.checks.issue import Issue


def check_collectives(ops: Sequence[spmd.hlo.Collective]) -> list[Issue]:
    """All-to-alls in a compiled step that no ``jax.lax.all_to_all`` asked for: a reshard between
    disagreeing layouts, traced to its jax op (one issue per op and axes, however many times it runs)."""
    grouped: dict[tuple[str, tuple[str, ...]], list] = {}
    for op in ops:  # an explicit jax all_to_all (MoE dispatch/combine in a shard_map) is meant
        if op.kind == "all-to-all" and not op.op_name.endswith("all_to_all"):
            row = grouped.setdefault((op.op_name or op.name, op.axes), [0, 0, set()])
            row[0] += op.count
            row[1] += op.total_bytes
            row[2].add(op.bytes)
    issues = []
    for (where, axes), (count, total, sizes) in grouped.items():
        each = f"{next(iter(sizes)):,} bytes x {count}" if len(sizes) == 1 else f"{total:,} bytes in {count}"
        issues.append(Issue(
            "all-to-all", where, None,
            f"unexpected all-to-all over {','.join(axes)} ({each}) from {where}",
            "the activation layouts on either side disagree: add spmd.constrain(x, dims) at this op, "
            "or use a rule set that keeps the dim on one axis", stage="compiled"))
    return issues


def check_activation_split(compiled_temp: int, split: int, whole: int, fixed: int, rows: int,
                           batch_axes: Sequence[str]) -> list[Issue]:
    """Compiled temporaries that look like every device holds the whole batch's activations.

    ``split`` / ``whole``: the activations estimated for this device's ``rows`` and for the whole
    (micro)batch; ``fixed``: temporaries that do not scale with the batch (gradients, the update's
    copy of the state). Flagged when the batch is split (``batch_axes``), the compiled temporaries
    reach half of ``whole``, and the gap between ``whole`` and ``split`` is too large for ``fixed``
    to explain. The usual cause: a model without activation constraints under FSDP, where GSPMD
    lays activations out like the weights (split on ``embed``) instead of on the batch.
    """
    if not batch_axes or whole <= split or compiled_temp < whole / 2 or whole - split < 2 * fixed:
        return []
    axes = " x ".join(batch_axes)
    return [Issue(
        "activations", "activations", "batch",
        f"compiled temporaries {fmt_bytes(compiled_temp)} per device are near the activations of the whole batch "
        f"({fmt_bytes(whole)}), not of this device's {rows} rows ({fmt_bytes(split)}): the activations are "
        f"probably not split over {axes}",
        f"constrain them to the batch, spmd.constrain(x, ('batch', ...)) at each block's input and output, or use "
        f"rules that shard no weight dim over {axes} (e.g. dp)", stage="compiled")]


_REMAT = re.compile(r"Involuntary full rematerialization[^\n]*?from sharding (?P<src>.+?) to (?P<dst>.+?) without[^\n]*")


def parse_remat_warnings(log: str) -> list[Issue]:
    """XLA's "Involuntary full rematerialization" warnings in a compiler log, with the jax op they came from."""
    issues = []
    for m in _REMAT.finditer(log):
        line = m.group(0)
        op = re.search(r'op_name="([^"]*)"', line)
        src = re.search(r'source_file="([^"]*)"\s+source_line=(\d+)', line)
        where = op.group(1) if op else "an unnamed op"
        at = f" ({src.group(1)}:{src.group(2)})" if src else ""
        issues.append(Issue(
            "remat", where, None,
            f"XLA rematerialised a full tensor to go from sharding {m.group('src')} to {m.group('dst')} at {where}{at}",
            "constrain this activation to one layout on both sides (spmd.constrain), or change the rule for its dims",
            stage="compiled"))
    return issues
