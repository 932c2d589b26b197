"""Preference pairs packed into rows: each pair's chosen and rejected documents side by side.

    it = iter(pair_stream(cfg.data, "train", pairs_per_row=8))
    next(it)   # {"inputs", "targets", "segment_ids", "positions", "weights", "response"}: int32/f32 [B, L]

A record ``(prompt, chosen, rejected)`` becomes documents ``prompt + chosen`` and ``prompt + rejected``,
packed whole into one row as segments ``2k + 1`` and ``2k + 2`` (at most ``pairs_per_row`` pairs);
``response`` is 1 on both responses' targets, ``weights`` 1 on one token per pair (so the step's weight
normalisation makes every mean a mean over pairs). Rows, blocks and the resumable position are
:class:`trainers.data.packing.PackedStream`'s. Truncation and refusals: docs/post-training.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spmd.models import segments
from trainers.data.documents import Documents, Encoder
from trainers.data.packing import PackedIterator, PackedStream, _Row

PAIR_FIELDS = 3  # prompt, chosen, rejected
Pair = tuple[np.ndarray, ...]  # (inputs, targets, response) of chosen, then of rejected


def is_pairs(fields: tuple[str, ...]) -> bool:
    """Whether ``data.fields`` names preference pairs: three fields, the last two ``chosen`` and ``rejected``
    (what the config check reads as pairs; ``run.objective=dpo`` reads any three fields as pairs)."""
    return len(fields) == PAIR_FIELDS and tuple(fields[1:]) == ("chosen", "rejected")


def check_fields(fields: tuple[str, ...]) -> None:
    """Preference pairs are read from exactly three fields: prompt, chosen, rejected."""
    if len(fields) != PAIR_FIELDS:
        raise ValueError(f"data.fields={','.join(fields)!r} names {len(fields)} field(s); run.objective=dpo reads "
                         "three, the prompt, the chosen and the rejected response, in that order (e.g. "
                         "data.fields=prompt,chosen,rejected)")


class PairStream(PackedStream):
    """A :class:`PackedStream` whose documents are preference pairs (see the module docstring)."""

    def __init__(self, docs: Documents, encoder: Encoder, split: str, *, pairs_per_row: int = 8, **kw: Any):
        check_fields(docs.fields)
        if kw.get("packing", "segments") != "segments":
            raise ValueError(f"data.packing={kw['packing']!r}: preference pairs are packed as segments; set "
                             "data.packing=segments or ''")
        super().__init__(docs, encoder, split, **{**kw, "weights": True})
        self.pairs_per_row = pairs_per_row

    def __iter__(self) -> PairIterator:
        return PairIterator(self)

    def _encode(self, epoch: int, block: int) -> list[Pair]:  # type: ignore[override]
        records = self.docs.split_records(self.blocks[block], self.split, self.validation_fraction)
        if self.shuffle:
            from trainers.data.loader import _grain_seed

            records = [records[i] for i in np.random.default_rng([_grain_seed(self.seed), epoch, block]).permutation(
                len(records))]
        out = [self._pair(rid, values) for rid, values in records]
        self.cut_away[block] = (len(out), 0, 0)
        return out

    def _pair(self, rid: str, values: tuple) -> Pair:
        prompt, chosen, rejected = values
        sides = [self.encoder((prompt, chosen)), self.encoder((prompt, rejected))]
        n_c, n_r = (t.size - 1 for t, _ in sides)
        L = self.seq_len
        if n_c + n_r > L:
            if not self.truncate:
                raise ValueError(f"data.path: pair {rid} has {n_c} + {n_r} tokens to predict (prompt + chosen, prompt "
                                 f"+ rejected), more than data.seq_len={L} holds in one row; set data.truncate=true "
                                 "to cut it, or a larger data.seq_len")
            keep_c = min(n_c, max(L // 2, L - n_r))
            keep = (keep_c, min(n_r, L - keep_c))
            sides = [(t[: k + 1], w[: k + 1]) for (t, w), k in zip(sides, keep)]
        out: list[np.ndarray] = []
        for name, (t, w) in zip(("chosen", "rejected"), sides):
            if not np.any(w[1:] > 0):
                raise ValueError(f"data.path: pair {rid}: data.seq_len={L} cuts away every token of its {name} "
                                 f"response (field {self.docs.fields[1 if name == 'chosen' else 2]!r}), leaving "
                                 "nothing to compare; use a larger data.seq_len or a shorter prompt")
            out += [t[:-1], t[1:], (w[1:] > 0).astype(np.float32)]
        if out[0].size == out[3].size and np.array_equal(out[1], out[4]) and np.array_equal(out[0], out[3]):
            cut = " after the cut to data.seq_len" if n_c + n_r > L else ""
            raise ValueError(f"data.path: pair {rid}: its chosen and rejected documents are the same{cut} "
                             f"({out[0].size} tokens), so it has no preference to learn; remove it"
                             + (" or use a larger data.seq_len" if cut else ""))
        return tuple(out)


class _PairRow(_Row):
    """One row of every global batch, packing whole pairs."""

    def segment_row(self) -> dict[str, np.ndarray] | None:
        L, most = self.s.seq_len, self.s.pairs_per_row  # type: ignore[attr-defined]
        row = _empty_row(L)
        seg, pos = np.zeros(L, np.int32), np.zeros(L, np.int32)
        o = k = 0
        while o < L and k < most:
            docs = self.docs()
            if docs is None:
                break
            pair = docs[self.doc]
            n = pair[0].size + pair[3].size
            if o + n > L:
                break
            for side in range(2):
                inp, tgt, resp = pair[3 * side: 3 * side + 3]
                m = inp.size
                row["inputs"][o: o + m], row["targets"][o: o + m], row["response"][o: o + m] = inp, tgt, resp
                seg[o: o + m], pos[o: o + m] = 2 * k + 1 + side, np.arange(m)
                if side == 0:
                    row["weights"][o + int(np.flatnonzero(resp)[0])] = 1.0
                o += m
            k, self.doc = k + 1, self.doc + 1
        if o == 0:
            return None
        seg[o:], pos[o:] = segments.padding_id(L), np.arange(L - o)
        self.padding, self.slots = self.padding + L - o, self.slots + L
        return {**row, "segment_ids": seg, "positions": pos}


def _empty_row(L: int) -> dict[str, np.ndarray]:
    return {"inputs": np.zeros(L, np.int32), "targets": np.zeros(L, np.int32), "segment_ids": np.ones(L, np.int32),
            "positions": np.arange(L, dtype=np.int32), "weights": np.zeros(L, np.float32),
            "response": np.zeros(L, np.float32)}


class PairIterator(PackedIterator):
    """Batches of pair rows; the position (``get_state``/``set_state``) is :class:`PackedIterator`'s."""

    def __init__(self, stream: PairStream):
        self.s = stream
        self.rows = [_PairRow(stream, j) for j in stream.rows]

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [r.segment_row() for r in self.rows]
        if all(r is None for r in rows):
            raise StopIteration
        return self.batch_of(rows)

    def batch_of(self, rows: list[dict[str, np.ndarray] | None]) -> dict[str, np.ndarray]:
        self.real_rows = np.asarray([r is not None for r in rows], np.float32)
        full = [_empty_row(self.s.seq_len) if r is None else r for r in rows]
        return {k: np.stack([r[k] for r in full]) for k in full[0]}


