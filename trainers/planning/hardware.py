"""Hardware data for planning: what one device of a target machine can compute, hold and move.

A :class:`Hardware` is a frozen record of datasheet figures per device (peak FLOP/s, HBM size and
bandwidth, fast and slow network bandwidth, fast-network domain), each with its source in a comment, and
the achievable fractions of peak the performance model runs at (matmuls, attention, memory-bound work)
with per-collective latencies and the TPU torus. :func:`collective_seconds` times a collective over
mesh axes as a hierarchical ring on the real topology (NVLink inside a node and the NIC across, ICI
links per torus dimension, DCN between slices). Constants and sources: docs/calibration.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainers.peaks import lookup_peak

GB = 1e9
GIB = 2**30
TB = 1e12


def _peaks(kind: str) -> dict[str, Any]:
    """``peak_bf16`` / ``peak_f32`` per device of the :data:`trainers.peaks.PEAK_FLOPS` entry for ``kind``."""
    spec = lookup_peak(kind)
    return {"peak_bf16": spec.per_device("bfloat16"), "peak_f32": spec.per_device("float32")}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Per-device figures of one accelerator model (see the module docstring for each field)."""

    name: str
    peak_bf16: float  # FLOP/s, dense
    peak_f32: float  # FLOP/s, dense, at XLA's default matmul precision
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    ici_bw: float  # bytes/s per device, bidirectional aggregate (NVLink / ICI)
    dcn_bw: float  # bytes/s per device, one direction (InfiniBand / DCN)
    domain: int  # devices on the fast network (NVLink node, TPU pod / slice)
    source: str = ""
    # achievable fractions of peak (docs/calibration.md gives each one's source): large bf16 matmuls,
    # fused (flash) attention, and HBM bandwidth reached by memory-bound elementwise work
    matmul_eff: float = 0.7
    attention_eff: float = 0.45
    hbm_eff: float = 0.8
    torus: int = 0  # TPU: torus dimensions of a slice (2: v5e / v6e, 3: v4 / v5p); 0: NVLink + NIC (GPU)
    overlap_cost: float = 0.0  # fraction of a hidden collective's time it still slows compute (GPU: NCCL's SMs)
    ici_latency: float = 5e-6  # seconds per ring step on the fast network
    dcn_latency: float = 15e-6  # seconds per ring step across nodes / slices
    headroom: float = 0.9  # share of HBM a layout may plan to use (the rest: allocator, workspaces, runtime)

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError(f"Hardware.name must be non-empty, got {self.name!r}")
        for field in ("peak_bf16", "peak_f32", "hbm_bytes", "hbm_bw", "ici_bw", "dcn_bw", "matmul_eff", "attention_eff",
                      "hbm_eff"):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"Hardware {self.name!r}: {field} must be a positive finite number, got {value!r}")
        for field in ("matmul_eff", "attention_eff", "hbm_eff", "headroom"):
            if not 0 < getattr(self, field) <= 1:
                raise ValueError(f"Hardware {self.name!r}: {field} is a fraction in (0, 1], got {getattr(self, field)!r}")
        if self.torus not in (0, 2, 3) or min(self.ici_latency, self.dcn_latency, self.overlap_cost) < 0:
            raise ValueError(f"Hardware {self.name!r}: torus must be 0 (GPU), 2 or 3 and latencies >= 0, got "
                             f"torus={self.torus!r}, ici_latency={self.ici_latency!r}, dcn_latency={self.dcn_latency!r}")
        if not isinstance(self.domain, int) or self.domain < 1:
            raise ValueError(f"Hardware {self.name!r}: domain must be a positive int (devices), got {self.domain!r}")

    def peak(self, dtype: str) -> float:
        """Dense matmul FLOP/s for a compute dtype ("bfloat16" or "float32")."""
        if dtype == "bfloat16":
            return self.peak_bf16
        if dtype == "float32":
            return self.peak_f32
        raise ValueError(f"no peak FLOP/s for dtype {dtype!r}; valid: 'bfloat16', 'float32'")

    @property
    def axis_bw(self) -> float:
        """Bytes/s a collective along one mesh axis gets on the fast network (one direction)."""
        return self.ici_bw / 2


