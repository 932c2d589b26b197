"""Data checked against the model before anything compiles: token ids inside the vocab, text that is
text, a corpus with at least one global batch of windows.

Every corpus kind goes through :func:`check_token_ids` (the built-in task calls it on each split),
the pre-tokenized fields of a document corpus through :func:`check_document_ids`;
a user task that declares ``Task.vocab_size`` has each batch's integer token leaves checked by
:func:`check_batch_ids`. Each check raises ValueError naming the value, the config key and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_SNIFF_BYTES = 1 << 13  # how much of a text file is read to tell text from binary (random bytes: P(no NUL) ~ 1e-14)
_CHUNK = 1 << 24  # token ids scanned per block (a memory-mapped corpus is never read whole)


def check_token_ids(tokens: np.ndarray, vocab_size: int, *, what: str, key: str = "data.vocab_size") -> None:
    """ValueError unless ``tokens`` is a 1-D integer array with every id in ``[0, vocab_size)``.

    ``what`` names the data (e.g. ``"npy file 'x.npy' (train split)"``); ``key`` the config key the
    vocab comes from. Scans in blocks, so a memory-mapped corpus is read once and never copied.
    """
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{what} holds {tokens.dtype} values; token ids must be integers (e.g. int32, uint16)")
    if tokens.size == 0 or (np.issubdtype(tokens.dtype, np.unsignedinteger) and np.iinfo(tokens.dtype).max < vocab_size):
        return  # e.g. bytes (uint8) under a vocab of 256: nothing to scan
    lo, hi = None, None
    flat = tokens.reshape(-1)
    for start in range(0, flat.shape[0], _CHUNK):
        block = np.asarray(flat[start:start + _CHUNK])
        b_lo, b_hi = int(block.min()), int(block.max())
        lo = b_lo if lo is None else min(lo, b_lo)
        hi = b_hi if hi is None else max(hi, b_hi)
    if lo >= 0 and hi < vocab_size:
        return
    bad = int(np.count_nonzero((flat < 0) | (flat >= vocab_size))) if flat.shape[0] <= 1 << 28 else -1
    first = int(np.argmax((flat < 0) | (flat >= vocab_size))) if bad else 0
    count = f"{bad:,} of {flat.shape[0]:,} ids" if bad >= 0 else "some ids"
    raise ValueError(
        f"{what} holds token ids in [{lo}, {hi}] but {key}={vocab_size} allows only [0, {vocab_size - 1}]: {count} "
        f"are outside (first at position {first}, value {int(flat[first])}). An id outside the vocab indexes past "
        f"the embedding table (NaN or garbage loss). Fix the data, or set {key} (and model.vocab_size) to at least "
        f"{hi + 1}" + (" (negative ids are never valid)" if lo < 0 else "")
    )


def check_batch_ids(batch: Mapping[str, Any], vocab_size: int, keys: Sequence[str], *, where: str) -> None:
    """ValueError unless the integer leaves ``batch[k]`` for ``k`` in ``keys`` are ids in ``[0, vocab_size)``
    (a user task that declares ``Task.vocab_size``; ``where`` says which batch)."""
    for k in keys:
        if not isinstance(batch, Mapping) or k not in batch:
            continue
        x = np.asarray(batch[k])
        if np.issubdtype(x.dtype, np.integer):
            check_token_ids(x, vocab_size, what=f"{where}: batch[{k!r}]", key="Task.vocab_size")


def check_text_file(path: str | os.PathLike, key: str = "data.path") -> None:
    """ValueError when ``path`` is binary: a NUL byte in its first 8 KiB (text in any encoding but
    UTF-16/32 has none; compressed, image, array and executable files almost always do)."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    nul = head.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"{key}={str(path)!r} is not a text file (a NUL byte at offset {nul}: binary data); corpus "
                         "'text' and spmd-tokenize read text. Token ids belong in a .npy file (data.corpus=npy) or a "
                         "spmd-tokenize folder (data.corpus=tokens); UTF-16 text must be converted to UTF-8 first")


