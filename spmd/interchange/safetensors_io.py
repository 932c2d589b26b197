"""Safetensors folders: a lazy reader (one slice at a time, never a whole file) and a sharded writer.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file). Every file's header is checked against its size before
anything is read, so a truncated file is one message naming it, not a failure mid-load. Slices
are read with positioned reads of their rows (not a memory map), so a process's memory is what it
keeps, not the mapped pages of the files it touched; files are written with ``safetensors``.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")
NUMPY = {"F64": np.float64, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "I64": np.int64,
         "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _check_file(file: str) -> dict:
    """The header of ``file``, after checking that the file holds every byte it declares."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is truncated: {size} bytes, not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{file} is truncated: its header declares {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has an unreadable safetensors header: {e}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{file} is truncated: its tensors need {8 + n + end} bytes, the file has {size}")
    return header


class SafetensorsFolder:
    """The tensors of a folder: names, shapes and dtypes from the headers; :meth:`read` reads one slice."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
            weight_map = None
        if not files:
            raise ValueError(f"{path!r} holds no *.safetensors files")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._file_of: dict[str, str] = {}
        self._offset: dict[str, int] = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise ValueError(f"{INDEX} lists {name}, which is not in {path!r}")
            header = _check_file(file)
            with open(file, "rb") as f:
                start = 8 + struct.unpack("<Q", f.read(8))[0]
            for key, info in header.items():
                if key != "__metadata__":
                    self.shapes[key], self.dtypes[key], self._file_of[key] = tuple(info["shape"]), info["dtype"], file
                    self._offset[key] = start + info["data_offsets"][0]
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self._file_of)
            if missing:
                raise ValueError(f"{INDEX} lists tensors no file holds: {', '.join(missing[:5])}")
        self._open: dict[str, Any] = {}
        self.bytes_read = 0  # by read(), since construction

    def file_of(self, name: str) -> str:
        """The file that holds tensor ``name``."""
        return self._file_of[name]

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """``tensor[index]`` as numpy (bf16 as ``ml_dtypes.bfloat16``): the rows of the first dim's slice
        are read (one positioned read), the other dims sliced from them."""
        shape, kind = self.shapes[name], self.dtypes[name]
        if kind not in NUMPY:
            raise ValueError(f"tensor {name} has dtype {kind}, which this reader does not know ({sorted(NUMPY)})")
        dtype = np.dtype(NUMPY[kind])
        rows = index[0].indices(shape[0])[:2] if index and shape else (0, shape[0] if shape else 1)
        inner = shape[1:] if shape else ()
        buf = np.empty((rows[1] - rows[0], *inner) if shape else (), dtype)
        view = memoryview(buf.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # bytes: ml_dtypes have no buffer format
        if self._file_of[name] not in self._open:
            self._open[self._file_of[name]] = open(self._file_of[name], "rb", buffering=0)
        f = self._open[self._file_of[name]]
        offset, done = self._offset[name] + rows[0] * int(np.prod(inner, dtype=np.int64)) * dtype.itemsize, 0
        while done < len(view):
            n = os.preadv(f.fileno(), [view[done:]], offset + done)
            if n <= 0:
                raise ValueError(f"{self._file_of[name]} ended while reading tensor {name}")
            done += n
        self.bytes_read += done
        return buf[(slice(None), *index[1:])] if index and shape else buf

    def close(self) -> None:
        """Close the files opened by :meth:`read` (a later read opens them again)."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def nbytes(self) -> int:
        return sum(os.path.getsize(f) for f in set(self._file_of.values()))


def write_folder(path: str, tensors: Iterable[tuple[str, np.ndarray]], *, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write ``(name, array)`` pairs as safetensors shards of at most ``max_shard_bytes`` (one tensor may
    exceed it) plus ``model.safetensors.index.json``, or one ``model.safetensors``; returns the files.

    Holds at most one shard in memory: tensors stream in, a full shard is written and dropped."""
    os.makedirs(path, exist_ok=True)
    parts: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"part-{len(parts):05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            parts.append(name)
            weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for name, array in tensors:
        array = np.ascontiguousarray(array)
        if shard and size + array.nbytes > max_shard_bytes:
            flush()
        shard[name] = array
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(parts) == 1:
        os.replace(os.path.join(path, parts[0]), os.path.join(path, "model.safetensors"))
        return ["model.safetensors"]
    final = {p: f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i, p in enumerate(parts)}
    for old, new in final.items():
        os.replace(os.path.join(path, old), os.path.join(path, new))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}},
                  f, indent=2)
    return list(final.values())
