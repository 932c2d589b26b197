"""The dry run's report: analytic and compiled memory side by side, collectives, roofline, diagnostics."""

from __future__ import annotations

import dataclasses

from spmd.hlo import Collective, format_collectives
from spmd.inspection import Memory
from spmd.units import fmt_bytes, fmt_seconds
from trainers.hardware import Hardware
from trainers.planning.costs import MemoryEstimate, Roofline, Traffic
from trainers.validate import Issue


@dataclasses.dataclass(frozen=True)
class DryRunReport:
    """What a dry run found; ``format()`` is the human-readable report."""

    name: str
    devices: int
    mesh: tuple[tuple[str, int], ...]
    dcn_axes: tuple[str, ...]
    rules: str
    hardware: Hardware
    headroom: float
    params: int  # parameter count
    model_flops: float  # per step, all devices
    analytic: MemoryEstimate | None
    compiled: Memory | None  # of the compiled step, per device
    state_bytes: int  # params + optimizer + counters, per device, from the abstract shard shapes
    batch_bytes: int
    collectives: tuple[Collective, ...] = ()
    traffic: tuple[Traffic, ...] = ()  # from the compiled collectives
    analytic_traffic: tuple[Traffic, ...] = ()
    roofline: Roofline | None = None
    issues: tuple[Issue, ...] = ()
    compile_s: float = 0.0
    backend: str = ""
    pipeline: str = ""  # "1f1b S=2 M=4 V=1" when the step is pipelined, else ""
    bubble: float = 0.0  # idle fraction of the pipeline's schedule table
    pipe_sent: int = 0  # bytes sent over pipe per step, summed over one pipeline's stage pairs (spmd.pipeline.hlo_sent_bytes)

    @property
    def pipe_permutes(self) -> tuple:
        """The compiled step's collective-permutes over the ``pipe`` axis (the pipeline's sends).

        Those in switch branches have ``in_branch`` and count every tick: an upper bound."""
        return tuple(op for op in self.collectives if op.kind == "collective-permute" and op.axes == ("pipe",))

    @property
    def pipe_traffic(self) -> Traffic | None:
        """The busiest stage's sends over ``pipe`` per device per step, as the roofline times them.

        From the compiled switch branches weighed by the schedule table; ``analytic_traffic`` has the table's own."""
        return next((x for x in self.traffic if x.kind == "collective-permute" and x.axes == ("pipe",)), None)

    @property
    def budget(self) -> float:
        return self.headroom * self.hardware.hbm_bytes

    @property
    def peak_bytes(self) -> int:
        """Per-device footprint: the compiled one when compiled, else the analytic one."""
        if self.compiled is not None:
            return self.compiled.total
        return self.analytic.total if self.analytic is not None else 0

    @property
    def fits(self) -> bool:
        return self.compiled is not None and self.peak_bytes <= self.budget

    def format(self) -> str:
        hw = self.hardware
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh if s > 1) or "1 device"
        out = [f"dry run: {self.name}, {self.params:,} params, mesh {mesh}"
               + (f" (dcn: {','.join(self.dcn_axes)})" if self.dcn_axes else "") + f", rules {self.rules}",
               f"target {hw.name} x {self.devices}; compiled on {self.backend} in {fmt_seconds(self.compile_s)}", ""]
        a, c = self.analytic, self.compiled
        if a is not None:
            rows = [("params", a.params, None), ("optimizer", a.optimizer, None)]
            if a.other:
                rows.append(("model variables (batch stats, RNG, ...)", a.other, None))
            state = "state (params + optimizer" + (" + variables)" if a.other else ")")
            rows += [(state, a.state, c.argument - self.batch_bytes if c else None),
                     ("grads", a.grads, None), ("activations", a.activations, None),
                     ("temporaries (grads + activations + ...)", a.grads + a.activations, c.temp if c else None),
                     ("batch", a.batch, self.batch_bytes if c else None),
                     ("total", a.total, c.total if c else None)]
            out.append(f"{'per device':<42}{'analytic':>14}{'compiled':>14}")
            out += [f"{k:<42}{fmt_bytes(x):>14}{fmt_bytes(y) if y is not None else '':>14}" for k, x, y in rows]
            verdict = "fits" if self.fits else "does NOT fit" if c is not None else "not compiled"
            out.append(f"{verdict}: {fmt_bytes(self.peak_bytes)} of {fmt_bytes(hw.hbm_bytes)} HBM (budget {self.headroom:.0%} = "
                       f"{fmt_bytes(self.budget)})")
        if self.pipeline:
            sends, compiled = self.pipe_permutes, self.pipe_traffic
            expected = [x for x in self.analytic_traffic if x.kind == "collective-permute" and x.axes == ("pipe",)]
            out += ["", f"pipeline: {self.pipeline}, bubble {self.bubble:.1%} of the schedule's slots idle",
                    f"sends over pipe per step: {fmt_bytes(self.pipe_sent)} over one pipeline's stage pairs (compiled "
                    f"switch branches weighed by the schedule table: spmd.pipeline.hlo_sent_bytes); busiest stage "
                    f"{compiled.count if compiled else 0} sends, {fmt_bytes(compiled.bytes if compiled else 0)} per "
                    f"device (analytic {sum(x.count for x in expected)}, {fmt_bytes(sum(x.bytes for x in expected))}); "
                    f"the table below counts every branch on every tick: {sum(op.count for op in sends)} "
                    f"collective-permutes, {fmt_bytes(sum(op.total_bytes for op in sends))}"]
        if self.collectives:
            out += ["", "collectives (compiled step, per device per step, as an accelerator runs it; the last column "
                        "says where the CPU program emits something else):", format_collectives(list(self.collectives))]
        if self.traffic:
            out += ["", f"{'communication on ' + hw.name:<42}{'bytes':>14}{'time':>12}"]
            out += [f"{x.kind + ' ' + ','.join(x.axes) + ' (' + x.network + ')':<42}{fmt_bytes(x.bytes):>14}{fmt_seconds(x.seconds):>12}"
                    for x in self.traffic]
        r = self.roofline
        if r is not None:
            out += ["", f"model FLOPs per step {self.model_flops:.3e}; per device executed {r.flops_per_device:.3e}",
                    f"roofline on {hw.name}: compute {fmt_seconds(r.compute_s)}, HBM {fmt_seconds(r.memory_s)}, "
                    f"communication {fmt_seconds(r.comm_s)}",
                    f"estimated step {fmt_seconds(r.step_s)} (no overlap; {fmt_seconds(r.step_s_overlap)} with perfect "
                    f"overlap), MFU {r.mfu:.1%}, dominant cost: {r.dominant}"]
        if self.issues:
            out += ["", "diagnostics:"] + [f"  - {i}" for i in self.issues]
        return "\n".join(out)
