"""``spmd-launch --processes N [--devices-per-process K] -- spmd-train ...``: a pod on one machine.

Starts N copies of a command on localhost as the processes of one multi-controller jax run, each
with the ``SPMD_*`` variables and K simulated CPU devices; the job fails as a whole. ``launch(cmd,
processes=...)`` is the same as a function. See docs/many-hosts.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

# The toolkit's own commands, run through this interpreter when they are not on PATH (no venv activated).
OWN_COMMANDS = {"spmd-train": "trainers", "spmd-plan": "trainers.launch.plan"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(
    process_id: int, processes: int, port: int, devices_per_process: int, timeout_s: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of child ``process_id``: SPMD_* settings and K simulated CPU devices."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"]),
        JAX_PLATFORMS="cpu",
        SPMD_COORDINATOR=f"127.0.0.1:{port}",
        SPMD_NUM_PROCESSES=str(processes),
        SPMD_PROCESS_ID=str(process_id),
        SPMD_INIT_TIMEOUT=str(timeout_s),
        PYTHONUNBUFFERED="1",
    )
    return env


# On Linux each child first asks the kernel to SIGKILL it when the launcher dies (even by SIGKILL),
# then execs the command; a launcher already gone by then makes it exit at once.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG = SIGKILL
    "os.getppid() == int(sys.argv[1]) or sys.exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def _wrap(cmd: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


def _forward(stream: TextIO, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_all(procs: list[subprocess.Popen], sig: int, *, groups: bool = False) -> None:
    """Signal each running child's process group; with ``groups``, also groups whose leader has exited."""
    for p in procs:
        if groups or p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def launch(
    cmd: Sequence[str],
    *,
    processes: int,
    devices_per_process: int = 1,
    port: int | None = None,
    timeout_s: int = 60,
    grace_s: float = 5.0,
    out: TextIO | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``cmd`` as ``processes`` processes of one jax run on localhost; return the job's exit status.

    0 when every child exits 0; otherwise the first failing child's status (128 + signal number
    when it was killed by a signal). ``timeout_s`` is each child's bound on joining the run
    (``SPMD_INIT_TIMEOUT``); ``grace_s`` the time between SIGTERM and SIGKILL for the others.
    """
    cmd = list(cmd)
    if not cmd or not all(isinstance(c, str) for c in cmd):
        raise ValueError(f"cmd must be a non-empty list of strings (e.g. ['spmd-train', 'gpt-small']), got {cmd!r}")
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process), ("timeout_s", timeout_s)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"port must be in 1..65535 (or None for a free one), got {port!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0 seconds, got {grace_s!r}")
    if shutil.which(cmd[0], path=(env or os.environ).get("PATH")) is None:
        if cmd[0] not in OWN_COMMANDS:
            raise ValueError(f"command {cmd[0]!r} not found (not an executable on PATH or a path to one)")
        cmd = [sys.executable, "-m", OWN_COMMANDS[cmd[0]], *cmd[1:]]  # this toolkit, without its venv on PATH
    out = sys.stdout if out is None else out
    port = free_port() if port is None else port
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    try:
        for i in range(processes):
            procs.append(subprocess.Popen(
                _wrap(cmd), env=child_env(i, processes, port, devices_per_process, timeout_s, env),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                errors="replace", bufsize=1, start_new_session=True,
            ))
    except OSError as err:
        _signal_all(procs, signal.SIGKILL)
        raise ValueError(f"cannot start {cmd[0]!r}: {err}") from err
    readers = [threading.Thread(target=_forward, args=(p.stdout, f"[p{i}] ", out, lock), daemon=True)
               for i, p in enumerate(procs)]
    for r in readers:
        r.start()

    received: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    status, kill_at = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if status is None and (failed or received):
                if failed:
                    i, c = failed[0]
                    status = _status(c)
                    with lock:
                        out.write(f"spmd-launch: process {i} exited with status {status}; stopping the others\n")
                else:
                    status = -1  # decided below from the children's own statuses
                    with lock:
                        out.write(f"spmd-launch: received signal {received[0]}; stopping all processes\n")
                _signal_all(procs, signal.SIGTERM)
                kill_at = time.monotonic() + grace_s
            if kill_at is not None and time.monotonic() >= kill_at:
                _signal_all(procs, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Live children here only if the launcher itself failed; leftover grandchildren in any case.
        _signal_all(procs, signal.SIGKILL, groups=True)
        for p in procs:
            p.wait()
        for r in readers:
            r.join(timeout=5)
    if status is None or status == -1:
        failed = [(i, _status(p.returncode)) for i, p in enumerate(procs) if p.returncode != 0]
        if failed and status is None:  # every process ended before a failure was seen: say which failed
            out.write("spmd-launch: " + "; ".join(f"process {i} exited with status {s}" for i, s in failed) + "\n")
        status = failed[0][1] if failed else 0
    return status


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="spmd-launch", description="Run a command as N processes of one jax run on this machine.",
                                usage="spmd-launch --processes N [--devices-per-process K] [--port P] [--timeout S] -- CMD ...",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(
                                    "example:\n  spmd-launch --processes 2 --devices-per-process 4 -- "
                                    "spmd-train gpt-small --tiny --mesh data=2,tensor=4\n\n"
                                    "The exit status is the first non-zero status of the processes (0 if all finish)."))
    p.add_argument("--processes", type=int, required=True, help="number of processes (simulated hosts)")
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices per process (default 1)")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=int, default=60, help="seconds each process may wait for the others to join (default 60)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            p.parse_args(["--help"])  # prints the help and exits 0
        raise ValueError("missing '--' before the command, e.g. spmd-launch --processes 2 -- spmd-train gpt-small --tiny")
    cut = argv.index("--")
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        raise ValueError("no command after '--', e.g. spmd-launch --processes 2 -- spmd-train gpt-small --tiny")
    return args, cmd


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, cmd = parse_args(argv)
        return launch(cmd, processes=args.processes, devices_per_process=args.devices_per_process, port=args.port,
                      timeout_s=args.timeout, grace_s=args.grace)
    except ValueError as err:
        print(f"spmd-launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
