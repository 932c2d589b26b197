"""Pre-tokenized corpora: a text folder encoded once into one memory-mapped token file per split.

    DIR/train.bin          the train split's token ids, raw little-endian uint16 (vocab <= 65536) or uint32
    DIR/train.json         {"format", "version", "split", "dtype", "count", "vocab_size", "tokenizer_sha256",
                            "separator", "validation_fraction", "source", "files", ...}
    DIR/validation.bin     the same for the validation split
    DIR/validation.json

:func:`prepare` writes them (``spmd-tokenize``); :func:`tokens_corpus` reads a split as an ``np.memmap``,
so training (and every resume) reads the same bytes and never tokenizes. Splits are the byte-level
text corpus's: a folder by document, a single file by token position. See docs/data.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainers.data import corpus as corpus_lib
from trainers.data import tokenizer as tok_lib

FORMAT, VERSION = "spmd-tokens", 1
PREPARE = "spmd-tokenize SOURCE --tokenizer tokenizer.json --out DIR"


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)  # a reader never sees half a file; an open memmap keeps the old inode


def prepare(
    source: str | os.PathLike,
    tokenizer: str | os.PathLike,
    out: str | os.PathLike,
    *,
    validation_fraction: float = 0.05,
    separator: str = "",
    suffixes: Sequence[str] = corpus_lib.TEXT_SUFFIXES,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Encode a text folder (or file) with a tokenizer.json into DIR/{split}.bin + DIR/{split}.json.

    Returns the metadata of each split. Errors are one-line ValueErrors naming the argument.
    """
    from tqdm.auto import tqdm

    corpus_lib._check_split("train", validation_fraction)
    src = Path(source).expanduser()
    if not src.exists():
        raise ValueError(f"SOURCE={str(source)!r} does not exist; give a text file or a folder of text files")
    tok, sha = tok_lib.load_tokenizer(tokenizer, key="--tokenizer")
    sep_token, sep = tok_lib.separator_id(tok, separator, key="--separator")
    vocab = tok_lib.vocab_size_of(tok)
    dtype = tok_lib.token_dtype(vocab)
    if src.is_file():
        if src.stat().st_size == 0:
            raise ValueError(f"SOURCE={str(source)!r} is an empty file; give a text file with content or a folder")
        root, by_split = src.parent, {s: [src.name] for s in corpus_lib.SPLITS}
    else:
        files = corpus_lib.text_files(src, suffixes)
        if not files:
            raise ValueError(f"SOURCE={str(source)!r} holds no text files; give a folder with files ending in "
                             f"{', '.join(suffixes)}")
        root, by_split = src, {s: corpus_lib.split_files(files, s, validation_fraction) for s in corpus_lib.SPLITS}
    out_dir = Path(out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    total = sum(len(v) for v in by_split.values()) // (2 if src.is_file() else 1)
    bar = tqdm(total=total, unit="file", desc=f"tokenize {src.name}", disable=not progress)
    tokens_of_file = None
    if src.is_file():  # one document: encode once, split by token position
        tokens_of_file = np.concatenate(list(tok_lib.encode_documents(tok, [src], sep, dtype)))
        bar.update(1)
    metas = {}
    for split, names in by_split.items():
        count = 0

        def write(f, names=names):
            nonlocal count
            if tokens_of_file is not None:
                ids = corpus_lib._by_position(tokens_of_file, split, validation_fraction)
                f.write(ids.astype("<" + dtype.str[1:]).tobytes())
                count = ids.size
                return
            for ids in tok_lib.encode_documents(tok, [root / n for n in names], sep, dtype,
                                                on_batch=lambda docs, n: bar.update(docs)):
                f.write(ids.astype("<" + dtype.str[1:]).tobytes())
                count += ids.size

        _write_atomic(out_dir / f"{split}.bin", write)
        meta = dict(format=FORMAT, version=VERSION, split=split, dtype=dtype.name, count=count, vocab_size=vocab,
                    tokenizer=str(Path(tokenizer).expanduser().resolve()), tokenizer_sha256=sha,
                    separator=sep_token, separator_id=sep, validation_fraction=validation_fraction,
                    source=str(src.resolve()), files=list(names))
        _write_atomic(out_dir / f"{split}.json", lambda f, m=meta: f.write(json.dumps(m, indent=1).encode()))
        metas[split] = meta
    bar.close()
    return metas


def read_meta(path: str | os.PathLike, split: str = "train", key: str = "data.path") -> dict[str, Any]:
    """The metadata of one split of a prepared folder; a one-line ValueError naming ``key`` otherwise."""
    p = Path(path).expanduser()
    hint = f"give a folder made by `{PREPARE}`"
    if not p.is_dir():
        raise ValueError(f"{key}={str(path)!r} {'is a file' if p.exists() else 'does not exist'}; {hint}")
    meta_path = p / f"{split}.json"
    if not meta_path.is_file():
        raise ValueError(f"{key}={str(path)!r} has no {split}.json, it is not a prepared token folder; {hint}")
    try:
        meta = json.loads(meta_path.read_text())
        ok = meta.get("format") == FORMAT and isinstance(meta.get("count"), int) and "dtype" in meta
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"{key}={str(path)!r}: {split}.json is not {FORMAT} metadata; {hint}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{key}={str(path)!r} is {FORMAT} version {meta.get('version')}, this reader knows "
                         f"version {VERSION}; prepare it again with `{PREPARE}`")
    return meta


