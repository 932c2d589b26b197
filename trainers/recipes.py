"""Recipes: functions returning a Config, each with a ``tiny`` variant that runs in seconds.

Run one with ``spmd-train NAME [--tiny] [--set key=value ...]``. Every recipe (and its tiny
variant) is loaded and stepped by the tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from trainers.checkpoint import CheckpointConfig
from trainers.config import Config, MeshConfig, RunConfig
from trainers.data import DataConfig
from trainers.lr import LRConfig
from trainers.optim import OptimizerConfig


def tiny_run(cfg: Config) -> Config:
    """Any config as a 2-step smoke run: 2 steps (warmup 1), eval of 1 batch at the end, synchronous
    checkpoints at the config's cadence and at the last step (a short run saves once), logs every step;
    model and data untouched (``spmd-train module:task --tiny``)."""
    return dataclasses.replace(
        cfg,
        lr=dataclasses.replace(cfg.lr, warmup_steps=1, total_steps=0),  # 0: the 2-step run
        checkpoint=dataclasses.replace(cfg.checkpoint, async_save=False),
        run=dataclasses.replace(cfg.run, name=cfg.run.name + "-tiny", steps=2, eval_every=2, eval_batches=1, log_every=1),
    )


def _tiny(cfg: Config) -> Config:
    """Shrink any recipe to a 2-step smoke run on a small model."""
    cfg = tiny_run(cfg)
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, d_model=32, n_layers=2, n_heads=4, n_kv_heads=None, d_ff=64, dtype="float32"),
        data=dataclasses.replace(cfg.data, seq_len=16, global_batch=8, max_tokens=50_000),
        run=dataclasses.replace(cfg.run, grad_accum=1),
    )


def gpt_small(tiny: bool = False) -> Config:
    """The README's main job: a 1.1M-parameter byte-level GPT on the Python standard library's
    source, FSDP x TP x DP on 8 (simulated) devices, 300 steps in a few minutes on 2 CPU cores."""
    cfg = Config(
        model=GPTConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512, dtype="float32"),
        mesh=MeshConfig(axes="data=2,fsdp=2,tensor=2"),
        rules="fsdp_tp",
        optimizer=OptimizerConfig(name="adamw", b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0),
        lr=LRConfig(kind="cosine", peak_lr=3e-3, warmup_steps=30, end_lr_fraction=0.1),
        data=DataConfig(corpus="stdlib", seq_len=128, global_batch=16, seed=0),
        checkpoint=CheckpointConfig(every_steps=100, keep=3),
        run=RunConfig(name="gpt-small", steps=300, eval_every=50, eval_batches=4, log_every=10),
    )
    return _tiny(cfg) if tiny else cfg


def gpt_small_pp(tiny: bool = False) -> Config:
    """``gpt-small`` (same model and data) pipelined: the 4 blocks as 4 stages over ``pipe=4``, the
    batch over ``data=2``, 1F1B with 8 microbatches (bubble 3/11 of the schedule's slots). The tiny
    variant keeps 4 layers (one per stage) and 16 rows (one per device per microbatch)."""
    cfg = dataclasses.replace(gpt_small(), mesh=MeshConfig(axes="data=2,pipe=4"), rules="dp",
                              pipeline=PipelineConfig("1f1b", microbatches=8),
                              run=dataclasses.replace(gpt_small().run, name="gpt-small-pp"))
    if not tiny:
        return cfg
    cfg = dataclasses.replace(cfg, pipeline=PipelineConfig())  # shrink unpipelined, then pipeline again
    cfg = _tiny(cfg)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=4),
                               data=dataclasses.replace(cfg.data, global_batch=16),
                               pipeline=PipelineConfig("1f1b", microbatches=8))


def gpt_moe(tiny: bool = False) -> Config:
    """``gpt-small`` with every MLP a mixture of 8 SwiGLU experts of width 256, top-2 (the active MLP width
    per token, 512, is gpt-small's), capacity factor 1.25; experts over ``expert=4``, the batch over
    ``data=2`` x ``expert=4`` (rules ``dp_ep``); aux and router z losses logged as ``moe_*`` (docs/moe.md)."""
    base = gpt_small()
    cfg = dataclasses.replace(
        base, model=dataclasses.replace(base.model, n_experts=8, experts_per_token=2, moe_d_ff=256, capacity_factor=1.25),
        mesh=MeshConfig(axes="data=2,expert=4"), rules="dp_ep", run=dataclasses.replace(base.run, name="gpt-moe"))
    if not tiny:
        return cfg
    cfg = _tiny(cfg)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_d_ff=32))


def _gpu_gpt(name: str, d_model: int, n_layers: int, n_heads: int, tiny: bool) -> Config:
    cfg = Config(
        model=GPTConfig(vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, dtype="bfloat16", remat=True),
        mesh=MeshConfig(axes="fsdp=-1"),
        rules="fsdp",
        optimizer=OptimizerConfig(name="adamw", b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0),
        lr=LRConfig(kind="cosine", peak_lr=6e-4, warmup_steps=200, end_lr_fraction=0.1),
        data=DataConfig(corpus="stdlib", seq_len=1024, global_batch=32),
        checkpoint=CheckpointConfig(every_steps=500, keep=3),
        run=RunConfig(name=name, steps=5000, eval_every=250, eval_batches=8, log_every=10),
    )
    return _tiny(cfg) if tiny else cfg


def gpt_125m(tiny: bool = False) -> Config:
    """GPT-2 small shape (12 x 768, ~85M non-embedding params, byte vocab), bf16, FSDP over all devices."""
    return _gpu_gpt("gpt-125m", 768, 12, 12, tiny)


def gpt_350m(tiny: bool = False) -> Config:
    """GPT-2 medium shape (24 x 1024, ~300M params, byte vocab), bf16, FSDP over all devices."""
    return _gpu_gpt("gpt-350m", 1024, 24, 16, tiny)


RECIPES: dict[str, Callable[..., Config]] = {"gpt-small": gpt_small, "gpt-small-pp": gpt_small_pp, "gpt-125m": gpt_125m,
                                             "gpt-350m": gpt_350m, "gpt-moe": gpt_moe}


def recipe(name: str, *, tiny: bool = False) -> Config:
    try:
        return RECIPES[name](tiny=tiny)
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}") from None
