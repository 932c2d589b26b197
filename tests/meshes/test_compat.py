"""meshes.compat: every private jax/orbax entry works on the jax installed here.

The suite runs on both ends of the supported range (jax 0.10.2 and 0.12), so each test here pins
one entry on each. All cheap: tiny jaxprs, no big compiles, one short subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.paths import ROOT

from meshes import compat, distributed

# --- version gate ----------------------------------------------------------------------------------------


def test_version_gate_matches_the_installed_jax():
    assert compat.JAX_VERSION == tuple(jax.__version_info__[:3])
    closed = jax.make_jaxpr(lambda a: a + 1)(1.0)
    # the gate says what the probe finds: from 0.12 a closed jaxpr is its own .jaxpr
    assert (closed.jaxpr is closed) == compat.JAXPR_CARRIES_CONSTS


# --- jaxprs (spmd.pipeline.split) ------------------------------------------------------------------------


def _f(p, x):
    return jnp.sin(p) * 2.0, p * x


def test_partial_eval_splits_by_dependence():
    closed = jax.make_jaxpr(_f)(1.0, 2.0)
    known, out_unknown = compat.partial_eval_jaxpr(closed, [False, True])  # p known, x unknown
    assert out_unknown == [False, True]
    assert len(known.jaxpr.invars) == 1  # only the known input
    outs = compat.eval_jaxpr(known.jaxpr, known.consts, 1.0)
    np.testing.assert_allclose(outs[0], 2 * np.sin(1.0), rtol=1e-6)  # the known output, then residuals
    # negative control: with p unknown too nothing is known
    _, all_unknown = compat.partial_eval_jaxpr(closed, [True, True])
    assert all_unknown == [True, True]


def test_eval_jaxpr_runs_and_retraces():
    closed = jax.make_jaxpr(_f)(1.0, 2.0)
    eager = compat.eval_jaxpr(closed.jaxpr, closed.consts, 0.5, 3.0)
    traced = jax.jit(lambda p, x: compat.eval_jaxpr(closed.jaxpr, closed.consts, p, x))(0.5, 3.0)
    np.testing.assert_allclose(eager, [2 * np.sin(0.5), 1.5], rtol=1e-6)
    np.testing.assert_allclose(traced, eager, rtol=1e-6)


def test_scan_consts_carry():
    def f(c, init, xs):
        def body(carry, x):
            a, b = carry
            return (a + c * x, b * x), x * 2.0

        return jax.lax.scan(body, (init, init), xs)

    closed = jax.make_jaxpr(f)(jnp.float32(2.0), jnp.float32(0.0), jnp.ones(3, jnp.float32))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    # one const (c, closed over), two carries, one xs
    assert compat.scan_consts_carry(eqn.params, eqn.invars) == (1, 2)
    assert len(eqn.invars) == 4


# --- backends (meshes.simulate) --------------------------------------------------------------------------


def test_backends_initialized_here():
    jax.devices()
    assert compat.backends_initialized() is True


def test_backends_initialized_in_a_fresh_process():
    """Before jax starts: False, and neither the query nor ``import meshes`` starts it or imports orbax."""
    code = textwrap.dedent("""
        import sys
        import meshes
        from meshes import compat
        before = compat.backends_initialized()
        import jax
        still = compat.backends_initialized()
        jax.devices()
        print(before, still, compat.backends_initialized(), "orbax" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True", "False"]


# --- multi-host (meshes.distributed, trainers.faults.preemption) -----------------------------------------


def test_cluster_detectors_are_jax_detectors():
    detectors = compat.cluster_detectors()
    assert detectors, "jax's cluster registry was not found"
    assert all(callable(getattr(d, "is_env_present", None)) for d in detectors)
    assert not [d for d in detectors if getattr(d, "opt_in_only_method", False)]
    assert "Mpi4pyCluster" not in {d.__name__ for d in detectors}  # opt-in only in jax


def test_cluster_detectors_skip_opt_in_only(monkeypatch):
    from jax._src.clusters import ClusterEnv  # the registry compat reads; patched to fake detectors

    def detector(name: str, opt_in: bool) -> type:
        return type(name, (), {"opt_in_only_method": opt_in, "is_env_present": classmethod(lambda cls: True)})

    monkeypatch.setattr(ClusterEnv, "_cluster_types", [detector("OptIn", True), detector("Auto", False)])
    assert [d.__name__ for d in compat.cluster_detectors()] == ["Auto"]
    assert distributed._cluster_detected() is True
    monkeypatch.setattr(ClusterEnv, "_cluster_types", [detector("OptIn", True)])
    assert compat.cluster_detectors() == []
    assert distributed._cluster_detected() is False


def test_distributed_client_is_none_without_initialize():
    assert not jax.distributed.is_initialized()
    assert compat.distributed_client() is None


# --- checkpoints (trainers.checkpoint.storage) -----------------------------------------------------------


def test_array_metadata_store():
    ocp = pytest.importorskip("orbax.checkpoint")
    store = compat.array_metadata_store()
    assert store is not compat.array_metadata_store()  # a new one each call
    assert type(store).__name__ == "Store" and hasattr(store, "write") and hasattr(store, "read")
    ocp.type_handlers.ArrayHandler(array_metadata_store=store)  # what storage.py builds with it


# --- the one place ---------------------------------------------------------------------------------------

PRIVATE = re.compile(r"^[^#\n]*\b_src\b", re.MULTILINE)


def test_private_internals_only_in_compat():
    hits = []
    for package in ("meshes", "spmd", "trainers", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "meshes" / "compat.py":
                continue
            hits += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in PRIVATE.finditer(path.read_text())]
    assert hits == [], "private jax/orbax internals outside meshes/compat.py:\n" + "\n".join(hits)


def test_private_check_catches_private_uses():
    """Negative control for the check above: code is caught, comments are not."""
    bad = ["from jax._src import core\n", "    import orbax.checkpoint._src.metadata\n", "x = jax._src.core.Var\n"]
    ok = ["# compat reaches what jax keeps in _src\n", "from jax.extend.core import Var\n"]
    assert [bool(PRIVATE.search(s)) for s in bad + ok] == [True, True, True, False, False]
