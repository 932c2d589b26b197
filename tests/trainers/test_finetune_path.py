"""The fine-tuning path on the default mesh: an imported Llama, a packed prompt/response corpus and
gradient accumulation on data=2 x fsdp=2 x tensor=2, trained end to end in a subprocess (a
compiler abort would kill the test process; here it is a failed test naming the signal).

Rows of 128 positions are the case jax 0.12's XLA aborted on (a failed check in the SPMD
partitioner: the embedding gather inside the accumulation loop's manual region); CI runs this
file on both ends of the supported jax range.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from helpers.fault_worker import worker_env

from spmd.interchange import save_pretrained
from spmd.models import GPT, GPTConfig
from trainers.logger import read_metrics

CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                tied_head_scale=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A random Llama-shaped Hugging Face folder (byte vocab) and a folder of chat records."""
    root = tmp_path_factory.mktemp("finetune")
    save_pretrained(str(root / "llama"), CFG, nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(3)), nnx.Param)))
    (root / "chat").mkdir()
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": f"q{i}: " + "what is " * int(rng.integers(1, 6)) + "this?",
                         "response": f"a{i}: " + "it is so. " * int(rng.integers(2, 9))}) for i in range(96)]
    (root / "chat" / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_imported_llama_packed_corpus_with_accumulation_on_the_default_mesh(inputs, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainers", "gpt-small", "--tiny", "--simulate-devices", "8", "--steps", "2",
           "--run-dir", str(run_dir), "--set", f"checkpoint.init_from=hf:{inputs / 'llama'}",
           "--set", "data.corpus=jsonl", "--set", f"data.path={inputs / 'chat'}", "--set", "data.fields=prompt,response",
           "--set", "data.seq_len=128", "--set", "run.grad_accum=2", "--set", "run.eval_batches=0",
           "--set", "run.progress=false", "--set", "run.tensorboard=false"]
    env = dict(worker_env(8), JAX_COMPILATION_CACHE_DIR=os.environ["SPMD_TEST_COMPILE_CACHE"],  # as in-process tests
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    died = f" (killed by {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else ""
    assert proc.returncode == 0, f"exit {proc.returncode}{died}\n{proc.stderr[-3000:]}"
    assert "data=2 x fsdp=2 x tensor=2" in proc.stdout + proc.stderr  # the default mesh of 8 devices
    records = read_metrics(str(run_dir))
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses)), records
