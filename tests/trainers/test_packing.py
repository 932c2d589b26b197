"""A packed batch of documents gives each document the loss and gradients it has alone, in every attention path, sharded and accumulated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.gpt_util import gpt_config, gpt_task

import meshes
import spmd
from spmd.models import GPT, GPTConfig
from spmd.models.segments import document_positions, skipped_fraction
from trainers.setup import build
from trainers.step import normalize_weights

CFG = GPTConfig(vocab_size=256,  # 64 trips an XLA partitioner check on data x fsdp x tensor under jax 0.12
                 d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, attention_block=4)
L, ROWS = 32, 16
TOL = 1e-5
ROW_OF: list[int] = []  # the row each document of corpus() was packed into


@functools.cache
def corpus(seed: int = 0):
    """Documents (token arrays, target weights) and their greedy packing into ROWS rows of L."""
    rng = np.random.default_rng(seed)
    rows = {k: np.zeros((ROWS, L), np.int32) for k in ("inputs", "targets", "segment_ids")}
    rows["weights"] = np.zeros((ROWS, L), np.float32)
    docs, r, o, s = [], 0, 0, 0
    while r < ROWS:
        n = int(rng.integers(2, 14))  # (input, target) pairs
        tokens = rng.integers(1, CFG.vocab_size, size=n + 1).astype(np.int32)
        w = (rng.random(n) < 0.7).astype(np.float32) * rng.choice([1.0, 0.5], size=n).astype(np.float32)
        if o + n > L:  # the row is full: pad it (one more segment) and start the next
            rows["segment_ids"][r, o:] = s + 1
            r, o, s = r + 1, 0, 0
            continue
        s += 1
        rows["inputs"][r, o:o + n], rows["targets"][r, o:o + n] = tokens[:-1], tokens[1:]
        rows["segment_ids"][r, o:o + n], rows["weights"][r, o:o + n] = s, w
        docs.append((tokens, w))
        ROW_OF.append(r)
        o += n
    rows["positions"] = document_positions(rows["segment_ids"])
    return docs, rows


def alone_rows(docs):
    """Each document alone in its own row from position 0, the rest of the row weighted 0: the
    unpacked (default, causal-only) path, an independent reference."""
    out = {k: np.zeros((len(docs), L), np.int32) for k in ("inputs", "targets")}
    out["weights"] = np.zeros((len(docs), L), np.float32)
    for i, (tokens, w) in enumerate(docs):
        n = tokens.size - 1
        out["inputs"][i, :n], out["targets"][i, :n], out["weights"][i, :n] = tokens[:-1], tokens[1:], w
    return out


@functools.cache
def _grad_fn(impl: str, packed: bool):
    keys = ("segment_ids", "positions", "weights") if packed else ("weights",)
    graphdef = nnx.split(GPT(GPTConfig(**{**CFG.__dict__, "attention": impl}), rngs=nnx.Rngs(0)))[0]

    @jax.jit
    def f(params, batch):
        def loss(p):
            b = normalize_weights(batch)
            m = nnx.merge(graphdef, p)
            return m.loss(b["inputs"], b["targets"], **{k: b[k] for k in keys})[0]
        return jax.value_and_grad(loss)(params)

    return f


def grad_of(impl: str, batch: dict, packed: bool):
    """(loss, grads) of the GPT with attention ``impl`` on ``batch`` (packed: with segment ids and positions)."""
    params = nnx.split(GPT(GPTConfig(**{**CFG.__dict__, "attention": impl}), rngs=nnx.Rngs(0)))[1]
    loss, grads = _grad_fn(impl, packed)(params, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(loss), grads


def rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@functools.cache
def alone_ce() -> list[np.ndarray]:
    """Each document's per-token cross-entropy alone (f64 NumPy from one device's logits): one forward
    of the rows of :func:`alone_rows` (causal: what follows a document in its row cannot reach it)."""
    docs, _ = corpus()
    model = GPT(GPTConfig(**{**CFG.__dict__, "attention": "naive"}), rngs=nnx.Rngs(0))
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(alone_rows(docs)["inputs"])), np.float64)
    out = []
    for (tokens, _), lg in zip(docs, logits):
        n = tokens.size - 1
        lg = lg[:n]
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        out.append(lse - lg[np.arange(n), tokens[1:]])
    return out


@functools.cache
def reference():
    docs, _ = corpus()
    return grad_of("naive", alone_rows(docs), packed=False)


@pytest.mark.parametrize("impl", ["naive", "xla", "blockwise"])
def test_packed_rows_equal_each_document_alone(impl):
    _, rows = corpus()
    ref_loss, ref_grads = reference()
    loss, grads = grad_of(impl, rows, packed=True)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel(grads, ref_grads) < TOL
    if impl == "naive":  # negative control: the same rows concatenated (one segment a row, positions run on)
        concat = {**rows, "segment_ids": np.ones_like(rows["segment_ids"]),
                  "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (ROWS, L)).copy()}
        c_loss, c_grads = grad_of(impl, concat, packed=True)
        assert abs(c_loss - ref_loss) > 1e-3 * ref_loss and rel(c_grads, ref_grads) > 1e-2


def test_blockwise_skips_blocks_that_share_no_document():
    _, rows = corpus()
    frac = skipped_fraction(rows["segment_ids"], CFG.attention_block)
    assert 0.2 < frac < 1.0, frac  # any row needing a block pair keeps it for the batch
    # one document filling each row: nothing to skip
    assert skipped_fraction(np.ones((2, L), np.int32), 4) == 0.0


def test_weighted_loss_sharded_and_accumulated_equals_numpy_over_the_global_batch():
    """data=2 x fsdp=2 x tensor=2, run.grad_accum=4 (1 row per device per microbatch): the step's loss
    is sum(w * ce) / sum(w) over the global batch, from per-token losses computed alone on one device
    and summed in NumPy; its gradient (SGD, lr 1) is the per-document reference's."""
    docs, rows = corpus()
    sizes = {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = meshes.make_mesh(sizes)
    model = GPTConfig(**{**CFG.__dict__, "attention": "blockwise"})
    cfg = gpt_config(sizes, "fsdp_tp", f"data.global_batch={ROWS}", f"data.seq_len={L}", "run.grad_accum=4",
                     model=model)
    run = build(cfg, gpt_task(model), mesh, tx=optax.sgd(1.0), donate=False)
    bs = run.batch_sharding
    params0 = jax.tree.map(np.asarray, run.stepped.state.params)
    state, metrics = run.train_step(run.stepped.state, {k: jax.device_put(v, bs) for k, v in rows.items()})
    # NumPy: per-token cross-entropy of each document alone (one device), weighted over the global batch
    num, den = np.zeros(ROWS), np.zeros(ROWS)
    for (_, w), ce, r in zip(docs, alone_ce(), ROW_OF):
        num[r], den[r] = num[r] + float((w * ce).sum()), den[r] + float(w.sum())
    assert float(metrics["loss"]) == pytest.approx(num.sum() / den.sum(), rel=TOL)
    # negative control: the mean of per-device means (one row per device per microbatch here) is another number
    assert abs(np.mean(num / den) - num.sum() / den.sum()) > 10 * TOL * num.sum() / den.sum()
    # params after one SGD step (lr 1) against p0 - g of the per-document reference (f32 cancellation in
    # p0 - p1 would cost the gradient ~1e-5, so compare params, relative to the update, as a norm)
    _, ref_grads = reference()
    expected = [p - np.asarray(g) for p, g in zip(jax.tree.leaves(params0), jax.tree.leaves(ref_grads))]
    diff = sum(float(np.sum((np.asarray(a) - b) ** 2)) for a, b in zip(jax.tree.leaves(state.params), expected))
    norm = sum(float(np.sum(np.asarray(g) ** 2)) for g in jax.tree.leaves(ref_grads))
    assert (diff / norm) ** 0.5 < TOL


def sharded_grad(sizes: dict, rules: str, exchange: str):
    """Packed loss and gradients with the GPT's length split over ``seq`` (context parallelism)."""
    _, rows = corpus()
    mesh = meshes.make_mesh(sizes)
    cfg = GPTConfig(**{**CFG.__dict__, "attention": "blockwise", "context_exchange": exchange})
    rules = spmd.get_rules(rules)
    graphdef, params, _ = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), rules, mesh)
    bs = spmd.batch_sharding(rules, mesh, dims=("batch",))

    @jax.jit
    def f(params, batch):
        def loss(p):
            with spmd.use_rules(rules, mesh):
                b = normalize_weights(batch)
                return nnx.merge(graphdef, p).loss(b["inputs"], b["targets"], segment_ids=b["segment_ids"],
                                                   positions=b["positions"], weights=b["weights"])[0]
        return jax.value_and_grad(loss)(params)

    loss, grads = f(params, {k: jax.device_put(v, bs) for k, v in rows.items()})
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("sizes, rules, exchange", [
    pytest.param({"data": 2, "seq": 2, "tensor": 2}, "dp_tp", "ring", marks=pytest.mark.sweep),
    pytest.param({"fsdp": 2, "seq": 4}, "fsdp", "allgather", marks=pytest.mark.sweep),
    pytest.param({"fsdp": 2, "seq": 4}, "fsdp", "ring", marks=pytest.mark.sweep),
    pytest.param({"data": 2, "seq": 2, "tensor": 2}, "dp_tp", "allgather", marks=pytest.mark.sweep),
])
def test_context_parallel_packed_rows_equal_each_document_alone(sizes, rules, exchange):
    ref_loss, ref_grads = reference()
    loss, grads = sharded_grad(sizes, rules, exchange)
    assert loss == pytest.approx(ref_loss, rel=TOL)
    assert rel(grads, ref_grads) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("schedule, accum", [pytest.param(*c, marks=pytest.mark.sweep) for c in (("1f1b", 2), ("zb-h1", 1))])
