"""Why no layout of N devices works, in the model's terms, and the nearest device counts that do.

    device_splits(cfg) -> AxisSplits: the sizes each axis group can take (batch, tensor, pipe, seq, expert)
    blockers(cfg, 7168) -> ["7 divides the device count 7168 but none of: ...", ...]
    workable_counts(cfg, 7168) -> (4096, 8192): the nearest counts with a valid factorisation

The built-in GPT's constraints (the layout stage of :func:`trainers.checks.check` checks them per layout): the batch per
step splits over the batch axes (and a pipeline's microbatches), heads / d_ff / vocab over tensor, layers
over pipe, the length over 2 x seq, experts over expert. See docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable

from trainers.checks import Issue, buildable, check
from trainers.config import Config


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _primes(n: int) -> dict[int, int]:
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def _valuation(n: int, p: int) -> int:
    k = 0
    while n and n % p == 0:
        n, k = n // p, k + 1
    return k


@dataclasses.dataclass(frozen=True)
class AxisSplits:
    """The sizes each axis group can take for one config, each constraint on its own (the planner's
    candidates combine them; a layout's own checks may still refuse a combination)."""

    batch: int  # rows per step (global batch / grad_accum): data x fsdp (x expert) x pipeline microbatches divide it
    tensor: tuple[int, ...]  # tensor sizes the heads, kv heads, d_ff and vocab allow
    pipe: tuple[int, ...]  # pipe sizes: divide n_layers and the batch (M >= pipe microbatches)
    seq: tuple[int, ...]  # seq sizes: the length splits into 2 x seq chunks
    expert: tuple[int, ...]  # expert sizes: divide n_experts (MoE only)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seq_len: int
    n_experts: int

    @functools.cached_property
    def counts(self) -> frozenset[int]:
        """Every device count some combination reaches (a pipe axis > 1 shares the batch's splits)."""
        out = set()
        for b in _divisors(self.batch):
            for p in self.pipe:
                if (self.batch // b) % p:  # p microbatches of b-way split rows at least
                    continue
                for t in self.tensor:
                    for s in self.seq:
                        for e in self.expert:  # expert splits the rows too: p microbatches of (b x e)-way split rows
                            if (self.batch // b) % (p * e) == 0:
                                out.add(b * p * t * s * e)
        return frozenset(out)


def device_splits(cfg: Config) -> AxisSplits:
    """The built-in GPT's :class:`AxisSplits`: tensor sizes from the real checks (heads, d_ff, vocab under
    the ``tp`` rule set), pipe from ``n_layers`` and the batch, seq from ``data.seq_len``."""
    m, micro = cfg.model, cfg.data.global_batch // max(cfg.run.grad_accum, 1)
    tensor = tuple(t for t in range(1, max(m.n_heads, 1) + 1)
                   if buildable(check(cfg, stages=("layout",), mesh_shape={"tensor": t}, rules="tp",
                                      select=("heads", "divisibility"))))
    pipe = tuple(p for p in _divisors(m.n_layers) if micro % p == 0)
    seq = tuple(s for s in _divisors(max(cfg.data.seq_len // 2, 1)) if cfg.data.seq_len % (2 * s) == 0)
    expert = _divisors(m.n_experts) if m.n_experts else (1,)
    return AxisSplits(micro, tensor, pipe, seq, expert, m.n_layers, m.n_heads, m.kv_heads, cfg.data.seq_len,
                      m.n_experts)


def blockers(cfg: Config, devices: int, splits: AxisSplits | None = None) -> list[str]:
    """What rules out every factorisation of ``devices`` (empty when some combination of the axis sizes
    reaches it): per prime factor of the device count, which axes could take it and how far."""
    s = splits or device_splits(cfg)
    if devices in s.counts:
        return []
    gb, ga = cfg.data.global_batch, cfg.run.grad_accum
    batch = f"global batch {gb}" + (f" / run.grad_accum {ga} = {s.batch} rows" if ga > 1 else "")
    where = {
        "batch": (s.batch, f"{batch} (data, fsdp)"),
        "pipe": (max(s.pipe), f"n_layers {s.n_layers} (pipe; also a divisor of the batch)"),
        "tensor": (max(s.tensor), f"n_heads {s.n_heads} / n_kv_heads {s.n_kv_heads}, d_ff, vocab "
                                  f"(tensor of {', '.join(map(str, s.tensor))})"),
        "seq": (max(s.seq), f"data.seq_len {s.seq_len} (seq: 2 x seq chunks)"),
    }
    if s.n_experts:
        where["expert"] = (max(s.expert), f"n_experts {s.n_experts} (expert)")
    out = []
    if devices > s.batch:
        out.append(f"{batch} cannot split over more than {s.batch} devices on the batch axes (data, fsdp): the other "
                   f"factor {devices / s.batch:g} must come from tensor, pipe, seq or expert")
    for p, k in sorted(_primes(devices).items()):
        reach = {axis: max((_valuation(x, p) for x in sizes), default=0) for axis, sizes in (
            ("batch", _divisors(s.batch)), ("pipe", s.pipe), ("tensor", s.tensor), ("seq", s.seq),
            ("expert", s.expert))}
        if not any(reach.values()):
            names = "; ".join(text for _, text in where.values())
            out.append(f"{p} divides the device count {devices} but none of: {names}")
        elif max(_valuation(c, p) for c in s.counts) < k:
            most = max(_valuation(c, p) for c in s.counts)
            takes = ", ".join(f"{a} {p}^{v}" for a, v in reach.items() if v)
            out.append(f"the device count {devices} holds {p}^{k} but the axes together split at most {p}^{most} "
                       f"ways ({takes}, before the pipeline shares the batch)")
    if not out:
        out.append(f"every factor of {devices} fits some axis, but no combination reaches it (a pipeline shares the "
                   "batch's splits)")
    return out


def workable_counts(cfg: Config, devices: int, splits: AxisSplits | None = None,
                    n: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``n`` nearest device counts below and above ``devices`` that some factorisation reaches."""
    counts = sorted((splits or device_splits(cfg)).counts)
    below = tuple(c for c in reversed(counts) if c < devices)[:n]
    above = tuple(c for c in counts if c > devices)[:n]
    return below, above


def reason_group(issue: Issue | None) -> str:
    """A short name for what rules a layout out: the constraint of its first fatal issue, or memory."""
    if issue is None:
        return "memory above the budget"
    dim = issue.dim or issue.path
    return {("batch", "batch"): "batch vs the batch axes (data, fsdp)",
            ("pipeline", "batch"): "batch vs pipeline microbatches x batch axes",
            ("pipeline", "layers"): "n_layers vs pipe x virtual stages",
            ("indivisible", "heads"): "n_heads / n_kv_heads vs tensor",
            ("indivisible", "length"): "seq_len vs 2 x seq"}.get((issue.kind, dim), f"{issue.kind}: {dim}")


def group_reasons(issues: Iterable[Issue | None]) -> list[tuple[str, int, str]]:
    """``(group, count, an example message)`` per :func:`reason_group`, most frequent first."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for issue in issues:
        key = reason_group(issue)
        counts[key] += 1
        example.setdefault(key, str(issue) if issue is not None else "")
    return [(k, c, example[k]) for k, c in counts.most_common()]