_NV = "NVIDIA {} Tensor Core GPU datasheet"
# Achievable fractions of peak and latencies, one set per accelerator family (never per run; sources and
# the published runs that bound them: docs/calibration.md). GPU matmuls: cuBLAS bf16 GEMMs of LLM shapes
# reach ~75-80% of dense peak at full power (Bekman, "Maximum Achievable Matmul FLOPS", ml-engineering);
# attention: FlashAttention-2 reaches 50-70% of peak on A100 and 35-50% on H100 (Dao 2023, tables 1-2);
# elementwise work streams HBM at ~80% of its bandwidth (STREAM-like copy kernels). NCCL ring steps cost
# a few microseconds on NVLink, ~10-20 us across InfiniBand (nccl-tests small-message times); an overlapped
# NCCL collective occupies SMs and HBM bandwidth, slowing the GEMMs beside it by ~a third of its own time
# (Rashidi et al., "T3", ASPLOS 2024; Jangda et al., "CoCoNet", ASPLOS 2022).
_GPU: dict[str, Any] = dict(hbm_eff=0.8, overlap_cost=0.3, ici_latency=5e-6, dcn_latency=15e-6)
_AMPERE: dict[str, Any] = dict(matmul_eff=0.75, attention_eff=0.5, **_GPU)
_HOPPER: dict[str, Any] = dict(matmul_eff=0.65, attention_eff=0.4, **_GPU)
# TPU MXUs run large bf16 matmuls near peak: MaxText's v5e 32B run (full remat: 4/3 of the model FLOPs
# executed) reports 66.9% MFU, i.e. >= 89% of peak in its matmuls; Pallas flash attention ~50%; ICI hops
# ~1 us, DCN ~10 us (the JAX scaling book, "How to think about TPUs").
# headroom 0.98: XLA plans a TPU program's memory statically (no allocator fragmentation, no NCCL/cuBLAS
# workspaces; GPUs keep 0.9 for those and the CUDA context): docs/calibration.md.
_TPU: dict[str, Any] = dict(matmul_eff=0.9, attention_eff=0.5, hbm_eff=0.8, ici_latency=1e-6, dcn_latency=10e-6, headroom=0.98)
_GCP = "Google Cloud TPU docs, {} system architecture page"

HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        "h100",
        **_peaks("H100"),  # PEAK_FLOPS
        hbm_bytes=80 * GB,  # 80 GB HBM3
        hbm_bw=3.35 * TB,  # 3.35 TB/s
        ici_bw=900 * GB,  # NVLink 4: 900 GB/s bidirectional per GPU
        dcn_bw=50 * GB,  # one ConnectX-7 400 Gb/s NDR port per GPU (DGX H100 reference design)
        domain=8,  # 8 GPUs per NVLink node (HGX H100)
        source=_NV.format("H100") + ", SXM5 column",
        **_HOPPER,
    ),
    # The H100 of torchtitan's Llama 3.1 benchmarks (Meta Grand Teton): 96 GB HBM2e at 2.4 TB/s, 500 W
    # power limit; its peak lies "between SXM and NVL" (torchtitan benchmarks/llama3_h100_202412_torchtitan.md):
    # the NVL dense figure, the lower end of that range.
    "h100-96gb": Hardware(
        "h100-96gb",
        **_peaks("H100 NVL"),
        hbm_bytes=96 * GB,
        hbm_bw=2.4 * TB,
        ici_bw=900 * GB,  # NVLink 4, 8 GPUs per host fully connected
        dcn_bw=50 * GB,  # backend RDMA network, 400 Gb/s per GPU
        domain=8,
        source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton H100, 500 W)",
        **_HOPPER,
    ),
    "h200": Hardware(
        "h200",
        **_peaks("H200"),  # PEAK_FLOPS
        hbm_bytes=141 * GB,  # 141 GB HBM3e
        hbm_bw=4.8 * TB,  # 4.8 TB/s
        ici_bw=900 * GB,  # NVLink 4: 900 GB/s bidirectional per GPU
        dcn_bw=50 * GB,  # 400 Gb/s NDR InfiniBand per GPU (HGX H200 reference design)
        domain=8,
        source=_NV.format("H200") + ", SXM column",
        **_HOPPER,
    ),
    "a100": Hardware(
        "a100",
        **_peaks("A100"),  # PEAK_FLOPS
        hbm_bytes=80 * GB,  # A100 80GB SXM, HBM2e
        hbm_bw=2.039 * TB,  # 2,039 GB/s (80GB SXM)
        ici_bw=600 * GB,  # NVLink 3: 600 GB/s bidirectional per GPU
        dcn_bw=25 * GB,  # one 200 Gb/s HDR InfiniBand port per GPU (DGX A100)
        domain=8,
        source=_NV.format("A100") + ", 80GB SXM column",
        **_AMPERE,
    ),
    "tpu-v4": Hardware(
        "tpu-v4",
        **_peaks("TPU v4"),  # PEAK_FLOPS
        hbm_bytes=32 * GIB,  # 32 GiB HBM2
        hbm_bw=1.2 * TB,  # 1,200 GB/s
        ici_bw=300 * GB,  # 2,400 Gbps interchip interconnect per chip (6 links, 3D torus)
        dcn_bw=50e9 / 8,  # 50 Gbps per chip: assumed as for v5p (the v4 page gives no per-chip DCN figure)
        domain=4096,  # chips per v4 pod
        source=_GCP.format("v4"),
        torus=3,
        **_TPU,
    ),
    "tpu-v5e": Hardware(
        "tpu-v5e",
        **_peaks("TPU v5e"),  # PEAK_FLOPS
        hbm_bytes=16 * GIB,  # 16 GiB HBM2e
        hbm_bw=819 * GB,  # 819 GB/s (the docs' "800 GiBps")
        ici_bw=400 * GB,  # bidirectional ICI bandwidth per chip: 400 GBps (4 ports, 2D torus)
        dcn_bw=2 * 100e9 / 8 / 8,  # per-host NIC 2 x 100 Gbps shared by 8 chips
        domain=256,  # chips per v5e pod
        source=_GCP.format("v5e"),
        torus=2,
        **_TPU,
    ),
    "tpu-v5p": Hardware(
        "tpu-v5p",
        **_peaks("TPU v5p"),  # PEAK_FLOPS
        hbm_bytes=95 * GIB,  # 95 GiB HBM2e
        hbm_bw=2.765 * TB,  # 2,765 GB/s
        ici_bw=1200 * GB,  # bidirectional ICI bandwidth per chip: 1,200 GBps (3D torus)
        dcn_bw=50e9 / 8,  # DCN bandwidth per chip: 50 Gbps
        domain=8960,  # chips per v5p pod
        source=_GCP.format("v5p"),
        torus=3,
        **_TPU,
    ),
    "cpu": Hardware(
        "cpu",
        peak_bf16=1e12,  # a generic many-core server socket with AVX-512: order of 1 TFLOP/s
        peak_f32=1e12,
        hbm_bytes=64 * GB,  # host RAM available to one simulated device (a guess; pass custom())
        hbm_bw=100 * GB,  # DDR5, a few channels
        ici_bw=50 * GB,  # memory copies between simulated devices of one host
        dcn_bw=10e9 / 8,  # 10 Gb Ethernet
        domain=1 << 20,  # one host: everything is "local"
        source="order-of-magnitude figures for a CPU host; use for tests and plumbing, not predictions",
    ),
}


def get_hardware(name: str | Hardware) -> Hardware:
    """A :class:`Hardware` by name (``h100``, ``h100-96gb``, ``h200``, ``a100``, ``tpu-v4``, ``tpu-v5e``, ``tpu-v5p``,
    ``cpu``)."""
    if isinstance(name, Hardware):
        return name
    try:
        return HARDWARE[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(HARDWARE)}") from None


def custom(base: str | Hardware = "h100", **changes: Any) -> Hardware:
    """A copy of ``base`` with some figures changed, e.g. ``custom("h100", hbm_bytes=2e6, name="tiny")``."""
    hw = get_hardware(base)
    bad = sorted(set(changes) - {f.name for f in dataclasses.fields(Hardware)})
    if bad:
        raise ValueError(f"unknown Hardware fields {bad}; valid: {[f.name for f in dataclasses.fields(Hardware)]}")
    changes.setdefault("name", f"{hw.name}-custom")
    return dataclasses.replace(hw, **changes)


# Roofline pieces: how long a collective takes on this hardware

