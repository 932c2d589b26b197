"""Data loading: a 1-D token array -> per-process shards of each global batch.

A grain `MapDataset` of windows, shuffled per epoch and cut into global batches; each process reads
only its rows, resume is exact and O(1), and `to_global` stitches the process-local rows into one
`jax.Array`. See docs/data.md.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


class TokenWindows:
    """grain random-access source: window i = tokens[i*L : i*L + L + 1] as inputs/targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if tokens.shape[0] < seq_len + 1:
            raise ValueError(
                f"corpus of {tokens.shape[0]} tokens is shorter than one window of seq_len + 1 = "
                f"{seq_len + 1} tokens (seq_len={seq_len}); use a larger corpus or a smaller seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.tokens.shape[0] - 1) // self.seq_len

    def __getitem__(self, i: int) -> Batch:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        w = np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1], dtype=np.int32)
        return {"inputs": w[:-1], "targets": w[1:]}


def _grain_seed(seed: int) -> int:
    """Spread user seeds apart: grain seeds epoch e with seed + e."""
    return int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint32)[0])


class ExampleLoader(Iterator[Batch]):
    """This process's rows of each global batch of a random-access source of *examples*, with an exact position.

    ``source`` is a grain ``MapDataset`` or anything with ``len`` and ``[i]`` whose items are single
    examples (pytrees of arrays without a batch dim, e.g. ``{"image": f32[8, 8, 1], "label": int}``).
    Global batch k holds elements [k*B, (k+1)*B) of ``source`` shuffled anew every epoch (``shuffle``)
    and repeated forever; this process reads only its block of rows and stacks them (``[b, ...]``).
    The position is one integer, so resuming is exact and O(1) on any process count.
    """

    def __init__(
        self,
        source: Any,
        global_batch: int,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
        shuffle: bool = True,
    ):
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index must be in [0, process_count={process_count}), got {process_index}")
        if global_batch % process_count:
            raise ValueError(
                f"global_batch={global_batch} is not divisible by process_count={process_count}; "
                f"use a multiple of {process_count}"
            )
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(f"an example source needs len() and [i] (a grain MapDataset or a sequence), got "
                            f"{type(source).__name__}")
        if len(source) < 1:
            raise ValueError("the example source is empty")
        self.source = source
        self.global_batch, self.seed, self.shuffle = global_batch, seed, shuffle
        self.process_index, self.process_count = process_index, process_count
        self.local_batch = global_batch // process_count

        stream = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
        if shuffle:
            stream = stream.shuffle(seed=_grain_seed(seed))
        self._stream = stream.repeat()  # infinite; upstream shuffle reseeds each epoch
        first_row, b, B = process_index * self.local_batch, self.local_batch, global_batch
        self._batches = (
            grain.MapDataset.range(sys.maxsize)
            .map(lambda i: self._stream[(i // b) * B + first_row + i % b])
            .batch(b)
        )
        self.step = 0

    @property
    def examples_per_epoch(self) -> int:
        return len(self.source)

    @property
    def epoch(self) -> float:
        """Epochs completed by the global batches consumed so far."""
        return self.step * self.global_batch / len(self.source)

    def __iter__(self) -> ExampleLoader:
        return self

    def __next__(self) -> Batch:
        batch = self._batches[self.step]
        self.step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position: the next global batch and what the stream depends on."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_examples": len(self.source), "shuffle": self.shuffle}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue at state["step"]; the rest of state must match this loader's stream."""
        mine = self.get_state()
        if isinstance(state, dict) and "num_windows" in state and "num_examples" in mine:
            state = _from_token_loader_state(state, getattr(self.source, "seq_len", None))
        if set(state) != set(mine):
            raise ValueError(f"loader state must have keys {sorted(mine)}, got {sorted(state)}")
        for key in mine:
            if key != "step" and state[key] != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {key}={mine[key]!r}; "
                    "resume with the same data config"
                )
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"loader state step must be a non-negative int, got {step!r}")
        self.step = step


