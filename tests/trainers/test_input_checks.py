"""Inputs checked before anything compiles: pre-tokenized ids of every document format, and imported
weights checked finite as they are read; each refusal names where, the value and what is valid,
beside a negative control that passes."""

import json

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from spmd.interchange import load_pretrained, save_pretrained
from spmd.models import GPT, GPTConfig
from trainers.config import override
from trainers.data.checks import check_document_ids
from trainers.data.documents import Documents
from trainers.launch import cli
from trainers.recipes import recipe
from trainers.task import checked_documents


def _records(n=40, bad=None):
    """``n`` prompt/response records of token ids, record ``n // 2`` with ``bad`` as one response id."""
    out = []
    for i in range(n):
        response = [(i * 7 + j) % 256 for j in range(12)]
        if bad is not None and i == n // 2:
            response[5] = bad
        out.append({"prompt": [1, 2, 3 + i % 200], "response": response})
    return out


def _jsonl(folder, records, extra_text=False):
    folder.mkdir(exist_ok=True)
    lines = [json.dumps(r) for r in records]
    if extra_text:  # text fields holding "[": parsed, not mistaken for ids
        lines += [json.dumps({"prompt": "a list [1, 2, 999]", "response": "[-5] is text"})] * 3
    (folder / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _config(path, corpus="jsonl", *sets):
    return override(recipe("gpt-small", tiny=True), [f"data.corpus={corpus}", f"data.path={path}",
                                                     "data.fields=prompt,response", "data.seq_len=32", *sets])


@pytest.mark.parametrize("bad, needle", [
    (256, r"field 'response' holds token id 256, outside the valid range \[0, 256\) of data.vocab_size=256.*"
          r"set data.vocab_size \(and model.vocab_size\) to at least 257"),
    (-3, r"field 'response' holds token id -3, outside the valid range \[0, 256\).*negative ids are never valid")])
def test_pretokenized_jsonl_ids_outside_the_vocab_are_refused(tmp_path, bad, needle):
    folder = _jsonl(tmp_path / "bad", _records(bad=bad))
    with pytest.raises(ValueError, match=needle) as e:
        checked_documents(_config(folder))
    offset = sum(len(json.dumps(r)) + 1 for r in _records()[:20])  # the bad record's first byte
    assert f"chat.jsonl' at byte {offset} field" in str(e.value) and "\n" not in str(e.value)
    ok = _config(_jsonl(tmp_path / "ok", _records(), extra_text=True))  # negative control
    assert next(iter(checked_documents(ok)))["inputs"].max() < 256


def test_pretokenized_parquet_ids_outside_the_vocab_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(records, path):
        path.parent.mkdir(exist_ok=True)
        table = pa.table({k: pa.array([r[k] for r in records], pa.list_(pa.int32())) for k in ("prompt", "response")})
        pq.write_table(table, path, row_group_size=16)  # the bad row (20) in the second row group
        return path.parent

    bad = write(_records(bad=70000), tmp_path / "bad" / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet' row 20 field 'response' holds token id 70000, outside the "
                                         r"valid range \[0, 256\).*at least 70001"):
        checked_documents(_config(bad, "parquet"))
    docs = Documents("parquet", str(bad), ("prompt", "response"))
    check_document_ids(docs, 70001)  # the same data under a vocab that covers it
    ok = write(_records(), tmp_path / "ok" / "train.parquet")  # negative control
    assert next(iter(checked_documents(_config(ok, "parquet"))))["inputs"].max() < 256


def test_cli_refuses_bad_pretokenized_ids_with_exit_2_before_compiling(tmp_path, capsys):
    folder = _jsonl(tmp_path / "bad", _records(bad=300))
    run_dir = tmp_path / "run"
    code = cli.main(["gpt-small", "--tiny", "--run-dir", str(run_dir), "--steps", "1", "--set", "data.corpus=jsonl",
                     "--set", f"data.path={folder}", "--set", "data.fields=prompt,response", "--set", "data.seq_len=32"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and "holds token id 300, outside the valid range [0, 256)" in err, err
    assert "step 1" not in err and not (run_dir / "config.json").exists()


# ----------------------------------------------------------------------------- imported weights
CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                tied_head_scale=False)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    save_pretrained(str(out), CFG, nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(3)), nnx.Param)))
    return out


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_non_finite_imported_weights_are_refused_naming_tensor_and_file(hf_folder, tmp_path, value, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hf_folder, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][17, 3] = value
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor {name} in .*bad/model.safetensors holds 1 non-finite value\(s\) "
                                         rf"of the 2,048 read \(first at index \[17, 3\]: {value}\); weights must be "
                                         "finite"):
        load_pretrained(str(bad))
    assert np.isfinite(nnx.to_pure_dict(nnx.state(load_pretrained(str(hf_folder)), nnx.Param))["embed"]).all()
    if np.isnan(value):  # the run refuses it too, with exit 2 and nothing written
        run_dir = tmp_path / "run"
        code = cli.main(["gpt-small", "--tiny", "--steps", "1", "--run-dir", str(run_dir), "--set",
                         f"checkpoint.init_from=hf:{bad}"])
        err = capsys.readouterr().err
        assert code == cli.EXIT_USAGE and f"tensor {name} in {bad}/model.safetensors" in err, err
        assert not (run_dir / "config.json").exists()
