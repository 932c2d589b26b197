"""Human-readable sizes, durations, counts and aligned tables: the one formatter for reports and benchmarks.

Table columns are sized to their widest cell, so tables stay aligned at pod scale (PiB, thousands of ops).
"""

from __future__ import annotations

from collections.abc import Sequence


def fmt_bytes(n: float) -> str:
    """Binary units with two decimals: 512 -> '512 B', 3 * 2**20 -> '3.00 MiB', 3 * 2**50 -> '3.00 PiB'
    (beyond 1024 PiB the PiB figure grows: '2048.00 PiB')."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    """Three significant-ish figures in s, ms or us: 2.5 -> '2.50 s', 0.0123 -> '12.30 ms'."""
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_count(n: float) -> str:
    """An integer count with thousands separators: 74511 -> '74,511'."""
    return f"{int(round(n)):,}"


def format_table(rows: Sequence[Sequence[object]], align: str, *, gap: int = 2, indent: str = "") -> str:
    """``rows`` (the first one the header) as text columns: ``align`` one letter per column, ``<`` left
    or ``>`` right; every column as wide as its widest cell, ``gap`` spaces between columns. The last
    column is left unpadded (free text such as notes)."""
    if any(len(r) != len(align) for r in rows):
        raise ValueError(f"format_table: every row needs {len(align)} cells (align={align!r}); got row lengths "
                         f"{sorted({len(r) for r in rows})}")
    if set(align) - {"<", ">"}:
        raise ValueError(f"format_table: align letters are '<' or '>', got {align!r}")
    cells = [[str(c) for c in r] for r in rows]
    widths = [max((len(r[i]) for r in cells), default=0) for i in range(len(align))]
    out = []
    for r in cells:
        parts = [f"{c:{a}{w}}" for c, a, w in zip(r[:-1], align, widths)]
        last = f"{r[-1]:{align[-1]}{widths[-1]}}" if align[-1] == ">" else r[-1]
        out.append((indent + (" " * gap).join(parts + [last])).rstrip())
    return "\n".join(out)
