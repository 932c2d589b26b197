"""Start jax's multi-controller runtime on every host, or do nothing on one host.

Order of precedence for the settings:
1. explicit arguments to :func:`initialize`;
2. the ``SPMD_COORDINATOR`` (host:port), ``SPMD_NUM_PROCESSES`` and ``SPMD_PROCESS_ID`` environment
   variables (what ``spmd-launch`` and the SLURM script set);
3. jax's own cluster detection (TPU pods, SLURM, Kubernetes), used when it recognises one.

With none of these, this is a single-host run and nothing is initialised.
"""

from __future__ import annotations

import os

import jax

_ENV = ("SPMD_COORDINATOR", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID")
_initialized = False


def _cluster_detected() -> bool:
    """Whether jax's own cluster detection recognises this environment (TPU pod, SLURM, k8s)."""
    try:
        from jax._src.clusters import ClusterEnv

        # Opt-in-only detectors (mpi4py: merely installed, not a cluster) are skipped, as jax does.
        return any(
            env.is_env_present() for env in ClusterEnv._cluster_types if not getattr(env, "opt_in_only_method", False)
        )
    except Exception:  # pragma: no cover - private API moved; fall back to single host
        return False


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
) -> bool:
    """Initialise ``jax.distributed`` when this is a multi-host run; return whether it did.

    Idempotent: a second call returns True without doing anything. Must run before any other jax
    call in the process.
    """
    global _initialized
    if _initialized:
        return True
    env = {k: os.environ.get(k) for k in _ENV}
    if coordinator_address is None and env["SPMD_COORDINATOR"]:
        coordinator_address = env["SPMD_COORDINATOR"]
        try:
            num_processes = num_processes if num_processes is not None else int(env["SPMD_NUM_PROCESSES"] or "")
            process_id = process_id if process_id is not None else int(env["SPMD_PROCESS_ID"] or "")
        except ValueError:
            raise ValueError(
                "SPMD_COORDINATOR is set, so SPMD_NUM_PROCESSES and SPMD_PROCESS_ID must be integers; got "
                f"SPMD_NUM_PROCESSES={env['SPMD_NUM_PROCESSES']!r}, SPMD_PROCESS_ID={env['SPMD_PROCESS_ID']!r}"
            ) from None
    if coordinator_address is None:
        if not _cluster_detected():
            return False
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        if num_processes is None or process_id is None:
            raise ValueError(
                f"coordinator {coordinator_address!r} given without num_processes/process_id "
                f"(got {num_processes!r}, {process_id!r})"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is not in [0, {num_processes})")
        if num_processes == 1:
            return False
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
        )
    _initialized = True
    return True
