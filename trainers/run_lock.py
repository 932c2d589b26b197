"""One run per run directory: ``<run_dir>/run.lock``, held by process 0 while it trains.

    with claim(cfg.run.directory):   # RunDirectoryInUse (exit 2) when another live run holds it
        ...

The file holds ``{"host", "pid", "started"}`` of its holder and an exclusive ``flock`` on it for as long
as the holder lives; it is removed when the holder leaves the ``with`` block. A second start on the same
directory is refused before it reads or writes anything there (its config, metrics and checkpoints stay
as the first run left them), naming the holder. A lock left by a process that is gone (killed: the
kernel released its ``flock``, or its pid no longer runs on this host) is taken over with a warning.
A lock written on another host whose ``flock`` is not visible here (a network file system) is refused:
only a person can tell whether that run is still alive, and the message says which file to remove.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunDirectoryInUse(ValueError):
    """Another live run holds the run directory (exit 2 from the CLI)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        data = json.loads(os.read(fd, 4096).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')!r}{when}"


@contextlib.contextmanager
def claim(run_dir: str, *, enabled: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the ``with`` block (``enabled=False``, on every process but 0: nothing).
    Raises :class:`RunDirectoryInUse` naming the holder when another live run has it."""
    if not enabled or (os.path.exists(run_dir) and not os.path.isdir(run_dir)):  # a file: the run's own check says so
        yield
        return
    created = not os.path.exists(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    fd = _acquire(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                os.unlink(path)
        os.close(fd)  # releases the flock
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)  # nothing else was written (a start refused before it wrote anything)


def _acquire(path: str) -> int:
    """An open descriptor of ``path`` holding its flock, with this process's identity written in it."""
    host = socket.gethostname()
    for _ in range(10):  # a holder that leaves while we look removes the file: look again
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirectoryInUse(
                f"run directory {os.path.dirname(path)!r} is in use by {_describe(holder)} (its lock file {path}); "
                "one run per run directory: wait for that run to end or stop it, or give another run.run_dir "
                "(--run-dir)") from None
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:  # removed and re-created meanwhile
                os.close(fd)
                continue
        except FileNotFoundError:
            os.close(fd)
            continue
        holder = _read(fd)
        if holder:  # left behind: its holder no longer holds the flock
            same_host = holder.get("host") == host
            pid = holder.get("pid")
            if not same_host or (isinstance(pid, int) and pid != os.getpid() and _alive(pid)):
                os.close(fd)
                raise RunDirectoryInUse(
                    f"run directory {os.path.dirname(path)!r} may be in use by {_describe(holder)} (its lock file "
                    f"{path}; the lock cannot be checked from host {host!r}): if that run has ended, remove {path} "
                    "and start again; else give another run.run_dir (--run-dir)")
            log.warning("run directory %s: taking over the lock left by %s, which is no longer running",
                        os.path.dirname(path), _describe(holder))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"host": host, "pid": os.getpid(), "started": time.time()}).encode())
        os.fsync(fd)
        return fd
    raise RunDirectoryInUse(f"run directory {os.path.dirname(path)!r}: its lock file {path} keeps changing; another "
                            "run is starting or stopping there")
