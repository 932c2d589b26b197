"""Simulated CPU devices for laptops, notebooks and tests.

XLA's CPU backend can split one host into N devices. The count is fixed when the backend
starts (the first ``jax.devices()`` or computation), so this must run before any jax work.
"""

from __future__ import annotations

import os

import jax


def backend_started() -> bool:
    """Whether a jax backend has already been initialised in this process."""
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


def simulate_cpu_devices(n: int = 8) -> list[jax.Device]:
    """Make jax see ``n`` CPU devices and return them.

    Call before any other jax work (first cell of a notebook, top of a script). If the backend has
    already started with ``n`` CPU devices this is a no-op; with any other count it raises, naming
    both counts, because the count can no longer change in this process.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"device count must be a positive integer, got {n!r}")
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
