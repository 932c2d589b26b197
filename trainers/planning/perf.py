"""The calibrated step-time model: compute at achievable fractions of peak, plus the exposed communication.

compute = matmul FLOPs / (peak x ``matmul_eff``) + attention FLOPs / (peak x ``attention_eff``), stretched
by ``1 / (1 - bubble)`` of a pipeline schedule; memory-bound work (norms, RoPE, SwiGLU, residuals, the
loss's softmax, the optimizer update) = its HBM bytes / (bandwidth x ``hbm_eff``). Collectives
(:class:`trainers.planning.traffic.Traffic`, each timed as hierarchical rings on the topology) overlap
where the program lets them: FSDP gathers (``W[D_fsdp] -> W[D]``) prefetch one layer ahead under the
forward and backward compute, gradient reduce-scatters and data all-reduces run under the backward (the
data all-reduce only under the last microbatch's), and what does not fit in its window, plus the first
gather and the last reduction, is exposed; tensor, seq, expert and pipe collectives sit on the critical
path. Constants and their sources: docs/calibration.md.
"""

from __future__ import annotations

import dataclasses

from trainers.planning.hardware import Hardware

OVERLAPPED_AXES = ("data", "fsdp")  # collectives over only these axes move weights or gradients: overlappable


@dataclasses.dataclass(frozen=True)
class Work:
    """What one device executes in one step: FLOPs by kind and the HBM bytes of memory-bound work."""

    matmul_flops: float
    attention_flops: float
    hbm_bytes: float
    model_flops: float  # the whole step's model FLOPs (all devices), for MFU
    n_layers: int = 1  # layers each device runs (the FSDP prefetch granularity)
    passes: int = 2  # FSDP gathers per layer per microbatch (2: forward + backward, 3: + a remat forward)
    microbatches: int = 1
    bubble: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepTime:
    matmul_s: float
    attention_s: float
    elementwise_s: float
    comm_s: float  # every collective, in series
    exposed_s: float  # the part of comm_s not hidden under compute
    step_s: float
    overlap_s: float  # perfect overlap: max(compute + elementwise, comm)
    dominant: str

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.attention_s


def _overlappable(axes: tuple[str, ...]) -> bool:
    return bool(axes) and all(a in OVERLAPPED_AXES for a in axes)


def step_time(work: Work, hw: Hardware, dtype: str, traffic) -> StepTime:
    """Step time of ``work`` with ``traffic`` on ``hw`` (see the module docstring)."""
    peak = hw.peak(dtype)
    stretch = 1 / (1 - work.bubble)
    matmul = work.matmul_flops / (peak * hw.matmul_eff) * stretch
    attention = work.attention_flops / (peak * hw.attention_eff) * stretch
    elementwise = work.hbm_bytes / (hw.hbm_bw * hw.hbm_eff) * stretch
    busy = matmul + attention + elementwise
    forward, backward = busy / 3, 2 * busy / 3
    if work.passes > 2:  # the remat forward runs inside the backward pass
        forward, backward = busy / 4, 3 * busy / 4
    gather = scatter = reduce = 0.0
    exposed: dict[str, float] = {}
    for x in traffic:
        if _overlappable(x.axes) and x.kind == "all-gather":
            gather += x.seconds
        elif _overlappable(x.axes) and x.kind == "reduce-scatter":
            scatter += x.seconds
        elif _overlappable(x.axes) and x.kind == "all-reduce":
            reduce += x.seconds
        else:
            key = f"{x.kind} {','.join(x.axes)} ({x.network})"
            exposed[key] = exposed.get(key, 0.0) + x.seconds
    n, k, p = max(work.n_layers, 1), max(work.microbatches, 1), max(work.passes, 1)
    gather_fwd = gather / p
    hidden_fwd = max(0.0, gather_fwd - forward)
    hidden_bwd = max(0.0, gather - gather_fwd + scatter - backward)
    last = max(0.0, reduce - backward / k)  # the data all-reduce: under the last microbatch's backward only
    edges = (gather_fwd + scatter) / (n * k) + reduce / n  # the first layer's gather, the last reductions
    exposed["fsdp/gradient collectives (exposed)"] = min(gather + scatter + reduce, hidden_fwd + hidden_bwd + last + edges)
    hidden = gather + scatter + reduce - exposed["fsdp/gradient collectives (exposed)"]
    exposed["collectives beside compute"] = hw.overlap_cost * hidden  # GPU: NCCL kernels share the SMs
    comm = gather + scatter + reduce + sum(v for k_, v in exposed.items() if "(exposed)" not in k_ and "beside" not in k_)
    exposed_s = sum(exposed.values())
    step = busy + exposed_s
    costs = {"matmuls": matmul, "attention": attention, "memory-bound work": elementwise, **exposed}
    return StepTime(matmul, attention, elementwise, comm, exposed_s, step, max(busy, comm),
                    max(costs, key=costs.get))
