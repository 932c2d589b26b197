"""Data loading: a 1-D token array -> per-process shards of each global batch.

The pipeline is a grain `MapDataset`, random access all the way down, so the
position in the stream is one integer and resuming is exact and O(1):

    windows   TokenWindows(tokens, L)   window i = tokens[i*L : i*L + L + 1]
    stream    .shuffle(seed).repeat()   a new permutation of the windows each epoch
    local     row j of global batch k = stream[k*B + p*b + j],  b = B / P
              .batch(b)                 {"inputs": int32[b, L], "targets": int32[b, L]}

`targets` is `inputs` shifted by one token (the window has L + 1 tokens).
Global batch k holds stream elements [k*B, (k+1)*B); process p of P reads only
its rows [p*b, (p+1)*b), so the processes' shards are disjoint, their union is
exactly the global batch, and no process reads another's windows. Epochs are
counted in windows, so a global batch may straddle an epoch boundary.

The user's seed is mixed (`np.random.SeedSequence`) before it reaches grain,
whose shuffle seeds epoch e with `seed + e`: unmixed, seed 1 would replay
seed 0 shifted by one epoch.

`Loader.get_state()` is `{"step": k, ...}` in *global* batches: it does not name
the process, so a run saved on P processes resumes on any P' that divides B.

`to_global` stitches the process-local batches into one `jax.Array` with
`jax.make_array_from_process_local_data`; with a sharding `Batch[B_data]` each
device then holds B / n_data rows. This assumes the batch dim is split over
every process (the usual case: hosts lie along the outer `data`/`fsdp` axes).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np

from spmd.sharding import path_str
from trainers.data import corpus as corpus_lib

logger = logging.getLogger(__name__)

CORPORA = ("stdlib", "text", "npy", "synthetic")
Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are cut into global batches.

    corpus: "stdlib" (default, no download) | "text" (file or folder at `path`)
        | "npy" (1-D token ids at `path`) | "synthetic" (random, benchmarks only).
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

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.corpus in ("text", "npy") and not self.path:
            raise ValueError(f"corpus {self.corpus!r} needs a path to a file or folder, got path={self.path!r}")
        if self.corpus in ("stdlib", "synthetic") and self.path is not None:
            raise ValueError(f"path is only read by corpus 'text' or 'npy', got path={self.path!r} with corpus {self.corpus!r}")
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
        if self.corpus in ("stdlib", "text") and self.vocab_size < corpus_lib.BYTE_VOCAB_SIZE:
            raise ValueError(
                f"corpus {self.corpus!r} is byte-level and needs vocab_size >= "
                f"{corpus_lib.BYTE_VOCAB_SIZE}, got {self.vocab_size}"
            )


def load_corpus(cfg: DataConfig, split: str) -> np.ndarray:
    """The 1-D token array of one split of cfg's corpus."""
    kw = dict(validation_fraction=cfg.validation_fraction)
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
    for k, batch in enumerate(iter(source)):
        if n_batches != -1 and k >= n_batches:
            return
        rows = jax.tree.leaves(batch)[0].shape[0]
        yield batch, np.ones((rows,), np.float32)


def process_rows(sharding: jax.sharding.Sharding, global_batch: int) -> tuple[int, int]:
    """Which rows of a ``[global_batch, ...]`` batch this process must load: ``(block, n_blocks)``.

    The rows this process's devices hold under ``sharding`` form block ``block`` of ``n_blocks``
    equal, contiguous blocks. With hosts along ``data`` (the usual layout) that is
    ``(process_index, process_count)``; when several processes hold the same rows (e.g. ``data=2,
    tensor=4`` on 4 processes x 2 devices, where each ``data`` row spans two processes) they
    load the same block, and a batch replicated over all devices is one block.
    """
    shape = (global_batch,)
    rows = {(idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map(shape).values()}
    intervals = sorted(rows)
    start, stop = intervals[0][0], intervals[-1][1]
    size = stop - start
    if any(a[1] != b[0] for a, b in zip(intervals, intervals[1:])):
        raise ValueError(
            f"this process's devices hold non-contiguous rows {intervals} of the batch; "
            "put the batch-sharding axes (data, fsdp) outermost so each process holds one block of rows"
        )
    if global_batch % size or start % size:
        raise ValueError(
            f"this process holds rows [{start}, {stop}) of global_batch={global_batch}: not one of equal blocks; "
            "use a global batch divisible by the number of processes along the batch axes"
        )
    return start // size, global_batch // size


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


def to_global(local_batch: Any, sharding: jax.sharding.Sharding, global_batch: int) -> Any:
    """Assemble this process's rows (block :func:`process_rows`) of any batch pytree into global
    ``[global_batch, ...]`` arrays."""
    block, n_blocks = process_rows(sharding, global_batch)
    rows = global_batch // n_blocks

    def one(path, local):
        local = np.asarray(local)
        if local.ndim < 1 or local.shape[0] != rows:
            raise ValueError(
                f"local batch {path_str(path) or '<root>'!r} has shape {local.shape}; expected {rows} rows "
                f"(block {block} of {n_blocks} of global_batch={global_batch} under this batch sharding); "
                "every leaf of a batch needs the batch as its leading dim"
            )
        return jax.make_array_from_process_local_data(sharding, local, (global_batch, *local.shape[1:]))

    return jax.tree_util.tree_map_with_path(one, local_batch)
