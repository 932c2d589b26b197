"""Peak FLOP/s of the accelerators: one dense-matmul figure per chip, from public datasheets.

:data:`PEAK_FLOPS` is matched against ``jax.Device.device_kind`` by :func:`lookup_peak`. The run's
MFU (:mod:`trainers.metrics`) and the planner's hardware records (:mod:`trainers.planning.hardware`)
both read it. Sources: docs/calibration.md.
"""

from __future__ import annotations

import dataclasses
import math
import re

SUPPORTED_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class PeakSpec:
    """Dense peak FLOP/s of one accelerator model, per chip, from a public datasheet."""

    kind: str  # matched as a word-bounded substring of jax.Device.device_kind
    bfloat16: float  # dense bf16 matmul FLOP/s per chip
    float32: float  # f32 matmul FLOP/s per chip at XLA's default precision (TF32 / bf16 pass)
    source: str
    devices_per_chip: int = 1  # JAX devices per chip (TensorCores shown separately)

    def __post_init__(self) -> None:
        if not self.kind.strip():
            raise ValueError(f"PeakSpec.kind must be a non-empty device-kind substring, got {self.kind!r}")
        for name in SUPPORTED_DTYPES:
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"PeakSpec {self.kind!r}: {name} peak must be a positive finite FLOP/s, got {value!r}")
        if self.devices_per_chip < 1:
            raise ValueError(f"PeakSpec {self.kind!r}: devices_per_chip must be >= 1, got {self.devices_per_chip}")

    def per_device(self, dtype: str) -> float:
        return getattr(self, dtype) / self.devices_per_chip


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_GCP = "Google Cloud TPU docs, system architecture page of"

# Ordered: an entry must come before every entry whose kind it contains.
PEAK_FLOPS: tuple[PeakSpec, ...] = (
    # --- NVIDIA (datasheets list dense and 2:4-sparse figures; these are the dense ones) ---
    # Blackwell. GB200 NVL72 datasheet: 360 PF bf16 / 180 PF tf32 sparse per 72 GPUs.
    PeakSpec("GB200", 2.5e15, 1.25e15, "NVIDIA GB200 NVL72 datasheet (dense = sparse / 2, per GPU)"),
    # HGX B200 datasheet: 36 PF bf16 / 18 PF tf32 sparse per 8 GPUs.
    PeakSpec("B200", 2.25e15, 1.125e15, "NVIDIA HGX B200 datasheet (dense = sparse / 2, per GPU)"),
    # Hopper. GH200 is the H100 SXM die with Grace; H200 SXM has the H100 SXM compute.
    PeakSpec("GH200", 989.4e12, 494.7e12, "NVIDIA GH200 Grace Hopper Superchip datasheet"),
    PeakSpec("H200 NVL", 835.5e12, 417.5e12, f"{_NV_H200}, H200 NVL (1671 / 835 TF sparse)"),
    PeakSpec("H200", 989.4e12, 494.7e12, f"{_NV_H200}, H200 SXM (1979 / 989 TF sparse)"),
    PeakSpec("H100 NVL", 835.5e12, 417.5e12, f"{_NV_H100}, H100 NVL (1671 / 835 TF sparse)"),
    PeakSpec("H100 PCIe", 756.5e12, 378e12, f"{_NV_H100}, H100 PCIe (1513 / 756 TF sparse)"),
    PeakSpec("H100", 989.4e12, 494.7e12, f"{_NV_H100}, H100 SXM (1979 / 989 TF sparse)"),
    # Ampere: same tensor throughput for the SXM4 and PCIe, 40 and 80 GB parts.
    PeakSpec("A100", 312e12, 156e12, "NVIDIA A100 Tensor Core GPU datasheet"),
    # Ada Lovelace data-centre parts; "L40S" and "L40" both contain "L4".
    PeakSpec("L40S", 362.05e12, 183e12, "NVIDIA L40S datasheet (733 / 366 TF sparse)"),
    PeakSpec("L40", 181.05e12, 90.5e12, "NVIDIA L40 datasheet (362.1 / 181 TF sparse)"),
    PeakSpec("L4", 121e12, 60e12, "NVIDIA L4 datasheet (242 / 120 TF sparse)"),
    # --- Google TPU (device_kind strings as JAX reports them; v5e/v6e/v5p aliases accepted) ---
    # 7x (Ironwood): 2307 TF bf16 per chip; two TensorCores per chip, each its own JAX device.
    PeakSpec("TPU7x", 2307e12, 2307e12, f"{_GCP} TPU7x (Ironwood)", devices_per_chip=2),
    PeakSpec("TPU v6 lite", 918e12, 918e12, f"{_GCP} v6e (Trillium)"),
    PeakSpec("TPU v6e", 918e12, 918e12, f"{_GCP} v6e (Trillium)"),
    PeakSpec("TPU v5 lite", 197e12, 197e12, f"{_GCP} v5e"),
    PeakSpec("TPU v5e", 197e12, 197e12, f"{_GCP} v5e"),
    PeakSpec("TPU v5p", 459e12, 459e12, f"{_GCP} v5p"),
    PeakSpec("TPU v5", 459e12, 459e12, f"{_GCP} v5p (JAX reports v5p as 'TPU v5')"),
    # v4i: one TensorCore, 4 MXUs of 128x128 at 1.05 GHz (Jouppi et al., ISCA 2021).
    PeakSpec("TPU v4 lite", 138e12, 138e12, "Jouppi et al., 'Ten Lessons From Three Generations', ISCA 2021 (TPUv4i)"),
    PeakSpec("TPU v4", 275e12, 275e12, f"{_GCP} v4 (megacore: one JAX device per chip)"),
    PeakSpec("TPU v3", 123e12, 123e12, f"{_GCP} v3", devices_per_chip=2),
    PeakSpec("TPU v2", 45e12, 45e12, f"{_GCP} v2", devices_per_chip=2),
)


def _kind_pattern(kind: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![0-9a-z]){re.escape(kind.lower())}(?![0-9a-z])")


_PATTERNS = tuple((_kind_pattern(spec.kind), spec) for spec in PEAK_FLOPS)


def lookup_peak(device_kind: str) -> PeakSpec | None:
    """The first `PEAK_FLOPS` entry whose kind occurs, word-bounded and case-insensitive, in `device_kind`."""
    kind = device_kind.lower()
    for pattern, spec in _PATTERNS:
        if pattern.search(kind):
            return spec
    return None
