"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os
from importlib.metadata import version as _version

_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
# The tests check numbers and programs, not speed: LLVM's optimisation of the CPU code is skipped (about
# half of a compile-bound test's time), unless XLA_FLAGS sets a level itself. Subprocesses inherit it.
if not any(f.startswith("--xla_backend_optimization_level") for f in _flags):
    _flags.append("--xla_backend_optimization_level=0")
# jaxlib 0.10's XLA:CPU compiles about 1.6x faster with its legacy fusion emitters (the fast tier: 10.6 min
# instead of 17.2 on 2 cores); later jaxlibs dropped the flag, and an unknown flag aborts the process
if _version("jaxlib").startswith("0.10.") and not any(f.startswith("--xla_cpu_use_fusion_emitters") for f in _flags):
    _flags.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Compilation dominates test time; a persistent cache makes re-runs cheap.
# one directory per jax version: entries written by another jax/jaxlib are never read back
_cache = os.environ.get(
    "SPMD_TEST_COMPILE_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache", f"jax-{jax.__version__}"))
os.environ["SPMD_TEST_COMPILE_CACHE"] = os.path.abspath(_cache)  # worker processes and notebooks use it too
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_modifyitems(items):
    """A ``sweep`` test (one more schedule, layout or family of a check the tiers already run once) is also
    ``slow``: neither CI tier runs it; ``-m sweep`` runs them all."""
    for item in items:
        if item.get_closest_marker("sweep") is not None:
            item.add_marker("slow")


def pytest_addoption(parser):
    parser.addoption("--first-variant", action="store_true",
                     help="run each test function once: its first parameter set of those selected (CI runs the "
                          "newest jax this way; every variant runs on the lowest)")


class _FirstVariant:
    @pytest.hookimpl(trylast=True)  # after -m and -k have selected
    def pytest_collection_modifyitems(self, config, items):
        seen, kept, dropped = set(), [], []
        for item in items:
            function = item.nodeid.split("[")[0]
            (dropped if function in seen else kept).append(item)
            seen.add(function)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def pytest_configure(config):
    if config.getoption("--first-variant"):
        config.pluginmanager.register(_FirstVariant(), "first-variant")
