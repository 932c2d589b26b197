"""meshes: MeshSpec validation, mesh building, presets, description, CPU simulation, distributed init."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from helpers.paths import REPO
from jax.sharding import AxisType

import meshes
from meshes import AXES, MeshError, MeshSpec, distributed

N = 8  # simulated devices (tests/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    assert len(jax.devices()) == N, "tests/conftest.py should give 8 simulated CPU devices"


# --- MeshSpec and make_mesh ---------------------------------------------------------------------


def test_minus_one_is_inferred_and_every_canonical_axis_is_present():
    mesh = meshes.make_mesh({"data": -1, "tensor": 2})
    sizes = meshes.axis_sizes(mesh)
    assert sizes["data"] == 4 and sizes["tensor"] == 2
    assert set(sizes) == set(AXES)
    assert all(sizes[a] == 1 for a in AXES if a not in ("data", "tensor"))
    assert math.prod(sizes.values()) == N


def test_declared_order_comes_first_then_canonical_order():
    mesh = meshes.make_mesh({"tensor": 2, "data": 4})
    assert mesh.axis_names[:2] == ("tensor", "data")
    assert mesh.axis_names[2:] == tuple(a for a in AXES if a not in ("tensor", "data"))
    assert mesh.devices.shape[:2] == (2, 4)


@pytest.mark.parametrize("axis_type, expected", [("auto", AxisType.Auto), ("explicit", AxisType.Explicit)])
def test_axis_types(axis_type, expected):
    kwargs = {} if axis_type == "auto" else {"axis_type": axis_type}
    mesh = meshes.make_mesh({"fsdp": 8}, **kwargs)
    assert tuple(mesh.axis_types) == (expected,) * len(AXES)


def test_bad_axis_type_names_the_valid_ones():
    with pytest.raises(MeshError, match=r"'implicit'.*auto.*explicit"):
        meshes.make_mesh({"fsdp": 8}, axis_type="implicit")


def test_string_spec_and_parse_axes():
    assert meshes.parse_axes("data=2,tensor=4") == {"data": 2, "tensor": 4}
    assert list(meshes.parse_axes(" tensor=4 , data=-1 ")) == ["tensor", "data"]
    mesh = meshes.make_mesh("data=2,tensor=4")
    assert meshes.axis_sizes(mesh)["tensor"] == 4


def test_explicit_device_subset():
    mesh = meshes.make_mesh({"tensor": 4}, devices=jax.devices()[:4])
    assert mesh.devices.size == 4
    assert {d.id for d in mesh.devices.flat} == {d.id for d in jax.devices()[:4]}


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ({"data": 3}, r"multiply to 3, but there are 8 devices"),
        ({"data": 2, "tensor": 2}, r"multiply to 4, but there are 8 devices"),
        ({"data": -1, "tensor": -1}, r"at most one mesh axis may be -1.*data, tensor"),
        ({"data": 0}, r"'data' has size 0"),
        ({"tensor": -2}, r"'tensor' has size -2"),
        ({"model": 8}, r"unknown mesh axis 'model'; valid axes are data, pipe, fsdp"),
        ({"data": -1, "tensor": 3}, r"cannot infer the -1 mesh axis: 8 devices .* product 3"),
        ({"data": -1, "tensor": 16}, r"cannot infer the -1 mesh axis: 8 devices .* product 16"),
        ("data=2,data=4", r"duplicate mesh axis 'data'"),
        ("data2", r"'data2' is not of the form axis=size"),
        ("data=two", r"'data' has size 'two'"),
    ],
)
def test_bad_specs_raise_with_the_numbers(spec, pattern):
    with pytest.raises(MeshError, match=pattern):
        meshes.make_mesh(spec)


def test_mesh_error_is_a_value_error():
    with pytest.raises(ValueError):
        MeshSpec.of({"data": 0})


def test_direct_construction_with_duplicate_axis_raises():
    with pytest.raises(MeshError, match="duplicate mesh axis"):
        MeshSpec(ici=(("data", 2), ("data", 4)))


def test_dcn_shape_must_match_process_count():
    spec = MeshSpec.of({"tensor": 4}, {"data": 2})
    assert spec.is_hybrid
    with pytest.raises(MeshError, match=r"DCN axis sizes \{'data': 2\} multiply to 2, but there are 1 slices"):
        meshes.make_mesh(spec)


def test_hybrid_mesh_with_one_slice_builds_in_one_process():
    spec = MeshSpec.of({"data": 2, "tensor": 4}, {"data": 1})
    assert not spec.is_hybrid
    mesh = meshes.make_mesh(spec)
    sizes = meshes.axis_sizes(mesh)
    assert (sizes["data"], sizes["tensor"]) == (2, 4)
    assert set(sizes) == set(AXES)
    # With more slices the DCN sizes multiply in: 2 slices of a (data=2, tensor=4) block.
    ici, dcn = MeshSpec.of({"data": 2, "tensor": 4}, {"data": -1}).resolve(16, 2)
    assert (ici["data"], ici["tensor"], dcn["data"], dcn["tensor"]) == (2, 4, 2, 1)
    with pytest.raises(MeshError, match="16 devices do not split evenly into 3 slices"):
        spec.resolve(16, 3)


def test_single_device_mesh():
    mesh = meshes.single_device_mesh()
    assert mesh.devices.size == 1
    assert mesh.devices.flat[0] == jax.devices()[0]
    assert meshes.axis_sizes(mesh) == {a: 1 for a in AXES}
    other = meshes.single_device_mesh(jax.devices()[3], axis_type="explicit")
    assert other.devices.flat[0] == jax.devices()[3]
    assert other.axis_types[0] == AxisType.Explicit


# --- presets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(meshes.PRESETS))
def test_every_preset_resolves_on_its_own_device_count(name):
    p = meshes.PRESETS[name]
    num_slices = math.prod(s for _, s in p.mesh.dcn) if p.mesh.dcn else 1
    assert p.hosts * p.devices_per_host == p.devices
    assert p.hosts % num_slices == 0, "a slice is made of whole hosts"
    ici, dcn = p.mesh.resolve(p.devices, num_slices)
    assert set(ici) == set(AXES) == set(dcn)
    assert math.prod(ici.values()) * math.prod(dcn.values()) == p.devices
    assert math.prod(dcn.values()) == num_slices


def test_preset_cpu8_builds_here_and_unknown_preset_lists_names():
    mesh = meshes.make_mesh(meshes.preset("cpu-8").mesh)
    sizes = meshes.axis_sizes(mesh)
    assert (sizes["data"], sizes["fsdp"], sizes["tensor"]) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"'tpu-9000'.*cpu-8"):
        meshes.preset("tpu-9000")


# --- describe -----------------------------------------------------------------------------------


def test_describe_mentions_axes_sizes_device_kind_hosts():
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    text = meshes.describe(mesh)
    assert "8 device(s)" in text
    assert "data=2" in text and "tensor=4" in text
    assert "Auto" in text
    assert "size-1 axes: pipe, fsdp, seq, expert" in text
    assert jax.devices()[0].device_kind in text
    assert "hosts: 1 process(es), 8 device(s) each" in text
    explicit = meshes.describe(meshes.make_mesh({"fsdp": 8}, axis_type="explicit"))
    assert "fsdp=8" in explicit and "Explicit" in explicit and "tensor=4" not in explicit


# --- CPU simulation -----------------------------------------------------------------------------


def test_simulate_after_backend_started():
    jax.devices()
    assert meshes.backend_started()
    assert len(meshes.simulate_cpu_devices(8)) == 8
    with pytest.raises(RuntimeError, match=r"cannot simulate 4 CPU devices.*already started with 8"):
        meshes.simulate_cpu_devices(4)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        meshes.simulate_cpu_devices(0)


def test_simulate_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import meshes
        assert not meshes.backend_started()
        devices = meshes.simulate_cpu_devices(4)
        import jax
        print(len(devices), len(jax.devices()), jax.devices()[0].platform)
        try:
            meshes.simulate_cpu_devices(8)
        except RuntimeError as e:
            print("refused:", "already started with 4" in str(e))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    root = REPO
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["4 4 cpu", "refused: True"]


# --- distributed --------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("SPMD_COORDINATOR", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(distributed, "_initialized", False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return calls


def test_initialize_is_a_noop_on_one_host(clean_env, monkeypatch):
    monkeypatch.setattr(distributed, "_cluster_detected", lambda: False)
    assert distributed.initialize() is False
    assert clean_env == []


def test_initialize_detects_no_cluster_here(clean_env):
    # The real detector: nothing here is a cluster (mpi4py being importable must not count).
    for key in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST", "TPU_WORKER_HOSTNAMES"):
        if key in os.environ:
            pytest.skip(f"{key} is set in this environment")
    assert distributed.initialize() is False
    assert clean_env == []


def test_cluster_detection_skips_opt_in_only_detectors(monkeypatch):
    from jax._src.clusters import ClusterEnv

    def detector(opt_in: bool, present: bool) -> type:
        return type("Fake", (), {"opt_in_only_method": opt_in, "is_env_present": classmethod(lambda cls: present)})

    # An opt-in-only detector (mpi4py: true whenever the package is importable) is not a cluster.
    monkeypatch.setattr(ClusterEnv, "_cluster_types", [detector(True, True), detector(False, False)])
    assert distributed._cluster_detected() is False
    monkeypatch.setattr(ClusterEnv, "_cluster_types", [detector(True, True), detector(False, True)])
    assert distributed._cluster_detected() is True


def test_initialize_rejects_bad_process_count(clean_env, monkeypatch):
    monkeypatch.setenv("SPMD_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "four")
    monkeypatch.setenv("SPMD_PROCESS_ID", "0")
    with pytest.raises(ValueError, match=r"SPMD_NUM_PROCESSES='four'"):
        distributed.initialize()
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "4")
    monkeypatch.setenv("SPMD_PROCESS_ID", "7")
    with pytest.raises(ValueError, match=r"process_id 7 is not in \[0, 4\)"):
        distributed.initialize()
    assert clean_env == []


def test_initialize_passes_env_settings_to_jax(clean_env, monkeypatch):
    monkeypatch.setenv("SPMD_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "1")
    monkeypatch.setenv("SPMD_PROCESS_ID", "0")
    assert distributed.initialize() is False  # one process: nothing to start
    assert clean_env == []
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "4")
    monkeypatch.setenv("SPMD_PROCESS_ID", "2")
    assert distributed.initialize(timeout_s=5) is True
    assert clean_env == [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2,
                              initialization_timeout=5)]
    assert distributed.initialize() is True  # idempotent: no second call
    assert len(clean_env) == 1


def test_default_dcn_puts_data_then_fsdp_across_slices():
    sizes = {"data": 4, "pipe": 1, "fsdp": 8, "seq": 1, "expert": 1, "tensor": 4}
    ici, dcn = meshes.default_dcn(sizes, 2)
    assert dcn["data"] == 2 and ici["data"] == 2 and ici["fsdp"] == 8 and sum(dcn.values()) == 2 + 5
    ici, dcn = meshes.default_dcn({**sizes, "data": 1}, 4)  # data too small: fsdp crosses slices
    assert dcn["fsdp"] == 4 and ici["fsdp"] == 2 and dcn["data"] == 1
    with pytest.raises(meshes.MeshError, match=r"neither data=3 nor fsdp=1 divides by 2.*--dcn"):
        meshes.default_dcn({**sizes, "data": 3, "fsdp": 1}, 2)
