"""Corpora: where the token ids come from, as one flat 1-D array per split.

`stdlib_corpus` (the Python standard library's source, bytes, no download), `text_corpus`,
`npy_corpus` and `synthetic_corpus`. Splits are deterministic on every host. See docs/data.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation")
BYTE_VOCAB_SIZE = 256
DOCUMENT_END = 0  # the NUL byte: never valid inside Python source, rare in text
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".tex")
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def _check_split(split: str, validation_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction!r}")


def _check_max(max_tokens: int | None, name: str) -> None:
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"{name} must be a positive int or None, got {max_tokens!r}")


def split_of(relative_path: str, validation_fraction: float) -> str:
    """'train' or 'validation' for a document, from a stable hash of its relative path."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    return "validation" if u < validation_fraction else "train"


def split_files(relpaths: Sequence[str], split: str, validation_fraction: float) -> list[str]:
    """The documents of relpaths that fall in split (:func:`split_of`), in their order."""
    return [f for f in relpaths if split_of(f, validation_fraction) == split]


def text_files(root: str | os.PathLike, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[str]:
    """Relative POSIX paths of the text files under a folder (the documents of a text corpus), sorted."""
    return _walk(Path(root), suffixes)


def _walk(root: Path, suffixes: Sequence[str]) -> list[str]:
    """Relative POSIX paths of files under root with one of suffixes, sorted; skipped dirs pruned."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(tuple(suffixes)))
    return sorted(found)


def _concat_documents(root: Path, relpaths: Sequence[str], max_tokens: int | None) -> np.ndarray:
    """Bytes of each file followed by DOCUMENT_END; stops reading once max_tokens is reached."""
    parts, total = [], 0
    for rel in relpaths:
        if max_tokens is not None and total >= max_tokens:
            break
        data = (root / rel).read_bytes() + bytes([DOCUMENT_END])
        parts.append(data)
        total += len(data)
    tokens = np.frombuffer(b"".join(parts), dtype=np.uint8)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def _nonempty(tokens: np.ndarray, what: str, split: str, hint: str) -> np.ndarray:
    if tokens.size == 0:
        raise ValueError(f"empty corpus: {what} has no tokens in split {split!r}; {hint}")
    return tokens


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def stdlib_files(split: str = "train", *, validation_fraction: float = 0.05) -> tuple[str, ...]:
    """Relative paths of the stdlib `*.py` files in a split, in sorted order."""
    _check_split(split, validation_fraction)
    return tuple(p for p in _walk(stdlib_root(), (".py",)) if split_of(p, validation_fraction) == split)


@functools.lru_cache(maxsize=8)
def _stdlib_tokens(split: str, validation_fraction: float, max_bytes: int | None) -> np.ndarray:
    files = stdlib_files(split, validation_fraction=validation_fraction)
    tokens = _concat_documents(stdlib_root(), files, max_bytes)
    tokens.flags.writeable = False  # shared by every caller through the cache
    return tokens


def stdlib_corpus(
    split: str = "train", *, validation_fraction: float = 0.05, max_bytes: int | None = None
) -> np.ndarray:
    """Byte tokens (uint8) of the Python standard library's source; read once per process, then cached."""
    _check_split(split, validation_fraction)
    _check_max(max_bytes, "max_bytes")
    tokens = _stdlib_tokens(split, float(validation_fraction), max_bytes)
    return _nonempty(tokens, f"the Python stdlib at {stdlib_root()}", split, "no *.py files found there")


def _by_position(tokens: np.ndarray, split: str, validation_fraction: float) -> np.ndarray:
    cut = tokens.shape[0] - int(round(tokens.shape[0] * validation_fraction))
    return tokens[:cut] if split == "train" else tokens[cut:]


def _existing(path: str | os.PathLike, kind: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{kind} corpus path {str(p)!r} does not exist")
    return p


def text_corpus(
    path: str | os.PathLike,
    split: str = "train",
    *,
    validation_fraction: float = 0.05,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Byte tokens (uint8) of a text file (split by position) or a folder (split by file)."""
    _check_split(split, validation_fraction)
    _check_max(max_tokens, "max_tokens")
    p = _existing(path, "text")
    if p.is_file():
        if p.stat().st_size == 0:
            raise ValueError(f"empty corpus: text file {str(p)!r} has 0 bytes")
        tokens = _by_position(np.memmap(p, dtype=np.uint8, mode="r"), split, validation_fraction)
        hint = f"validation_fraction={validation_fraction} leaves nothing for it"
        return _nonempty(tokens[:max_tokens], f"text file {str(p)!r}", split, hint)
    files = _walk(p, suffixes)
    if not files:
        raise ValueError(f"empty corpus: no files with suffixes {tuple(suffixes)} under {str(p)!r}")
    chosen = split_files(files, split, validation_fraction)
    hint = (
        f"{len(files)} files are split by a hash of their path with validation_fraction="
        f"{validation_fraction}; use more files, a larger validation_fraction, or a single file "
        "(split by position)"
    )
    return _nonempty(_concat_documents(p, chosen, max_tokens), f"text folder {str(p)!r}", split, hint)


def npy_corpus(
    path: str | os.PathLike,
    split: str = "train",
    *,
    validation_fraction: float = 0.05,
    max_tokens: int | None = None,
) -> np.ndarray:
    """Token ids from a 1-D integer `.npy`, memory-mapped and split by position."""
    _check_split(split, validation_fraction)
    _check_max(max_tokens, "max_tokens")
    p = _existing(path, "npy")
    tokens = np.load(p, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"npy corpus {str(p)!r} must hold a 1-D integer array of token ids, "
            f"got shape {tokens.shape} dtype {tokens.dtype}"
        )
    hint = f"the file holds {tokens.shape[0]} tokens and validation_fraction={validation_fraction}"
    return _nonempty(_by_position(tokens, split, validation_fraction)[:max_tokens], f"npy file {str(p)!r}", split, hint)


def synthetic_corpus(n_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """Uniform random int32 token ids: for throughput benchmarks only, there is nothing to learn."""
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return np.random.default_rng(seed).integers(0, vocab_size, size=n_tokens, dtype=np.int32)
