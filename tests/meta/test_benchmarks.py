"""The benchmarks: their shared parts on small inputs (fast), and each one's --quick run (slow).

The fast tests pin what the tables rest on: the results file keeps every other section when one
benchmark rewrites its own, interleaved timing alternates its order, the HLO matmul counter
multiplies loop bodies by their trip count, the scaling and comms arithmetic. The slow test
runs every benchmark's ``--quick`` mode end to end and checks it produced its table.
"""

from __future__ import annotations

import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from benchmarks import common, comms, mfu, pipeline, scaling, stack, steptime

# ---------------------------------------------------------------------------------- results file
INFO = {"CPU": "test cpu", "cores": "2", "load average (1, 5, 15 min)": "0", "devices": "8 x cpu", "GPU": "none",
        "jax": jax.__version__, "python": "3"}


def test_write_section_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "RESULTS.md"
    common.write_section(path, "mfu", "## MFU\nfirst mfu", INFO)
    common.write_section(path, "comms", "## Comms\ncomms table", INFO)
    common.write_section(path, "mfu", "## MFU\nsecond mfu", INFO)
    sections = common.read_sections(path)
    assert sections == {"comms": "## Comms\ncomms table\n", "mfu": "## MFU\nsecond mfu\n"}
    text = path.read_text()
    assert "first mfu" not in text and text.count("second mfu") == 1
    assert text.index("<!-- begin comms -->") < text.index("<!-- begin mfu -->")  # common.ORDER, not write order
    assert "- CPU: test cpu" in text and text.startswith("# Benchmark results")
    with pytest.raises(ValueError, match="section name 'bad name'"):
        common.write_section(path, "bad name", "x", INFO)


def test_interleaved_alternates_the_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name) or 0.5) for name in ("a", "b", "c")}
    times = common.interleaved(3, fns)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert times == {"a": [0.5] * 3, "b": [0.5] * 3, "c": [0.5] * 3}
    with pytest.raises(ValueError, match="rounds=0"):
        common.interleaved(0, fns)


def test_row_cells_and_options():
    assert common.Row("x", "1", "2", 0.5, "<= 1", True).cells()[3:6] == ["0.500", "<= 1", "met"]
    assert common.Row("x", "1", "2", 1.5, "<= 1", False).cells()[5] == "NOT met"
    assert common.Row("x", "1", "2", math.nan, "reported", None).cells()[3::2] == ["-", "-"]
    with pytest.raises(ValueError, match="quick"):
        common.Options(quick="yes")
    with pytest.raises(ValueError, match="unknown layout 'dp3'"):
        common.layout_mesh("dp3")


# ---------------------------------------------------------------------------------- arithmetic
def test_gathered_bytes_undoes_only_the_named_axis():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P("fsdp")))  # 2 rows per device
    y = jax.device_put(np.zeros((8,), np.float32), NamedSharding(mesh, P("data")))  # 4 per device
    assert comms.gathered_bytes({"x": x, "y": y}, "fsdp", mesh) == 8 * 4 * 4 + 4 * 4
    assert comms.gathered_bytes({"x": x, "y": y}, "data", mesh) == 2 * 4 * 4 + 8 * 4  # negative control


def test_comms_role_row_uses_the_accelerator_view_and_names_the_cpu_program():
    rs = spmd.hlo.Collective("reduce-scatter", ("fsdp",), 2, 1000, 8, emitted_kind="all-reduce", emitted_bytes=2000,
                             cpu_note="reduce-scatter emitted as all-reduce + dynamic-slice")
    row = comms.role_row("fsdp8", "gradient reduction", [rs], 2000, "W")
    assert (row.ratio, row.met) == (1.0, True) and "CPU program: all-reduce over fsdp 3.91 KiB" in row.note
    over = comms.role_row("fsdp8", "gradient reduction", [rs], 1900, "W")
    assert not over.met and "unexplained: 100 B" in over.note  # negative control
    ar = spmd.hlo.Collective("all-reduce", ("tensor",), 1, 800, 4)
    pair = [spmd.hlo.Collective("reduce-scatter", ("tensor",), 1, 800, 4), spmd.hlo.Collective("all-gather", ("tensor",), 1, 800, 4)]
    assert ar.wire_bytes == sum(o.wire_bytes for o in pair) == 1200  # SP moves what the all-reduce moves


def test_steptime_without_git_skips_the_base(monkeypatch, tmp_path):
    monkeypatch.setattr(steptime.shutil, "which", lambda name: None)
    assert steptime.base_worktree(tmp_path / "base") == "git is not available"


