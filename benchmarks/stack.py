"""Layer stack: the GPT's blocks scanned or unrolled (``model.scan_layers``) at 4, 16 and 48 layers.

For each depth the minimal GPT step (``common.gpt_setup``: the gpt-small shape, f32 AdamW, no remat)
on the fsdp_tp layout (data 2 x fsdp 2 x tensor 2) is compiled both ways: compile seconds, step
wall time and CPU seconds of this process per step (all XLA threads; interleaved rounds, medians),
peak memory per device (compiled arguments + temporaries), and the compiled HLO's op counts (loops,
dynamic-update-slices, dynamic-slices, copies, zero-filled broadcasts: :func:`op_counts`). Goals: where
``auto`` unrolls, unrolled costs at most 0.9 x the scanned CPU per step; where it scans, unrolled
compiles at least 1.5 x longer (why ``auto`` scans deep stacks). ``--quick``: a tiny GPT at 2 layers.

    python -m benchmarks.stack [--quick] [--output PATH]
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Sequence

import jax

from benchmarks import common
from benchmarks.common import Row

CPU_GOAL, COMPILE_GOAL = 0.9, 1.5
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_SHAPE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
COUNTED = ("kernels", "while", "dynamic-update-slice", "dynamic-slice", "copy", "zero-fill", "concatenate", "pad")
_FREE = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")  # no kernel of their own


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """``{computation name: its instructions (name, type, op, rest)}`` of an HLO text, ``ENTRY`` for the entry."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(", line)
        if head and line.rstrip().endswith("{"):
            current = "ENTRY" if head.group(1) else head.group(2)
            comps[current] = []
        elif current is not None and (m := _INSTR.match(line)):
            comps[current].append(m.groups())
    return comps


def _bytes(typ: str) -> int:
    shape = _SHAPE.match(typ)
    if not shape:
        return 0
    size = _BYTES.get(shape.group(1), 4)
    for d in filter(None, shape.group(2).split(",")):
        size *= int(d)
    return size


def op_counts(hlo: str) -> dict[str, int]:
    """The compiled step's kernels by kind (a loop body counted once): every instruction outside fused
    computations, a fusion counted as its root op (a fused dynamic-update-slice is one), for :data:`COUNTED`;
    ``zero-fill``: a broadcast of a zero constant of at least 4 KiB; also ``copy bytes``, ``zero-fill bytes``
    and ``copy of a zero-fill`` (a zero buffer copied into each loop buffer that starts from it)."""
    comps = _computations(hlo)
    called = {c for instrs in comps.values() for *_, op, rest in instrs if op == "fusion"
              for c in re.findall(r"calls=%?([\w.\-]+)", rest)}
    roots = {name: instrs[-1] for name, instrs in comps.items() if instrs}
    zeros = {n for instrs in comps.values() for n, _, op, rest in instrs
             if op == "constant" and re.match(r"-?0(\.0*)?\)", rest)}
    fills, out = set(), collections.Counter()
    for name, instrs in comps.items():
        if name in called:
            continue
        for n, typ, op, rest in instrs:
            operand = rest.split(")")[0].split(",")[0].strip().lstrip("%")
            if op == "fusion":
                body = re.search(r"calls=%?([\w.\-]+)", rest)
                root = roots.get(body.group(1)) if body else None
                op = root[2] if root else "fusion"
                if op in ("broadcast", "parameter") and operand in zeros:
                    op = "broadcast"
            if op == "broadcast" and operand in zeros and _bytes(typ) >= 4096:
                op = "zero-fill"
                fills.add(n)
            elif op == "copy" and operand in fills:
                out["copy of a zero-fill"] += 1
            out[op] += 1
            out[f"{op} bytes"] += _bytes(typ)
            out["kernels"] += op not in _FREE
    return {k: out[k] for k in (*COUNTED, "copy bytes", "zero-fill bytes", "copy of a zero-fill")}


@dataclasses.dataclass
class Measured:
    compile_s: float
    wall_s: list[float]
    cpu_s: list[float]
    peak: int
    ops: dict[str, int]


def measure(depths: Sequence[int], quick: bool, rounds: int, steps: int) -> dict[tuple[int, str], Measured]:
    base, batch, length = common.gpt_config(quick)
    layout = "fsdp_tp" if len(jax.devices()) >= 8 else "single"
    out = {}
    for n in depths:
        setups = {}
        for form in ("scanned", "unrolled"):
            cfg = dataclasses.replace(base, n_layers=n, scan_layers=form)
            s = common.gpt_setup(cfg, common.layout_mesh(layout), common.LAYOUTS.get(layout, ({}, "none"))[1],
                                 batch, length)
            mem = s.compiled.memory_analysis()
            peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            holder = {"state": s.step(s.state, s.batch)[0]}  # warm up
            setups[form] = (s, holder)
            out[(n, form)] = Measured(s.compile_s, [], [], peak, op_counts(s.compiled.as_text()))

        def timed(form: str, n: int = n):
            def one() -> float:
                s, holder = setups[form]
                t0, c0 = time.perf_counter(), time.process_time()
                state = holder["state"]
                for _ in range(steps):
                    state, loss = s.step(state, s.batch)
                jax.block_until_ready(loss)
                holder["state"] = state
                out[(n, form)].cpu_s.append((time.process_time() - c0) / steps)
                return (time.perf_counter() - t0) / steps
            return one

        times = common.interleaved(rounds, {f: timed(f) for f in setups})
        for form in setups:
            out[(n, form)].wall_s.extend(times[form])
        print(f"{n} layers: " + ", ".join(f"{f} {statistics.median(times[f]) * 1e3:.1f} ms" for f in setups), flush=True)
    return out


