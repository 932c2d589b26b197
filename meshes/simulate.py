"""Simulated CPU devices for laptops, notebooks and tests; call before any jax work.

``simulate_cpu_devices(n)`` always gives ``n`` CPU devices;
``simulate_cpu_devices_unless_accelerator(n)`` gives them unless a GPU plugin or ``libtpu`` is
installed (``JAX_PLATFORMS=cpu`` forces the simulation). See docs/meshes.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import warnings

import jax

from meshes import compat


def backend_started() -> bool:
    """Whether a jax backend has already been initialised in this process."""
    return compat.backends_initialized()


def _check_count(n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"device count must be a positive integer, got {n!r}")


def simulate_cpu_devices(n: int = 8) -> list[jax.Device]:
    """Make jax see ``n`` CPU devices and return them.

    Call before any other jax work (first cell of a notebook, top of a script). If the backend has
    already started with ``n`` CPU devices this is a no-op; with any other count it raises, naming
    both counts, because the count can no longer change in this process.
    """
    _check_count(n)
    if backend_started():
        have = jax.devices()
        if have[0].platform == "cpu" and len(have) == n:
            return have
        raise RuntimeError(
            f"cannot simulate {n} CPU devices: the jax backend already started with {len(have)} "
            f"{have[0].platform} device(s). Call simulate_cpu_devices({n}) before any other jax call "
            f"(or restart the kernel), or set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "before importing jax."
        )
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    return jax.devices()


def _is_cpu_only(platforms: str) -> bool:
    """Whether a ``JAX_PLATFORMS`` value (comma-separated platform names) names the CPU alone."""
    return {p.strip().lower() for p in platforms.split(",") if p.strip()} == {"cpu"}


def cpu_only_requested() -> bool:
    """Whether ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms``) restricts jax to the CPU."""
    return _is_cpu_only(os.environ.get("JAX_PLATFORMS", "")) or _is_cpu_only(getattr(jax.config, "jax_platforms", None) or "")


def accelerator_plugin() -> str | None:
    """The accelerator plugin jax would load, named, or ``None``; never imports it or starts jax.

    Looks for GPU plugins in the ``jax_plugins`` namespace package and the ``jax_plugins`` entry
    point group, then for ``libtpu``. ``None`` as well when ``JAX_PLATFORMS=cpu``.
    """
    if cpu_only_requested():
        return None
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None:
        names = [m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations or []))]
        return "jax_plugins" + (f" ({', '.join(sorted(names))})" if names else "")
    entry_points = list(importlib.metadata.entry_points(group="jax_plugins"))
    if entry_points:
        return "jax_plugins entry points (" + ", ".join(sorted(ep.name for ep in entry_points)) + ")"
    if importlib.util.find_spec("libtpu") is not None:
        return "libtpu"
    return None


def simulate_cpu_devices_unless_accelerator(n: int = 8) -> list[jax.Device]:
    """The real devices where jax has an accelerator plugin, else ``n`` simulated CPU devices.

    For the first cell of a notebook (or the top of a script) that should run unchanged on a
    laptop, a GPU node and a TPU VM. The choice is made from what is installed
    (:func:`accelerator_plugin`) *before* jax's backend starts, then:

    - accelerator plugin found (and ``JAX_PLATFORMS`` is not ``cpu``): returns ``jax.devices()``,
      whatever their count; ``n`` is not used. A plugin installed on a machine without its
      hardware makes jax fall back to one CPU device: that is returned with a warning (set
      ``JAX_PLATFORMS=cpu`` to simulate ``n`` devices instead);
    - otherwise: ``simulate_cpu_devices(n)``, with its rules (a no-op when the backend already
      runs ``n`` CPU devices, ``RuntimeError`` when it runs another count).

    Raises ``ValueError`` when ``n`` is not a positive integer (checked in both cases).
    """
    _check_count(n)
    plugin = accelerator_plugin()
    if plugin is None:
        return simulate_cpu_devices(n)
    devices = jax.devices()
    if devices[0].platform == "cpu":
        warnings.warn(
            f"accelerator plugin {plugin} is installed but jax found no accelerator; running on "
            f"{len(devices)} CPU device(s). Set JAX_PLATFORMS=cpu before the first jax call to simulate "
            f"{n} CPU devices instead.",
            stacklevel=2,
        )
    return devices
