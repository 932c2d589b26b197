"""Peak FLOP/s lookup, MFU, step timing, and the run logger's JSONL / TensorBoard / config output."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.crc32c import crc32c
from tensorboardX.proto.event_pb2 import Event

from trainers import logger as logger_lib
from trainers import metrics as metrics_lib
from trainers.logger import RunLogger, read_metrics, write_config
from trainers.metrics import (
    StepMeter,
    UnknownAcceleratorWarning,
    measure_cpu_matmul_peak,
    mfu,
    peak_flops_per_device,
)
from trainers.peaks import PEAK_FLOPS, lookup_peak


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    platform: str = "gpu"


# ----------------------------------------------------------------------------- peak table


@pytest.mark.parametrize(
    "kind, platform, bf16, f32",
    [
        ("NVIDIA H100 80GB HBM3", "gpu", 989.4e12, 494.7e12),
        ("NVIDIA H100 PCIe", "gpu", 756.5e12, 378e12),
        ("NVIDIA H100 NVL", "gpu", 835.5e12, 417.5e12),
        ("NVIDIA H200", "gpu", 989.4e12, 494.7e12),
        ("NVIDIA GH200 480GB", "gpu", 989.4e12, 494.7e12),
        ("NVIDIA A100-SXM4-40GB", "gpu", 312e12, 156e12),
        ("NVIDIA A100 80GB PCIe", "gpu", 312e12, 156e12),
        ("NVIDIA L4", "gpu", 121e12, 60e12),
        ("NVIDIA L40S", "gpu", 362.05e12, 183e12),
        ("TPU v4", "tpu", 275e12, 275e12),
        ("TPU v5 lite", "tpu", 197e12, 197e12),
        ("TPU v5e", "tpu", 197e12, 197e12),
        ("TPU v5", "tpu", 459e12, 459e12),
        ("TPU v5p", "tpu", 459e12, 459e12),
        ("TPU v6 lite", "tpu", 918e12, 918e12),
        ("TPU v6e", "tpu", 918e12, 918e12),
        ("TPU v3", "tpu", 61.5e12, 61.5e12),  # 123 TF per chip, two devices per chip
        ("TPU7x", "tpu", 1153.5e12, 1153.5e12),  # 2307 TF per chip, two devices per chip
    ],
)
def test_peak_lookup_for_known_kinds(kind, platform, bf16, f32):
    got_bf16, source = peak_flops_per_device(FakeDevice(kind, platform), "bfloat16")
    got_f32, _ = peak_flops_per_device(FakeDevice(kind, platform), jnp.float32)
    assert got_bf16 == pytest.approx(bf16) and got_f32 == pytest.approx(f32)
    assert "datasheet" in source or "TPU" in source or "ISCA" in source


@pytest.mark.parametrize(
    "kind, expected, not_",
    [
        ("TPU v5 lite", "TPU v5 lite", "TPU v5"),  # v5e must not be read as v5p
        ("TPU v4 lite", "TPU v4 lite", "TPU v4"),
        ("NVIDIA L40S", "L40S", "L4"),
        ("NVIDIA L40", "L40", "L4"),
        ("NVIDIA H100 PCIe", "H100 PCIe", "H100"),
        ("NVIDIA GH200 480GB", "GH200", "H200"),
        ("NVIDIA GB200", "GB200", "B200"),
    ],
)
def test_more_specific_kinds_win(kind, expected, not_):
    spec = lookup_peak(kind)
    assert spec is not None and spec.kind == expected and spec.kind != not_


def test_every_table_entry_is_reachable():
    # An entry shadowed by an earlier, shorter kind could never be selected.
    for spec in PEAK_FLOPS:
        assert lookup_peak(spec.kind) is spec, spec.kind
        assert lookup_peak(f"Vendor {spec.kind} 80GB") is spec, spec.kind


def test_word_boundaries_prevent_accidental_matches():
    assert lookup_peak("NVIDIA RTX A1000") is None  # contains "A100" but is not one
    assert lookup_peak("TPU v40") is None
    assert lookup_peak("nvidia a100-sxm4-80gb").kind == "A100"  # case-insensitive


def test_unknown_kind_warns_and_gives_nan():
    with pytest.warns(UnknownAcceleratorWarning, match="Quantum QPU 9000"):
        peak, source = peak_flops_per_device(FakeDevice("Quantum QPU 9000"), "bfloat16")
    assert math.isnan(peak) and "unknown" in source
    assert math.isnan(mfu(1e12, 1.0, 8, peak))


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ValueError, match="int8"):
        peak_flops_per_device(FakeDevice("TPU v4", "tpu"), "int8")
    with pytest.raises(ValueError, match="not a dtype"):
        peak_flops_per_device(FakeDevice("TPU v4", "tpu"), "notadtype")


# ----------------------------------------------------------------------------- CPU measurement


def test_measured_cpu_peak_is_positive_finite_and_cached():
    peak = measure_cpu_matmul_peak(jnp.float32, n=128, repeats=2)
    assert peak > 0 and math.isfinite(peak)
    assert measure_cpu_matmul_peak(jnp.float32, n=128, repeats=2) == peak  # same (dtype, n): cached
    assert ("float32", 128) in metrics_lib._CPU_PEAK_CACHE
    with pytest.raises(ValueError, match="n must be"):
        measure_cpu_matmul_peak(jnp.float32, n=0)


def test_cpu_device_peak_is_measured_and_shared_by_local_devices(monkeypatch):
    monkeypatch.setattr(metrics_lib, "measure_cpu_matmul_peak", lambda dtype, n=1024, repeats=5: 8.0e10)
    peak, source = peak_flops_per_device(jax.devices("cpu")[0], "float32")
    n_cpu = len(jax.local_devices(backend="cpu"))
    assert n_cpu == 8
    assert peak == pytest.approx(8.0e10 / n_cpu)
    assert "measured" in source


# ----------------------------------------------------------------------------- mfu and StepMeter


def test_mfu_arithmetic():
    # 8 devices at 1e12 FLOP/s for 0.5 s can do 4e12 FLOPs; the model did 1e12 of them.
    assert mfu(1e12, 0.5, 8, 1e12) == pytest.approx(0.25)
    assert mfu(1e12, 0.5, 8, 1e12) != pytest.approx(mfu(1e12, 0.5, 4, 1e12))  # negative control
    assert math.isnan(mfu(math.nan, 0.5, 8, 1e12))
    for bad in [dict(step_time_s=0.0), dict(n_devices=0), dict(peak_per_device=-1.0)]:
        args = dict(model_flops_per_step=1e12, step_time_s=0.5, n_devices=8, peak_per_device=1e12) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            mfu(**args)


def test_step_meter_excludes_the_compile_step():
    meter = StepMeter(tokens_per_step=1000, model_flops_per_step=2e12, n_devices=4, peak_per_device=1e12)
    first = meter.record(10.0)  # compilation
    assert first["step_time_s"] == 10.0 and first["tokens_per_s"] == pytest.approx(100.0)
    assert meter.summary()["steps"] == 0 and math.isnan(meter.summary()["step_time_s"])
    meter.record(1.0)
    meter.record(3.0)
    summary = meter.summary()
    assert summary["steps"] == 2
    assert summary["step_time_s"] == pytest.approx(2.0)  # the 10 s step would make it 4.67
    assert summary["tokens_per_s"] == pytest.approx(500.0)
    assert summary["mfu"] == pytest.approx(2e12 / (2.0 * 4 * 1e12))
    # One interval covering several steps counts as that many steps.
    per_step = meter.record(4.0, steps=4)
    assert per_step["step_time_s"] == pytest.approx(1.0)
    assert meter.summary()["steps"] == 6 and meter.summary()["step_time_s"] == pytest.approx(8.0 / 6)


def test_step_meter_start_stop_uses_the_clock_and_blocks():
    ticks = iter([0.0, 2.0, 5.0, 6.0])
    meter = StepMeter(tokens_per_step=10, clock=lambda: next(ticks))
    meter.start()
    out = meter.stop(block_on={"x": jnp.ones(2)})
    assert out["step_time_s"] == 2.0 and math.isnan(out["mfu"])  # no FLOPs given: NaN, not a guess
    meter.start()
    assert meter.stop()["tokens_per_s"] == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="start"):
        meter.stop()


# ----------------------------------------------------------------------------- RunLogger


def _read_events(tb_dir: Path) -> list[Event]:
    """Parse TFRecord framing (u64 length, masked crc, payload, masked crc) and decode each Event."""

    def masked(data: bytes) -> int:
        x = crc32c(data) & 0xFFFFFFFF
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    data, off, events = files[0].read_bytes(), 0, []
    while off < len(data):
        header = data[off : off + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[off + 8 : off + 12])
        assert length_crc == masked(header)
        payload = data[off + 12 : off + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[off + 12 + length : off + 16 + length])
        assert payload_crc == masked(payload)
        event = Event()
        event.ParseFromString(payload)
        events.append(event)
        off += 16 + length
    assert off == len(data)
    return events


def test_run_logger_writes_jsonl_and_tensorboard(tmp_path):
    with RunLogger(tmp_path, total_steps=3, progress=False) as log:
        log.log(1, {"loss": np.float32(2.5), "lr": jnp.asarray(1e-3), "tokens_per_s": 100})
        log.log(2, {"loss": jnp.ones((1,)) * 2.0, "mfu": 0.25})
        log.log(2, {"loss": 3.0}, prefix="eval")
        assert "loss=2" in log.postfix and "mfu=25.0%" in log.postfix and "eval_loss=3" in log.postfix
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [(r["step"], r["split"]) for r in records] == [(1, "train"), (2, "train"), (2, "eval")]
    assert records[0]["loss"] == 2.5 and records[0]["lr"] == pytest.approx(1e-3) and records[0]["tokens_per_s"] == 100
    assert type(records[1]["loss"]) is float and records[1]["loss"] == 2.0
    assert records[2] == {"step": 2, "split": "eval", "time": records[2]["time"], "loss": 3.0}

    scalars = {
        (v.tag, e.step): v.simple_value for e in _read_events(tmp_path / "tensorboard") for v in e.summary.value
    }
    assert scalars[("train/loss", 1)] == 2.5 and scalars[("train/loss", 2)] == 2.0
    assert scalars[("train/lr", 1)] == pytest.approx(1e-3)
    assert scalars[("eval/loss", 2)] == 3.0
    assert ("eval/loss", 1) not in scalars and ("train/mfu", 1) not in scalars  # negative control


def test_non_finite_values_are_null_in_json(tmp_path):
    with RunLogger(tmp_path, use_tensorboard=False, progress=False) as log:
        log.log(0, {"loss": float("nan"), "grad_norm": np.inf, "lr": 0.1})
        assert "loss=nan" in log.postfix
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    record = json.loads(text)  # strict JSON
    assert record["loss"] is None and record["grad_norm"] is None and record["lr"] == 0.1
    (back,) = read_metrics(tmp_path, split="train")
    assert math.isnan(back["loss"]) and back["lr"] == 0.1
    assert not (tmp_path / "tensorboard").exists()


def test_non_main_process_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    with RunLogger(run_dir, is_main=False, total_steps=10) as log:
        log.log(1, {"loss": 1.0})
        log.message("hello from another host")
        with pytest.raises(ValueError, match="reserved"):  # inputs are still checked everywhere
            log.log(2, {"step": 1.0})
    assert not run_dir.exists()
    assert "hello" not in capsys.readouterr().out


def test_progress_bar_and_message(tmp_path, capsys):
    with RunLogger(tmp_path, total_steps=4, use_tensorboard=False, tty=True) as log:
        log.message("starting run")
        log.log(2, {"loss": 1.25, "tokens_per_s": 5e4})
        assert log._bar.n == 2
    captured = capsys.readouterr()
    assert "starting run" in captured.out
    assert "loss=1.25" in captured.err and "tok/s=5e+04" in captured.err


def test_progress_off_a_terminal_is_one_plain_line_per_logged_step(tmp_path, capsys):
    with RunLogger(tmp_path, total_steps=60, use_tensorboard=False, tty=False) as log:
        for step in range(10, 61, 10):
            log.log(step, {"loss": 1.0 / step})
        log.log(60, {"loss": 0.5}, prefix="eval")  # not a progress line
        assert log._bar is None
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines() == [f"step {s}/60: loss={1.0 / s:.4g}" for s in range(10, 61, 10)]


def test_resume_keeps_each_logged_step_once_in_jsonl_and_tensorboard(tmp_path):
    """A kill after step 3 (a torn last line), a resume from step 2: every step once, the resumed values."""
    from trainers.log_files import read_scalars

    with RunLogger(tmp_path, progress=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": float(step)})
        assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]  # flushed at each step
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "spl')  # torn by the kill
    with RunLogger(tmp_path, progress=False) as log:
        log.resume_at(2)
        for step in (3, 4):
            log.log(step, {"loss": 10.0 * step})
    rows = [(r["step"], r["loss"]) for r in read_metrics(tmp_path, "train")]
    assert rows == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert read_scalars(tmp_path)["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.*"))) == 2  # negative control: the old file still holds step 3


def test_run_logger_rejects_bad_inputs(tmp_path):
    with RunLogger(tmp_path, use_tensorboard=False, progress=False) as log:
        with pytest.raises(ValueError, match=r"shape \(2,\)"):
            log.log(0, {"loss": np.ones(2)})
        with pytest.raises(ValueError, match="'name'"):
            log.log(0, {"name": "abc"})
        with pytest.raises(ValueError, match="step"):
            log.log(-1, {"loss": 1.0})
        with pytest.raises(ValueError, match="prefix"):
            log.log(0, {"loss": 1.0}, prefix="")
    with pytest.raises(RuntimeError, match="closed"):
        log.log(1, {"loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""


# ----------------------------------------------------------------------------- write_config


@dataclasses.dataclass(frozen=True)
class _Opt:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)


def test_write_config_round_trips(tmp_path):
    config = {"model": {"d_model": 64, "n_layers": 2}, "mesh": [["data", 2], ["tensor", 4]], "seed": 0, "name": "tiny"}
    path = write_config(tmp_path / "run", config)
    assert path == tmp_path / "run" / "config.json"
    assert json.loads(path.read_text()) == config
    nested = {"opt": _Opt(), "dir": tmp_path, "scale": np.float32(0.5), "clip": None}
    back = json.loads(write_config(tmp_path, nested).read_text())
    assert back == {"opt": {"lr": 3e-4, "betas": [0.9, 0.95]}, "dir": str(tmp_path), "scale": 0.5, "clip": None}
    with pytest.raises(ValueError, match=r"config\['fn'\]"):
        write_config(tmp_path, {"fn": print})
    with pytest.raises(ValueError, match="mapping"):
        write_config(tmp_path, [1, 2])
    assert logger_lib.CONFIG_FILE == "config.json"
