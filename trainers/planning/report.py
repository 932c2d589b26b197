"""The dry run's report: analytic and compiled memory side by side, collectives, roofline, diagnostics."""

from __future__ import annotations

import dataclasses

from spmd.hlo import Collective, format_collectives
from spmd.inspection import Memory
from spmd.units import fmt_bytes, fmt_count, fmt_seconds, format_table
from trainers.checks import Issue
from trainers.planning.blockers import group_reasons
from trainers.planning.costs import MemoryEstimate, Roofline, Traffic
from trainers.planning.hardware import HARDWARE, Hardware


def is_cpu_target(hw: Hardware) -> bool:
    """Whether ``hw`` is the CPU stand-in (or a :func:`trainers.planning.hardware.custom` copy of it): the one target
    whose memory the CPU compile itself measures."""
    return getattr(hw, "platform", "") == "cpu" or hw.name == "cpu" or hw.source == HARDWARE["cpu"].source


def target_platform(hw: Hardware) -> str:
    """The jax backend ``hw`` runs on: ``cpu``, ``tpu`` (a torus) or ``gpu``."""
    return "cpu" if is_cpu_target(hw) else "tpu" if hw.torus else "gpu"


def layer_stack(model, hw: Hardware) -> str:
    """How a GPT config's blocks run on ``hw`` (``spmd.stack.stack_form``), as a report line."""
    form = model.stack_form(target_platform(hw))
    how = f"auto: {model.n_layers} layers on {target_platform(hw)}" if model.scan_layers == "auto" else "set"
    return f"layer stack {form} (model.scan_layers={model.scan_layers}; {how})"


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
    state_bytes: int  # params + optimizer + counters, per device, under the compiled program's input shardings
    batch_bytes: int
    # the accelerator memory model on the compiled shapes: state_bytes + batch_bytes + the analytic gradients and
    # activations in the compute dtype (what a GPU/TPU holds; the CPU's temporaries keep bf16 work in f32)
    model_bytes: int = 0
    verdict: str = "accelerator"  # what decides `fits`: "accelerator" (model_bytes) or "compiled" (a CPU target)
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
    error: str = ""  # the first line of the exception when building or compiling the step raised (then nothing compiled)
    layer_stack: str = ""  # how the built-in GPT's blocks run on the target (layer_stack); "" for a task

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
        """Per-device footprint the fit verdict reads (``model_bytes`` for a GPU/TPU target, compiled for a CPU one).

        For a GPU/TPU target the accelerator memory model on the compiled shapes; for a CPU target the
        compiled program's total; uncompiled, the analytic one."""
        if self.compiled is not None:
            return self.compiled.total if self.verdict == "compiled" else self.model_bytes
        return self.analytic.total if self.analytic is not None else 0

    @property
    def fits(self) -> bool:
        return self.compiled is not None and self.peak_bytes <= self.budget

    def format(self) -> str:
        hw = self.hardware
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh if s > 1) or "1 device"
        out = [f"dry run: {self.name}, {self.params:,} params, mesh {mesh}"
               + (f" (dcn: {','.join(self.dcn_axes)})" if self.dcn_axes else "") + f", rules {self.rules}"
               + (f", {self.layer_stack}" if self.layer_stack else ""),
               f"target {hw.name} x {self.devices}; compiled on {self.backend} in {fmt_seconds(self.compile_s)}", ""]
        if self.error:
            out += [f"compile failed: {self.error}", ""]
        a, c = self.analytic, self.compiled
        if a is not None:
            out += self._memory_table(a, c)
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
            rows = [(f"communication on {hw.name}", "count", "bytes", "time")]
            rows += [(f"{x.kind} {','.join(x.axes)} ({x.network})", fmt_count(x.count), fmt_bytes(x.bytes),
                      fmt_seconds(x.seconds)) for x in self.traffic]
            out += ["", format_table(rows, "<>>>")]
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

    def _memory_table(self, a: MemoryEstimate, c: Memory | None) -> list[str]:
        """Per-device memory: analytic, the accelerator model on the compiled shapes, the CPU compile; the verdict."""
        model = c is not None and self.verdict != "compiled"
        cpu_state = c.argument - self.batch_bytes if c else None
        state = "state (params + optimizer" + (" + variables)" if a.other else ")")
        rows: list[tuple[str, int, int | None, int | None]] = [("params", a.params, None, None), ("optimizer", a.optimizer, None, None)]
        if a.other:
            rows.append(("model variables (batch stats, RNG, ...)", a.other, None, None))
        rows += [(state, a.state, self.state_bytes if c else None, cpu_state),
                 ("grads", a.grads, a.grads if c else None, None),
                 ("activations", a.activations, a.activations if c else None, None),
                 ("temporaries (grads + activations + ...)", a.grads + a.activations,
                  a.grads + a.activations if c else None, c.temp if c else None),
                 ("batch", a.batch, self.batch_bytes if c else None, self.batch_bytes if c else None),
                 ("total", a.total, self.model_bytes if c else None, c.total if c else None)]
        cells = [("per device", "analytic", "accelerator", "CPU compile")]
        cells += [(k, fmt_bytes(x), "" if y is None else fmt_bytes(y), "" if z is None else fmt_bytes(z))
                  for k, x, y, z in rows]
        out = [format_table(cells, "<>>>")]
        if c is None:
            return out + [f"not compiled: {fmt_bytes(self.peak_bytes)} analytic of {fmt_bytes(self.hardware.hbm_bytes)} "
                          f"HBM (budget {self.headroom:.0%} = {fmt_bytes(self.budget)})"]
        how = ("the accelerator memory model on the compiled shapes: compiled state and batch + gradients and "
               "activations in the compute dtype; the CPU compile's total is a cross-check, not the verdict"
               if model else "the compiled program's total (a CPU target: the CPU compile is the program that runs)")
        verdict = "fits" if self.fits else "does NOT fit"
        return out + [f"{verdict}: {fmt_bytes(self.peak_bytes)} of {fmt_bytes(self.hardware.hbm_bytes)} HBM (budget "
                      f"{self.headroom:.0%} = {fmt_bytes(self.budget)}); verdict from {how}"]