def rows_for(n: int, scanned: Measured, unrolled: Measured, form_auto: str, rounds: int, steps: int) -> list[Row]:
    med = statistics.median
    cpu_r = [u / s for u, s in zip(unrolled.cpu_s, scanned.cpu_s)]
    wall_r = [u / s for u, s in zip(unrolled.wall_s, scanned.wall_s)]
    spread = f"{rounds} interleaved rounds x {steps} steps; per-round ratios {min(cpu_r):.2f}-{max(cpu_r):.2f}"
    unrolls = form_auto == "unrolled"
    return [
        Row(f"{n} layers: CPU seconds per step, unrolled / scanned", f"{med(unrolled.cpu_s) * 1e3:.1f} ms",
            f"{med(scanned.cpu_s) * 1e3:.1f} ms scanned", med(cpu_r), f"<= {CPU_GOAL}" if unrolls else "reported",
            med(cpu_r) <= CPU_GOAL if unrolls else None, f"auto: {form_auto}; {spread}"),
        Row(f"{n} layers: step wall time, unrolled / scanned", f"{med(unrolled.wall_s) * 1e3:.1f} ms",
            f"{med(scanned.wall_s) * 1e3:.1f} ms scanned", med(wall_r), "reported", None,
            f"per-round ratios {min(wall_r):.2f}-{max(wall_r):.2f}"),
        Row(f"{n} layers: compile time, unrolled / scanned", f"{unrolled.compile_s:.1f} s", f"{scanned.compile_s:.1f} s",
            unrolled.compile_s / scanned.compile_s, "reported" if unrolls else f">= {COMPILE_GOAL}",
            None if unrolls else unrolled.compile_s / scanned.compile_s >= COMPILE_GOAL, "lower + compile, one run"),
        Row(f"{n} layers: peak memory per device, unrolled / scanned", common.fmt_bytes(unrolled.peak),
            common.fmt_bytes(scanned.peak), unrolled.peak / scanned.peak, "reported", None,
            "compiled arguments + temporaries + outputs - aliased"),
    ]


def ops_table(measured: dict[tuple[int, str], Measured]) -> str:
    keys = ("kernels", "while", "dynamic-update-slice", "dynamic-slice", "copy", "copy bytes", "zero-fill",
            "zero-fill bytes", "copy of a zero-fill", "concatenate", "pad")
    rows = [[f"{n}", form] + [common.fmt_bytes(m.ops[k]) if k.endswith("bytes") else str(m.ops[k]) for k in keys]
            for (n, form), m in sorted(measured.items())]
    return common.markdown_table(("layers", "stack", *keys), rows)


def run(options: common.Options, command: str = "python -m benchmarks.stack") -> list[Row]:
    from spmd.stack import stack_form

    common.setup_devices(options.real_devices)
    started = common.load()
    depths, rounds, steps = ((2,), 2, 2) if options.quick else ((4, 16, 48), 7, 3)
    measured = measure(depths, options.quick, rounds, steps)
    backend = jax.default_backend()
    rows = [r for n in depths for r in rows_for(n, measured[(n, "scanned")], measured[(n, "unrolled")],
                                                 stack_form("auto", n, backend), rounds, steps)]
    cfg, batch, length = common.gpt_config(options.quick)
    before = [f"- the minimal step (value_and_grad -> AdamW -> apply, f32, no remat), GPT d_model={cfg.d_model}, "
              f"n_heads={cfg.n_heads}, d_ff={cfg.ff}, batch {batch} x {length}, at each depth; layout fsdp_tp on "
              f"{len(jax.devices())} {backend} devices; CPU seconds = this process's, all threads. The machine is "
              "shared (2 cores): timings are noisy, the ratios come from interleaved rounds of one process."]
    after = ["Kernels of the compiled step by kind (benchmarks.stack.op_counts: a fusion counted as its root op, a "
             "loop body once; zero-fill = a broadcast of zero >= 4 KiB); docs/performance.md reads them.", "",
             ops_table(measured)]
    common.report("stack", "Layer stack: scanned vs unrolled", rows, options, command, before=before, after=after,
                  started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.stack") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
