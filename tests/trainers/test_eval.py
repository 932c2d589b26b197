"""Eval is one computation on every layout: the weighted loss, ``document_loss``, ``padding`` and the
other metrics of a packed, prompt-masked corpus are the same pipelined (every schedule), under
context parallelism and accumulation as on the plain data x fsdp x tensor layout, and a batch with
no loss weight at all is loss 0, weight 0."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from trainers.config import override
from trainers.examples import sft
from trainers.loop import evaluate
from trainers.setup import build
from trainers.step import eval_view

TOL = 1e-5
PLAIN = ("mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp")


@functools.cache
def base(tmp: str):
    """A chat corpus (the prompt weighs 0) packed with segment ids into rows of 32, 4 layers."""
    path = sft.write_chat(f"{tmp}/chat.parquet", n=300)
    return override(sft.config(path, f"{tmp}/run", steps=2, tiny=True),
                    ["data.seq_len=32", "data.global_batch=8", "model.n_layers=4", "data.validation_fraction=0.2"])


@functools.cache
def eval_of(tmp: str, sets: tuple[str, ...]) -> dict[str, float]:
    """One pass over the validation split (``run.eval_batches=-1``) of the freshly initialised model."""
    cfg = override(base(tmp), list(sets))
    run = build(cfg)
    return evaluate(run.eval_step, eval_view(run.sharded.state), run.task.eval_source(cfg), run.batch_sharding,
                    cfg.data.global_batch, -1)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("eval"))


def check_equal(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), (key, got, want)


def test_pipelined_eval_equals_unpipelined_on_a_packed_prompt_masked_corpus(tmp):
    """data=2 x pipe=2 x tensor=2, 1F1B over 4 microbatches: the eval loss is the weighted sum over the
    weight (not over every position), with the same padding and document loss as unpipelined."""
    want = eval_of(tmp, PLAIN)
    got = eval_of(tmp, ("mesh.axes=data=2,pipe=2,tensor=2", "rules=dp", "pipeline.schedule=1f1b",
                        "pipeline.microbatches=4"))
    check_equal(got, want)
    # negative control: the prompt weighs 0, so the loss over weighted tokens is not the mean over positions
    assert want["loss_weight"] < 0.5 and want["padding"] > 0.05, want
    assert abs(want["loss"] * want["loss_weight"] - want["loss"]) > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("sets", [  # every schedule in the sweep (1F1B: the fast test and the padded batch's below)
    pytest.param(("mesh.axes=data=2,pipe=2,tensor=2", "rules=dp", "pipeline.schedule=gpipe",
                  "pipeline.microbatches=2"), marks=pytest.mark.sweep),
    pytest.param(("mesh.axes=data=2,pipe=2,tensor=2", "rules=dp", "pipeline.schedule=interleaved",
                  "pipeline.microbatches=2", "pipeline.virtual_stages=2"), marks=pytest.mark.sweep),
    pytest.param(("mesh.axes=data=2,pipe=2,fsdp=2", "rules=fsdp", "pipeline.schedule=zb-h1",
                  "pipeline.microbatches=2"), marks=pytest.mark.sweep),
    pytest.param(("mesh.axes=data=2,pipe=2,tensor=2", "rules=dp", "pipeline.schedule=zb-h2",
                  "pipeline.microbatches=4"), marks=pytest.mark.sweep),
    pytest.param(("mesh.axes=data=2,pipe=2,tensor=2", "rules=dp", "pipeline.schedule=zb-v",
                  "pipeline.microbatches=2", "pipeline.virtual_stages=2"), marks=pytest.mark.sweep),
    ("mesh.axes=data=2,seq=2,tensor=2", "rules=dp_tp"),  # context parallelism
    ("mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp", "run.grad_accum=2"),
], ids=["gpipe", "interleaved", "zb-h1", "zb-h2", "zb-v", "context", "accumulation"])
def test_eval_is_the_same_on_every_layout(tmp, sets):
    check_equal(eval_of(tmp, sets), eval_of(tmp, PLAIN))


def test_a_batch_without_loss_weight_is_loss_zero_weight_zero():
    """All weights 0 (a prompt that fills the row): the train step's loss is 0 with loss_weight 0 and
    finite gradients, not NaN, and the step is not a bad one; a batch with weight is the control."""
    import optax
    from helpers.gpt_util import gpt_config, gpt_task

    import meshes
    from spmd.models import GPTConfig

    mesh = meshes.make_mesh({"data": 8})
    cfg = GPTConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    run = build(gpt_config({"data": 8}, "dp", "data.global_batch=8", "data.seq_len=8", model=cfg), gpt_task(cfg), mesh,
                tx=optax.sgd(0.1), donate=False)
    step, bs = run.train_step, run.batch_sharding
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(8, 9)).astype(np.int32)
    for weight in (0.0, 1.0):
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.full((8, 8), weight, np.float32)}
        _, m = step(run.stepped.state, jax.device_put(batch, bs))
        m = {k: float(v) for k, v in m.items()}
        assert bool(m["finite"]) and np.isfinite(m["grad_norm"]), m
        assert m["loss_weight"] == weight, m
        assert (m["loss"] == 0.0 and m["grad_norm"] == 0.0) if weight == 0 else m["loss"] > 1.0, m



@pytest.mark.slow
def test_pipelined_eval_of_a_padded_last_batch_without_weights_equals_unpipelined():
    """Token windows (no loss weights), ``run.eval_batches=-1`` over 1249 windows in batches of 16: the
    padded last batch's 15 padding rows weigh nothing under the pipeline too (they used to count)."""
    from trainers.recipes import recipe

    def evaluated(sets):
        cfg = override(recipe("gpt-small-pp", tiny=True), ["data.max_tokens=20000", *sets])
        run = build(cfg)
        source = run.task.eval_source(cfg)
        assert len(source) % cfg.data.global_batch, len(source)  # the last batch is padded
        return evaluate(run.eval_step, eval_view(run.sharded.state), source, run.batch_sharding,
                        cfg.data.global_batch, -1)

    check_equal(evaluated([]), evaluated(["pipeline.schedule=none", "mesh.axes=data=8"]))


