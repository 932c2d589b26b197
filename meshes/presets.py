"""Named meshes for common hardware, as data.

Each preset names the hardware (device count, devices per host, device kind) and a default layout
for a dense transformer: ``fsdp`` within a fast-interconnect island, ``data`` across slices or
nodes, ``tensor`` 1. See docs/meshes.md.
"""

from __future__ import annotations

import dataclasses

from meshes.spec import MeshSpec


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    devices: int
    devices_per_host: int
    device_kind: str
    mesh: MeshSpec
    note: str = ""

    @property
    def hosts(self) -> int:
        return self.devices // self.devices_per_host


def _p(name, devices, per_host, kind, ici, dcn=None, note=""):
    return Preset(name, devices, per_host, kind, MeshSpec.of(ici, dcn), note)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        _p("cpu-1", 1, 1, "cpu", {}, note="one CPU device; the single-device reference"),
        _p("cpu-8", 8, 8, "cpu", {"data": 2, "fsdp": 2, "tensor": 2},
           note="8 simulated CPU devices; every parallelism dimension exercised once"),
        _p("gpu-1", 1, 1, "gpu", {}, note="one GPU"),
        _p("gpu-8", 8, 8, "gpu", {"fsdp": 8}, note="one 8-GPU node (NVLink): FSDP over the node"),
        _p("gpu-8x4", 32, 8, "gpu", {"fsdp": 8}, {"data": 4},
           note="4 nodes of 8 GPUs: FSDP inside a node, data parallel across nodes"),
        _p("v4-32", 16, 4, "TPU v4", {"fsdp": 16}, note="TPU v4-32: 16 chips, 4 hosts, one slice"),
        _p("v5e-8", 8, 8, "TPU v5 lite", {"fsdp": 8}, note="TPU v5e-8: 8 chips, one host"),
        _p("v5e-256", 256, 4, "TPU v5 lite", {"data": 16, "fsdp": 16},
           note="TPU v5e-256: 16x16 chips, 64 hosts; FSDP along one torus dimension"),
        _p("v5e-256x2", 512, 4, "TPU v5 lite", {"data": 16, "fsdp": 16}, {"data": 2},
           note="two v5e-256 slices over DCN: data parallel across slices"),
        _p("v5p-128", 64, 4, "TPU v5", {"fsdp": 64}, note="TPU v5p-128: 64 chips, 16 hosts"),
    )
}


def preset(name: str) -> Preset:
    """Look up a preset by name; unknown names list the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown mesh preset {name!r}; valid presets: {', '.join(PRESETS)}") from None
