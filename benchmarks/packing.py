"""Documents: the packed loader's throughput and memory, and blockwise attention over packed rows.

Rows (trainers.data.packing, spmd.models.segments):

- **loader tokens/s** for a JSONL text corpus (byte tokens), a Parquet chat corpus (prompt and
  response fields) and a pre-tokenized Parquet corpus (a list-of-int32 ``tokens`` field), one
  process reading all rows of ``global_batch x seq_len``; goals: 10x the tokens/s the main job's
  step (``gpt-small``: 16 x 128 tokens on ``data=2,fsdp=2,tensor=2``, timed here) consumes, and
  1M tokens/s pre-tokenized. Each row also reports the packer's padding fraction.
- **RSS while streaming** a JSONL corpus 10x larger than the 50 MB goal: resident memory after
  the first batch and at the end (goal: grows by at most 50 MB).
- **blockwise with segments**: training-step temporaries at L=2048 and 8192 with packed
  documents (goal: ratio <= 4.5, linear in L), and with many short documents the fraction of
  block pairs skipped and the step time with skipping against the same step with every block
  pair computed (goal: faster).

``--quick``: the main job's step on the tiny model (one block), small corpora, a corpus 2x the RSS goal,
L = 256 and 1024 with blocks of 64, the skipping step on one row of 1024 tokens (a smoke test, not a
measurement).

    python -m benchmarks.packing [--quick] [--output PATH]
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes
from spmd.models import GPT, GPTConfig, segments
from trainers.data.documents import Documents, Encoder
from trainers.data.packing import PackedStream
from trainers.step import normalize_weights

RSS_GOAL = 50 << 20


def rss() -> int:
    """This process's resident set size now (bytes), from /proc (``ru_maxrss`` is a peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_corpora(root: Path, n_docs: int, seed: int = 0) -> dict[str, tuple[Path, tuple[str, ...]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = np.array("the of and to a in that is was for on with as by at from it his an be".split())
    lens = rng.integers(20, 400, size=n_docs)
    with open(root / "text.jsonl", "w") as f:
        for n in lens:
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=n // 4))}) + "\n")
    chat = pa.table({"prompt": [f"Question {i}: " + " ".join(rng.choice(words, size=int(n) // 16)) for i, n in
                                enumerate(lens)],
                     "response": [" ".join(rng.choice(words, size=int(n) // 6)) for n in lens]})
    pq.write_table(chat, root / "chat.parquet", row_group_size=4096)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 32000, offsets[-1]).astype(np.int32)))
    pq.write_table(pa.table({"tokens": ids}), root / "tokens.parquet", row_group_size=4096)
    return {"JSONL text (bytes)": (root / "text.jsonl", ("text",)),
            "Parquet chat, prompt masked (bytes)": (root / "chat.parquet", ("prompt", "response")),
            "Parquet pre-tokenized (int32 lists)": (root / "tokens.parquet", ("tokens",))}


def loader_rate(path: Path, fields: tuple[str, ...], seq_len: int, batch: int, n: int) -> tuple[float, float]:
    """(tokens/s, padding fraction) of ``n`` packed batches after one warm-up batch."""
    fmt = "jsonl" if path.suffix == ".jsonl" else "parquet"
    it = iter(PackedStream(Documents(fmt, str(path), fields), Encoder(), "train", seq_len=seq_len,
                           global_batch=batch, seed=0))
    next(it)
    start, tokens = time.perf_counter(), 0
    for _ in range(n):
        tokens += next(it)["inputs"].size
    return tokens / (time.perf_counter() - start), it.padding_fraction


def main_job_rate(quick: bool) -> tuple[float, str]:
    """Tokens/s the main job's step consumes (median of timed steps), and what ran."""
    cfg, batch, length = common.gpt_config(quick, one_block=True)
    setup = common.gpt_setup(cfg, common.layout_mesh("fsdp_tp"), "fsdp_tp", batch, length)
    state = setup.state
    times = []
    for _ in range(2 if quick else 6):
        start = time.perf_counter()
        state, loss = setup.compiled(state, setup.batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    step = float(np.median(times[1:]))
    return batch * length / step, f"{batch} x {length} tokens in {step * 1e3:.0f} ms/step"


def rss_rows(root: Path, quick: bool) -> list[Row]:
    target = (2 if quick else 10) * RSS_GOAL  # bytes of corpus streamed
    path, line = root / "big.jsonl", json.dumps({"text": "lorem ipsum dolor sit amet " * 150}) + "\n"
    with open(path, "w") as f:
        for _ in range(target // len(line) + 1):
            f.write(line)
    it = iter(PackedStream(Documents("jsonl", str(path), ("text",)), Encoder(), "train", seq_len=4096,
                           global_batch=16, seed=0, shuffle=False, repeat=False, validation_fraction=0.0))
    next(it)
    first, peak, start = rss(), 0, time.perf_counter()
    for _ in it:
        peak = max(peak, rss())
    seconds = time.perf_counter() - start
    growth = max(peak - first, 0)
    size = path.stat().st_size
    return [Row("RSS growth streaming a JSONL corpus", fmt_bytes(growth), f"{fmt_bytes(RSS_GOAL)} (corpus "
                f"{fmt_bytes(size)}, {size / RSS_GOAL:.0f}x the goal)", growth / RSS_GOAL, "<= 1", growth <= RSS_GOAL,
                f"RSS {fmt_bytes(first)} after the first batch, peak {fmt_bytes(peak)}; read in {seconds:.1f} s")]


def packed_rows(n_rows: int, length: int, doc: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    seg = np.cumsum(rng.random((n_rows, length)) < 1.0 / doc, axis=1).astype(np.int32) + 1
    return {"inputs": rng.integers(0, 256, (n_rows, length), dtype=np.int32),
            "targets": rng.integers(0, 256, (n_rows, length), dtype=np.int32),
            "segment_ids": seg, "positions": segments.document_positions(seg),
            "weights": np.ones((n_rows, length), np.float32)}


def packed_step(cfg: GPTConfig):
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optax.sgd(1e-3)

    def step(params, batch):
        def loss(p):
            b = normalize_weights(batch)
            return nnx.merge(graphdef, p).loss(b["inputs"], b["targets"], segment_ids=b["segment_ids"],
                                               positions=b["positions"], weights=b["weights"])[0]
        value, grads = jax.value_and_grad(loss)(params)
        return optax.apply_updates(params, tx.update(grads, tx.init(params))[0]), value

    return jax.jit(step), params


def attention_rows(quick: bool) -> list[Row]:
    block = 64 if quick else 512
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, attention="blockwise",
                    attention_block=block)
    lengths = (256, 1024) if quick else (2048, 8192)
    temps = {}
    for length in lengths:
        step, params = packed_step(cfg)
        batch = {k: jnp.asarray(v) for k, v in packed_rows(1, length, 400).items()}
        temps[length] = spmd.inspection.memory(step.lower(params, batch).compile()).temp
    growth = temps[lengths[1]] / temps[lengths[0]]
    rows = [Row(f"blockwise with segments: temporaries L={lengths[1]} / L={lengths[0]}",
                f"{fmt_bytes(temps[lengths[1]])} / {fmt_bytes(temps[lengths[0]])}", "linear 4x, quadratic 16x", growth,
                "<= 4.5", growth <= 4.5, "documents of ~400 tokens; compiled only")]
    # quick: one row, so that the skipping step is the L=1024 program above again (a compile cache hit)
    n_rows, length, doc = (1, 1024, 64) if quick else (2, 4096, 128)
    batch = {k: jnp.asarray(v) for k, v in packed_rows(n_rows, length, doc).items()}
    cfg = GPTConfig(**{**cfg.__dict__, "attention_block": 64 if quick else 128})
    frac = segments.skipped_fraction(np.asarray(batch["segment_ids"]), cfg.attention_block)
    timings = {}
    real_table = segments.block_table
    for mode in ("skip", "all"):
        if mode == "all":  # the same program with every block pair needed: nothing skipped
            segments.block_table = lambda q, k, size: jnp.ones((q.shape[1] // size, k.shape[1] // size), bool)
        try:
            step, params = packed_step(cfg)
            jax.block_until_ready(step(params, batch))
            runs = []
            for _ in range(2 if quick else 4):
                start = time.perf_counter()
                jax.block_until_ready(step(params, batch))
                runs.append(time.perf_counter() - start)
            timings[mode] = float(np.median(runs))
        finally:
            segments.block_table = real_table
    ratio = timings["skip"] / timings["all"]
    rows.append(Row(f"blockwise step, {n_rows} x {length} tokens, documents of ~{doc}", f"{timings['skip'] * 1e3:.0f} ms "
                    f"(skipping {frac:.0%} of causal block pairs)", f"{timings['all'] * 1e3:.0f} ms (no skipping)",
                    ratio, "< 1", ratio < 1, f"attention_block={cfg.attention_block}; one device"))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.packing") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    rows: list[Row] = []
    consumed, job = main_job_rate(options.quick)
    seq_len, batch, n = (256, 8, 20) if options.quick else (2048, 16, 40)
    with tempfile.TemporaryDirectory() as tmp:
        corpora = write_corpora(Path(tmp), 2000 if options.quick else 20000)
        for what, (path, fields) in corpora.items():
            rate, padding = loader_rate(path, fields, seq_len, batch, n)
            pretok = "pre-tokenized" in what
            goal = 1e6 if pretok else 10 * consumed
            rows.append(Row(f"loader: {what}", f"{rate / 1e6:.2f} M tokens/s",
                            "1M tokens/s" if pretok else f"{consumed / 1e3:.1f} k tokens/s = main job's step ({job})",
                            rate / (1e6 if pretok else consumed), ">= 1" if pretok else ">= 10", rate >= goal,
                            f"padding {padding:.1%}; rows of {seq_len}, batch {batch}; one process"))
        rows += rss_rows(Path(tmp), options.quick)
    rows += attention_rows(options.quick)
    before = ["- loader: trainers.data.packing.PackedStream, segments packing, shuffled blocks, byte tokens (the text "
              "corpora) or the ids as stored; documents of 20-400 words/tokens",
              "- attention: GPT d_model=64, n_layers=2, n_heads=4, f32, SGD; one device"]
    common.report("packing", "Documents: packed loader and blockwise attention over packed rows", rows, options,
                  command, before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.packing") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
