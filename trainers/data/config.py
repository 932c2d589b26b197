"""Data settings: which corpus, how it is split, and how it is cut into global batches; the loader they make."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from trainers.data import checks
from trainers.data import corpus as corpus_lib
from trainers.data import packing as packing_lib
from trainers.data import pairs as pairs_lib
from trainers.data import prepare as prepare_lib
from trainers.data import tokenizer as tok_lib
from trainers.data.batches import process_rows
from trainers.data.loader import Loader

CORPORA = ("stdlib", "text", "npy", "synthetic", "tokens", "jsonl", "parquet", "hf")
DOCUMENT_CORPORA = ("jsonl", "parquet", "hf")  # documents, packed into rows (trainers.data.packing)
_PATH_CORPORA = ("text", "npy", "tokens", *DOCUMENT_CORPORA)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are cut into global batches.

    corpus: "stdlib" (default, no download) | "text" (file or folder at `path`)
        | "npy" (1-D token ids at `path`) | "synthetic" (random, benchmarks only)
        | "tokens" (a folder `spmd-tokenize` prepared at `path`, memory-mapped)
        | "jsonl" | "parquet" (files, a glob or a folder at `path`) | "hf" (a `datasets.save_to_disk` folder):
        documents, streamed in blocks and packed into rows (trainers.data.packing).
    text_field / fields: the document's text field, or "prompt,response"-style fields concatenated
        with every field but the last weighted 0 in the loss (fields overrides text_field).
    packing: "segments" (documents never attend across each other; the default for documents) | "concat".
    truncate: cut a document longer than seq_len (False: refuse it).
    tokenizer: a tokenizer.json that encodes the text corpora ("stdlib", "text"); "" = bytes.
        `vocab_size` must cover its vocab (it is never derived: the config says what it trains).
    separator: the token that ends each document with a tokenizer; "" = its end-of-text token.
    max_tokens: truncate each split (tiny runs); None keeps everything.
    synthetic_tokens: size of the synthetic train split.
    """

    corpus: str = "stdlib"
    path: str | None = None
    seq_len: int = 128
    global_batch: int = 16
    seed: int = 0
    validation_fraction: float = 0.05
    vocab_size: int = corpus_lib.BYTE_VOCAB_SIZE
    max_tokens: int | None = None
    synthetic_tokens: int = 1 << 20
    tokenizer: str = ""
    separator: str = ""
    text_field: str = "text"
    fields: str = ""
    packing: str = ""
    truncate: bool = True

    @property
    def field_names(self) -> tuple[str, ...]:
        """The record fields a document is made of."""
        return tuple(f.strip() for f in self.fields.split(",")) if self.fields else (self.text_field,)

    @property
    def packing_mode(self) -> str:
        """``packing`` made concrete: "segments" for document corpora, "concat" for token corpora."""
        return self.packing or ("segments" if self.corpus in DOCUMENT_CORPORA else "concat")

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.corpus in _PATH_CORPORA and not self.path:
            raise ValueError(f"corpus {self.corpus!r} needs a path to a file or folder, got path={self.path!r}")
        if self.corpus in ("stdlib", "synthetic") and self.path is not None:
            raise ValueError(f"path is only read by corpus 'text', 'npy' or 'tokens', got path={self.path!r} with corpus "
                             f"{self.corpus!r} (and by the document corpora {', '.join(DOCUMENT_CORPORA)})")
        self._check_documents()
        for name in ("seq_len", "global_batch", "vocab_size", "synthetic_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        self._check_source()
        if self.corpus in ("stdlib", "text", *DOCUMENT_CORPORA) and not self.tokenizer and \
                self.vocab_size < corpus_lib.BYTE_VOCAB_SIZE:
            raise ValueError(
                f"corpus {self.corpus!r} is byte-level and needs vocab_size >= "
                f"{corpus_lib.BYTE_VOCAB_SIZE}, got {self.vocab_size}"
            )

    def _check_source(self) -> None:
        """data.path, data.tokenizer and data.separator name things that exist and fit data.vocab_size."""
        if self.tokenizer and self.corpus not in ("stdlib", "text", "tokens", *DOCUMENT_CORPORA):
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is read only by corpus 'stdlib', 'text' or 'tokens', "
                             f"got corpus {self.corpus!r}; set data.tokenizer=''")
        if self.separator and not self.tokenizer and self.corpus != "tokens":
            raise ValueError(f"data.separator={self.separator!r} is read only with data.tokenizer; set data.tokenizer "
                             "to a tokenizer.json or data.separator=''")
        if self.corpus == "tokens":
            prepare_lib.check_tokens_dir(self.path, self.vocab_size, self.tokenizer, self.separator)
            return
        if self.corpus in ("text", "npy"):
            _check_path(self.corpus, self.path)
        if self.corpus in DOCUMENT_CORPORA:  # preference pairs (run.objective=dpo) pack as pairs
            (pairs_lib.check if pairs_lib.is_pairs(self.field_names) else packing_lib.check)(self)
        if self.tokenizer:
            tok, _ = tok_lib.load_tokenizer(self.tokenizer)
            tok_lib.separator_id(tok, self.separator)
            n = tok_lib.vocab_size_of(tok)
            if self.vocab_size < n:
                raise ValueError(f"data.vocab_size={self.vocab_size} does not cover the {n} tokens of data.tokenizer="
                                 f"{self.tokenizer!r}; set data.vocab_size and model.vocab_size to at least {n}")


    def _check_documents(self) -> None:
        if self.packing and self.packing not in packing_lib.PACKINGS:
            raise ValueError(f"data.packing={self.packing!r} is not one of {packing_lib.PACKINGS} ('' = segments for "
                             "document corpora)")
        if self.packing_mode == "segments" and self.corpus not in DOCUMENT_CORPORA:
            raise ValueError(f"data.packing='segments' needs a document corpus ({', '.join(DOCUMENT_CORPORA)}), got "
                             f"data.corpus={self.corpus!r}; set data.packing='concat' or ''")
        if not all(self.field_names) or not isinstance(self.truncate, bool):
            raise ValueError(f"data.fields={self.fields!r} / data.text_field={self.text_field!r} must name record fields "
                             f"(e.g. data.fields=prompt,response) and data.truncate must be true or false")