def test_pipelined_packed_rows_equal_each_document_alone(schedule, accum):
    """data=4 x pipe=2, 1F1B (with run.grad_accum=2 around it) or ZB-H1 over 2 microbatches: the packed
    train step's loss and gradient (SGD, lr 1) are the per-document reference's."""
    _, rows = corpus()
    sizes = {"data": 4, "pipe": 2}
    mesh = meshes.make_mesh(sizes)
    model = GPTConfig(**{**CFG.__dict__, "attention": "blockwise"})
    cfg = gpt_config(sizes, "dp", f"data.global_batch={ROWS}", f"data.seq_len={L}", f"run.grad_accum={accum}",
                     f"pipeline.schedule={schedule}", "pipeline.microbatches=2", model=model)
    run = build(cfg, gpt_task(model, pipeline=cfg.pipeline), mesh, tx=optax.sgd(1.0), donate=False)
    bs = run.batch_sharding
    params0 = jax.tree.map(np.asarray, run.stepped.state.params)
    state, metrics = run.train_step(run.stepped.state, {k: jax.device_put(v, bs) for k, v in rows.items()})
    ref_loss, ref_grads = reference()
    assert float(metrics["loss"]) == pytest.approx(ref_loss, rel=TOL)
    expected = [p - np.asarray(g) for p, g in zip(jax.tree.leaves(params0), jax.tree.leaves(ref_grads))]
    diff = sum(float(np.sum((np.asarray(a) - b) ** 2)) for a, b in zip(jax.tree.leaves(state.params), expected))
    norm = sum(float(np.sum(np.asarray(g) ** 2)) for g in jax.tree.leaves(ref_grads))
    assert (diff / norm) ** 0.5 < TOL


