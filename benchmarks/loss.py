"""Loss: the compiled training step's temporaries with the cross-entropy taken in chunks, vs whole logits.

The step is ``value_and_grad`` (wrt the head weight ``w[D, V]`` and the hidden states ``x[B, L, D]``,
both arguments) of the mean next-token cross-entropy of ``logits = x @ w`` (f32): once over whole
logits (``spmd.models.lm_loss``), once through ``spmd.models.loss.chunked_lm_loss`` (a scan over
chunks of the sequence, each chunk checkpointed so the backward pass recomputes its logits).
Shape: V = 32768, L = 2048, B = 1, D = 64 (``--quick``: V = 4096, L = 512, chunk 64).

- **temporaries, one device**: XLA's ``memory_analysis().temp_size_in_bytes``, deterministic. Whole
  logits ``[B, L, V]`` f32 are the unit; goal: the chunked step's temporaries at most half the
  unchunked step's (ratio <= 0.5);
- **parity**: the two losses and gradients on random inputs, max abs difference <= 1e-5;
- **matmul FLOPs**: the ``dot`` FLOPs of the compiled steps (loop bodies times their trip count):
  the recomputation costs one more head matmul per chunk, 4/3 of the unchunked step's head FLOPs;
- **fsdp_tp** (data=2, fsdp=2, tensor=2 on simulated devices; x ``[B_(data,fsdp), L, D]``, w
  ``[D_fsdp, V_tensor]``, logits constrained to ``[B_(data,fsdp), L, V_tensor]``, B = 4):
  temporaries per device and the collective bytes per step, chunked vs whole. The head weight's
  gradient is reduced over data x fsdp once per chunk, inside the loop (the partitioner cannot
  carry a partial sum through a loop); GPU compilers run XLA's while-loop all-reduce code motion,
  which sinks such an all-reduce out of the loop (a reduce-scatter only with
  ``--xla_gpu_enable_while_loop_reduce_scatter_code_motion``); not checked here: no GPU.

    python -m benchmarks.loss [--quick] [--output PATH]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import meshes
import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes
from benchmarks.mfu import dot_flops
from spmd.constraints import constrain
from spmd.models import lm_loss
from spmd.models.loss import chunked_lm_loss

GOAL = 0.5
TOL = 1e-5
FSDP_TP = {"data": 2, "fsdp": 2, "tensor": 2}


def shape(quick: bool) -> tuple[int, int, int, int]:
    """(vocab, length, d_model, chunk)."""
    return (4096, 512, 64, 64) if quick else (32768, 2048, 64, 256)


def step(chunk: int, sharded: bool = False):
    """``value_and_grad`` of the loss wrt (w, x); chunk 0: over whole logits."""
    def head(w_DV):
        return lambda x_BLD: constrain(jnp.einsum("bld,dv->blv", x_BLD, w_DV), ("batch", "length", "vocab"))

    def loss(w_DV, x_BLD, targets_BL):
        if chunk:
            return chunked_lm_loss(x_BLD, head(w_DV), targets_BL, chunk=chunk)[0]
        return lm_loss(head(w_DV)(x_BLD), targets_BL)[0]

    if not sharded:
        return jax.value_and_grad(loss, argnums=(0, 1))
    mesh, rules = meshes.make_mesh(FSDP_TP), spmd.get_rules("fsdp_tp")

    def in_rules(w_DV, x_BLD, targets_BL):
        with spmd.use_rules(rules, mesh):
            return jax.value_and_grad(loss, argnums=(0, 1))(w_DV, x_BLD, targets_BL)
    return in_rules


def shapes(vocab: int, length: int, d: int, batch: int, mesh=None) -> tuple[jax.ShapeDtypeStruct, ...]:
    if mesh is None:
        return (jax.ShapeDtypeStruct((d, vocab), jnp.float32), jax.ShapeDtypeStruct((batch, length, d), jnp.float32),
                jax.ShapeDtypeStruct((batch, length), jnp.int32))
    rules, sizes = spmd.get_rules("fsdp_tp"), meshes.axis_sizes(mesh)

    def sharding(dims, kind):
        return jax.sharding.NamedSharding(mesh, rules.spec(dims, kind=kind, mesh_sizes=sizes, what="benchmark"))
    return (jax.ShapeDtypeStruct((d, vocab), jnp.float32, sharding=sharding(("embed", "vocab"), "params")),
            jax.ShapeDtypeStruct((batch, length, d), jnp.float32,
                                 sharding=sharding(("batch", "length", "embed"), "activations")),
            jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=spmd.batch_sharding(rules, mesh)))


def one_device_rows(vocab: int, length: int, d: int, chunk: int) -> list[Row]:
    args = shapes(vocab, length, d, 1)
    whole_c = jax.jit(step(0)).lower(*args).compile()
    chunk_c = jax.jit(step(chunk)).lower(*args).compile()
    whole, chunked = spmd.inspection.memory(whole_c).temp, spmd.inspection.memory(chunk_c).temp
    logits = length * vocab * 4
    rows = [
        Row("whole logits: temporaries of the step (1 device)", fmt_bytes(whole),
            f"{fmt_bytes(logits)} = logits [1, {length}, {vocab}] f32", whole / logits, "reported", None,
            "the unit: the step holds the logits and their gradient (softmax) whole"),
        Row(f"chunked (chunk {chunk}): temporaries of the step (1 device)", fmt_bytes(chunked),
            f"{fmt_bytes(whole)} = whole logits' step", chunked / whole, f"<= {GOAL}", chunked / whole <= GOAL,
            f"{chunked / (chunk * vocab * 4):.1f} x one chunk's logits [1, {chunk}, {vocab}] f32 "
            f"({fmt_bytes(chunk * vocab * 4)})"),
    ]
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0.0, d**-0.5, (d, vocab)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(1, length, d)), jnp.float32)
    t = jnp.asarray(rng.integers(0, vocab, (1, length)), jnp.int32)
    (ref, ref_g), (got, got_g) = whole_c(w, x, t), chunk_c(w, x, t)
    loss_diff = abs(float(got) - float(ref))
    grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got_g, ref_g))
    rows.append(Row("parity: max abs loss difference, chunked vs whole", f"{loss_diff:.2e}", f"{TOL:.0e}",
                    loss_diff / TOL, "<= 1", loss_diff <= TOL, f"loss {float(ref):.6f}"))
    rows.append(Row("parity: max abs gradient difference, chunked vs whole", f"{grad_diff:.2e}", f"{TOL:.0e}",
                    grad_diff / TOL, "<= 1", grad_diff <= TOL, "gradients wrt the head weight and the hidden states"))
    whole_f, chunk_f = dot_flops(whole_c.as_text())[0], dot_flops(chunk_c.as_text())[0]
    rows.append(Row("chunked: matmul FLOPs of the step", f"{chunk_f:.3g}", f"{whole_f:.3g} = whole logits' step",
                    chunk_f / whole_f, "reported", None,
                    "expected 4/3: the backward pass recomputes each chunk's logits (one more head matmul)"))
    return rows


def fsdp_tp_rows(vocab: int, length: int, d: int, chunk: int) -> list[Row]:
    mesh = meshes.make_mesh(FSDP_TP)
    batch = 4
    args = shapes(vocab, length, d, batch, mesh)
    whole_c = jax.jit(step(0, sharded=True)).lower(*args).compile()
    chunk_c = jax.jit(step(chunk, sharded=True)).lower(*args).compile()
    whole, chunked = spmd.inspection.memory(whole_c).temp, spmd.inspection.memory(chunk_c).temp
    local_logits = batch // 4 * length * vocab // 2 * 4
    rows = [Row(f"fsdp_tp: temporaries per device, chunked (chunk {chunk}) vs whole", fmt_bytes(chunked),
                f"{fmt_bytes(whole)} = whole logits' step", chunked / whole, f"<= {GOAL}", chunked / whole <= GOAL,
                f"this device's logits shard [{batch // 4}, {length}, {vocab // 2}] f32: {fmt_bytes(local_logits)}")]
    summaries = [spmd.hlo.summarize(spmd.hlo.collectives(c, mesh)) for c in (whole_c, chunk_c)]
    for key in sorted(set(summaries[0]) | set(summaries[1])):
        w, c = (s.get(key, {"count": 0, "bytes": 0}) for s in summaries)
        kind, axes = key
        note = ""
        if kind == "all-reduce" and set(axes) == {"data", "fsdp"}:
            note = (f"the head weight's gradient, reduced once per chunk ({length // chunk} chunks) inside the loop "
                    "(+ the scalar loss); GPU compilers sink an all-reduce accumulated in a loop out of it, a "
                    "reduce-scatter (FSDP) only with --xla_gpu_enable_while_loop_reduce_scatter_code_motion")
        elif kind == "all-reduce" and axes == ("tensor",):
            note = "logsumexp and target logit over the vocab shards, per chunk; the hidden states' gradient"
        elif kind == "all-gather":
            note = "the head weight gathered over fsdp; chunked: once more for the backward recomputation"
        rows.append(Row(f"fsdp_tp: {kind} over {','.join(axes)} per step, chunked vs whole",
                        f"{fmt_bytes(c['bytes'])} ({c['count']} ops)",
                        f"{fmt_bytes(w['bytes'])} ({w['count']} ops)",
                        c["bytes"] / w["bytes"] if w["bytes"] else math.nan, "reported", None, note))
    return rows


def run(options: common.Options, command: str = "python -m benchmarks.loss") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    vocab, length, d, chunk = shape(options.quick)
    rows = one_device_rows(vocab, length, d, chunk)
    print("one device: done", flush=True)
    after = []
    if len(jax.devices()) >= math.prod(FSDP_TP.values()):
        rows += fsdp_tp_rows(vocab, length, d, chunk)
        print("fsdp_tp: done", flush=True)
    else:
        after.append(f"skipped fsdp_tp: it needs {math.prod(FSDP_TP.values())} devices, {len(jax.devices())} present")
    before = [f"- step: value_and_grad wrt (head w[D, V], hidden x[B, L, D]) of the mean cross-entropy of x @ w, f32; "
              f"V = {vocab}, L = {length}, D = {d}, B = 1 (fsdp_tp: B = 4); chunk {chunk} positions",
              "- temporaries: XLA's compiled temp bytes per device (deterministic; the arguments and outputs, "
              "the same for both, are not in them)"]
    common.report("loss", "Loss: chunked cross-entropy vs whole logits", rows, options, command,
                  before=before, after=after, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.loss") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
