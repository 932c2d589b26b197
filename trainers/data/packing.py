"""Packing documents into rows: segment ids, per-document positions and loss weights.

    it = iter(packed_stream(cfg.data, "train").for_process(p, P))   # this process's rows of each global batch
    next(it)   # {"inputs", "targets", "segment_ids", "positions", "weights"}: int32/f32 [B/P, L]

``packing="segments"``: whole documents in stream order while they fit a row of L (a longer one is
cut, or refused with ``truncate=False``), numbered 1, 2, ..., positions restarting at 0, the rest
padding (one more id, weight 0). ``packing="concat"``: the documents end to end in windows of L + 1.
Epoch e reads the blocks in an order seeded by (seed, e), each block's documents in one seeded by
(seed, e, block); process p reads blocks p, p + P, ... The position (epoch, block, document, offset)
is the iterator's state: resuming is exact and reads only the block it resumes in. See docs/data.md.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

from trainers.data import corpus as corpus_lib
from trainers.data.documents import Documents, Encoder
from trainers.data.loader import _grain_seed

PACKINGS = ("segments", "concat")


class PackedStream:
    """An iterable of this process's batches of packed rows (see the module docstring)."""

    def __init__(self, docs: Documents, encoder: Encoder, split: str, *, seq_len: int, global_batch: int,
                 seed: int = 0, packing: str = "segments", truncate: bool = True, validation_fraction: float = 0.05,
                 shuffle: bool = True, repeat: bool = True, weights: bool | None = None,
                 process_index: int = 0, process_count: int = 1):
        if packing not in PACKINGS:
            raise ValueError(f"data.packing={packing!r} is not one of {PACKINGS}")
        if global_batch % process_count:
            raise ValueError(f"global_batch={global_batch} is not divisible by {process_count} processes")
        self.docs, self.encoder, self.split = docs, encoder, split
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.packing, self.truncate, self.validation_fraction = packing, truncate, validation_fraction
        self.shuffle, self.repeat = shuffle, repeat
        self.weights = len(docs.fields) > 1 if weights is None else weights
        self.process_index, self.process_count = process_index, process_count
        self.blocks = docs.blocks_of(split)
        if not self.blocks:
            raise ValueError(f"data.path={docs.path!r} has no {split} split")

    def for_process(self, process_index: int, process_count: int) -> PackedStream:
        """This stream as process ``process_index`` of ``process_count`` reads it."""
        other = copy.copy(self)
        PackedStream.__init__(other, self.docs, self.encoder, self.split, seq_len=self.seq_len,
                              global_batch=self.global_batch, seed=self.seed, packing=self.packing,
                              truncate=self.truncate, validation_fraction=self.validation_fraction,
                              shuffle=self.shuffle, repeat=self.repeat, weights=self.weights,
                              process_index=process_index, process_count=process_count)
        return other

    def __iter__(self) -> PackedIterator:
        return PackedIterator(self)

    def block_order(self, epoch: int) -> list[int]:
        """The blocks this process reads in ``epoch``, in order."""
        n = len(self.blocks)
        order = (np.random.default_rng([_grain_seed(self.seed), epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        if n >= self.process_count:
            order = order[self.process_index :: self.process_count]
        return [int(i) for i in order]

    def documents(self, epoch: int, block: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(inputs, targets, target weights)`` of this process's documents of one block, in epoch order."""
        records = self.docs.records(self.blocks[block])
        if self.docs.hash_split:
            records = [r for r in records if corpus_lib.split_of(r[0], self.validation_fraction) == self.split]
        if len(self.blocks) < self.process_count:
            records = records[self.process_index :: self.process_count]
        if self.shuffle:
            records = [records[i] for i in np.random.default_rng([_grain_seed(self.seed), epoch, block]).permutation(
                len(records))]
        out = []
        for rid, values in records:
            tokens, weights = self.encoder(values)
            if tokens.size - 1 > self.seq_len and self.packing == "segments":
                if not self.truncate:
                    raise ValueError(f"data.path: document {rid} has {tokens.size - 1} tokens to predict, more than "
                                     f"data.seq_len={self.seq_len} (field(s) {list(self.docs.fields)}); set "
                                     "data.truncate=true to cut it, or a larger data.seq_len")
                tokens, weights = tokens[: self.seq_len + 1], weights[: self.seq_len + 1]
            if tokens.size > 1:
                out.append((tokens[:-1], tokens[1:], weights[1:]))
        return out


class PackedIterator(Iterator[dict[str, np.ndarray]]):
    """Batches of ``global_batch / process_count`` rows; ``get_state``/``set_state`` give the exact position."""

    def __init__(self, stream: PackedStream):
        self.s = stream
        self.epoch, self.block, self.doc, self.offset = 0, 0, 0, 0
        self._cache: tuple[tuple[int, int], list] | None = None
        self._found = False  # a document was found in this epoch (a resumed epoch counts as found)
        self.padding, self.slots, self.documents_read = 0, 0, 0

    # -------------------------------------------------------------------- position
    def _docs(self) -> list | None:
        """The documents of the block at the position (None: the data ended, repeat=False)."""
        while True:
            order = self.s.block_order(self.epoch)
            if self.block >= len(order):
                if not self.s.repeat:
                    return None
                if not self._found:  # a whole epoch without one document
                    raise ValueError(f"data.path={self.s.docs.path!r}: process {self.s.process_index} of "
                                     f"{self.s.process_count} has no document of split {self.s.split!r} to read")
                self.epoch, self.block, self.doc, self._found = self.epoch + 1, 0, 0, False
                continue
            docs = self._block_docs(self.epoch, order[self.block])
            if self.doc < len(docs):
                self._found = True
                return docs
            self.block, self.doc, self.offset = self.block + 1, 0, 0

    def _block_docs(self, epoch: int, block: int) -> list:
        if self._cache is None or self._cache[0] != (epoch, block):
            self._cache = ((epoch, block), self.s.documents(epoch, block))
        return self._cache[1]

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "block": self.block, "doc": self.doc, "offset": self.offset,
                "seed": self.s.seed, "seq_len": self.s.seq_len, "blocks": len(self.s.blocks),
                "packing": self.s.packing, "process": [self.s.process_index, self.s.process_count]}

    def set_state(self, state: dict[str, Any]) -> None:
        mine = self.get_state()
        for key in ("seed", "seq_len", "blocks", "packing", "process"):
            if list(np.atleast_1d(state.get(key))) != list(np.atleast_1d(mine[key])):
                raise ValueError(f"packed loader state has {key}={state.get(key)!r} but this loader has "
                                 f"{key}={mine[key]!r}; resume with the same data config and process count")
        self.epoch, self.block, self.doc, self.offset = (int(state[k]) for k in ("epoch", "block", "doc", "offset"))
        self._found = True

    # -------------------------------------------------------------------- rows
    def __iter__(self) -> PackedIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        b = self.s.global_batch // self.s.process_count
        rows, ended = [], False
        for _ in range(b):
            row = None if ended else (self._segment_row() if self.s.packing == "segments" else self._concat_row())
            ended = ended or row is None
            rows.append(row if row is not None else self._empty_row())
        if ended and all(r["weights"].sum() == 0 and r["inputs"].sum() == 0 for r in rows):
            raise StopIteration
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        if self.s.packing == "concat" and not self.s.weights:
            batch = {"inputs": batch["inputs"], "targets": batch["targets"]}
        return batch

    @property
    def padding_fraction(self) -> float:
        """Padding positions / all positions of the rows made so far."""
        return self.padding / max(self.slots, 1)

    def _empty_row(self) -> dict[str, np.ndarray]:
        L = self.s.seq_len
        return {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32), "segment_ids": np.ones(L, np.int32), "positions": np.arange(L, dtype=np.int32),
                "weights": np.zeros(L, np.float32)}

    def _segment_row(self) -> dict[str, np.ndarray] | None:
        L = self.s.seq_len
        row = self._empty_row()
        seg = np.zeros(L, np.int32)
        pos = np.zeros(L, np.int32)
        o = n_docs = 0
        while o < L:
            docs = self._docs()
            if docs is None:
                break
            inp, tgt, w = docs[self.doc]
            n = inp.size
            if o + n > L:
                break
            row["inputs"][o : o + n], row["targets"][o : o + n], row["weights"][o : o + n] = inp, tgt, w
            n_docs += 1
            seg[o : o + n], pos[o : o + n] = n_docs, np.arange(n)
            o += n
            self.doc += 1
            self.documents_read += 1
        if o == 0:
            return None
        seg[o:], pos[o:] = n_docs + 1, np.arange(L - o)  # padding: one more segment, weight 0
        self.padding, self.slots = self.padding + L - o, self.slots + L
        return {**row, "segment_ids": seg, "positions": pos}

    def _concat_row(self) -> dict[str, np.ndarray] | None:
        """The next window of L + 1 tokens of the documents end to end; the position moves L tokens on."""
        L = self.s.seq_len
        toks, ws, need = [], [], L + 1
        moved = None
        while need > 0:
            docs = self._docs()
            if docs is None:
                return None
            inp, tgt, w = docs[self.doc]
            t = np.concatenate([inp, tgt[-1:]])
            wt = np.concatenate([[0.0], w]).astype(np.float32)  # weight of predicting token i
            take = t[self.offset : self.offset + need]
            toks.append(take), ws.append(wt[self.offset : self.offset + need])
            taken_before = L + 1 - need
            if moved is None and taken_before + take.size > L:  # token L of the window: where the next starts
                moved = (self.epoch, self.block, self.doc, self.offset + (L - taken_before))
            need -= take.size
            if self.offset + take.size >= t.size:
                self.doc, self.offset = self.doc + 1, 0
                self.documents_read += 1
            else:
                self.offset += take.size
        self.epoch, self.block, self.doc, self.offset = moved
        window, weights = np.concatenate(toks).astype(np.int32), np.concatenate(ws)
        self.slots += L
        return {"inputs": window[:-1], "targets": window[1:], "weights": weights[1:],
                "segment_ids": np.ones(L, np.int32), "positions": np.arange(L, dtype=np.int32)}


def packed_stream(cfg, split: str, *, train: bool = True) -> PackedStream:
    """The packed stream of one split of a document corpus ``cfg`` (a ``DataConfig``): shuffled and
    repeated for training, in file order and one pass for evaluation (``train=False``)."""
    docs = Documents(cfg.corpus, cfg.path, cfg.field_names)
    return PackedStream(docs, Encoder(cfg.tokenizer, cfg.separator), split, seq_len=cfg.seq_len,
                        global_batch=cfg.global_batch, seed=cfg.seed, packing=cfg.packing_mode, truncate=cfg.truncate,
                        validation_fraction=cfg.validation_fraction, shuffle=train, repeat=train)


def check(cfg) -> None:
    """A document corpus config reads: files exist and hold the fields as text, and the first block
    of the train split packs (fields, types, lengths); one-line ValueErrors naming file and field."""
    stream = packed_stream(cfg, "train")
    stream.documents(0, stream.block_order(0)[0])


def per_token(results: dict[str, float]) -> dict[str, float]:
    """Eval means made per weighted token and per document: with loss weights the eval step's means
    (over rows) of ``loss``, ``ce``, ``z_loss`` are divided by the mean ``weight``; ``document_loss``
    by ``documents`` (the loss per document, every document counted once)."""
    out = dict(results)
    if out.get("weight"):
        for key in ("loss", "ce", "z_loss"):
            if key in out:
                out[key] = out[key] / out["weight"]
    if out.get("documents"):
        out["document_loss"] = out["document_loss"] / out["documents"]
    return out
