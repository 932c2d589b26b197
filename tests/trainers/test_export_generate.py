"""``spmd-export`` and ``spmd-generate`` as a new user meets them: a model that would change on export is
refused unless asked for, no traceback without --debug, a length bounded by the model's and tokens
streamed as they are made, Ctrl-C answered within a second, and messages that name the fix for a Hugging
Face folder given where a run directory belongs (or the other way round)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx
from helpers.fault_worker import default_signals
from helpers.paths import REPO

from spmd.interchange import load_pretrained, save_pretrained
from spmd.models import GPT, GPTConfig, generate
from trainers.config import Config, RunConfig
from trainers.launch.models import export_main, generate_main
from trainers.logger import write_config

CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, tied_head_scale=False)
MOE = dataclasses.replace(CFG, n_experts=4, experts_per_token=2, moe_d_ff=32)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    save_pretrained(str(out), CFG, nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(0)), nnx.Param)))
    return out


def _run_dir(path, model: GPTConfig, *, step: bool = True):
    """A run directory's config.json for ``model`` (and, with ``step``, one step directory that holds no state)."""
    write_config(path, Config(model=model, run=RunConfig(run_dir=str(path))).to_dict())
    if step:
        os.makedirs(path / "checkpoints" / "5")
    return path


def test_export_refuses_a_capacity_moe_as_a_dropless_family_unless_asked(tmp_path, capsys):
    capacity = _run_dir(tmp_path / "capacity", dataclasses.replace(MOE, capacity_factor=1.25))
    assert export_main([str(capacity), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "would change the model: model.capacity_factor=1.25" in err and "MixtralForCausalLM is dropless" in err, err
    assert "--allow-model-change" in err and not os.path.exists(tmp_path / "out")
    # asked for: the model check passes, and the export goes on to read the step (none is usable here)
    assert export_main([str(capacity), str(tmp_path / "out"), "--allow-model-change"]) == 2
    err = capsys.readouterr().err
    assert "would change the model" not in err and "no params could be restored" in err, err
    dropless = _run_dir(tmp_path / "dropless", MOE)  # negative control: dropless exports as it is
    assert export_main([str(dropless), str(tmp_path / "out2")]) == 2
    assert "would change the model" not in capsys.readouterr().err


def test_a_run_without_a_usable_checkpoint_is_a_message_not_a_traceback(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", CFG)
    assert export_main([str(run), str(tmp_path / "out")]) == 2
    assert generate_main([str(run), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("no params could be restored") == 2 and "give RUN_DIR/STEP naming a complete step" in err, err
    assert "Traceback" not in err


def test_a_hugging_face_folder_without_hf_names_the_fix(hf_folder, tmp_path, capsys):
    assert generate_main([str(hf_folder), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "is a Hugging Face folder (config.json with architectures ['LlamaForCausalLM']" in err, err
    assert f"give hf:{hf_folder}" in err and "unknown config key" not in err, err
    assert export_main([f"hf:{hf_folder}", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is already a Hugging Face folder" in err and "RUN_DIR" in err and "asks for hf:PATH" not in err, err
    from trainers.config import override
    from trainers.pretrained import resolve

    with pytest.raises(ValueError, match=rf"checkpoint.init_from='{hf_folder}' is a Hugging Face folder .*"
                                         rf"give checkpoint.init_from=hf:{hf_folder}"):
        resolve(override(Config(), [f"checkpoint.init_from={hf_folder}"]))


def test_generate_is_bounded_by_the_models_positions_and_streams(hf_folder, capsys):
    import json

    hf = json.loads((hf_folder / "config.json").read_text())
    limit = hf["max_position_embeddings"]
    assert generate_main([f"hf:{hf_folder}", "--prompt", "1 2 3", "--ids", "--max-new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert f"exceeds the model's {limit} positions (max_position_embeddings of" in err, err
    assert f"give --max-new-tokens <= {limit - 3}" in err
    # streaming: each step's tokens reach the host in order as they are made, and they are the output
    model = load_pretrained(str(hf_folder))
    seen: list[np.ndarray] = []
    out = np.asarray(generate(model, np.asarray([[1, 2, 3]]), 6, on_tokens=seen.append))
    assert len(seen) == 6 and np.array_equal(np.stack(seen, axis=1), out)
    assert generate_main([f"hf:{hf_folder}", "--prompt", "1 2 3", "--ids", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in out[0]]


@pytest.mark.slow
def test_ctrl_c_during_export_exits_130_within_a_second_without_a_traceback(tmp_path):
    run = _run_dir(tmp_path / "run", CFG)
    code = ("import sys, time\n"
            "import trainers.pretrained as p\n"
            "def slow_export(*args, **kwargs):\n"  # an export that takes long: the Ctrl-C comes in the middle
            "    print('exporting', file=sys.stderr, flush=True)\n"
            "    time.sleep(60)\n"
            "p.export_run = slow_export\n"
            "from trainers.launch.models import export_main\n"
            "sys.exit(export_main())\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", code, str(run), str(tmp_path / "out")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    assert proc.stderr.readline().strip() == "exporting"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 130, (proc.returncode, err)
    assert took < 1.5, took  # INTERRUPT_GRACE_S, and the time to print
    assert "spmd-export: interrupted (Ctrl-C)" in err and "incomplete export" in err and "Traceback" not in err, err