def _from_token_loader_state(state: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
    """A token :class:`Loader`'s state (``num_windows``, ``seq_len``) as an ExampleLoader's, so
    checkpoints written before the GPT task read its windows through ExampleLoader still resume."""
    state = dict(state)
    state["num_examples"] = state.pop("num_windows")
    saved_len = state.pop("seq_len", None)
    if seq_len is not None and saved_len is not None and saved_len != seq_len:
        raise ValueError(f"loader state has seq_len={saved_len!r} but this loader has seq_len={seq_len!r}; "
                         "resume with the same data config")
    return state


class Loader(ExampleLoader):
    """An :class:`ExampleLoader` over the windows of a 1-D token array (``{"inputs", "targets"}`` of ``[b, L]``)."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch: int,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
        shuffle: bool = True,
    ):
        self.windows = TokenWindows(tokens, seq_len)
        self.seq_len = seq_len
        super().__init__(self.windows, global_batch, seed, process_index, process_count, shuffle)

    @property
    def windows_per_epoch(self) -> int:
        return len(self.windows)

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        return {"step": state["step"], "seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "num_windows": state["num_examples"], "shuffle": self.shuffle}


class IterLoader(Iterator[Batch]):
    """Per-process batches from a grain ``IterDataset`` or any iterable (each item: this process's rows).

    The position is exact when the iterator has ``get_state``/``set_state`` (grain's iterators do);
    otherwise a resumed run starts the iterable afresh (logged once: such data is not exactly
    resumable).
    """

    def __init__(self, iterable: Any):
        self.iterable = iterable
        self._it = iter(iterable)
        self.step = 0
        self.resumable = hasattr(self._it, "get_state") and hasattr(self._it, "set_state")

    def __iter__(self) -> IterLoader:
        return self

    def __next__(self) -> Batch:
        try:
            batch = next(self._it)
        except StopIteration:
            raise RuntimeError(f"the data iterable ran out after {self.step} batches; give an infinite "
                                "(repeated) dataset or fewer run.steps") from None
        self.step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"step": self.step, "iterator": self._it.get_state() if self.resumable else None}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "step" not in state or "iterator" not in state:
            raise ValueError(f"iterable loader state must have keys ['iterator', 'step'], got {state!r}")
        if self.resumable and state["iterator"] is not None:
            self._it.set_state(state["iterator"])
        elif state["step"]:
            logger.warning("the data iterable has no get_state/set_state: the resumed run starts it afresh, "
                           "not at batch %d (not exactly resumable)", state["step"])
        self.step = int(state["step"])


def eval_batches(source: Any, global_batch: int, n_batches: int, *, process_index: int, process_count: int
                 ) -> Iterator[tuple[Batch, np.ndarray]]:
    """``(local batch, local mask)`` pairs for one evaluation.

    A random-access source of examples: ``n_batches`` batches in order (wrapping around), or with
    ``n_batches = -1`` one pass over the whole source, the last batch padded (mask 0 on padded rows).
    An iterable of per-process batches: its first ``n_batches`` batches (all of them for -1), mask 1.
    """
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        n = len(source)
        total = -(-n // global_batch) if n_batches == -1 else n_batches
        b = global_batch // process_count
        for k in range(total):
            rows = [k * global_batch + process_index * b + j for j in range(b)]
            items = [source[r % n] for r in rows]
            mask = np.asarray([1.0 if (n_batches != -1 or r < n) else 0.0 for r in rows], np.float32)
            yield jax.tree.map(lambda *xs: np.stack(xs), *items), mask
        return
    it = iter(source)
    for k, batch in enumerate(it):
        if n_batches != -1 and k >= n_batches:
            return
        rows = jax.tree.leaves(batch)[0].shape[0]
        real = getattr(it, "real_rows", None)  # packed rows: those whose data has ended are padding
        yield batch, (np.ones((rows,), np.float32) if real is None else np.asarray(real, np.float32))


def agreed_eval_batches(source: Any, global_batch: int, n_batches: int, *, process_index: int, process_count: int
                        ) -> Iterator[tuple[Batch, np.ndarray, bool]]:
    """``(local batch, local mask, padded)`` for one evaluation: :func:`eval_batches`, the same number on
    every process, and ``padded`` (some row of the global batch is padding) the same on every process.

    A random-access source has that number by its length. An iterable of per-process batches may end
    sooner on one process than on another (packed rows: each process packs its own); on several
    processes they agree before the loop on the largest count (one host-level all-gather), and a
    process whose batches have ended contributes empty ones (mask 0): its source's ``empty_batch()``,
    else zeros shaped like its last batch. A source with ``count_batches(limit)`` is counted without
    being kept; any other iterable is read whole (up to ``n_batches``) before the loop.
    """
    def local():
        return eval_batches(source, global_batch, n_batches, process_index=process_index, process_count=process_count)

    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        n = len(source)
        for k, (batch, mask) in enumerate(local()):
            yield batch, mask, n_batches == -1 and (k + 1) * global_batch > n
        return
    if jax.process_count() == 1:
        for batch, mask in local():
            yield batch, mask, False
        return
    from jax.experimental import multihost_utils

    if hasattr(source, "count_batches"):
        mine, batches = source.count_batches(n_batches), local()
    else:
        batches = list(local())
        mine, batches = len(batches), iter(batches)
    counts = [int(c) for c in np.asarray(multihost_utils.process_allgather(np.asarray([mine], np.int64))).reshape(-1)]
    total, fewest = max(counts), min(counts)
    if fewest == 0 and total and not hasattr(source, "empty_batch"):  # the same answer on every process
        raise ValueError(f"the eval data of process(es) {[p for p, c in enumerate(counts) if c == 0]} yielded no batch "
                         f"while others yielded up to {total} (batches per process: {counts}); give every process "
                         f"eval data, or a source with empty_batch()")
    last = None
    for k in range(total):
        if k < mine:
            last, mask = next(batches)
            yield last, mask, k >= fewest
        else:
            empty = source.empty_batch() if hasattr(source, "empty_batch") else jax.tree.map(np.zeros_like, last)
            yield empty, np.zeros((jax.tree.leaves(empty)[0].shape[0],), np.float32), True
