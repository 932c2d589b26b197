"""Every use of jax's and orbax's private internals, in one place, so that an upgrade touches one file.

Supported range: jax 0.10.2 .. 0.12, orbax-checkpoint 0.12.8 and up. Each entry is a small function,
grouped by the module that uses it, whose docstring says what public API is missing and where
jax versions differ (gated by ``JAX_VERSION`` or a feature probe); tests/meshes/test_compat.py runs
every entry on the installed versions, and the suite runs on both ends of the range. Private modules are imported inside
the functions: one that moves breaks only the feature using it, never ``import meshes``, and orbax
is never needed to import ``meshes``. See docs/meshes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__[:3])
# jax 0.12 folded ClosedJaxpr into Jaxpr: a jaxpr carries its consts, and ``closed.jaxpr is closed``.
JAXPR_CARRIES_CONSTS = JAX_VERSION >= (0, 12, 0)


# -- jaxprs: the zero-bubble backward split (spmd.pipeline.split) ------------------------------------------


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluate (or, under a trace, re-trace) ``jaxpr`` on ``consts`` and ``args``; returns its outputs.

    Missing public API: ``jax.extend.core`` exports only ``jaxpr_as_fun``, which runs under
    ``debug_nans(False)``; ``jax.core.eval_jaxpr`` is a leftover of ``jax.core``, whose members
    jax keeps deprecating. Same call on 0.10.2 .. 0.12 (on 0.12 ``jaxpr`` may be the
    closed jaxpr itself, whose ``.jaxpr`` is itself).
    """
    from jax._src import core

    return core.eval_jaxpr(jaxpr, consts, *args)


def partial_eval_jaxpr(closed: Any, unknowns: Sequence[bool]) -> tuple[Any, list[bool]]:
    """Split ``closed`` by data dependence: ``(known, out_unknown)``.

    ``known`` is the closed jaxpr of the equations that depend on the known inputs only (those with
    ``unknowns[i]`` False), taking those inputs and returning the known outputs followed by the
    residuals the unknown part would need; ``out_unknown[j]`` says whether output ``j`` depends on
    an unknown input. Known outputs are not instantiated into the unknown part.

    Missing public API: partial evaluation (``pe.partial_eval_jaxpr_nounits``) has no public
    entry in any jax release. Version difference: before 0.12 it takes and returns
    ``ClosedJaxpr``; from 0.12 (:data:`JAXPR_CARRIES_CONSTS`) a ``Jaxpr`` carrying its consts.
    Either way the result has ``.jaxpr`` and ``.consts`` for :func:`eval_jaxpr`.
    """
    from jax._src.interpreters import partial_eval as pe

    known, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(closed, list(unknowns), instantiate=False)
    return known, list(out_unknown)


def scan_consts_carry(params: dict[str, Any], operands: Sequence[Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation with ``params`` applied to ``operands``.

    Missing public API: the params of jax's primitives are internal. Version difference (a
    feature probe on the params): before 0.12 the scan equation has ``num_consts`` and
    ``num_carry``; from 0.12 it has ``ft_in``, the operand groups (consts, carry, xs) as a flat
    tree that the operands are unpacked with.
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry = params["ft_in"].update(list(operands)).unpack()[:2]
    return len(list(consts)), len(list(carry))


# -- backends: CPU simulation (meshes.simulate) ---------------------------------------------------------------


def backends_initialized() -> bool:
    """Whether a jax backend has already been initialised in this process (never starts one).

    Missing public API: ``jax.extend.backend.backends()`` starts the backends to list them, and
    nothing public asks without starting. ``xla_bridge.backends_are_initialized`` exists on
    0.10.2 .. 0.12 (feature probe; else its backend table ``_backends`` is read directly).
    """
    from jax._src import xla_bridge

    probe = getattr(xla_bridge, "backends_are_initialized", None)
    if probe is not None:
        return bool(probe())
    return bool(getattr(xla_bridge, "_backends", None))


# -- multi-host: cluster detection (meshes.distributed) and the coordination client (trainers.faults) --------


def cluster_detectors() -> list[type[Any]]:
    """jax's cluster detectors that ``jax.distributed.initialize()`` tries without being asked.

    Each has a classmethod ``is_env_present()``. Opt-in-only detectors (mpi4py: present whenever
    the package is importable, not a cluster) are left out, as jax leaves them out. Empty when
    the registry moved (the caller then treats the host as a single host).

    Missing public API: jax exposes no way to ask whether ``initialize()`` would find a cluster
    without calling it; the registry ``ClusterEnv._cluster_types`` and each detector's
    ``opt_in_only_method`` are the same on 0.10.2 .. 0.12. Read at each call (tests patch it).
    """
    try:
        from jax._src.clusters import ClusterEnv

        detectors = list(ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # pragma: no cover - private API moved; fall back to single host
        return []
    return [d for d in detectors if not getattr(d, "opt_in_only_method", False)]


def distributed_client() -> Any | None:
    """jax's coordination-service client (it has ``wait_at_barrier(name, timeout_ms)``), or ``None``
    when this process was not started with ``jax.distributed.initialize()``.

    Missing public API: ``jax.distributed.is_initialized()`` says whether there is a client but
    not which; a barrier with a timeout needs the client (``multihost_utils.sync_global_devices``
    has none). Same ``distributed.global_state.client`` on 0.10.2 .. 0.12.
    """
    from jax._src import distributed

    return distributed.global_state.client


# -- checkpoints: what a step writes (trainers.checkpoint.storage) --------------------------------------------


def array_metadata_store() -> Any:
    """A new instance of orbax's per-array metadata store, the one its default ``jax.Array`` handler uses.

    Missing public API: orbax (0.12.8 and later in our range) has no public path to the store,
    and an ``ArrayHandler`` built with other options must be given it to write the metadata that
    plain orbax reads back. orbax is imported here, not when ``meshes`` is imported.
    """
    from orbax.checkpoint._src.metadata import array_metadata_store as store

    return store.Store()
