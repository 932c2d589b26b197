"""What a run read, by content: each data file's size and a hash of its first and last block.

    record(run_dir, cfg.data)                  # <run_dir>/data_manifest.json, written with config.json
    changed = differences(run_dir, cfg.data)   # on resume: [] when the files are the same bytes

A resume is refused when the data it would read is not the data its checkpoints point into: a file
rewritten in place (another size, or other bytes at either end), added or removed. The same files by
another path (``data.path`` absolute where the run had it relative, a copy on another disk) are the same
data. Files are named relative to the corpus's folder (:func:`trainers.data.documents.corpus_root`), so
where that folder lies does not matter. Reading two blocks per file keeps this cheap for any corpus size;
an edit that changes neither end nor the size is not seen.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import Any

BLOCK = 1 << 16  # bytes hashed at each end of a file
MANIFEST_FILE = "data_manifest.json"
_PATH_CORPORA = ("text", "npy", "tokens", "jsonl", "parquet", "hf")


def files_of(cfg: Any) -> tuple[str, list[str]] | None:
    """``(root, files)`` the corpus of a ``DataConfig`` reads (None for corpora without a path); files
    are paths, ``root`` the folder they are named relative to."""
    if cfg.corpus not in _PATH_CORPORA or not cfg.path:
        return None
    from trainers.data.corpus import text_files
    from trainers.data.documents import corpus_root, resolve_files

    p = os.path.expanduser(cfg.path)
    root = corpus_root("jsonl", p) if cfg.corpus != "hf" else p
    if cfg.corpus in ("jsonl", "parquet"):  # the files the corpus reads, as it finds them
        try:
            return root, sorted(resolve_files(cfg.corpus, p))
        except ValueError:  # no such path: the corpus's own check says so
            return root, []
    if cfg.corpus == "text" and os.path.isdir(p):
        return root, [os.path.join(p, f) for f in text_files(p)]
    if any(c in p for c in "*?["):
        files = [f for f in glob.glob(p, recursive=True) if os.path.isfile(f)]
    elif os.path.isdir(p):
        files = [os.path.join(d, f) for d, dirs, names in os.walk(p) for f in names if not f.startswith(".")]
    else:
        files = [p] if os.path.isfile(p) else []
    return root, sorted(files)


def _digest(f, offset: int, size: int) -> str:
    f.seek(offset)
    return hashlib.sha256(f.read(size)).hexdigest()[:32]


def manifest(cfg: Any) -> dict[str, Any] | None:
    """``{"corpus": ..., "files": {name: {"size", "head", "tail"}}}`` of a ``DataConfig``'s files (None
    for corpora without a path)."""
    found = files_of(cfg)
    if found is None:
        return None
    root, files = found
    entries = {}
    for path in files:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            entries[os.path.relpath(path, root).replace(os.sep, "/")] = {
                "size": size, "head": _digest(f, 0, BLOCK), "tail": _digest(f, max(size - BLOCK, 0), BLOCK)}
    return {"corpus": cfg.corpus, "files": entries}


def record(run_dir: str, cfg: Any) -> None:
    """Write the manifest of ``cfg``'s data into ``run_dir`` (nothing for corpora without a path)."""
    current = manifest(cfg)
    path = os.path.join(run_dir, MANIFEST_FILE)
    if current is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(current, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def recorded(run_dir: str) -> dict[str, Any] | None:
    """The manifest ``run_dir`` holds, or None (a run written before manifests, or without a data path)."""
    try:
        with open(os.path.join(run_dir, MANIFEST_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def differences(old: dict[str, Any], cfg: Any) -> list[str]:
    """What differs between a recorded manifest and ``cfg``'s data now, one phrase per file; [] when the
    same files hold the same bytes (by size and both ends)."""
    new = manifest(cfg) or {"files": {}}
    a, b = old.get("files", {}), new["files"]
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"{name} is gone")
        elif name not in a:
            out.append(f"{name} is new")
        elif a[name]["size"] != b[name]["size"]:
            out.append(f"{name} changed ({a[name]['size']} -> {b[name]['size']} bytes)")
        elif (a[name]["head"], a[name]["tail"]) != (b[name]["head"], b[name]["tail"]):
            out.append(f"{name} changed (same size, other bytes)")
    return out
