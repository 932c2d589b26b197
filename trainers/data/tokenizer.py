"""Subword tokenizers: a Hugging Face ``tokenizers`` tokenizer.json, loaded once, hashed, run over documents.

With ``data.tokenizer`` set, the text corpora (``stdlib``, ``text``) are encoded with it instead of
byte by byte; each document is followed by its end-of-text token (``data.separator``, or the first
of END_OF_TEXT the tokenizer has; none: documents are simply concatenated). See docs/data.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from trainers.data import corpus as corpus_lib

# Looked up in this order when no separator is named.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
ENCODE_BATCH = 64  # documents per encode_batch call (the library encodes a batch in parallel)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes: the identity of a tokenizer.json."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path), file_sha256(path)


def load_tokenizer(path: str | os.PathLike, key: str = "data.tokenizer"):
    """``(tokenizers.Tokenizer, sha256)`` of a tokenizer.json; a one-line ValueError naming ``key`` otherwise.

    Cached per file version (path, mtime, size): a config check and the corpus share one load.
    """
    p = Path(path).expanduser()
    valid = "a Hugging Face tokenizers tokenizer.json (tokenizers.Tokenizer.save)"
    if not p.is_file():
        what = "is a folder" if p.is_dir() else "does not exist"
        raise ValueError(f"{key}={str(path)!r} {what}; give {valid}")
    st = p.stat()
    try:
        return _load(str(p.resolve()), st.st_mtime_ns, st.st_size)
    except Exception as e:  # the library raises a bare Exception for a corrupt file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{key}={str(path)!r} is not a readable tokenizer ({reason}); give {valid}") from None


def vocab_size_of(tok) -> int:
    """Ids the tokenizer can emit: its vocab with the added (special) tokens."""
    return tok.get_vocab_size(with_added_tokens=True)


def separator_id(tok, separator: str = "", key: str = "data.separator") -> tuple[str, int | None]:
    """``(token, id)`` that ends each document: ``separator`` when given (it must be a token), else the
    first of END_OF_TEXT the tokenizer has, else ``("", None)``."""
    if separator:
        sid = tok.token_to_id(separator)
        if sid is None:
            special = [t for t in END_OF_TEXT if tok.token_to_id(t) is not None]
            added = sorted(t.content for t in tok.get_added_tokens_decoder().values())[:10]
            raise ValueError(f"{key}={separator!r} is not a token of the tokenizer; give one of its tokens, "
                             f"e.g. {(special or added)!r}, or '' for its end-of-text token")
        return separator, sid
    for token in END_OF_TEXT:
        sid = tok.token_to_id(token)
        if sid is not None:
            return token, sid
    return "", None


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 up to 65536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_text(path: Path) -> str:
    """A document's text; bytes that are not UTF-8 become U+FFFD."""
    return path.read_bytes().decode("utf-8", errors="replace")


def encode_documents(
    tok, paths: Sequence[Path], sep_id: int | None, dtype: np.dtype, on_batch: Callable[[int, int], None] | None = None
) -> Iterator[np.ndarray]:
    """Token ids of each batch of documents, each document followed by sep_id (when not None).

    ``on_batch(documents, tokens)`` is called after each batch (a progress bar).
    """
    for start in range(0, len(paths), ENCODE_BATCH):
        texts = [read_text(p) for p in paths[start : start + ENCODE_BATCH]]
        parts = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            if sep_id is not None:
                parts.append(np.asarray([sep_id], dtype=dtype))
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype)
        if on_batch is not None:
            on_batch(len(texts), ids.size)
        yield ids


def _concat(chunks: Iterator[np.ndarray], max_tokens: int | None, dtype: np.dtype) -> np.ndarray:
    parts, total = [], 0
    for ids in chunks:
        if max_tokens is not None and total >= max_tokens:
            break
        parts.append(ids)
        total += ids.size
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return tokens[:max_tokens] if max_tokens is not None else tokens


def tokenized_corpus(
    path: str | os.PathLike | None,
    split: str,
    tokenizer: str,
    *,
    separator: str = "",
    validation_fraction: float = 0.05,
    max_tokens: int | None = None,
) -> np.ndarray:
    """A text corpus (``path``; None: the Python stdlib) encoded with a tokenizer, split like the byte corpus:
    a folder by document (:func:`trainers.data.corpus.split_of`), a single file by token position."""
    corpus_lib._check_split(split, validation_fraction)
    tok, _ = load_tokenizer(tokenizer)
    _, sep = separator_id(tok, separator)
    dtype = token_dtype(vocab_size_of(tok))
    if path is None:
        root = corpus_lib.stdlib_root()
        files = list(corpus_lib.stdlib_files(split, validation_fraction=validation_fraction))
        what = f"the Python stdlib at {root}"
    else:
        root = Path(path).expanduser()
        if root.is_file():
            tokens = np.concatenate(list(encode_documents(tok, [root], sep, dtype)))
            tokens = corpus_lib._by_position(tokens, split, validation_fraction)[:max_tokens]
            hint = f"validation_fraction={validation_fraction} leaves nothing for it"
            return corpus_lib._nonempty(tokens, f"text file {str(root)!r}", split, hint)
        files = corpus_lib.split_files(corpus_lib.text_files(root), split, validation_fraction)
        what = f"text folder {str(root)!r}"
    tokens = _concat(encode_documents(tok, [root / f for f in files], sep, dtype), max_tokens, dtype)
    hint = f"validation_fraction={validation_fraction}; use more files or a larger validation_fraction"
    return corpus_lib._nonempty(tokens, what, split, hint)
