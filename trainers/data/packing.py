"""Packing documents into rows: segment ids, per-document positions and loss weights.

    it = iter(packed_stream(cfg.data, "train").for_process(p, P))   # this process's rows of each global batch
    next(it)   # {"inputs", "targets", "segment_ids", "positions", "weights"}: int32/f32 [B/P, L]

``packing="segments"``: whole documents in stream order while they fit a row of L (a longer one is
cut, or refused with ``truncate=False``), numbered 1, 2, ..., positions restarting at 0, the rest
padding (id L + 1, weight 0). ``packing="concat"``: the documents end to end in windows of L + 1.
Row j of the global batch B is a stream of its own: blocks j, j + B, ... of epoch e's order (seeded
by (seed, e); with fewer blocks than B, every block and its documents j, j + B, ...). A process packs
only its rows, the global batch is the same on any process count, and the state (every row's
(epoch, block, document, offset)) resumes exactly on any. See docs/data.md.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from spmd.models import segments
from trainers.data.documents import Documents, Encoder
from trainers.data.loader import _grain_seed

PACKINGS = ("segments", "concat")
log = logging.getLogger(__name__)
_warned: set[tuple] = set()  # (path, fields, seq_len, tokenizer) whose lost targets were reported


class PackedStream:
    """An iterable of batches of packed rows: all ``global_batch`` rows, or ``rows`` (one process's)."""

    def __init__(self, docs: Documents, encoder: Encoder, split: str, *, seq_len: int, global_batch: int,
                 seed: int = 0, packing: str = "segments", truncate: bool = True, validation_fraction: float = 0.05,
                 shuffle: bool = True, repeat: bool = True, weights: bool | None = None,
                 rows: Sequence[int] | None = None):
        if packing not in PACKINGS:
            raise ValueError(f"data.packing={packing!r} is not one of {PACKINGS}")
        self.docs, self.encoder, self.split = docs, encoder, split
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.packing, self.truncate, self.validation_fraction = packing, truncate, validation_fraction
        self.shuffle, self.repeat = shuffle, repeat
        self.weights = len(docs.fields) > 1 if weights is None else weights
        self.rows = tuple(range(global_batch)) if rows is None else tuple(rows)
        self.blocks = docs.blocks_of(split)
        if not self.blocks:
            raise ValueError(f"data.path={docs.path!r} has no {split} split")
        self._cache: OrderedDict = OrderedDict()  # (epoch, block) -> its documents, shared by the rows
        self._orders: dict[int, np.ndarray] = {}  # epoch -> block order (recent epochs)
        self._counts: dict[tuple, int] = {}  # (rows, limit) -> batches in one pass; shared with for_process copies
        self.cut_away: dict[int, tuple[int, int, int]] = {}  # block -> (documents encoded, of them with every
        # weighted target cut away by truncation, the data.seq_len that keeps one target of each of those)

    def for_process(self, block: int, n_blocks: int) -> PackedStream:
        """The stream of rows ``[block * b, (block + 1) * b)``, ``b = global_batch / n_blocks``: what one
        process loads (``trainers.data.process_rows``)."""
        if self.global_batch % n_blocks:
            raise ValueError(f"global_batch={self.global_batch} is not divisible into {n_blocks} blocks of rows")
        b = self.global_batch // n_blocks
        other = copy.copy(self)
        other.rows, other._cache, other._orders = tuple(range(block * b, (block + 1) * b)), OrderedDict(), {}
        return other

    def __iter__(self) -> PackedIterator:
        return PackedIterator(self)

    def count_batches(self, limit: int = -1) -> int:
        """How many batches one pass over a finite stream (``repeat=False``) yields, at most ``limit``
        (-1: no limit); counted once (packing every row), then remembered by this stream and its
        ``for_process`` copies. Processes compare counts before an evaluation (:func:`trainers.data.loader.agreed_eval_batches`)."""
        if self.repeat:
            raise ValueError("a repeated stream has no end: count_batches needs repeat=False")
        key = (self.rows, limit)
        if key not in self._counts:
            n = 0
            for _ in iter(self):  # this stream's own iterator (a subclass's too)
                n += 1
                if n == limit:
                    break
            self._counts[key] = n
        return self._counts[key]

    def empty_batch(self) -> dict[str, np.ndarray]:
        """A batch of this stream's rows that holds no document (no loss weight): what a process whose
        rows have ended contributes while others still evaluate."""
        return iter(self).batch_of([None] * len(self.rows))

    def block_order(self, epoch: int, row: int = 0) -> list[int]:
        """The blocks row ``row`` reads in ``epoch``, in order."""
        n = len(self.blocks)
        if epoch not in self._orders:
            self._orders = {epoch: (np.random.default_rng([_grain_seed(self.seed), epoch]).permutation(n)
                                    if self.shuffle else np.arange(n)), **{e: o for e, o in self._orders.items()
                                                                           if e > epoch - 2}}
        order = self._orders[epoch]
        if n >= self.global_batch:
            order = order[row :: self.global_batch]
        return [int(i) for i in order]

    def documents(self, epoch: int, block: int, row: int = 0) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(inputs, targets, target weights)`` of row ``row``'s documents of one block, in epoch order."""
        key = (epoch, block)
        if key not in self._cache:
            self._cache[key] = self._encode(epoch, block)
            while len(self._cache) > len(self.rows) + 2:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        docs = self._cache[key]
        return docs[row :: self.global_batch] if len(self.blocks) < self.global_batch else docs

    def _encode(self, epoch: int, block: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        records = self.docs.split_records(self.blocks[block], self.split, self.validation_fraction)
        if self.shuffle:
            records = [records[i] for i in np.random.default_rng([_grain_seed(self.seed), epoch, block]).permutation(
                len(records))]
        out, lost, need = [], 0, 0
        for rid, values in records:
            tokens, weights = self.encoder(values)
            if tokens.size - 1 > self.seq_len and self.packing == "segments":
                if not self.truncate:
                    raise ValueError(f"data.path: document {rid} has {tokens.size - 1} tokens to predict, more than "
                                     f"data.seq_len={self.seq_len} (field(s) {list(self.docs.fields)}); set "
                                     "data.truncate=true to cut it, or a larger data.seq_len")
                weighted = np.flatnonzero(weights[1:] > 0)  # the targets the loss reads
                if weighted.size and weighted[0] >= self.seq_len:  # all of them past the cut
                    lost, need = lost + 1, max(need, int(weighted[0]) + 1)
                tokens, weights = tokens[: self.seq_len + 1], weights[: self.seq_len + 1]
            if tokens.size > 1:
                out.append((tokens[:-1], tokens[1:], weights[1:]))
        self.cut_away[block] = (len(out), lost, need)
        return out


class _Row:
    """One row of every global batch: its own reader of documents, packer and position."""

    def __init__(self, s: PackedStream, j: int):
        self.s, self.j = s, j
        self.epoch = self.block = self.doc = self.offset = 0
        self.found = False  # a document was found in this epoch (a resumed epoch counts as found)
        self.padding = self.slots = 0

    @property
    def position(self) -> list[int]:
        return [self.j, self.epoch, self.block, self.doc, self.offset]

    def docs(self) -> list | None:
        """The documents of the block at the position (None: the data ended, repeat=False)."""
        while True:
            order = self.s.block_order(self.epoch, self.j)
            if self.block >= len(order):
                if not self.s.repeat:
                    return None
                if not self.found:  # a whole epoch without one document
                    raise ValueError(f"data.path={self.s.docs.path!r}: row {self.j} of {self.s.global_batch} has no "
                                     f"document of split {self.s.split!r} to read; use a smaller data.global_batch")
                self.epoch, self.block, self.doc, self.offset, self.found = self.epoch + 1, 0, 0, 0, False
                continue
            docs = self.s.documents(self.epoch, order[self.block], self.j)
            if self.doc < len(docs):
                self.found = True
                return docs
            self.block, self.doc, self.offset = self.block + 1, 0, 0

    def segment_row(self) -> dict[str, np.ndarray] | None:
        L = self.s.seq_len
        row = _empty_row(L)
        seg, pos = np.zeros(L, np.int32), np.zeros(L, np.int32)
        o = n_docs = 0
        while o < L:
            docs = self.docs()
            if docs is None:
                break
            inp, tgt, w = docs[self.doc]
            n = inp.size
            if o + n > L:
                break
            row["inputs"][o : o + n], row["targets"][o : o + n], row["weights"][o : o + n] = inp, tgt, w
            n_docs += 1
            seg[o : o + n], pos[o : o + n] = n_docs, np.arange(n)
            o, self.doc = o + n, self.doc + 1
        if o == 0:
            return None
        seg[o:], pos[o:] = segments.padding_id(L), np.arange(L - o)  # padding: its own segment, weight 0
        self.padding, self.slots = self.padding + L - o, self.slots + L
        return {**row, "segment_ids": seg, "positions": pos}

    def concat_row(self) -> dict[str, np.ndarray] | None:
        """The next window of L + 1 tokens of the documents end to end; the position moves L tokens on."""
        L = self.s.seq_len
        toks, ws, need, moved = [], [], L + 1, None
        while need > 0:
            docs = self.docs()
            if docs is None:
                return None
            inp, tgt, w = docs[self.doc]
            t = np.concatenate([inp, tgt[-1:]])
            wt = np.concatenate([[0.0], w]).astype(np.float32)  # weight of predicting token i
            take = t[self.offset : self.offset + need]
            toks.append(take)
            ws.append(wt[self.offset : self.offset + need])
            taken_before = L + 1 - need
            if moved is None and taken_before + take.size > L:  # token L of the window: where the next starts
                moved = (self.epoch, self.block, self.doc, self.offset + (L - taken_before))
            need -= take.size
            if self.offset + take.size >= t.size:
                self.doc, self.offset = self.doc + 1, 0
            else:
                self.offset += take.size
        self.epoch, self.block, self.doc, self.offset = moved
        window, weights = np.concatenate(toks).astype(np.int32), np.concatenate(ws)
        self.slots += L
        return {"inputs": window[:-1], "targets": window[1:], "weights": weights[1:],
                "segment_ids": np.ones(L, np.int32), "positions": np.arange(L, dtype=np.int32)}


def _empty_row(L: int) -> dict[str, np.ndarray]:
    return {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32), "segment_ids": np.ones(L, np.int32),
            "positions": np.arange(L, dtype=np.int32), "weights": np.zeros(L, np.float32)}


class PackedIterator(Iterator[dict[str, np.ndarray]]):
    """Batches of the stream's rows; ``get_state``/``set_state`` give the exact position of every row of
    the global batch (gathered from all processes), so a run resumes on any process count."""

    def __init__(self, stream: PackedStream):
        self.s = stream
        self.rows = [_Row(stream, j) for j in stream.rows]

    def __iter__(self) -> PackedIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        make = (lambda r: r.segment_row()) if self.s.packing == "segments" else (lambda r: r.concat_row())
        rows = [make(r) for r in self.rows]
        if all(r is None for r in rows):
            raise StopIteration
        return self.batch_of(rows)

    def batch_of(self, rows: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
        """The batch of these rows, a row whose data ended (None) made empty (weight 0); ``real_rows``
        says which rows hold data (1) and which are empty (0): the eval mask."""
        self.real_rows = np.asarray([r is not None for r in rows], np.float32)
        rows = [_empty_row(self.s.seq_len) if r is None else r for r in rows]
        batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        if self.s.packing == "concat" and not self.s.weights:
            batch = {"inputs": batch["inputs"], "targets": batch["targets"]}
        return batch

    @property
    def padding_fraction(self) -> float:
        """Padding positions / all positions of the rows made so far."""
        return sum(r.padding for r in self.rows) / max(sum(r.slots for r in self.rows), 1)

    def get_state(self) -> dict[str, Any]:
        """Every row's position ``[row, epoch, block, document, offset]`` (a collective across processes)."""
        positions = np.asarray([r.position for r in self.rows], np.int64)
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            positions = np.asarray(multihost_utils.process_allgather(positions)).reshape(-1, 5)
        table = {int(p[0]): [int(x) for x in p] for p in positions}
        return {"rows": [table[j] for j in sorted(table)], "seed": self.s.seed, "seq_len": self.s.seq_len,
                "blocks": len(self.s.blocks), "packing": self.s.packing, "global_batch": self.s.global_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        mine = {"seed": self.s.seed, "seq_len": self.s.seq_len, "blocks": len(self.s.blocks),
                "packing": self.s.packing, "global_batch": self.s.global_batch}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"packed loader state has {key}={state.get(key)!r} but this loader has {key}="
                                 f"{value!r}; resume with the same data config")
        table = {int(p[0]): p for p in state["rows"]}
        for r in self.rows:
            if r.j not in table:
                raise ValueError(f"packed loader state has no position for row {r.j}")
            _, r.epoch, r.block, r.doc, r.offset = (int(x) for x in table[r.j])
            r.found = True


def packed_stream(cfg, split: str, *, train: bool = True) -> PackedStream:
    """The packed stream of one split of a document corpus ``cfg`` (a ``DataConfig``): shuffled and
    repeated for training, in file order and one pass for evaluation (``train=False``; its batches
    always carry loss weights, so the rows of a last, part-empty batch weigh nothing)."""
    docs = Documents(cfg.corpus, cfg.path, cfg.field_names)
    return PackedStream(docs, Encoder(cfg.tokenizer, cfg.separator), split, seq_len=cfg.seq_len,
                        global_batch=cfg.global_batch, seed=cfg.seed, packing=cfg.packing_mode, truncate=cfg.truncate,
                        validation_fraction=cfg.validation_fraction, shuffle=train, repeat=train,
                        weights=None if train else True)


def check(cfg) -> None:
    """A document corpus config reads: files exist and hold the fields as text, and the first block
    of the train split that holds one of its documents packs (fields, types, lengths); one-line
    ValueErrors naming file and field, or the split when it has no document at all."""
    stream = packed_stream(cfg, "train")
    n, rows = len(stream.blocks), cfg.global_batch
    if n < rows:  # every row reads its own documents of every block: some block must hold one per row
        most = max(len(stream._encode(0, b)) for b in range(n))
        if 0 < most < rows:
            raise ValueError(f"data.path={cfg.path!r} has {most} document(s) of split 'train' in its largest block, "
                             f"fewer than the data.global_batch={rows} rows that each read their own; use a "
                             f"data.global_batch of at most {most}, or more documents")
    else:
        most = next((1 for b in range(n) if stream._encode(0, b)), 0)  # in file order, usually the first block
    if not most:
        raise ValueError(f"data.path={cfg.path!r} has no document in split 'train' (data.validation_fraction="
                         f"{cfg.validation_fraction} of the documents are held out, by a hash of where each one is); "
                         "give more documents or a smaller data.validation_fraction")
    _check_targets_kept(cfg, stream)


def _check_targets_kept(cfg, stream: PackedStream) -> None:
    """Truncation to ``data.seq_len`` that cuts away every weighted target of a document (a prompt
    longer than the row) leaves it nothing to learn: refused when it is so for every document read
    (the blocks :func:`check` encoded), one warning with the count when for some."""
    counts = list(stream.cut_away.values())
    docs, lost, need = sum(c[0] for c in counts), sum(c[1] for c in counts), max((c[2] for c in counts), default=0)
    if not lost:
        return
    read = (f"documents read (the first {len(counts)} block(s) of split 'train' of data.path={cfg.path!r}): their "
            f"weighted tokens (field {cfg.field_names[-1]!r}) begin past position {cfg.seq_len}")
    fix = f"a data.seq_len of at least {need} keeps a target of each (or shorten the other fields)"
    if lost == docs:
        raise ValueError(f"data.seq_len={cfg.seq_len} cuts away every target of all {docs} {read}, so training would "
                         f"learn nothing; {fix}")
    key = (cfg.path, cfg.fields, cfg.seq_len, cfg.tokenizer)
    if key not in _warned:  # one warning, however many times the config is checked
        _warned.add(key)
        log.warning("data.seq_len=%d cuts away every target of %d of the %d %s, so they carry no loss weight; %s",
                    cfg.seq_len, lost, docs, read, fix)


def per_token(results: dict[str, float]) -> dict[str, float]:
    """Eval means made per weighted token and per document: with loss weights the eval step's means
    (over rows) of ``loss``, ``ce``, ``z_loss`` (and DPO's ``rewards/*``, ``logps/*``) are divided by the mean ``loss_weight``; ``document_loss``
    by ``documents`` (the loss per document, every document counted once)."""
    out = dict(results)
    if out.get("loss_weight"):
        for key in out:
            if key in ("loss", "ce", "z_loss") or key.startswith(("rewards/", "logps/")):  # DPO's: per pair
                out[key] = out[key] / out["loss_weight"]
    if out.get("documents"):
        out["document_loss"] = out["document_loss"] / out["documents"]
    return out
