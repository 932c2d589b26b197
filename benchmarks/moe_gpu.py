"""MoE on one GPU: the dropless layer's grouped expert matmuls against the dense dispatch, timed.

The MoE layer alone (``value_and_grad`` of a loss of ``MoE(x)``, bf16 compute, D 1024, F 2816, E 8,
top-2) on T tokens of one device: dropless with grouped matmuls (``jax.lax.ragged_dot``, the GPU's
default, and the block loop, CPU's default) against the dense dispatch (every expert on every
token's slot grid, capacity ``E / k``: 4x the top-k FLOPs); same parameters and input, interleaved
rounds in one run, and their loss and gradients compared. Without a GPU it prints "no GPU: skipped".

    python -m benchmarks.moe_gpu [--quick] [--real-devices] [--output PATH]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import Row

D, F, E, K = 1024, 2816, 8, 2


def _step(tokens: int, capacity_factor: float, impl: str | None, quick: bool):
    from flax import nnx

    from spmd.models import MoE

    d, f = (128, 256) if quick else (D, F)
    layer = MoE(d, f, E, K, rngs=nnx.Rngs(0), capacity_factor=capacity_factor, dtype=jnp.bfloat16, grouped_impl=impl)
    graphdef, params = nnx.split(layer)

    def loss(p, x):
        y, stats = nnx.merge(graphdef, p)(x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + 0.01 * stats["aux_loss"]

    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, tokens, d)), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(loss)).lower(params, x).compile()
    return (lambda: jax.block_until_ready(step(params, x))), d, f


def rows(quick: bool) -> list[Row]:
    out = []
    for tokens in (512,) if quick else (4096, 16384):
        runs = {name: _step(tokens, cf, impl, quick) for name, cf, impl in
                (("ragged", 0.0, "ragged"), ("loop", 0.0, "loop"), ("dense", E / K, None))}
        results = {name: fn() for name, (fn, _, _) in runs.items()}
        times = common.interleaved(3 if quick else 5, {name: (lambda fn=fn: common.timed(fn)) for name, (fn, _, _) in runs.items()})
        best = {name: min(t) for name, t in times.items()}
        d, f = runs["dense"][1:]
        topk = 2 * 3 * K * tokens * 3 * d * f
        (ld, gd), (lr, gr) = results["dense"], results["ragged"]
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(gd)))
        for name in ("ragged", "loop"):
            out.append(Row(f"MoE layer T={tokens}, one GPU (bf16): dropless {name} vs dense dispatch, step time",
                           f"{best[name] * 1e3:.2f} ms", f"{best['dense'] * 1e3:.2f} ms dense dispatch",
                           best[name] / best["dense"], "reported", None,
                           f"{topk / best[name] / 1e12:.0f} TFLOP/s of top-k work (dense: "
                           f"{topk / best['dense'] / 1e12:.0f}, computing 4x that); best of interleaved rounds"))
        out.append(Row(f"MoE layer T={tokens}, one GPU: dropless ragged vs dense dispatch, max abs gradient difference",
                       f"{diff:.2e}", f"loss {float(lr):.6f} vs {float(ld):.6f}", float("nan"), "reported", None,
                       "bf16 compute, f32 parameters"))
    return out


def run(options: common.Options, command: str = "python -m benchmarks.moe_gpu") -> list[Row]:
    return common.report_gpu("moe_gpu", "MoE on one GPU", rows, options, command, lambda: [
        f"- {jax.devices()[0].device_kind}; MoE layer D {D}, F {F}, E {E}, top-{K}, bf16 compute, "
        "value_and_grad of the layer's loss; one device's tokens"])


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.moe_gpu") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    raise SystemExit(main())
