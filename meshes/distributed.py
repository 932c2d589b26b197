"""Start jax's multi-controller runtime on every host, or do nothing on one host; check that the
hosts agree before a run starts.

Settings, first match wins: arguments to :func:`initialize`; ``SPMD_COORDINATOR`` /
``SPMD_NUM_PROCESSES`` / ``SPMD_PROCESS_ID``; jax's own cluster detection. :func:`check_consistent`
stops every process with :class:`ConsistencyError` when the hosts disagree. See docs/many-hosts.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading
from collections.abc import Mapping
from typing import Any

import jax

from meshes import compat

_ENV = ("SPMD_COORDINATOR", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID")
TIMEOUT_ENV = "SPMD_INIT_TIMEOUT"  # default for timeout_s (spmd-launch --timeout sets it)
DEFAULT_TIMEOUT_S = 300
INIT_TIMEOUT_EXIT_CODE = 75  # the exit status of a process whose peers / coordinator never came
MAX_FIELDS = 31  # fingerprint fields; one more row carries the field names
_ROW = 64  # bytes per fingerprint row: 8 of hash, 56 of text shown in errors
_initialized = False
_settings: Settings | None = None


class DistributedError(RuntimeError):
    """jax's multi-controller runtime could not start (the message names coordinator and process)."""


class ConsistencyError(RuntimeError):
    """The processes of one run disagree on versions, mesh or config."""


def parse_coordinator(address: str) -> tuple[str, int]:
    """``"10.0.0.1:1234"`` / ``"host-0:1234"`` / ``"[::1]:1234"`` -> (host, port); anything else raises."""
    if not isinstance(address, str):
        raise ValueError(f"coordinator {address!r} must be a 'host:port' string, e.g. '10.0.0.1:1234'")
    host, sep, port = address.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator {address!r} is not of the form host:port with a port in 1..65535 "
            "(e.g. '10.0.0.1:1234', 'node-0:1234' or '[::1]:1234')"
        )
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved settings of one process: where the coordinator is, how many processes, which one this is.

    ``coordinator`` is None when jax's cluster detection supplies everything (``source`` names
    the cluster then).
    """

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    source: str

    def __post_init__(self) -> None:
        if self.coordinator is None:
            return
        parse_coordinator(self.coordinator)
        n, i = self.num_processes, self.process_id
        for name, value in (("num_processes", n), ("process_id", i)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"coordinator {self.coordinator!r} given, so {name} must be an integer; got {value!r}")
        if n < 1:
            raise ValueError(f"num_processes must be >= 1, got {n}")
        if not 0 <= i < n:
            raise ValueError(f"process_id {i} is not in [0, {n}) (num_processes={n})")


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """Name the multi-host environment from its variables: "spmd", "slurm", "ompi", "tpu", "k8s" or None.

    Mirrors what jax's cluster detection looks at (jax also asks the TPU VM metadata server,
    which needs no variables); used for messages, launch scripts and tests.
    """
    env = os.environ if env is None else env
    if env.get("SPMD_COORDINATOR"):
        return "spmd"
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "ompi"
    if env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    if "KUBERNETES_SERVICE_HOST" in env:
        return "k8s"
    return None


def _cluster_detected() -> bool:
    """Whether jax's own cluster detection recognises this environment (TPU pod, SLURM, k8s)."""
    try:
        # Opt-in-only detectors (mpi4py: merely installed, not a cluster) are skipped, as jax does.
        return any(env.is_env_present() for env in compat.cluster_detectors())
    except Exception:  # pragma: no cover - a detector failed; fall back to single host
        return False


