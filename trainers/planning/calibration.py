"""Published training runs, expressed in the toolkit, and the planner's estimate for each.

Each :class:`PublishedRun` is a run someone else measured (torchtitan's, MaxText's and llm-foundry's tables):
the model as a GPT config, sequence, per-device batch, devices, hardware, the published layout (mesh,
rule set, remat policy) and the reported throughput, with the source file. :func:`estimate` prices it
with the analytic model the planner ranks by (:func:`trainers.planning.costs.layout_costs`) and
:func:`rank` places it among the planner's own candidates. Runs and results: docs/calibration.md;
``python -m trainers.planning.calibration`` prints the table.
"""

from __future__ import annotations

import dataclasses
import math

from spmd.models import GPTConfig, flops_per_token
from trainers.config import Config
from trainers.data.config import DataConfig
from trainers.planning.costs import Costs, layout_costs
from trainers.planning.hardware import get_hardware

RATIO_BOUNDS = (0.8, 1.25)  # estimated / published tokens/s per device
# runs whose published per-device batch is the largest that fit (the config lowered it when the model grew):
# one more row per device must not fit (docs/calibration.md)
LARGEST_BATCH = ("maxtext-32b v5p-128", "maxtext-64b v5p-128")

TT_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @31a17bf"
TT_A100 = "pytorch/torchtitan docs/performance.md @0413364"
MT_V5P = "AI-Hypercomputer/maxtext MaxText/configs/v5p/README.md @76bd53b, {}.sh"
MT_V5P_32B = "AI-Hypercomputer/maxtext README.md and MaxText/configs/v5p/32b.sh @9501baa"
MT_V5E = "AI-Hypercomputer/maxtext MaxText/configs/v5e/README.md @76bd53b, {}.sh"
MT_V5P_BIG = "AI-Hypercomputer/maxtext MaxText/configs/v5p/README.md @0ed7bd5, {}.sh @0777510"
LLMF = ("mosaicml/llm-foundry scripts/train/benchmarking/README.md @061f2c7, table {}; "
        "scripts/train/yamls/pretrain/mpt-30b.yaml")

LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336)
LLAMA3_70B = dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
LLAMA2_13B = dict(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824)
LLAMA2_70B = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
# MPT-30B (d_model 7168, 56 heads, 48 layers, vocab 50368, GELU MLP of 4 D): the toolkit's SwiGLU at the
# same MLP parameters and FLOPs, 3 D F = 8 D^2 (F = 8 D / 3, rounded down to a multiple of 8)
MPT_30B = dict(vocab_size=50368, d_model=7168, n_layers=48, n_heads=56, d_ff=19112)