def _check_path(corpus: str, path: str) -> None:
    """A one-line ValueError naming data.path when it cannot hold corpus `corpus`."""
    p = os.path.expanduser(path)
    valid = ("a text file or a folder of files ending in " + ", ".join(corpus_lib.TEXT_SUFFIXES) if corpus == "text"
             else "a .npy file of 1-D token ids")
    if not os.path.exists(p):
        raise ValueError(f"data.path={path!r} does not exist; corpus {corpus!r} reads {valid}")
    if os.path.isfile(p) and os.path.getsize(p) == 0:
        raise ValueError(f"data.path={path!r} is an empty file; corpus {corpus!r} reads {valid}")
    if os.path.isdir(p) and (corpus == "npy" or not _has_text_file(p)):
        raise ValueError(f"data.path={path!r} is a folder with no {'text ' if corpus == 'text' else ''}files; "
                         f"corpus {corpus!r} reads {valid}")
    if corpus == "text":  # binary data read as bytes trains without a word: refuse it here
        checks.check_text_file(p) if os.path.isfile(p) else checks.check_text_files(p, corpus_lib.text_files(p))
    elif os.path.isfile(p):
        checks.check_npy_file(p)


def _has_text_file(root: str) -> bool:
    for _, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in corpus_lib._SKIPPED_DIRS]  # as the corpus walks
        if any(f.endswith(corpus_lib.TEXT_SUFFIXES) for f in filenames):
            return True
    return False


def load_corpus(cfg: DataConfig, split: str) -> np.ndarray:
    """The 1-D token array of one split of cfg's corpus."""
    if cfg.corpus in DOCUMENT_CORPORA:
        raise ValueError(f"data.corpus={cfg.corpus!r} is a corpus of documents, not one token array: read it with "
                         "trainers.data.packed_stream(cfg, split) (the built-in task does)")
    kw: dict[str, Any] = dict(validation_fraction=cfg.validation_fraction)
    if cfg.corpus == "tokens":
        return prepare_lib.tokens_corpus(cfg.path, split, max_tokens=cfg.max_tokens)
    if cfg.tokenizer:  # "stdlib" or "text", encoded with the tokenizer
        return tok_lib.tokenized_corpus(cfg.path, split, cfg.tokenizer, separator=cfg.separator,
                                        max_tokens=cfg.max_tokens, **kw)
    if cfg.corpus == "stdlib":
        return corpus_lib.stdlib_corpus(split, max_bytes=cfg.max_tokens, **kw)
    if cfg.corpus == "text":
        return corpus_lib.text_corpus(cfg.path, split, max_tokens=cfg.max_tokens, **kw)
    if cfg.corpus == "npy":
        return corpus_lib.npy_corpus(cfg.path, split, max_tokens=cfg.max_tokens, **kw)
    if split not in corpus_lib.SPLITS:
        raise ValueError(f"split must be one of {corpus_lib.SPLITS}, got {split!r}")
    # Synthetic validation: a separate stream (seed + 1), sized by validation_fraction.
    n = cfg.synthetic_tokens
    if split == "validation":
        n = max(int(n * cfg.validation_fraction), cfg.seq_len + 1)
    tokens = corpus_lib.synthetic_corpus(n, cfg.vocab_size, cfg.seed + (split == "validation"))
    return tokens[: cfg.max_tokens]


def make_loader(
    cfg: DataConfig,
    split: str,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
    shuffle: bool = True,
) -> Loader:
    """A Loader over one split of cfg's corpus, yielding the rows this process must feed.

    With ``sharding`` (the batch sharding), the rows are the ones this process's devices hold
    (:func:`process_rows`); otherwise block ``process_index`` of ``process_count`` (default: jax's).
    """
    if sharding is not None:
        if process_index is not None or process_count is not None:
            raise ValueError("give either sharding or process_index/process_count, not both")
        process_index, process_count = process_rows(sharding, cfg.global_batch)
    return Loader(
        load_corpus(cfg, split),
        cfg.seq_len,
        cfg.global_batch,
        cfg.seed,
        process_index=process_index,
        process_count=process_count,
        shuffle=shuffle,
    )
