"""Build a jax Mesh from a MeshSpec with topology-aware device order and explicit axis types.

Device order comes from jax's own helpers (``mesh_utils.create_device_mesh`` and, for multi-slice,
``create_hybrid_device_mesh``), which put the innermost (last) axis on the nearest devices: the
ICI ring of a TPU slice, the NVLink island of a GPU node. So ``tensor`` (innermost) communicates
fastest and ``data`` (outermost) may cross the slow network.

Axis types: **Auto** by default. Model code is written as single-device code; under Auto axes
XLA's GSPMD partitioner propagates shardings through it, and the toolkit adds explicit control
with ``shard_map`` where it matters. ``axis_type="explicit"`` builds Explicit axes (sharding in
types) for code written for that mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshes.spec import MeshError, MeshSpec

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
DCN_DEFAULT_AXES = ("data", "fsdp")  # axes laid across slices when the spec names no DCN sizes


def _num_slices(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """Number of slices (granules) and whether a process is the granule (GPU/CPU hosts)."""
    slice_ids = {getattr(d, "slice_index", None) for d in devices}
    if None not in slice_ids and len(slice_ids) > 1:
        return len(slice_ids), False
    return len({d.process_index for d in devices}), True


def default_dcn(sizes: Mapping[str, int], num_slices: int) -> tuple[dict[str, int], dict[str, int]]:
    """Split global axis sizes into (ici, dcn) for ``num_slices`` slices when the spec gave no DCN sizes.

    The first of ``data``, ``fsdp`` whose size divides by the slice count goes across slices (the
    slow network then carries only the once-per-step gradient reduction); every other axis stays
    inside a slice. Raises MeshError naming the sizes when neither divides.
    """
    for axis in DCN_DEFAULT_AXES:
        if sizes.get(axis, 1) % num_slices == 0 and sizes.get(axis, 1) >= num_slices:
            ici = dict(sizes)
            ici[axis] //= num_slices
            return ici, {n: (num_slices if n == axis else 1) for n in sizes}
    raise MeshError(
        f"the devices span {num_slices} slices but neither data={sizes.get('data', 1)} nor "
        f"fsdp={sizes.get('fsdp', 1)} divides by {num_slices}; make one of them a multiple of {num_slices} "
        f"or give the DCN sizes explicitly (MeshSpec dcn / --dcn, e.g. data={num_slices})"
    )


def make_mesh(
    spec: MeshSpec | Mapping[str, int] | str,
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_type: str = "auto",
) -> Mesh:
    """A Mesh over all canonical axes (undeclared ones have size 1), e.g. ``make_mesh({"data": -1, "tensor": 2})``.

    ``devices`` defaults to all devices of all processes. A spec with ``dcn`` sizes builds a hybrid
    mesh: each axis is ``ici * dcn`` long, with the DCN part outermost, so one slice (TPU) or one
    host (GPU/CPU) holds a contiguous ICI block. Without ``dcn`` sizes on devices that span several
    TPU slices, ``data`` (else ``fsdp``) goes across slices (:func:`default_dcn`); GPU and CPU hosts
    need no such default: the global device order is host by host, so the outer axes span hosts.
    """
    if not isinstance(spec, MeshSpec):
        spec = MeshSpec.of(spec)
    if axis_type not in AXIS_TYPES:
        raise MeshError(f"axis_type {axis_type!r} is not one of {sorted(AXIS_TYPES)}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshError("no devices to build a mesh from")
    names = spec.axis_names()
    types = (AXIS_TYPES[axis_type],) * len(names)

    if spec.dcn:
        num_slices, process_is_granule = _num_slices(devices)
        ici, dcn = spec.resolve(len(devices), num_slices)
        if num_slices == 1:
            device_array = mesh_utils.create_device_mesh([ici[n] for n in names], devices)
        else:
            device_array = mesh_utils.create_hybrid_device_mesh(
                [ici[n] for n in names],
                [dcn[n] for n in names],
                devices,
                process_is_granule=process_is_granule,
            )
    else:
        ici, _ = spec.resolve(len(devices))
        shape = [ici[n] for n in names]
        num_slices, process_is_granule = _num_slices(devices)
        if num_slices > 1 and not process_is_granule:  # multi-slice TPU: keep ICI axes inside a slice
            ici, dcn = default_dcn(ici, num_slices)
            device_array = mesh_utils.create_hybrid_device_mesh(
                [ici[n] for n in names], [dcn[n] for n in names], devices, process_is_granule=False)
        elif len(devices) == 1:
            device_array = np.array(devices).reshape(shape)
        else:
            device_array = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(device_array, names, axis_types=types)


def single_device_mesh(device: jax.Device | None = None, *, axis_type: str = "auto") -> Mesh:
    """A mesh of one device carrying every canonical axis at size 1: the single-device reference."""
    return make_mesh({}, devices=[device or jax.devices()[0]], axis_type=axis_type)


class MeshLike(Protocol):
    """What :func:`axis_sizes` reads of a mesh: a ``jax.sharding.Mesh``, or a stand-in with its axis
    names and an array of its shape as ``devices`` (planning decides layouts for meshes it does not have)."""

    @property
    def axis_names(self) -> tuple[Any, ...]: ...

    @property
    def devices(self) -> np.ndarray: ...


def axis_sizes(mesh: MeshLike) -> dict[str, int]:
    """Ordered {axis: size} of a mesh."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))