def resolve_settings(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings | None:
    """The settings :func:`initialize` would use, or None for a single-host run (pure apart from detection)."""
    env = os.environ if env is None else env
    source = "arguments"
    if coordinator is None and env.get("SPMD_COORDINATOR"):
        coordinator, source = env["SPMD_COORDINATOR"], "SPMD_* environment variables"
        try:
            num_processes = num_processes if num_processes is not None else int(env.get("SPMD_NUM_PROCESSES") or "")
            process_id = process_id if process_id is not None else int(env.get("SPMD_PROCESS_ID") or "")
        except ValueError:
            raise ValueError(
                "SPMD_COORDINATOR is set, so SPMD_NUM_PROCESSES and SPMD_PROCESS_ID must be integers; got "
                f"SPMD_NUM_PROCESSES={env.get('SPMD_NUM_PROCESSES')!r}, SPMD_PROCESS_ID={env.get('SPMD_PROCESS_ID')!r}"
            ) from None
    if coordinator is None:
        if num_processes is not None or process_id is not None:
            raise ValueError(
                f"num_processes={num_processes!r} / process_id={process_id!r} given without a coordinator; "
                "pass coordinator='host:port' (process 0's address) as well, or none of them"
            )
        if env.get("SLURM_NTASKS") == "1" or not _cluster_detected():
            return None
        return Settings(None, None, None, f"jax cluster detection ({detect_cluster(env) or 'TPU VM'})")
    settings = Settings(coordinator, num_processes, process_id, source)
    return None if settings.num_processes == 1 else settings


def _probe(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return f"the coordinator port {host}:{port} accepts connections, but not all processes joined"
    except OSError as err:
        return f"nothing answers at {host}:{port} ({err.strerror or err})"


def _timeout_message(s: Settings, timeout_s: float) -> str:
    if s.coordinator is None:
        where = f"the coordinator found by {s.source}"
        state = "jax's cluster detection found the cluster but the processes did not all connect"
    else:
        where = f"coordinator {s.coordinator} (from {s.source})"
        host, port = parse_coordinator(s.coordinator)
        state = ("this process hosts the coordinator; the other processes never connected"
                 if s.process_id == 0 else _probe(host, port))
    ident = f"process {s.process_id} of {s.num_processes}" if s.process_id is not None else "this process"
    return (
        f"spmd: error: jax.distributed did not start within {timeout_s:g} s on {ident}, waiting for {where}: "
        f"{state}.\nCheck that every process was started (and none crashed; see their logs), that all use the same "
        "coordinator address and process count with distinct process ids, that process 0's host is reachable on that "
        f"port (firewall, hostname), and raise the timeout ({TIMEOUT_ENV} or timeout_s) if hosts start slowly. "
        f"Exiting with status {INIT_TIMEOUT_EXIT_CODE}.\n"
    )


def _watchdog(settings: Settings, timeout_s: float, done: threading.Event) -> None:
    """Exit with a clear message shortly before jax would abort the process with a stack trace."""
    if not done.wait(timeout_s - min(1.0, 0.1 * timeout_s)):
        sys.stderr.write(_timeout_message(settings, timeout_s))
        sys.stderr.flush()
        os._exit(INIT_TIMEOUT_EXIT_CODE)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int | None = None,
) -> bool:
    """Initialise ``jax.distributed`` when this is a multi-host run; return whether it is one.

    Call before any other jax work. ``timeout_s`` (default ``$SPMD_INIT_TIMEOUT`` or 300) bounds
    the wait for the coordinator and all peers; past it the process exits with a message (see
    the module docstring). Idempotent: calling again with the same settings returns True and
    does nothing; different settings raise ValueError.
    """
    global _initialized, _settings
    if timeout_s is None:
        text = os.environ.get(TIMEOUT_ENV) or str(DEFAULT_TIMEOUT_S)
        if not text.isdigit():
            raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a positive integer number of seconds")
        timeout_s = int(text)
    if not isinstance(timeout_s, int) or isinstance(timeout_s, bool) or timeout_s < 1:
        raise ValueError(f"timeout_s must be a positive integer number of seconds, got {timeout_s!r}")
    settings = resolve_settings(coordinator, num_processes, process_id)
    if _initialized:
        same = settings is None or _settings is None or (
            (settings.coordinator, settings.num_processes, settings.process_id)
            == (_settings.coordinator, _settings.num_processes, _settings.process_id)
        )
        if not same:
            raise ValueError(f"jax.distributed is already initialised with {_settings}; cannot re-initialise with {settings}")
        return True
    if settings is None:
        return False
    if jax.distributed.is_initialized():  # someone called jax.distributed.initialize directly: adopt it
        _initialized, _settings = True, settings
        return True
    done = threading.Event()
    threading.Thread(target=_watchdog, args=(settings, timeout_s, done), daemon=True, name="spmd-init-watchdog").start()
    try:
        if settings.coordinator is None:
            jax.distributed.initialize(initialization_timeout=timeout_s)
        else:
            jax.distributed.initialize(
                coordinator_address=settings.coordinator,
                num_processes=settings.num_processes,
                process_id=settings.process_id,
                initialization_timeout=timeout_s,
            )
    except Exception as err:
        raise DistributedError(
            f"jax.distributed.initialize failed on process {settings.process_id} of {settings.num_processes} "
            f"(coordinator {settings.coordinator or settings.source}): {err}. It must run before any other jax "
            "call in the process (build meshes and arrays afterwards)."
        ) from err
    finally:
        done.set()
    _initialized, _settings = True, settings
    return True


# ----------------------------------------------------------------------------- consistency
def toolkit_version() -> str:
    """The installed spmd toolkit's version ("unknown" when running from an uninstalled tree)."""
    from importlib import metadata

    try:
        return metadata.version("spmd")
    except metadata.PackageNotFoundError:
        return "unknown"


def fingerprint(mesh: jax.sharding.Mesh | None = None, config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """What must be equal on every process: versions, device count, the mesh (axes, sizes, device order), a config hash."""
    import jaxlib

    fields = {
        "spmd": toolkit_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "devices": f"{jax.device_count()} {jax.devices()[0].platform}",
    }
    if mesh is not None:
        order = hashlib.sha256(str([d.id for d in mesh.devices.flat]).encode()).hexdigest()[:8]
        axes = ",".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.devices.shape))
        fields["mesh"] = f"{axes} ({mesh.size} devices, order {order})"
    if config is not None:
        text = json.dumps(config, sort_keys=True, default=str)
        fields["config"] = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return fields


