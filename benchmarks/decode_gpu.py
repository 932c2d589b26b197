"""Decode and prefill on one GPU: tokens/s of ``spmd.models.generate`` against the memory-bandwidth bound.

A Llama-shaped GPT of about 1.1B parameters (bf16 weights, GQA 16/8 heads) generates greedily with its
KV cache. Decode reads every weight and the whole cache once per step, so its bound is
``(weight bytes + KV-cache bytes) / HBM bandwidth`` tokens/s per sequence (the bandwidth measured here,
a jitted sum over 2 GiB); prefill is bounded by ``2 x params`` FLOPs per token at the device's bf16 peak
(measured: a 8192^3 matmul). Without a GPU it prints "no GPU: skipped".

    python -m benchmarks.decode_gpu [--quick] [--real-devices] [--output PATH]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import Row, fmt_bytes


def _bandwidth_and_peak() -> tuple[float, float]:
    x = jnp.ones((512 << 20,) if jax.default_backend() == "gpu" else (1 << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    bw = x.nbytes / min(common.timed(lambda: total(x).block_until_ready()) for _ in range(5))
    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    peak = 2 * n**3 * 10 / min(common.timed(lambda: [mm(a) for _ in range(10)]) for _ in range(5))
    return bw, peak


def rows(quick: bool) -> list[Row]:
    from flax import nnx

    from spmd.models import GPT, GPTConfig, generate, param_count
    from spmd.models.decode import layer_loop

    cfg = GPTConfig(vocab_size=32000, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, d_ff=5632, dtype="bfloat16")
    if quick:
        cfg = dataclasses.replace(cfg, vocab_size=1024, d_model=256, n_layers=2, d_ff=512)
    graphdef, state = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                                             state))  # bf16 weights: what decode reads
    params = param_count(cfg)
    bw, peak = _bandwidth_and_peak()
    auto = layer_loop("auto")
    out = []

    def timer(b: int, p: int, k: int, loop: str):
        prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, p)).astype(np.int32)
        return lambda: jax.block_until_ready(generate(model, prompt, k, loop=loop))

    for b in (1, 8):
        p, n = 128, 32 if quick else 128
        runs = {(loop, k): timer(b, p, k, loop) for loop in ("scan", "unrolled") for k in (1, n + 1)}
        for fn in runs.values():
            fn()  # compile
        t = common.interleaved(3, {f"{loop} {k}": (lambda fn=fn: common.timed(fn)) for (loop, k), fn in runs.items()})
        kv = 2 * cfg.n_layers * b * (p + n) * cfg.kv_heads * cfg.k * 2  # bf16 cache, read whole every step
        bound_s = (params * 2 + kv) / bw
        for loop in ("scan", "unrolled"):
            one, many = min(t[f"{loop} 1"]), min(t[f"{loop} {n + 1}"])
            step_s = (many - one) / n
            ratio = (b / step_s) / (b / bound_s)
            chosen = loop == auto
            out.append(Row(f"decode, batch {b}, one GPU (bf16), layers {loop}{' (auto)' if chosen else ''}",
                           f"{b / step_s:.0f} tokens/s",
                           f"{b / bound_s:.0f} tokens/s reading weights {fmt_bytes(params * 2)} + KV cache "
                           f"{fmt_bytes(kv)} once per step at {bw / 1e12:.2f} TB/s (measured)",
                           ratio, ">= 0.6" if chosen else "reported", ratio >= 0.6 if chosen else None,
                           f"{step_s * 1e3:.2f} ms per step = (t({n + 1} tokens) - t(1)) / {n}; prompt {p}"))
    long = 256 if quick else 2048
    for b, p in ((1, 128), (8, 128), (1, long), (8, long)):
        fn = timer(b, p, 1, auto)
        fn()
        one = min(common.timed(fn) for _ in range(3))
        flops = 2 * params * b * p + 2 * cfg.n_layers * b * p * p * cfg.n_heads * cfg.k  # matmuls + causal attention
        bound = b * p / (flops / peak)
        ratio = (b * p / one) / bound
        out.append(Row(f"prefill, batch {b} x {p} tokens, one GPU (bf16)", f"{b * p / one:.0f} tokens/s",
                       f"{bound:.0f} tokens/s at 2 x params FLOPs per token + causal attention, "
                       f"{peak / 1e12:.0f} TFLOP/s measured bf16 matmul", ratio,
                       ">= 0.6" if p == long else "reported", ratio >= 0.6 if p == long else None,
                       f"{one * 1e3:.1f} ms incl. sampling one token (one program: cache, prefill, sample)"))
    return out


def run(options: common.Options, command: str = "python -m benchmarks.decode_gpu") -> list[Row]:
    return common.report_gpu("decode_gpu", "Decode on one GPU", rows, options, command, lambda: [
        f"- {jax.devices()[0].device_kind}; GPT d_model 2048, GQA 16/8 heads, d_ff 5632, vocab 32000, "
        "bf16 weights and cache, greedy; minimum of 3 interleaved rounds"])


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.decode_gpu") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
