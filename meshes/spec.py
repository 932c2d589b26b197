"""MeshSpec: a device mesh declared as ordered axis sizes, validated before any device is touched.

    MeshSpec.of({"data": -1, "fsdp": 1, "tensor": 2})   # outermost first; -1 inferred; others 1

Optional ``dcn`` sizes describe the axes that cross the slow network between slices or hosts.
See docs/meshes.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

# Canonical mesh axes, outermost (slowest network) to innermost (fastest network).
AXES: tuple[str, ...] = ("data", "pipe", "fsdp", "seq", "expert", "tensor")


class MeshError(ValueError):
    """A mesh declaration that cannot be built on the devices at hand."""


def _check_axes(sizes: Mapping[str, int], what: str) -> tuple[tuple[str, int], ...]:
    items = tuple(sizes.items())
    seen: set[str] = set()
    for name, size in items:
        if name not in AXES:
            raise MeshError(f"unknown {what} axis {name!r}; valid axes are {', '.join(AXES)}")
        if name in seen:
            raise MeshError(f"duplicate {what} axis {name!r} in {dict(items)}")
        seen.add(name)
        if not isinstance(size, int) or isinstance(size, bool):
            raise MeshError(f"{what} axis {name!r} has size {size!r}; sizes are integers (-1 = infer)")
        if size == 0 or size < -1:
            raise MeshError(
                f"{what} axis {name!r} has size {size}; sizes are positive integers, or -1 to infer one axis"
            )
    inferred = [n for n, s in items if s == -1]
    if len(inferred) > 1:
        raise MeshError(f"at most one {what} axis may be -1 (inferred); got -1 for {', '.join(inferred)}")
    return items


def _infer(items: tuple[tuple[str, int], ...], total: int, what: str, unit: str = "devices") -> dict[str, int]:
    known = math.prod(s for _, s in items if s != -1)
    if any(s == -1 for _, s in items):
        if total % known:
            raise MeshError(
                f"cannot infer the -1 {what} axis: {total} {unit} do not divide by the product "
                f"{known} of the other sizes {dict(items)}"
            )
        return {n: (total // known if s == -1 else s) for n, s in items}
    if known != total:
        raise MeshError(
            f"{what} axis sizes {dict(items)} multiply to {known}, but there are {total} {unit}; "
            f"make the product {total} or use -1 for one axis"
        )
    return dict(items)


def parse_axes(text: str) -> dict[str, int]:
    """Parse ``"data=2,tensor=4"`` (the CLI form) into an ordered dict of sizes."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep:
            raise MeshError(f"mesh item {part!r} is not of the form axis=size (e.g. 'data=2,tensor=4')")
        try:
            value = int(size)
        except ValueError:
            raise MeshError(f"mesh axis {name.strip()!r} has size {size!r}; sizes are integers (-1 = infer)") from None
        if name.strip() in out:
            raise MeshError(f"duplicate mesh axis {name.strip()!r} in {text!r}")
        out[name.strip()] = value
    return out


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Ordered axis sizes for one slice (``ici``) and, optionally, across slices (``dcn``).

    Build with :meth:`of`; turn into concrete sizes for a device count with :meth:`resolve`.
    """

    ici: tuple[tuple[str, int], ...]
    dcn: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, ici: Mapping[str, int] | str, dcn: Mapping[str, int] | str | None = None) -> MeshSpec:
        ici_map = parse_axes(ici) if isinstance(ici, str) else dict(ici)
        dcn_map = parse_axes(dcn) if isinstance(dcn, str) else dict(dcn or {})
        return cls(_check_axes(ici_map, "mesh"), _check_axes(dcn_map, "DCN"))

    def __post_init__(self) -> None:
        _check_axes(dict(self.ici), "mesh")
        _check_axes(dict(self.dcn), "DCN")
        if len(dict(self.ici)) != len(self.ici):
            raise MeshError(f"duplicate mesh axis in {self.ici}")

    @property
    def is_hybrid(self) -> bool:
        return any(s != 1 for _, s in self.dcn)

    def axis_names(self) -> tuple[str, ...]:
        """All canonical axes: declared ones in declared order, then the rest (size 1) in canonical order."""
        declared = [n for n, _ in self.ici]
        declared += [n for n, _ in self.dcn if n not in declared]
        return tuple(declared) + tuple(a for a in AXES if a not in declared)

    def resolve(self, num_devices: int, num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
        """Concrete (ici, dcn) sizes over all canonical axes for ``num_devices`` devices in ``num_slices`` slices.

        Raises MeshError naming the numbers when the sizes cannot fit.
        """
        if num_devices % num_slices:
            raise MeshError(f"{num_devices} devices do not split evenly into {num_slices} slices")
        dcn = _infer(self.dcn, num_slices, "DCN", "slices (processes or granules)") if self.dcn else {}
        if math.prod(dcn.values()) != num_slices:
            raise MeshError(
                f"DCN sizes {dict(self.dcn) or '{}'} multiply to {math.prod(dcn.values())}, but there are "
                f"{num_slices} slices (processes or granules); make the product {num_slices}"
            )
        ici = _infer(self.ici, num_devices // num_slices, "mesh")
        names = self.axis_names()
        return {n: ici.get(n, 1) for n in names}, {n: dcn.get(n, 1) for n in names}

    def __str__(self) -> str:
        text = ",".join(f"{n}={s}" for n, s in self.ici)
        return text + (" dcn:" + ",".join(f"{n}={s}" for n, s in self.dcn) if self.dcn else "")