HLO = """HloModule m

%body (b: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %b = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%b), index=1
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/while/body/bd,de->be/dot_general"}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%k, %d)
}

%cond (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %w0 = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body{trip}
  %e = f32[4,4]{1,0} dot(f32[4,8]{1,0} %p, f32[4,8]{1,0} %p), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/transpose(jvp())/bd,cd->bc/dot_general"}
  ROOT %out = f32[4,8]{1,0} copy(%p)
}
"""


def test_dot_flops_multiplies_loop_bodies_by_their_trip_count():
    body, entry = 2 * 4 * 8 * 8, 2 * 4 * 4 * 8
    total, by_op = mfu.dot_flops(HLO.replace("{trip}", ', backend_config={"known_trip_count":{"n":"3"}}'))
    assert total == 3 * body + entry
    assert by_op == {"fwd bd,de->be": 3 * body, "bwd bd,cd->bc": entry}
    # negative control: without a known trip count the body counts once
    assert mfu.dot_flops(HLO.replace("{trip}", ""))[0] == body + entry


def test_stack_op_counts_tell_a_loop_from_unrolled_layers():
    def layers(x_N, unroll):  # a residual saved per layer (tanh's output), as a stack keeps its activations
        body = lambda c, w: (jnp.tanh(c @ w), None)  # noqa: E731
        return jax.lax.scan(body, x_N[0], x_N, unroll=unroll)[0].sum()

    x = jnp.ones((6, 64, 64))
    scanned, unrolled = (stack.op_counts(jax.jit(jax.grad(lambda x, u=u: layers(x, u))).lower(x).compile().as_text())
                         for u in (1, 6))
    assert scanned["while"] == 2 and unrolled["while"] == 0  # forward and backward loops
    assert scanned["dynamic-update-slice"] >= 1 and unrolled["dynamic-update-slice"] == 0
    assert scanned["zero-fill"] >= 1 and scanned["zero-fill bytes"] >= 6 * 64 * 64 * 4  # the stacked residuals
    assert unrolled["kernels"] > scanned["kernels"]


def test_scaling_rows_compare_with_the_ideal():
    def result(n, compile_s, dp_bytes, fsdp_bytes):
        one = {"compile_s": compile_s, "compile_cpu_s": compile_s, "temp_bytes": 0}
        return {"devices": n, "layouts": {"dp": {**one, "state_bytes": dp_bytes}, "fsdp": {**one, "state_bytes": fsdp_bytes}}}

    rows = {r.what: r for r in scaling.rows_of([result(1, 1.0, 800, 800), result(4, 3.0, 800, 204)])}
    assert rows["fsdp x4: state bytes per device"].ratio == pytest.approx(204 / 200)
    assert rows["fsdp x4: state bytes per device"].met
    assert rows["dp x4: state bytes per device"].ratio == 1.0
    assert rows["dp x4: compile time (CPU seconds)"].ratio == 3.0 and not rows["dp x4: compile time (CPU seconds)"].met
    bad = {r.what: r for r in scaling.rows_of([result(1, 1.0, 800, 800), result(4, 1.0, 800, 800)])}
    assert not bad["fsdp x4: state bytes per device"].met  # replicated "FSDP" state is caught


@pytest.mark.skipif(importlib.util.find_spec("spmd.pipeline") is None, reason="spmd.pipeline not present")
def test_pipeline_schedule_rows_match_theory():
    rows = pipeline.schedule_rows(4, (4, 8))
    assert len(rows) == 6 and all(r.met for r in rows)
    assert {r.what for r in rows} >= {"schedule gpipe S=4 M=8", "schedule interleaved S=4 M=4 V=2"}


# ---------------------------------------------------------------------------------- quick runs
@pytest.mark.slow
@pytest.mark.parametrize("name", common.ORDER)
def test_quick_mode_writes_its_table(name, tmp_path, capsys):
    from benchmarks.__main__ import BENCHMARKS

    out = tmp_path / "RESULTS.md"
    assert BENCHMARKS[name](["--quick", "--output", str(out)], command=f"python -m benchmarks.{name}") == 0
    section = common.read_sections(out)[name]
    assert "(quick mode)" in section
    printed = capsys.readouterr().out
    if name in ("gpu", "decode_gpu", "moe_gpu") and not any(d.platform == "gpu" for d in jax.devices()):
        assert "no GPU: skipped" in section and "no GPU: skipped" in printed
        return
    if name == "peer" and not os.environ.get("SPMD_MAXTEXT_VENV"):
        assert "skipped: no MaxText environment" in section and "skipped: no MaxText environment" in printed
        return
    if name == "pipeline" and importlib.util.find_spec("spmd.pipeline") is None:
        assert "pipeline: not available" in section
        return
    assert "| what | measured | limit or baseline | ratio | goal | met | note |" in section
    assert section.count("\n| ") >= 2  # the header and at least one row (the rule line starts "|-")
    assert "| met |" in section or "| NOT met |" in section
