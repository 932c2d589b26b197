"""Throughput metrics: peak FLOP/s per device, model FLOPs utilisation (MFU), step timing.

    mfu = model_flops_per_step / (step_time_s * n_devices * peak_flops_per_device)

Peaks come from `PEAK_FLOPS` (dense datasheet figures) or, on CPU, a measured matmul; otherwise MFU
is NaN. See docs/metrics.md.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainers.peaks import PEAK_FLOPS, SUPPORTED_DTYPES, lookup_peak


class UnknownAcceleratorWarning(UserWarning):
    """No peak FLOP/s figure is known for the device; MFU will be NaN."""


def _dtype_name(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError as err:
        raise ValueError(f"dtype {dtype!r} is not a dtype; valid: {SUPPORTED_DTYPES}") from err
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"no peak FLOP/s figures for dtype {name!r}; valid: {SUPPORTED_DTYPES}")
    return name


_CPU_PEAK_CACHE: dict[tuple[str, int], float] = {}


def measure_cpu_matmul_peak(dtype: Any = jnp.float32, n: int = 1024, repeats: int = 5) -> float:
    """Measured FLOP/s of an (n, n) @ (n, n) matmul jitted on the first CPU device.

    Compiled and run once untimed, then the best of `repeats` timed runs: 2 n^3 / seconds.
    Cached per (dtype, n) for the life of the process.
    """
    name = _dtype_name(dtype)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n must be a positive int (the matmul side), got {n!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int | np.integer) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    key = (name, int(n))
    if key in _CPU_PEAK_CACHE:
        return _CPU_PEAK_CACHE[key]
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    a_NN, b_NN = (jax.device_put(jnp.asarray(rng.standard_normal((n, n)), name), cpu) for _ in range(2))
    matmul = jax.jit(jnp.matmul)
    matmul(a_NN, b_NN).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a_NN, b_NN).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n**3 / max(best, 1e-9)
    _CPU_PEAK_CACHE[key] = flops
    return flops


def peak_flops_per_device(device: jax.Device | None = None, dtype: Any = "bfloat16") -> tuple[float, str]:
    """(peak dense matmul FLOP/s of one device, where that figure comes from).

    Table lookup for accelerators, a measurement on CPU, and NaN with an
    `UnknownAcceleratorWarning` for an accelerator the table does not know.
    """
    name = _dtype_name(dtype)
    if device is None:
        device = jax.devices()[0]
    platform = str(getattr(device, "platform", "")).lower()
    kind = str(getattr(device, "device_kind", ""))
    if platform == "cpu":
        n_cpu = len(jax.local_devices(backend="cpu"))
        measured = measure_cpu_matmul_peak(name)
        return measured / n_cpu, (
            f"measured {name} XLA matmul on this host: {measured:.3g} FLOP/s shared by {n_cpu} local CPU device(s)"
        )
    spec = lookup_peak(kind)
    if spec is None:
        warnings.warn(
            f"no peak FLOP/s figure for device kind {kind!r} (platform {platform!r}); MFU will be NaN. "
            f"Known kinds: {', '.join(s.kind for s in PEAK_FLOPS)}. "
            "Pass your own figure to mfu()/StepMeter(peak_per_device=...) to get an MFU.",
            UnknownAcceleratorWarning,
            stacklevel=2,
        )
        return math.nan, f"unknown device kind {kind!r}"
    per_chip = getattr(spec, name)
    detail = f"{per_chip:.4g} FLOP/s per chip"
    if spec.devices_per_chip > 1:
        detail += f" / {spec.devices_per_chip} devices per chip"
    return spec.per_device(name), f"{spec.source}: {name} dense, {detail} (matched {spec.kind!r})"


def mfu(model_flops_per_step: float, step_time_s: float, n_devices: int, peak_per_device: float) -> float:
    """Model FLOPs utilisation: model_flops_per_step / (step_time_s * n_devices * peak_per_device).

    NaN when the FLOPs or the peak are NaN (unknown), never a guess.
    """
    if model_flops_per_step < 0:
        raise ValueError(f"model_flops_per_step must be >= 0 (or NaN if unknown), got {model_flops_per_step!r}")
    if not step_time_s > 0:
        raise ValueError(f"step_time_s must be > 0 seconds, got {step_time_s!r}")
    if isinstance(n_devices, bool) or not isinstance(n_devices, int | np.integer) or n_devices < 1:
        raise ValueError(f"n_devices must be a positive int, got {n_devices!r}")
    if peak_per_device <= 0:
        raise ValueError(f"peak_per_device must be > 0 FLOP/s (or NaN if unknown), got {peak_per_device!r}")
    return float(model_flops_per_step) / (float(step_time_s) * int(n_devices) * float(peak_per_device))


class StepMeter:
    """Wall time, tokens/s and MFU of training steps.

    `tokens_per_step` and `model_flops_per_step` are global (all devices). The first
    `warmup_steps` steps (compilation) are reported per step but left out of `summary()`.

        meter = StepMeter(tokens_per_step=B * L, model_flops_per_step=6 * n_params * B * L,
                          n_devices=mesh.size, peak_per_device=peak)
        for step in range(n):
            meter.start()
            state, out = train_step(state, batch)
            step_metrics = meter.stop(block_on=out)  # waits for the step before reading the clock

    `record(elapsed_s, steps=k)` takes an interval measured elsewhere, covering k steps.
    """

    def __init__(
        self,
        *,
        tokens_per_step: int,
        model_flops_per_step: float = math.nan,
        n_devices: int = 1,
        peak_per_device: float = math.nan,
        warmup_steps: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if tokens_per_step < 0:
            raise ValueError(f"tokens_per_step must be >= 0, got {tokens_per_step!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        # Validates n_devices, the FLOPs and the peak once, up front.
        mfu(model_flops_per_step, 1.0, n_devices, peak_per_device)
        self.tokens_per_step = tokens_per_step
        self.model_flops_per_step = model_flops_per_step
        self.n_devices = n_devices
        self.peak_per_device = peak_per_device
        self.warmup_steps = warmup_steps
        self._clock = clock
        self._t0: float | None = None
        self.steps_seen = 0
        self._timed_steps = 0
        self._timed_s = 0.0

    def start(self) -> None:
        """Mark the start of a step (or of a run of steps)."""
        self._t0 = self._clock()

    def stop(self, block_on: Any = None, steps: int = 1) -> dict[str, float]:
        """End the interval opened by `start()`; blocks on `block_on` (a pytree of arrays) first."""
        if self._t0 is None:
            raise RuntimeError("StepMeter.stop() called without a matching start()")
        if block_on is not None:
            jax.block_until_ready(block_on)
        elapsed = self._clock() - self._t0
        self._t0 = None
        return self.record(elapsed, steps=steps)

    def record(self, elapsed_s: float, steps: int = 1) -> dict[str, float]:
        """Account `steps` steps that took `elapsed_s` seconds in all; returns their per-step metrics."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps!r}")
        if not elapsed_s > 0:
            raise ValueError(f"elapsed_s must be > 0 seconds, got {elapsed_s!r}")
        first = self.steps_seen
        self.steps_seen += steps
        if first >= self.warmup_steps:  # an interval touching a warm-up step is excluded whole
            self._timed_steps += steps
            self._timed_s += elapsed_s
        return self._metrics(elapsed_s / steps)

    def _metrics(self, step_time_s: float) -> dict[str, float]:
        return {
            "step_time_s": step_time_s,
            "tokens_per_s": self.tokens_per_step / step_time_s,
            "mfu": mfu(self.model_flops_per_step, step_time_s, self.n_devices, self.peak_per_device),
        }

    def summary(self) -> dict[str, float]:
        """Means over the steps after warm-up; NaN values (and steps=0) when there are none yet."""
        if self._timed_steps == 0:
            return {"steps": 0, "step_time_s": math.nan, "tokens_per_s": math.nan, "mfu": math.nan}
        return {"steps": self._timed_steps, **self._metrics(self._timed_s / self._timed_steps)}