def maxtext_model(scale: int) -> dict:
    """MaxText's ``global_parameter_scale`` model (base.yml: emb 2048, 16 heads of 128, MLP 7168, 16 layers,
    vocab 32000, SwiGLU): heads and MLP, then emb, then layers double in turn (pyconfig.get_individual_scales)."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + (rem > 0)
    emb = base + (rem > 1)
    return dict(vocab_size=32000, d_model=2048 << emb, n_layers=16 << base, n_heads=16 << heads, head_dim=128,
                d_ff=7168 << heads)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    model: dict  # GPTConfig fields
    seq_len: int
    batch_per_device: int  # global batch / devices (MaxText's per_device_batch_size, torchtitan's local batch)
    hardware: str
    mesh: tuple[tuple[str, int], ...]  # the published layout, outermost axis first
    rules: str
    remat: str  # spmd.remat policy the published checkpointing maps to
    published: float  # the reported figure: tokens/s per device, or TFLOP/s per chip (``tflops``)
    source: str
    tflops: bool = False  # MaxText reports model TFLOP/s per chip (PaLM counting, as spmd.models.flops_per_token)
    note: str = ""
    grad_accum: int = 1  # microbatches per step (batch_per_device counts all of them)

    @property
    def devices(self) -> int:
        return math.prod(n for _, n in self.mesh)

    def config(self) -> Config:
        model = GPTConfig(**self.model, dtype="bfloat16", remat_policy=self.remat, attention="cudnn")
        mesh_arg = ",".join(f"{a}={n}" for a, n in self.mesh)
        cfg = Config(model=model, rules=self.rules,
                     data=DataConfig(seq_len=self.seq_len, global_batch=self.batch_per_device * self.devices))
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, axes=mesh_arg),
                                   run=dataclasses.replace(cfg.run, grad_accum=self.grad_accum))

    @property
    def sizes(self) -> dict[str, int]:
        return {a: dict(self.mesh).get(a, 1) for a in ("data", "pipe", "fsdp", "seq", "expert", "tensor")}

    @property
    def tokens_per_device(self) -> float:
        """The published throughput in tokens/s per device."""
        if not self.tflops:
            return self.published
        return self.published * 1e12 / flops_per_token(self.config().model, self.seq_len)


RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("llama3-8b fsdp8 h100", LLAMA3_8B, 8192, 2, "h100-96gb", (("fsdp", 8),), "fsdp", "save_dots", 6667,
                 TT_H100, note="table 1, FSDP + torch.compile; selective op AC"),
    PublishedRun("llama3-8b fsdp128 h100", LLAMA3_8B, 8192, 2, "h100-96gb", (("fsdp", 128),), "fsdp", "save_dots", 6514,
                 TT_H100, note="table 3, FSDP + torch.compile; selective op AC"),
    PublishedRun("llama3-8b fsdp64 a100", LLAMA3_8B, 8192, 1, "a100", (("fsdp", 64),), "fsdp", "save_dots", 2973,
                 TT_A100, note="selective op AC; 58.2% MFU"),
    PublishedRun("llama3-70b fsdp64 a100", LLAMA3_70B, 8192, 1, "a100", (("fsdp", 64),), "fsdp", "full", 331,
                 TT_A100, note="full AC; 51.7% MFU"),
    PublishedRun("llama2-13b fsdp64 a100", LLAMA2_13B, 4096, 2, "a100", (("fsdp", 64),), "fsdp", "save_all_but_gathered", 2162,
                 TT_A100, note="no AC; 61.1% MFU"),
    PublishedRun("llama2-70b fsdp64 a100", LLAMA2_70B, 4096, 2, "a100", (("fsdp", 64),), "fsdp", "full", 353,
                 TT_A100, note="full AC; 50.5% MFU"),
    PublishedRun("maxtext-32b v5p-128", maxtext_model(32), 2048, 6, "tpu-v5p", (("fsdp", 16), ("tensor", 4)),
                 "fsdp_tp_sp", "save_dots", 311, MT_V5P_32B, tflops=True,
                 note="remat minimal; 67.76% MFU of 459 TFLOP/s, the Llama-style model at batch 6"),
    PublishedRun("maxtext-64b v5p-128", maxtext_model(64), 2048, 3, "tpu-v5p", (("fsdp", 16), ("tensor", 4)),
                 "fsdp_tp_sp", "save_dots", 323, MT_V5P.format("64b"), tflops=True, note="remat minimal; 70.31% MFU; batch 3 since the Llama-style model"),
    PublishedRun("maxtext-128b v5p-256", maxtext_model(128), 2048, 1, "tpu-v5p", (("fsdp", 16), ("tensor", 8)),
                 "fsdp_tp_sp", "save_dots", 315, MT_V5P.format("128b"), tflops=True, note="remat minimal; 68.68% MFU"),
    PublishedRun("maxtext-256b v5p-1024", maxtext_model(256), 2048, 1, "tpu-v5p", (("fsdp", 64), ("tensor", 8)),
                 "fsdp_tp_sp", "save_dots", 308, MT_V5P_BIG.format("256b"), tflops=True, note="remat minimal; 67.09% MFU"),
    PublishedRun("maxtext-512b v5p-1024", maxtext_model(512), 2048, 2, "tpu-v5p", (("fsdp", 64), ("tensor", 8)),
                 "fsdp_tp_sp", "full", 294, MT_V5P_BIG.format("512b"), tflops=True, note="remat full; 63.99% MFU"),
    PublishedRun("maxtext-16b v5e-256", maxtext_model(16), 2048, 6, "tpu-v5e", (("fsdp", 256),), "fsdp", "full", 120,
                 MT_V5E.format("16b"), tflops=True, note="remat full; 61.10% MFU"),
    PublishedRun("maxtext-32b v5e-256", maxtext_model(32), 2048, 4, "tpu-v5e", (("fsdp", 256),), "fsdp", "full", 132,
                 MT_V5E.format("32b"), tflops=True, note="remat full; 66.86% MFU"),
    PublishedRun("maxtext-64b v5e-256", maxtext_model(64), 2048, 2, "tpu-v5e", (("fsdp", 256),), "fsdp", "full", 118,
                 MT_V5E.format("64b"), tflops=True, note="remat full; 59.90% MFU"),
    PublishedRun("mpt-30b fsdp8 a100 accum21", MPT_30B, 2048, 63, "a100", (("fsdp", 8),), "fsdp", "full", 916,
                 LLMF.format("A100 80GB"), grad_accum=21,
                 note="FULL_SHARD, activation checkpointing, microbatch 3 x 21; 55.3% MFU"),
    PublishedRun("mpt-30b fsdp8 h100 accum21", MPT_30B, 2048, 63, "h100", (("fsdp", 8),), "fsdp", "full", 2002,
                 LLMF.format("H100 80GB BF16"), grad_accum=21,
                 note="FULL_SHARD, activation checkpointing, microbatch 3 x 21; 38.1% MFU"),
)


@dataclasses.dataclass(frozen=True)
class Point:
    """One published run priced by the model."""

    run: PublishedRun
    costs: Costs
    budget: float  # the planner's default budget (the hardware's headroom x HBM)
    hbm: float

    @property
    def tokens_per_device(self) -> float:
        cfg = self.run.config()
        return cfg.data.global_batch * cfg.data.seq_len / self.costs.roofline.step_s / self.run.devices

    @property
    def ratio(self) -> float:
        return self.tokens_per_device / self.run.tokens_per_device

    @property
    def fits(self) -> bool:
        """The estimate fits the planner's default budget: the planner would propose the layout."""
        return self.costs.memory is not None and self.costs.memory.total <= self.budget