def format_plan(plan, top: int = 5) -> str:
    """A :class:`trainers.planning.planner.Plan` as text (its ``format``): aligned at pod scale."""
    hw, total = plan.hardware, len(plan.ranked) + len(plan.rejected)
    lines = [f"{fmt_count(len(plan.ranked))} of {fmt_count(total)} layouts of {fmt_count(plan.devices)} devices "
             f"fit {hw.name} ({fmt_bytes(hw.hbm_bytes)} HBM, budget {fmt_bytes(plan.budget)})"]
    if not plan.ranked:
        lines += ["", plan.why_none()]
    picks = plan.picks[:top]
    if picks:
        compiled = {id(e): r for e, r in zip(plan.ranked, plan.compiled)}  # compiled in rank order
        head = ("#", "layout", "mem/device", "compiled", "CPU compile", "step", "overlap", "MFU", "dominant cost")
        rows: list[tuple[object, ...]] = [head]
        for i, e in enumerate(picks, 1):
            r, c = e.roofline, compiled.get(id(e))
            cpu = fmt_bytes(c.compiled.total) if c is not None and c.compiled is not None else "-"
            rows.append((i, e.layout, fmt_bytes(e.memory.total), fmt_bytes(c.peak_bytes) if c else "-", cpu,
                         fmt_seconds(r.step_s), fmt_seconds(r.step_s_overlap), f"{r.mfu:.1%}", r.dominant))
        lines += ["", format_table(rows, "><>>>>>><")]
        if plan.compiled:
            how = ("accelerator memory model on the compiled shapes" if plan.compiled[0].verdict != "compiled"
                   else "compiled program's footprint (a CPU target)")
            lines.append(f"compiled (abstract state, {plan.compiled[0].backend}): each pick's {how} fits the budget")
        else:
            lines.append("analytic ranking, not compiled (spmd-plan compiles the top picks unless --no-compile)")
    dropped = [(e, r) for e, r in zip(plan.ranked, plan.compiled) if not r.fits]
    if dropped:
        lines += ["", "compiled and dropped (over the budget when compiled, or the compile failed):"]
        lines += [f"    {e.layout}: " + (f"compile failed: {r.error}" if r.error else
                                         f"{fmt_bytes(r.peak_bytes)} > {fmt_bytes(r.budget)}") for e, r in dropped]
    if plan.rejected:
        groups = group_reasons(next((i for i in e.issues if i.fatal), None) for e in plan.rejected)
        reasons = [("rejected", "layouts", "e.g.")] + [(g, fmt_count(n), ex) for g, n, ex in groups]
        lines += ["", format_table(reasons, "<><", indent="    ")]
        over = [e for e in plan.rejected if e.buildable][:3]  # the closest by memory among buildable layouts
        if over:
            lines += ["", "closest over the budget:"] + [
                f"    {e.layout}: needs {fmt_bytes(e.memory.total)} > {fmt_bytes(e.budget)}" for e in over]
    if picks:
        lines += ["", f"chosen: {plan.best.layout.command()}"]
        if plan.layer_stack:
            lines.append(f"{plan.layer_stack} (compiled picks ran it)")
    return "\n".join(lines)


def counts_text(counts: tuple[int, ...], where: str) -> str:
    return f"{', '.join(map(fmt_count, counts))} {where}" if counts else f"none {where}"
