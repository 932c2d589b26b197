"""meshes.simulate: the accelerator check and the choice between real and simulated devices.

The detection is tested against a faked installation (``find_spec`` / ``entry_points`` patched),
the choice with the detection patched, and one subprocess checks the real thing end to end: with
``JAX_PLATFORMS=cpu`` the helper decides before jax's backend starts and gets ``n`` CPU devices.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import jax
import pytest
from helpers.paths import ROOT

import meshes
from meshes import simulate


def fake_install(monkeypatch, *, namespace: bool = False, entry_points: tuple[str, ...] = (), libtpu: bool = False):
    """Make the detection see the given plugins (and nothing else), without installing anything."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "jax_plugins":
            return types.SimpleNamespace(submodule_search_locations=[]) if namespace else None
        if name == "libtpu":
            return object() if libtpu else None
        return real_find_spec(name, *args, **kwargs)

    def eps(*, group):
        assert group == "jax_plugins"
        return [types.SimpleNamespace(name=n) for n in entry_points]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "entry_points", eps)


@pytest.fixture
def gpu_allowed(monkeypatch):
    """JAX_PLATFORMS unset, as on a GPU node (jax's config value is patched too: it was read at import)."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(simulate, "cpu_only_requested", lambda: False)


def test_exported():
    assert meshes.simulate_cpu_devices_unless_accelerator is simulate.simulate_cpu_devices_unless_accelerator
    assert "simulate_cpu_devices_unless_accelerator" in meshes.__all__


def test_nothing_installed_is_no_accelerator(monkeypatch, gpu_allowed):
    fake_install(monkeypatch)
    assert simulate.accelerator_plugin() is None


@pytest.mark.parametrize("install, expected", [
    (dict(namespace=True), "jax_plugins"),
    (dict(entry_points=("cuda",)), "jax_plugins entry points (cuda)"),
    (dict(libtpu=True), "libtpu"),
])
def test_each_kind_of_plugin_is_detected(monkeypatch, gpu_allowed, install, expected):
    fake_install(monkeypatch, **install)
    assert simulate.accelerator_plugin() == expected


@pytest.mark.parametrize("value, cpu_only", [
    ("cpu", True), (" CPU ", True), ("cpu,cpu", True), ("cuda,cpu", False), ("tpu", False), ("", False),
])
def test_which_jax_platforms_values_mean_cpu_only(value, cpu_only):
    assert simulate._is_cpu_only(value) is cpu_only


def test_jax_platforms_cpu_hides_an_installed_plugin(monkeypatch):
    fake_install(monkeypatch, namespace=True, libtpu=True)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert simulate.cpu_only_requested()
    assert simulate.accelerator_plugin() is None


def test_no_accelerator_simulates_n_cpu_devices(monkeypatch):
    calls = []
    monkeypatch.setattr(simulate, "accelerator_plugin", lambda: None)
    monkeypatch.setattr(simulate, "simulate_cpu_devices", lambda n: calls.append(n) or ["cpu"] * n)
    monkeypatch.setattr(jax, "devices", lambda *a: pytest.fail("jax.devices() must not run before simulating"))
    assert simulate.simulate_cpu_devices_unless_accelerator(4) == ["cpu"] * 4
    assert calls == [4]


def test_accelerator_uses_the_real_devices(monkeypatch):
    gpus = [types.SimpleNamespace(platform="gpu", id=i) for i in range(2)]
    monkeypatch.setattr(simulate, "accelerator_plugin", lambda: "jax_plugins (xla_cuda12)")
    monkeypatch.setattr(simulate, "simulate_cpu_devices", lambda n: pytest.fail("must not simulate on a GPU node"))
    monkeypatch.setattr(jax, "devices", lambda *a: gpus)
    assert simulate.simulate_cpu_devices_unless_accelerator(8) is gpus  # the real count (2), not n


def test_plugin_without_hardware_warns(monkeypatch):
    cpus = [types.SimpleNamespace(platform="cpu", id=0)]
    monkeypatch.setattr(simulate, "accelerator_plugin", lambda: "libtpu")
    monkeypatch.setattr(jax, "devices", lambda *a: cpus)
    with pytest.warns(UserWarning, match="libtpu is installed but jax found no accelerator.*JAX_PLATFORMS=cpu"):
        assert simulate.simulate_cpu_devices_unless_accelerator(8) is cpus


@pytest.mark.parametrize("bad", [0, -2, 2.0, "8", True, None])
def test_bad_count_is_rejected(bad):
    with pytest.raises(ValueError, match=f"positive integer, got {bad!r}"):
        meshes.simulate_cpu_devices_unless_accelerator(bad)


def test_in_this_process_matches_the_running_backend():
    """The test process runs 8 CPU devices under JAX_PLATFORMS=cpu: asking for 8 is a no-op, for 4 an error."""
    devices = meshes.simulate_cpu_devices_unless_accelerator(8)
    assert devices == jax.devices() and len(devices) == 8 and devices[0].platform == "cpu"
    with pytest.raises(RuntimeError, match="cannot simulate 4 CPU devices.*already started with 8"):
        meshes.simulate_cpu_devices_unless_accelerator(4)


def test_fresh_process_with_jax_platforms_cpu_gets_n_cpu_devices():
    """End to end, nothing patched but a probe: the decision runs before the backend starts, then 3 CPU devices."""
    script = textwrap.dedent("""
        import meshes
        from meshes import simulate

        seen = []
        detect = simulate.accelerator_plugin
        simulate.accelerator_plugin = lambda: seen.append(meshes.backend_started()) or detect()
        devices = meshes.simulate_cpu_devices_unless_accelerator(3)
        print(seen, len(devices), {d.platform for d in devices})
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no device count from the test setup
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[-2] == "[False] 3 {'cpu'}", proc.stdout