def estimate(run: PublishedRun) -> Point:
    """The planner's analytic estimate of ``run`` in its published layout."""
    hw = get_hardware(run.hardware)
    costs = layout_costs(run.config(), run.sizes, hw)
    if costs.roofline is None:
        raise ValueError(f"published run {run.name!r} does not build: {[str(i) for i in costs.issues if i.fatal]}")
    return Point(run, costs, hw.headroom * hw.hbm_bytes, hw.hbm_bytes)


def rank(run: PublishedRun) -> tuple[int, float]:
    """``(rank, step / best step)`` of the published layout (its mesh and rule set) among
    :func:`trainers.planning.planner.plan`'s fitting layouts, each at its fastest remat policy and
    schedule (rank 0: no layout is faster). The published remat policy is the run's own choice; the
    planner proposes a policy per layout, so layouts are compared at their best."""
    from trainers.planning.planner import plan  # the planner imports the costs this module also reads

    result = plan(run.config(), run.devices, run.hardware, nearest=0)
    best: dict[tuple, float] = {}
    for e in result.ranked:
        key = (tuple((a, n) for a, n in e.layout.mesh if n > 1), e.layout.rules)
        best[key] = min(best.get(key, float("inf")), e.roofline.step_s)
    mine = (tuple((a, n) for a, n in run.mesh if n > 1), run.rules)
    step = min(best.get(mine, float("inf")), estimate(run).costs.roofline.step_s)
    return sum(s < step for k, s in best.items() if k != mine), step / min([*best.values(), step])


def table(points: list[Point] | None = None, ranks: dict[str, tuple[int, float]] | None = None) -> str:
    """The calibration table in markdown (with ``ranks``: the published layout's place in the plan)."""
    points = points if points is not None else [estimate(r) for r in RUNS]
    extra = " planner rank (step / best) |" if ranks else ""
    rows = [f"| run | devices | layout | published | tokens/s/device published | estimated | ratio | memory / HBM (budget) |{extra}",
            "|---|---|---|---|---|---|---|---|" + ("---|" if ranks else "")]
    for p in points:
        r = p.run
        fig = f"{r.published:g} TFLOP/s/chip" if r.tflops else f"{r.published:g} tokens/s/device"
        layout = ",".join(f"{a}={n}" for a, n in r.mesh) + f" {r.rules} remat={r.remat}" + (f" accum={r.grad_accum}" if r.grad_accum > 1 else "")
        row = (f"| {r.name} | {r.devices} {r.hardware} | {layout} | {fig} | {r.tokens_per_device:,.0f} | "
               f"{p.tokens_per_device:,.0f} | {p.ratio:.2f} | {p.costs.memory.total / 1e9:.1f} / {p.hbm / 1e9:.1f} ({p.budget / 1e9:.1f}) GB |")
        if ranks:
            k, rel = ranks[r.name]
            row += f" {k + 1} ({rel:.3f}) |"
        rows.append(row)
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(table(ranks={r.name: rank(r) for r in RUNS} if "--rank" in sys.argv else None))
