"""meshes: devices -> named jax Mesh (imports jax only).

    import meshes
    mesh = meshes.make_mesh({"data": -1, "tensor": 2})
    print(meshes.describe(mesh))
"""

from meshes import distributed
from meshes.build import AXIS_TYPES, axis_sizes, default_dcn, make_mesh, single_device_mesh
from meshes.describe import describe
from meshes.presets import PRESETS, Preset, preset
from meshes.simulate import backend_started, simulate_cpu_devices, simulate_cpu_devices_unless_accelerator
from meshes.spec import AXES, MeshError, MeshSpec, parse_axes

__all__ = [
    "AXES",
    "AXIS_TYPES",
    "default_dcn",
    "MeshError",
    "MeshSpec",
    "PRESETS",
    "Preset",
    "axis_sizes",
    "backend_started",
    "describe",
    "distributed",
    "make_mesh",
    "parse_axes",
    "preset",
    "simulate_cpu_devices",
    "simulate_cpu_devices_unless_accelerator",
    "single_device_mesh",
]