def test_eval_document_and_token_losses_equal_numpy():
    """The eval metrics of packed rows: each document's mean weighted loss (summed per row, with the
    document count per row) and the loss per weighted token, against each document alone in NumPy."""
    from spmd.models.packed import document_count, document_losses

    docs, rows = corpus()
    model = GPT(GPTConfig(**{**CFG.__dict__, "attention": "naive"}), rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    loss_B, count_B = nnx.jit(document_losses)(model, batch), document_count(model, batch)
    _, aux = nnx.jit(lambda m, b: m.loss(b["inputs"], b["targets"], segment_ids=b["segment_ids"],
                                         positions=b["positions"], weights=b["weights"]))(model, batch)
    means, num, den = [], 0.0, 0.0
    for (_, w), ce in zip(docs, alone_ce()):
        if w.sum() > 0:
            means.append(float((w * ce).sum() / w.sum()))
        num, den = num + float((w * ce).sum()), den + float(w.sum())
    assert float(count_B.sum()) == len(means)
    assert float(loss_B.sum() / count_B.sum()) == pytest.approx(np.mean(means), rel=TOL)
    assert float(aux["ce"] / aux["loss_weight"]) == pytest.approx(num / den, rel=TOL)  # per weighted token
    assert abs(np.mean(means) - num / den) > 1e-3  # the two averages differ: each is its own number