def wire_factor(kind: str, group_size: int) -> float:
    """Bytes each device sends per byte of the full buffer, for a bandwidth-optimal ring algorithm.

    all-reduce ``2(n-1)/n`` (reduce-scatter + all-gather); all-gather and reduce-scatter
    ``(n-1)/n`` of the full (gathered / un-scattered) buffer; all-to-all ``(n-1)/n``;
    collective-permute 1 (the whole buffer moves once).
    """
    n = max(int(group_size), 1)
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    raise ValueError(f"unknown collective kind {kind!r}; valid: all-reduce, all-gather, reduce-scatter, "
                     "all-to-all, collective-permute")


def collective_seconds(hw: Hardware, kind: str, nbytes: float, group_size: int, *, dcn: bool,
                       levels: list[tuple[int, float, float]] | None = None, count: float = 1) -> float:
    """Time of collectives moving ``nbytes`` in all (full buffers, per device) over a group of ``group_size``.

    With ``levels`` (:func:`axis_levels`: ``(size, bytes/s, seconds per step)`` innermost first) a
    hierarchical ring: level ``i`` moves the buffer divided by the sizes inside it, at its own
    bandwidth, plus ``count`` x its ring steps x latency. Without: one flat ring at
    :attr:`Hardware.axis_bw` (or ``dcn_bw`` when ``dcn``), no latency.
    """
    if levels is None:
        return wire_factor(kind, group_size) * nbytes / (hw.dcn_bw if dcn else hw.axis_bw)
    total, inner = 0.0, 1
    steps = 2 if kind == "all-reduce" else 1
    for size, bw, latency in levels:
        if size > 1:
            moved = nbytes / inner if kind != "collective-permute" else nbytes
            total += wire_factor(kind, size) * moved / bw + count * steps * (size - 1) * latency
            inner *= size if kind != "all-to-all" else 1
    return total


def axis_levels(sizes: dict[str, int], axes: tuple[str, ...], hw: Hardware,
                dcn_axes: tuple[str, ...] = ()) -> list[tuple[int, float, float]]:
    """The network levels a collective over ``axes`` crosses: ``(ring size, bytes/s per device one way,
    seconds per ring step)``, innermost first.

    GPU (``hw.torus == 0``): an axis's members lie ``prod(sizes inside it)`` devices apart; those within
    one NVLink ``domain`` ring at ``ici_bw / 2``, the rest (other nodes) at the NIC's ``dcn_bw``.
    TPU: an axis within a slice spans ``log(size) / log(slice chips) x torus`` torus dimensions, each
    a bidirectional ring with wraparound of two ``ici_bw / (4 torus)`` links; beyond the slice (or
    named in ``dcn_axes``) it runs over DCN.
    """
    names = list(sizes)
    total = math.prod(sizes.values())
    out = []
    for name in reversed(names):
        n = sizes.get(name, 1)
        if name not in axes or n <= 1:
            continue
        inside = math.prod(sizes[a] for a in names[names.index(name) + 1:])
        if name in dcn_axes:
            out.append((n, hw.dcn_bw, hw.dcn_latency))
            continue
        local = max(1, min(n, hw.domain // inside)) if inside < hw.domain else 1
        while n % local:
            local -= 1
        if local > 1:
            if hw.torus:
                chips = min(total, hw.domain)
                dims = hw.torus * math.log(local) / math.log(chips) if chips > 1 else 1
                out.append((local, max(dims, 1) * 2 * hw.ici_bw / (4 * hw.torus), hw.ici_latency))
            else:
                out.append((local, hw.axis_bw, hw.ici_latency))
        if n // local > 1:
            out.append((n // local, hw.dcn_bw, hw.dcn_latency))
    return out


def networks(sizes: dict[str, int], hw: Hardware, dcn_axes: tuple[str, ...] = ()) -> dict[str, str]:
    """``{axis: "ici" | "dcn"}`` for the mesh axes in ``sizes`` (ordered outermost first).

    Mesh construction puts the innermost axis on the nearest devices, so the devices of one
    collective group along axis ``a`` lie within a block of ``prod(sizes of a and the axes inside
    it)`` devices; when that block is larger than the hardware's fast-network ``domain`` the axis
    crosses the slow network. Axes named in ``dcn_axes`` (a multi-slice ``--dcn``) always do.
    """
    names = list(sizes)
    out = {}
    for i, name in enumerate(names):
        block = math.prod(sizes[n] for n in names[i:])
        out[name] = "dcn" if name in dcn_axes or (sizes[name] > 1 and block > hw.domain) else "ici"
    return out
