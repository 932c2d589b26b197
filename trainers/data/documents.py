"""Document sources: JSONL, Parquet and Hugging Face datasets, read in blocks, never whole.

A source is a list of *blocks* (a JSONL byte range of about ``BLOCK_BYTES`` (1 MiB) cut at line starts, a
Parquet row group, ``HF_BLOCK_ROWS`` rows of a saved dataset); a block is read and tokenized only
when the stream reaches it, so memory holds one block whatever the corpus size. A record is one
document: ``text_field`` (default ``"text"``), or ``fields`` (e.g. ``("prompt", "response")``)
concatenated, every field but the last with loss weight 0; a field is text, or a list of token
ids (pre-tokenized: used as they are). Records are split train/validation by a
stable hash of ``file@offset``, the file relative to the corpus root, so a moved or remounted corpus
keeps its split (:func:`trainers.data.corpus.split_of`); a ``DatasetDict``, or files
named ``train*`` and ``validation*`` (or ``test*``), give their own splits. Bad input is a one-line ValueError
naming the file, the record and the field. See docs/data.md.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any

import numpy as np

from trainers.data import corpus as corpus_lib

FORMATS = ("jsonl", "parquet", "hf")
SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
BLOCK_BYTES = 1 << 20
HF_BLOCK_ROWS = 4096
HF_INSTALL = "pip install 'spmd[hf]' (or: pip install datasets)"


@dataclasses.dataclass(frozen=True)
class Block:
    """One unit of reading: ``file`` and, by format, a byte range, a row group, or a row range."""

    file: str
    start: int
    stop: int


def _arrow():
    import pyarrow.parquet as pq

    return pq


def _hf_load(path: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.corpus='hf' needs the Hugging Face datasets library; {HF_INSTALL}") from None
    try:
        return datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - the library raises several kinds for a folder it cannot read
        raise ValueError(f"data.path={path!r} is not a dataset saved with datasets.save_to_disk "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def resolve_files(fmt: str, path: str) -> list[str]:
    """The files of ``path`` (a file, a glob, or a folder searched for ``SUFFIXES[fmt]``), sorted."""
    p = os.path.expanduser(path)
    valid = f"a {fmt} file, a glob of them, or a folder holding files ending in {', '.join(SUFFIXES[fmt])}"
    if any(c in p for c in "*?["):
        files = sorted(f for f in glob.glob(p, recursive=True) if os.path.isfile(f))
    elif os.path.isdir(p):
        files = [os.path.join(p, f) for f in corpus_lib.text_files(p, SUFFIXES[fmt])]
    elif os.path.isfile(p):
        files = [p]
    else:
        raise ValueError(f"data.path={path!r} does not exist; data.corpus={fmt!r} reads {valid}")
    if not files:
        raise ValueError(f"data.path={path!r} matches no file; data.corpus={fmt!r} reads {valid}")
    return files


def corpus_root(fmt: str, path: str) -> str:
    """The folder record ids are relative to in the split hash: a folder itself, a file's folder, a
    glob's folder before its first wildcard, a saved dataset's own path."""
    p = os.path.expanduser(path)
    if fmt == "hf" or os.path.isdir(p):
        return p
    if any(c in p for c in "*?["):
        return os.path.dirname(re.split(r"[*?\[]", p, maxsplit=1)[0])
    return os.path.dirname(p)


class Documents:
    """The blocks of a document corpus and how to read their records (see the module docstring)."""

    def __init__(self, fmt: str, path: str, fields: tuple[str, ...]):
        if fmt not in FORMATS:
            raise ValueError(f"data.corpus={fmt!r} is not a document format; one of {FORMATS}")
        self.fmt, self.path, self.fields = fmt, path, tuple(fields)
        self._hf = None
        self.root = corpus_root(fmt, path)
        if fmt == "hf":
            self.files = [path]
        else:
            self.files = resolve_files(fmt, path)
        self.blocks = self._blocks()

    # ------------------------------------------------------------------------------ layout
    def _blocks(self) -> list[Block]:
        blocks = []
        if self.fmt == "jsonl":
            for f in self.files:
                size = os.path.getsize(f)
                if size == 0:
                    raise ValueError(f"data.path: {f!r} is an empty file; a JSONL file holds one JSON object per line")
                blocks += [Block(f, s, min(s + BLOCK_BYTES, size)) for s in range(0, size, BLOCK_BYTES)]
        elif self.fmt == "parquet":
            for f in self.files:
                meta = self._parquet(f).metadata
                if meta.num_rows == 0:
                    raise ValueError(f"data.path: {f!r} is a Parquet file with no rows")
                self._check_schema(f, self._parquet(f).schema_arrow)
                blocks += [Block(f, g, g + 1) for g in range(meta.num_row_groups)]
        else:
            for split in ("train", "validation"):
                ds = self.hf_split(split)
                if ds is None:
                    continue
                self._check_schema(self.path, ds.features.arrow_schema if hasattr(ds.features, "arrow_schema")
                                   else ds.data.schema)
                blocks += [Block(f"{self.path}#{split}", s, min(s + HF_BLOCK_ROWS, len(ds)))
                           for s in range(0, len(ds), HF_BLOCK_ROWS)]
        return blocks

    def _parquet(self, f: str):
        pq = _arrow()
        try:
            return pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError: not Parquet, truncated
            raise ValueError(f"data.path: {f!r} is not a Parquet file ({str(e).splitlines()[0]})") from None

    def _check_schema(self, f: str, schema) -> None:
        import pyarrow as pa

        for field in self.fields:
            if field not in schema.names:
                raise ValueError(f"data.path: {f!r} has no field {field!r} (it has {schema.names}); set "
                                 f"data.text_field or data.fields to fields it has")
            t = schema.field(field).type
            ids = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or ids):
                raise ValueError(f"data.path: {f!r} field {field!r} has type {t}, not string (text) or a list of "
                                 "integers (token ids)")

    def hf_split(self, split: str):
        """The saved dataset's split (a ``DatasetDict``'s own; a plain ``Dataset`` serves both)."""
        if self._hf is None:
            self._hf = _hf_load(self.path)
        ds: Any = self._hf
        if hasattr(ds, "keys"):  # DatasetDict
            names = list(ds.keys())
            if split == "train":
                return ds["train"] if "train" in ds else ds[names[0]]
            for name in ("validation", "valid", "test"):
                if name in ds:
                    return ds[name]
            return None
        return ds if split == "train" else None

    @property
    def hash_split(self) -> bool:
        """Whether records are split by hash: not for a DatasetDict with its own splits, nor for files
        named by split (``train*`` and ``validation*`` or ``test*``, as ``spmd-tokenize`` writes them)."""
        return not (self.fmt == "hf" and hasattr(self._hf, "keys")) and self._named_splits() is None

    def _named_splits(self) -> dict[str, set[str]] | None:
        if self.fmt == "hf":
            return None
        names = {f: os.path.basename(f) for f in self.files}
        train = {f for f, n in names.items() if n.startswith("train")}
        held = {f for f, n in names.items() if n.startswith(("validation", "valid", "test"))}
        return {"train": train, "validation": held} if train and held else None

    def blocks_of(self, split: str) -> list[Block]:
        """The blocks a split reads (with a hash split every block; records are filtered when read)."""
        if self.hash_split:
            return self.blocks
        named = self._named_splits()
        if named is not None:
            return [b for b in self.blocks if b.file in named[split]]
        return [b for b in self.blocks if b.file.endswith(f"#{split}")]

    # ------------------------------------------------------------------------------ reading
    def split_records(self, block: Block, split: str, validation_fraction: float
                      ) -> list[tuple[str, tuple[str, ...]]]:
        """The records of ``block`` in ``split``: all of them unless the split is by hash, then those
        whose id relative to the corpus root hashes into ``split``."""
        records = self.records(block)
        if not self.hash_split:
            return records
        n = len(os.path.join(self.root, "")) if self.root else 0
        return [r for r in records if corpus_lib.split_of(r[0][n:] if r[0].startswith(self.root) else r[0],
                                                          validation_fraction) == split]

    def records(self, block: Block) -> list[tuple[str, tuple[str, ...]]]:
        """``(record id, field values)`` of every record in ``block``, in file order."""
        if self.fmt == "jsonl":
            return self._jsonl(block)
        if self.fmt == "parquet":
            table = self._parquet(block.file).read_row_group(block.start, columns=list(self.fields))
            ids = [f"{block.file}@{block.start}:{r}" for r in range(table.num_rows)]
        else:
            split = block.file.rsplit("#", 1)[1]
            table = self.hf_split(split).data.slice(block.start, block.stop - block.start).select(list(self.fields))
            ids = [f"{block.file}@{block.start + r}" for r in range(table.num_rows)]
        columns = [_column(table.column(f)) for f in self.fields]
        out = []
        for r, rid in enumerate(ids):
            values = tuple(c[r] for c in columns)
            for field, v in zip(self.fields, values):
                if v is None:
                    raise ValueError(f"data.path: {rid} field {field!r} is null; every document needs text")
            out.append((rid, values))
        return out

    def _jsonl(self, block: Block) -> list[tuple[str, tuple[str, ...]]]:
        out = []
        with open(block.file, "rb") as f:
            if block.start:
                f.seek(block.start - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line that began in the previous block is that block's
            pos = f.tell()
            while pos < block.stop:
                line = f.readline()
                if not line:
                    break
                if line.strip():
                    out.append((f"{block.file}@{pos}", self._fields_of(block.file, pos, line)))
                pos += len(line)
        return out

    def _fields_of(self, file: str, pos: int, line: bytes) -> tuple[str, ...]:
        where = f"{file!r} at byte {pos}"
        try:
            record: Any = json.loads(line)
        except ValueError as e:
            raise ValueError(f"data.path: {where} is not a JSON line ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"data.path: {where} is a JSON {type(record).__name__}, not an object with field(s) "
                             f"{list(self.fields)}")
        values = []
        for field in self.fields:
            if field not in record:
                raise ValueError(f"data.path: {where} has no field {field!r} (it has {sorted(record)}); set "
                                 "data.text_field or data.fields to fields it has")
            value = record[field]
            if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                value = np.asarray(value, np.int64)  # token ids
            elif not isinstance(value, str):
                raise ValueError(f"data.path: {where} field {field!r} is a {type(value).__name__}, not a "
                                 "string (text) or a list of integers (token ids)")
            values.append(value)
        return tuple(values)


def _column(chunked) -> list:
    """A column's values: str for text, int64 arrays (views of the column's buffer) for token-id lists."""
    import pyarrow as pa

    if not (pa.types.is_list(chunked.type) or pa.types.is_large_list(chunked.type)):
        return chunked.to_pylist()
    out = []
    for chunk in chunked.chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        nulls = chunk.is_null().to_numpy(zero_copy_only=False)
        out += [None if nulls[r] else values[offsets[r]:offsets[r + 1]] for r in range(len(chunk))]
    return out


class Encoder:
    """Text fields -> ``(tokens, weights)`` of one document: the fields' tokens concatenated, then the
    end-of-document token; weight 0 on the tokens of every field but the last (a prompt), 1 on the
    rest (its response and the end token). Bytes (vocab 256, end token 0) or a tokenizer.json.
    Fields that are token ids (pre-tokenized) are used as stored, without an end token added."""

    def __init__(self, tokenizer: str = "", separator: str = ""):
        self.tok = None
        self.end = corpus_lib.DOCUMENT_END
        if tokenizer:
            from trainers.data import tokenizer as tok_lib

            self.tok, _ = tok_lib.load_tokenizer(tokenizer)
            _, sep = tok_lib.separator_id(self.tok, separator)
            self.end = sep

    def ids(self, text: str | np.ndarray) -> np.ndarray:
        if isinstance(text, np.ndarray):  # pre-tokenized
            return text.astype(np.int32, copy=False)
        if self.tok is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, np.int32)

    def __call__(self, values: tuple[str | np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        parts = [self.ids(v) for v in values]
        if self.end is not None and not all(isinstance(v, np.ndarray) for v in values):  # token ids: as stored
            parts.append(np.asarray([self.end], np.int32))
        tokens = np.concatenate(parts)
        weights = np.ones(tokens.shape, np.float32)
        weights[: sum(p.size for p in parts[: len(values) - 1])] = 0.0  # the prompt fields
        return tokens, weights
