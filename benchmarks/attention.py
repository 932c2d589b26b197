"""Attention memory: compiled temporaries of the GPT training step per attention implementation and length.

Naive attention keeps the ``[B, H, L, L]`` f32 scores (and the probabilities autodiff saves for
the backward pass) for every layer, so the training step's temporaries grow quadratically in the
sequence length L. The blockwise path (``spmd.models.attention``, flash attention in plain JAX
with a custom VJP) keeps only q, k, v, the output and one f32 log-sum-exp per row, so the step
should grow linearly: from L=2048 to L=8192 (4x) the temporaries may grow by at most 4.5x.

For each implementation (naive, xla, blockwise) and length the minimal GPT train step
(``value_and_grad -> AdamW``, f32, batch 1, a tiny model so that attention dominates) is
compiled on one device and XLA's ``memory_analysis().temp_size_in_bytes`` read; nothing is
run, so lengths whose temporaries exceed this machine's memory still compile. Rows:

- **temporaries** per path and length, against the bytes of one layer's ``[B, H, L, L]`` f32
  score matrix (the analytic quadratic term);
- **growth** of each path's temporaries from the middle to the longest length (goal for
  blockwise: <= 4.5, linear is 4; naive is shown for contrast, ~16 when quadratic);
- **blockwise vs naive** at the longest length.

``--quick``: a tiny model with attention block 64 at L = 128 and 512; naive and xla at L = 512 only
(no growth rows for them); the state set up abstract (the "set up and compiled" seconds then exclude its init).

    python -m benchmarks.attention [--quick] [--output PATH]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

import spmd
from benchmarks import common
from benchmarks.common import Row, fmt_bytes
from spmd.models import GPTConfig, param_count

PATHS = ("naive", "xla", "blockwise")
SLACK = 1.125  # blockwise temp growth may exceed linear by this factor: 4.5 for 4x the length


def setting(quick: bool) -> tuple[GPTConfig, tuple[int, ...]]:
    """(model, lengths): attention block 512 (the default), or 64 and two short lengths when quick."""
    if quick:
        return GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, attention_block=64), (128, 512)
    cfg = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, attention_block=512)
    return cfg, (512, 2048, 8192)


def temp_bytes(cfg: GPTConfig, length: int, abstract: bool = False) -> tuple[int, float]:
    """(temp bytes per device, compile seconds) of the training step at ``length`` on one device."""
    start = time.perf_counter()
    setup = common.gpt_setup(cfg, common.layout_mesh("single"), "none", 1, length, abstract=abstract)
    return spmd.inspection.memory(setup.compiled).temp, time.perf_counter() - start


def run(options: common.Options, command: str = "python -m benchmarks.attention") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    base, lengths = setting(options.quick)
    mid, longest = lengths[-2], lengths[-1]
    temps: dict[tuple[str, int], int] = {}
    rows: list[Row] = []
    # quick (the test suite's smoke run): the growth of blockwise only; naive and xla at the longest length
    grown = ("blockwise",) if options.quick else PATHS
    for path in PATHS:
        cfg = dataclasses.replace(base, attention=path)
        for length in lengths if path in grown else lengths[-1:]:
            temp, seconds = temp_bytes(cfg, length, abstract=options.quick)
            temps[path, length] = temp
            scores = 4 * base.n_heads * length * length  # one layer's [B=1, H, L, L] f32 scores
            rows.append(Row(f"{path}: step temporaries, L={length}", fmt_bytes(temp),
                            f"{fmt_bytes(scores)} = one layer's [1, {base.n_heads}, L, L] f32 scores",
                            temp / scores, "reported", None, f"set up and compiled in {seconds:.1f} s"))
            print(f"{path} L={length}: {fmt_bytes(temp)}", flush=True)
    for path in grown:
        growth = temps[path, longest] / temps[path, mid]
        linear, quadratic = longest / mid, (longest / mid) ** 2
        goal, bound = path == "blockwise", SLACK * linear
        rows.append(Row(f"{path}: temporaries L={longest} / L={mid}",
                        f"{fmt_bytes(temps[path, longest])} / {fmt_bytes(temps[path, mid])}",
                        f"linear {linear:.0f}x, quadratic {quadratic:.0f}x", growth,
                        f"<= {bound:g}" if goal else "reported", growth <= bound if goal else None,
                        "memory linear in L, forward and backward" if goal else
                        ("scores materialised: quadratic" if growth > 2 * linear else "")))
    ratio = temps["blockwise", longest] / temps["naive", longest]
    rows.append(Row(f"blockwise vs naive temporaries, L={longest}", fmt_bytes(temps["blockwise", longest]),
                    fmt_bytes(temps["naive", longest]), ratio, "reported", None,
                    f"{1 / ratio:.0f}x less" if ratio < 1 else ""))
    before = [f"- model: GPT d_model={base.d_model}, n_layers={base.n_layers}, n_heads={base.n_heads}, "
              f"d_ff={base.ff}, vocab={base.vocab_size}, {param_count(base):,} params, f32, AdamW; batch 1; "
              f"one device; attention_block={base.attention_block}",
              "- measured: XLA's compiled temp bytes of the whole training step (forward + backward + update); "
              "compiled only, never run"]
    common.report("attention", "Attention: training-step temporaries per implementation and length", rows,
                  options, command, before=before, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.attention") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