def check_npy_file(path: str | os.PathLike, key: str = "data.path") -> None:
    """ValueError when ``path`` is not a ``.npy`` file (its first bytes are not numpy's magic string)."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head != b"\x93NUMPY":
        kind = "text" if head and all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "not numpy"
        raise ValueError(f"{key}={str(path)!r} is not a .npy file (it starts {head!r}: {kind}); corpus 'npy' reads a "
                         "1-D integer array saved with numpy.save. For a text file use data.corpus=text")


def check_text_files(root: str | os.PathLike, relpaths: Sequence[str], key: str = "data.path", limit: int = 64) -> None:
    """:func:`check_text_file` on the first ``limit`` files of a text folder (``relpaths`` under ``root``)."""
    for rel in list(relpaths)[:limit]:
        check_text_file(os.path.join(root, rel), key=f"{key} (file {rel!r})")


def check_windows(n_windows: int, global_batch: int, seq_len: int, n_tokens: int, *, what: str) -> None:
    """ValueError when one global batch needs more windows than the corpus has (every step would repeat rows)."""
    if n_windows < global_batch:
        raise ValueError(
            f"data.global_batch={global_batch} needs {global_batch} windows of seq_len + 1 = {seq_len + 1} tokens per "
            f"step, but {what} has {n_tokens:,} tokens: {n_windows} windows. Lower data.global_batch to at most "
            f"{max(n_windows, 1)} or data.seq_len, or use a larger corpus (data.max_tokens, data.validation_fraction)"
        )


def check_examples(n_examples: int, global_batch: int, *, what: str = "the task's data") -> None:
    """ValueError when a random-access source has fewer examples than one global batch (each batch would
    hold some examples twice)."""
    if n_examples < global_batch:
        raise ValueError(f"{what} has {n_examples} examples, fewer than data.global_batch={global_batch}: every batch "
                         f"would repeat some of them. Lower data.global_batch to at most {max(n_examples, 1)} (a "
                         "multiple of the batch-sharding devices) or give more examples")


def check_document_ids(docs: Any, vocab_size: int, *, key: str = "data.vocab_size") -> None:
    """ValueError unless every pre-tokenized field (a list of token ids) of every record of ``docs`` (a
    :class:`trainers.data.documents.Documents`, both splits) holds ids in ``[0, vocab_size)``; the message
    names the file, the record, the field, the value and the valid range. Text fields are checked by
    the tokenizer's vocab (``DataConfig``). A Parquet or saved dataset's id columns are scanned whole
    (one column at a time); a JSONL file is read in blocks, and only lines holding a ``[`` are parsed."""
    if docs.fmt == "jsonl":
        for file in docs.files:
            _check_jsonl_ids(file, docs.fields, vocab_size, key)
        return
    import pyarrow as pa

    def scan(column, where: str, field: str, first_row: int) -> None:
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            return  # text
        row = first_row
        for chunk in column.chunks:
            offsets = chunk.offsets.to_numpy()
            values = chunk.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
            bad = (values < 0) | (values >= vocab_size)
            if values.size and bad.any():
                first = int(np.argmax(bad))
                r = row + int(np.searchsorted(offsets, offsets[0] + first, side="right")) - 1
                _refuse_ids(f"{where} row {r} field {field!r}", int(values[first]),
                            f"{int(np.count_nonzero(bad)):,} of the {values.size:,} ids of that field there", vocab_size, key)
            row += len(chunk)

    if docs.fmt == "parquet":
        for file in docs.files:
            pf = docs._parquet(file)
            row = 0
            for g in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(g, columns=list(docs.fields))
                for field in docs.fields:
                    scan(table.column(field), repr(file), field, row)
                row += table.num_rows
        return
    for split in ("train", "validation"):
        ds = docs.hf_split(split)
        if ds is not None:
            for field in docs.fields:
                scan(ds.data.column(field), f"{docs.path!r} ({split} split)", field, 0)


def _check_jsonl_ids(file: str, fields: Sequence[str], vocab_size: int, key: str, block: int = 1 << 24) -> None:
    import json

    with open(file, "rb") as f:
        pos, rest = 0, b""
        while True:
            data = f.read(block)
            buf = rest + data
            cut = len(buf) if not data else buf.rfind(b"\n") + 1
            lines, rest = buf[:cut], buf[cut:]
            if b"[" in lines:
                at = pos
                for line in lines.split(b"\n"):
                    if b"[" in line:
                        try:
                            record = json.loads(line)
                        except ValueError:
                            record = None  # the reader names a line that is not JSON
                        for field in fields if isinstance(record, dict) else ():
                            ids = record.get(field)
                            if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                                     for t in ids):
                                arr = np.asarray(ids, np.int64)
                                bad = (arr < 0) | (arr >= vocab_size)
                                if bad.any():
                                    _refuse_ids(f"{file!r} at byte {at} field {field!r}", int(arr[np.argmax(bad)]),
                                                f"{int(np.count_nonzero(bad)):,} of its {arr.size:,} ids", vocab_size, key)
                    at += len(line) + 1
            pos += len(lines)
            if not data:
                return


def _refuse_ids(where: str, value: int, count: str, vocab_size: int, key: str) -> None:
    fix = ("negative ids are never valid; fix the data" if value < 0 else
           f"fix the data, or set {key} (and model.vocab_size) to at least {value + 1}")
    raise ValueError(f"data.path: {where} holds token id {value}, outside the valid range [0, {vocab_size}) of "
                     f"{key}={vocab_size} ({count} are outside). An id outside the vocab indexes "
                     f"past the embedding table (NaN or garbage loss): {fix}")