def check_tokens_dir(path: str, vocab_size: int, tokenizer: str = "", separator: str = "") -> None:
    """A prepared folder matches the config: its vocab fits data.vocab_size, and data.tokenizer /
    data.separator, when given, are the ones it was made with (a one-line ValueError otherwise)."""
    for split in corpus_lib.SPLITS:
        meta = read_meta(path, split)
        if meta["vocab_size"] > vocab_size:
            raise ValueError(f"data.vocab_size={vocab_size} does not cover the {meta['vocab_size']} tokens of the "
                             f"tokenizer data.path={path!r} was made with; set data.vocab_size and model.vocab_size "
                             f"to at least {meta['vocab_size']}")
        if tokenizer:
            _, sha = tok_lib.load_tokenizer(tokenizer)
            if sha != meta["tokenizer_sha256"]:
                raise ValueError(f"data.tokenizer={tokenizer!r} (sha256 {sha[:12]}) is not the tokenizer data.path="
                                 f"{path!r} was made with ({meta['tokenizer']}, sha256 "
                                 f"{meta['tokenizer_sha256'][:12]}); give that one, '' to trust the folder, or "
                                 "prepare the folder again")
        if separator and separator != meta["separator"]:
            raise ValueError(f"data.separator={separator!r} differs from {meta['separator']!r}, the separator "
                             f"data.path={path!r} was made with; give that one, or '' to trust the folder")


def tokens_corpus(path: str | os.PathLike, split: str = "train", *, max_tokens: int | None = None) -> np.ndarray:
    """One split of a prepared folder as a read-only ``np.memmap`` (never read whole, never re-tokenized)."""
    corpus_lib._check_split(split, 0.0)
    corpus_lib._check_max(max_tokens, "max_tokens")
    meta = read_meta(path, split)
    bin_path = Path(path).expanduser() / f"{split}.bin"
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    size = bin_path.stat().st_size if bin_path.is_file() else -1
    if size != meta["count"] * dtype.itemsize:
        raise ValueError(f"data.path={str(path)!r}: {split}.bin holds {size} bytes, {split}.json says "
                         f"{meta['count']} x {dtype.name}; prepare it again with `{PREPARE}`")
    if meta["count"] == 0:
        raise ValueError(f"empty corpus: data.path={str(path)!r} has no tokens in split {split!r}; prepare it "
                         "with more files or a larger --validation-fraction")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(meta["count"],))
    return tokens[:max_tokens]