def pair_stream(cfg, split: str, *, pairs_per_row: int = 8, train: bool = True) -> PairStream:
    """The pair stream of one split of a document corpus ``cfg`` (a ``DataConfig`` with three fields):
    shuffled and repeated for training, in file order and one pass for evaluation (``train=False``)."""
    docs = Documents(cfg.corpus, cfg.path, cfg.field_names)
    return PairStream(docs, Encoder(cfg.tokenizer, cfg.separator), split, pairs_per_row=pairs_per_row,
                      seq_len=cfg.seq_len, global_batch=cfg.global_batch, seed=cfg.seed, packing=cfg.packing_mode,
                      truncate=cfg.truncate, validation_fraction=cfg.validation_fraction, shuffle=train, repeat=train)


def check(cfg, pairs_per_row: int = 8) -> None:
    """The pairs of ``cfg`` (a ``DataConfig``) read: three fields, and the first block of the train split
    that holds pairs encodes and packs them (errors name the file, the record and the field)."""
    check_fields(cfg.field_names)
    stream = pair_stream(cfg, "train", pairs_per_row=pairs_per_row)
    if not any(stream._encode(0, b) for b in range(len(stream.blocks))):
        raise ValueError(f"data.path={cfg.path!r} has no pair in split 'train' (data.validation_fraction="
                         f"{cfg.validation_fraction} of the pairs are held out); give more pairs or a smaller "
                         "data.validation_fraction")
