"""Run logging: one call writes a step's metrics to JSONL, TensorBoard and the progress bar.

A run directory holds `config.json`, `metrics.jsonl` (non-finite values as `null`) and
`tensorboard/`; only the process built with `is_main=True` writes. See docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trainers.log_files import METRICS_FILE, TENSORBOARD_DIR, ScalarWriter, truncate_metrics

CONFIG_FILE = "config.json"
_RESERVED = ("step", "split", "time")

# Metrics shown in the progress bar's postfix: (metric key, label, format).
_POSTFIX = (
    ("loss", "loss", "{:.4g}"),
    ("lr", "lr", "{:.2e}"),
    ("grad_norm", "gnorm", "{:.3g}"),
    ("tokens_per_s", "tok/s", "{:.4g}"),
    ("mfu", "mfu", "{:.1%}"),
)


def _to_float(key: str, value: Any) -> float:
    """A metric value as a Python float; one-element arrays of any real dtype are accepted."""
    try:
        arr = np.asarray(value)
    except Exception as err:  # e.g. a jax array that is not fully addressable on this process
        raise ValueError(f"metric {key!r}: cannot read value of type {type(value).__name__}: {err}") from err
    if arr.dtype.kind not in "biuf":
        raise ValueError(
            f"metric {key!r} has value {value!r} of dtype {arr.dtype}; expected a real number or a one-element array"
        )
    if arr.size != 1:
        raise ValueError(f"metric {key!r} has shape {arr.shape}; expected a scalar (one element)")
    return float(arr.reshape(()))


def _json_value(x: float) -> float | None:
    return x if math.isfinite(x) else None


class RunLogger:
    """Writes metrics of a training run to JSONL, TensorBoard and a tqdm progress bar."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        is_main: bool = True,
        total_steps: int | None = None,
        use_tensorboard: bool = True,
        progress: bool = True,
        tty: bool | None = None,
    ) -> None:
        """``progress``: a tqdm bar where stderr is a terminal (``tty``, default: detected), else one plain
        line per logged train step (schedulers, ``nohup`` and CI logs get no carriage returns)."""
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"total_steps must be >= 0 or None, got {total_steps!r}")
        self.run_dir = Path(run_dir)
        self.is_main = bool(is_main)
        self.closed = False
        self._postfix: dict[str, str] = {}
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._lines = False  # plain progress lines instead of a bar
        self._use_tb = use_tensorboard
        self._purge_step: int | None = None
        self.total_steps = total_steps
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        if progress and (sys.stderr.isatty() if tty is None else tty):
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)
        self._lines = progress and self._bar is None

    def _tensorboard(self):
        """The TensorBoard writer, made at the first record (after :meth:`resume_at` set its purge step)."""
        if self._tb is None and self._use_tb and self.is_main:
            self._tb = ScalarWriter(self.run_dir / TENSORBOARD_DIR, purge_step=self._purge_step)
        return self._tb

    def resume_at(self, step: int, keep_splits: tuple[str, ...] = ()) -> None:
        """A run resumed (or rolled back) at ``step`` logs every later step again: drop their records from
        metrics.jsonl except the splits in ``keep_splits`` (:func:`trainers.log_files.truncate_metrics`) and
        hide them in TensorBoard (``purge_step``)."""
        if not self.is_main or self.closed:
            return
        self._jsonl.close()
        truncate_metrics(self.run_dir, step, keep_splits)
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._purge_step = step + 1

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    @property
    def postfix(self) -> str:
        """The progress bar's current postfix text (also kept when there is no bar)."""
        return ", ".join(f"{k}={v}" for k, v in self._postfix.items())

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "train") -> None:
        """Record `metrics` at `step` under the split `prefix` ("train", "eval", ...)."""
        if self.closed:
            raise RuntimeError(f"RunLogger for {str(self.run_dir)!r} is closed; log() after close()")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(prefix, str) or not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"prefix must be a non-empty string without spaces (e.g. 'train'), got {prefix!r}")
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"metric names must be non-empty strings, got {key!r}")
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved for the record itself; reserved: {_RESERVED}")
            values[key] = _to_float(key, value)
        if not self.is_main:
            return
        step = int(step)
        record = {"step": step, "split": prefix, "time": time.time()}
        record.update({k: _json_value(v) for k, v in values.items()})
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        tb = self._tensorboard()
        if tb is not None:  # on disk when this returns: a kill loses no logged step
            tb.add(step, {f"{prefix}/{key}": value for key, value in values.items()})
        self._update_postfix(values, prefix)
        if self._lines and prefix == "train":
            total = f"/{self.total_steps}" if self.total_steps else ""
            print(f"step {step}{total}: {self.postfix}", file=sys.stderr, flush=True)
        if self._bar is not None:
            if prefix == "train" and step > self._bar.n:
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(self.postfix, refresh=True)

    def _update_postfix(self, values: Mapping[str, float], prefix: str) -> None:
        for key, label, fmt in _POSTFIX:
            if key in values:
                name = label if prefix == "train" else f"{prefix}_{label}"
                self._postfix[name] = fmt.format(values[key]) if math.isfinite(values[key]) else "nan"

    def text(self, tag: str, text: str, step: int) -> None:
        """A text entry in TensorBoard's text tab (process 0, when TensorBoard is on)."""
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=step)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar (main process only)."""
        if self.is_main and not self.closed:
            tqdm.write(str(text))

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the bar. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """The records of run_dir/metrics.jsonl (optionally one split), with null read back as NaN."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {str(run_dir)!r}; is it a run directory written by RunLogger?")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:  # a last line torn by a kill (a resumed run drops it)
                continue
            if split is None or rec.get("split") == split:
                records.append({k: (math.nan if v is None else v) for k, v in rec.items()})
    return records


def _to_json(value: Any, where: str) -> Any:
    """`value` as plain JSON types; non-finite floats become null as in metrics.jsonl."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _json_value(value)
    if isinstance(value, np.generic | np.ndarray) and np.ndim(value) == 0:
        return _to_json(np.asarray(value).item(), where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_json(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"config key {k!r} at {where} is a {type(k).__name__}; JSON keys must be strings")
            out[k] = _to_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValueError(
        f"config value at {where} has type {type(value).__name__}; expected JSON data "
        "(None, bool, int, float, str, list, tuple, dict, dataclass, path, numpy scalar)"
    )


def write_config(run_dir: str | Path, config: Mapping[str, Any]) -> Path:
    """Write the resolved `config` to run_dir/config.json (atomically); returns the path. A different
    config already there is kept as ``config.<n>.json`` (n = 1, 2, ...: the run's history), never lost."""
    if not (isinstance(config, Mapping) or (dataclasses.is_dataclass(config) and not isinstance(config, type))):
        raise ValueError(f"config must be a mapping (or a dataclass instance), got {type(config).__name__}")
    data = _to_json(config, "config")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if path.exists():
        if path.read_text(encoding="utf-8") == text:
            return path
        n = 1
        while (run_dir / f"config.{n}.json").exists():
            n += 1
        os.replace(path, run_dir / f"config.{n}.json")  # the history: config.1.json is the first config
    tmp = path.with_name(f".{CONFIG_FILE}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The config a run directory holds (``config.json``), or None when it has none."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable config ({e}); move it aside to start this run directory afresh") from None
    return data if isinstance(data, dict) else None