def _encode(fields: Mapping[str, Any]) -> Any:
    """uint8[MAX_FIELDS + 1, 64]: row 0 the field names, row k the k-th field (8 hash bytes + 56 text bytes)."""
    import numpy as np

    if not isinstance(fields, Mapping) or not all(isinstance(k, str) and k for k in fields):
        raise ValueError(f"fingerprint must be a mapping of non-empty str names to values, got {fields!r}")
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"fingerprint has {len(fields)} fields; at most {MAX_FIELDS} are compared")
    names = sorted(fields)
    texts = [",".join(names)] + [str(fields[k]) for k in names]
    rows = np.zeros((MAX_FIELDS + 1, _ROW), np.uint8)
    for r, (key, text) in enumerate(zip(["fields", *names], texts)):
        digest = hashlib.sha256(f"{key}={text}".encode()).digest()[:8]
        shown = text.encode()[: _ROW - 8]
        rows[r, :8] = np.frombuffer(digest, np.uint8)
        rows[r, 8 : 8 + len(shown)] = np.frombuffer(shown, np.uint8)
    return rows


def _decode(row: Any) -> str:
    return bytes(row[8:]).rstrip(b"\0").decode(errors="replace")


def disagreement(gathered: Any, names: list[str]) -> str | None:
    """None if all processes' encoded fingerprints (uint8[P, MAX_FIELDS + 1, 64]) agree, else what differs and where."""
    import numpy as np

    gathered = np.asarray(gathered)
    lines = []
    for r, key in enumerate(["fields", *sorted(names)]):
        groups: dict[bytes, list[int]] = {}
        for p in range(gathered.shape[0]):
            groups.setdefault(bytes(gathered[p, r, :8]), []).append(p)
        if len(groups) > 1:
            parts = [f"process(es) {procs} have {_decode(gathered[procs[0], r])!r}" for procs in groups.values()]
            lines.append(f"  {key}: " + "; ".join(parts))
        if r == 0 and lines:
            break  # different field sets: the rows below do not line up
    if not lines:
        return None
    return (
        f"the {gathered.shape[0]} processes of this run disagree:\n" + "\n".join(lines) + "\nEvery process must run "
        "the same toolkit, jax and jaxlib versions, build the same mesh and use the same config (same recipe, "
        "--set overrides and flags on every host)."
    )


def check_consistent(fields: Mapping[str, Any]) -> None:
    """Raise ConsistencyError on every process unless all processes passed equal ``fields``.

    One all-gather of 2 KiB per process; returns at once with one process. Call it on every
    process (it is a collective), e.g. ``check_consistent(fingerprint(mesh, cfg.to_dict()))``.
    """
    rows = _encode(fields)
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    problem = disagreement(multihost_utils.process_allgather(rows), list(fields))
    if problem:
        raise ConsistencyError(f"process {jax.process_index()}: {problem}")