# ----------------------------------------------------------------------------- many processes
def _chat_folder(path) -> str:
    """train.jsonl, and validation.jsonl whose documents go to rows 0..7 in turn (one block, read in
    order): short ones to rows 0-3, long ones to rows 4-7, so process 1 (rows 4-7 of 8) packs more
    eval batches than process 0."""
    import json
    import os

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)

    def record(long: bool) -> str:
        a, b = (int(x) for x in rng.integers(0, 100, 2))
        prompt = f"what is {a} plus {b}? " if long else f"{a}+{b}="
        return json.dumps({"prompt": prompt, "response": str(a + b)})

    with open(os.path.join(path, "train.jsonl"), "w") as f:
        f.write("\n".join(record(i % 2 == 1) for i in range(64)) + "\n")
    with open(os.path.join(path, "validation.jsonl"), "w") as f:
        f.write("\n".join(record(i % 8 >= 4) for i in range(40)) + "\n")
    return str(path)


@pytest.mark.slow
def test_two_process_packed_eval_of_the_whole_split_equals_one_process_and_exits(tmp_path):
    """``run.eval_batches=-1`` over a packed corpus on 2 processes x 4 devices: the processes pack
    different numbers of eval batches (checked), agree on the largest before the loop, and the eval
    record equals the 1-process one; the run exits 0 (it used to hang in the last eval batch)."""
    import os
    import signal
    import subprocess
    import sys

    from helpers.paths import REPO

    from trainers.data.packing import packed_stream
    from trainers.launch import cli, command
    from trainers.logger import read_metrics
    from trainers.loop import train

    data = _chat_folder(tmp_path / "chat")
    args = ["gpt-small", "--tiny", "--mesh", "data=2,fsdp=2,tensor=2", "--steps", "2", "--set", "data.corpus=jsonl",
            "--set", f"data.path={data}", "--set", "data.fields=prompt,response", "--set", "data.packing=segments",
            "--set", "data.seq_len=32", "--set", "run.eval_every=2", "--set", "run.eval_batches=-1",
            "--set", "run.progress=false", "--set", "run.tensorboard=false", "--set", "checkpoint.every_steps=2"]
    one, two = str(tmp_path / "1x8"), str(tmp_path / "2x4")
    cfg = command.build_config(cli.parse_args([*args, "--run-dir", one]))
    stream = packed_stream(cfg.data, "validation", train=False)
    counts = [stream.for_process(p, 2).count_batches() for p in range(2)]
    assert counts[0] < counts[1] == stream.count_batches(), counts  # the case: processes disagree
    reference = train(cfg)

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = jax.config.jax_compilation_cache_dir
    if cache:  # the children share this session's compilation cache
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    launcher = subprocess.Popen([sys.executable, "-m", "trainers.launch.local", "--processes", "2",
                                 "--devices-per-process", "4", "--", sys.executable, "-m", "trainers", *args,
                                 "--run-dir", two], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = launcher.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGTERM)  # the launcher stops both processes
        out = launcher.communicate(timeout=60)[0]
        pytest.fail(f"2 processes still running after 300 s (hung in eval?):\n{out[-3000:]}")
    assert launcher.returncode == 0, out[-3000:]
    evals = [r for r in read_metrics(two) if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [2], evals
    want = reference.eval_metrics[2]
    check_equal({k: evals[0][k] for k in want}, want)
    assert want["loss_weight"] < 0.9 and want["documents"] > 1, want  # weighted, packed: the numbers are not trivial
