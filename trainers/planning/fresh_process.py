"""Call a toolkit function in a fresh Python process that sees N simulated CPU devices.

jax fixes its device count when its backend starts, so a dry run for another count runs in a child
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``, ``JAX_PLATFORMS=cpu``). Arguments and
result cross as JSON: dataclasses are named and rebuilt only from this toolkit's own modules (no
pickle: nothing read back can run code).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import meshes

TOOLKIT = ("meshes.", "spmd.", "trainers.")  # the modules whose names may cross
# Most simulated CPU devices a compile may ask for: 4096 took 4.5 s and 0.7 GB on 2 cores, 16384 over 2 min
# and 2 GB (jax builds every device and its client up front), so larger counts are refused, not attempted.
MAX_SIMULATED_DEVICES = 4096


def check_simulated(devices: int, what: str = "the dry run") -> None:
    """ValueError when ``devices`` simulated CPU devices are more than a laptop can compile for, saying what to do instead."""
    if devices > MAX_SIMULATED_DEVICES:
        raise ValueError(
            f"--devices {devices}: {what} compiles on {devices} simulated CPU devices, more than the "
            f"{MAX_SIMULATED_DEVICES} this toolkit simulates (memory and start-up grow faster than the count). For an "
            f"analytic estimate of that many devices (memory, collectives, step time, no compile) run "
            f"spmd-plan TARGET --devices {devices} --no-compile; or compile a smaller count with the same per-device "
            f"shapes (e.g. fewer data replicas: --devices {MAX_SIMULATED_DEVICES})")


def call_with_devices(function: str, args: list, kwargs: dict[str, Any], devices: int, *,
                      path: str | None = None) -> Any:
    """``function(*args, **kwargs)`` (``"package.module:name"`` of this toolkit) in a child process with
    ``devices`` simulated CPU devices; ``path`` goes first on the child's ``sys.path``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(encode([function, args, kwargs, devices]), f)
        code = f"import sys; from {__name__} import child_main; sys.exit(child_main({src!r}, {dst!r}))"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{function} in a subprocess with {devices} simulated CPU devices failed "
                               f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(dst) as f:
            return decode(json.load(f))


def child_main(src: str, dst: str) -> int:
    """The child's side of :func:`call_with_devices`: read the call from ``src``, write its result to ``dst``."""
    with open(src) as f:
        function, args, kwargs, devices = decode(json.load(f))
    meshes.simulate_cpu_devices(devices)
    result = _toolkit_object(function)(*args, **kwargs)
    with open(dst, "w") as f:
        json.dump(encode(result), f)
    return 0


def import_root(target: str) -> str | None:
    """The sys.path entry this process imports ``target``'s top-level package (or module) from."""
    try:
        spec = importlib.util.find_spec(target.partition(":")[0].split(".")[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return os.path.dirname(list(spec.submodule_search_locations)[0])
    return os.path.dirname(spec.origin) if spec.origin else None


def _toolkit_object(name: str) -> Any:
    """The object ``"package.module:qualified.name"`` names, refused unless its module is this toolkit's."""
    module, _, qualname = name.partition(":")
    if not module.startswith(TOOLKIT):
        raise ValueError(f"refusing to rebuild {name!r}: not a name of this toolkit")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def encode(x: Any) -> Any:
    """``x`` as JSON-ready data: dataclasses by their type's name, tuples and dicts tagged."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        kind = f"{type(x).__module__}:{type(x).__qualname__}"
        return {"__dataclass__": kind, "fields": {f.name: encode(getattr(x, f.name))
                                                  for f in dataclasses.fields(x) if f.init}}
    if isinstance(x, tuple):
        return {"__tuple__": [encode(v) for v in x]}
    if isinstance(x, list):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise TypeError(f"cannot encode a dict with non-string keys: {list(x)[:3]}")
        return {"__dict__": {k: encode(v) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot encode {type(x).__name__} for the dry-run subprocess")


def decode(x: Any) -> Any:
    """The value :func:`encode` gave ``x`` for; only dataclasses of this toolkit are rebuilt."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(decode(v) for v in x["__tuple__"])
    if "__dict__" in x:
        return {k: decode(v) for k, v in x["__dict__"].items()}
    cls = _toolkit_object(x["__dataclass__"])
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{x['__dataclass__']!r} is not a dataclass")
    return cls(**{k: decode(v) for k, v in x["fields"].items()})
