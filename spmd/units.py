"""Human-readable sizes and durations, the one formatter for reports, errors and benchmarks."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Binary units with two decimals: 512 -> '512 B', 3 * 2**20 -> '3.00 MiB'."""
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
