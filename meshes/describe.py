"""Human-readable description of a mesh: axes, sizes, device kind, hosts."""

from __future__ import annotations

from jax.sharding import Mesh

from meshes.build import axis_sizes


def describe(mesh: Mesh) -> str:
    """Multi-line text: one line per axis with its size and type, then devices and hosts.

    Size-1 axes are listed together on one line; they cost nothing.
    """
    devices = mesh.devices.flatten()
    kinds = sorted({d.device_kind for d in devices})
    hosts = sorted({d.process_index for d in devices})
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    sizes = axis_sizes(mesh)
    lines = [f"Mesh: {len(devices)} device(s) = " + " x ".join(f"{n}={s}" for n, s in sizes.items() if s > 1 or len(devices) == 1)]
    for name, size in sizes.items():
        if size > 1:
            lines.append(f"  {name:<7} {size:>4}  ({types[name].name})")
    ones = [n for n, s in sizes.items() if s == 1]
    if ones:
        lines.append(f"  size-1 axes: {', '.join(ones)}")
    lines.append(f"  devices: {', '.join(kinds)} ({devices[0].platform})")
    per_host = len(devices) // len(hosts)
    lines.append(f"  hosts: {len(hosts)} process(es), {per_host} device(s) each")
    return "\n".join(lines)
