"""Document corpora (JSONL, Parquet, saved Hugging Face datasets) stream into packed rows that resume
exactly, split across processes, and refuse bad input with one message naming the file and the field."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainers.data import DataConfig
from trainers.data import documents as docs_lib
from trainers.data.documents import Documents, Encoder
from trainers.data.packing import PackedStream, packed_stream
from trainers.launch import cli

L = 32


def write_jsonl(path, n=200, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " + "ab" * int(rng.integers(0, 20)), "id": i}) + "\n")
    return path


def write_chat(path, n=120, row_group=16):
    table = pa.table({"prompt": [f"Q{i}: what is {i} + {i}?" for i in range(n)],
                      "response": [f"It is {2 * i}." for i in range(n)]})
    pq.write_table(table, path, row_group_size=row_group)
    return path


def batches(stream, n):
    it = iter(stream)
    return [next(it) for _ in range(n)]


def test_segments_rows_hold_whole_documents_with_positions_and_weights(tmp_path):
    path = write_chat(tmp_path / "chat.parquet")
    stream = packed_stream(DataConfig(corpus="parquet", path=str(path), fields="prompt,response", seq_len=L,
                                      global_batch=4), "train")
    batch = batches(stream, 1)[0]
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    for r in range(4):
        seg, pos, w = batch["segment_ids"][r], batch["positions"][r], batch["weights"][r]
        assert np.all(np.diff(seg) >= 0) and seg[0] == 1
        for s in np.unique(seg):
            idx = np.flatnonzero(seg == s)
            assert np.array_equal(pos[idx], np.arange(idx.size))  # positions restart per document
        text = bytes(batch["inputs"][r][seg == 1].astype(np.uint8)).decode()
        assert text.startswith("Q") and "It is" in text
        # the prompt's targets weigh 0, the response's and its end token's 1; padding 0
        first = batch["targets"][r][seg == 1]
        w1 = w[seg == 1]
        prompt_len = text.index("It is")  # targets shifted by one: target t is input t + 1
        assert np.all(w1[: prompt_len - 1] == 0) and np.all(w1[prompt_len - 1:] == 1)
        assert first[-1] == 0 or first.size == L  # ends with the end token, unless cut at seq_len
    it = iter(stream)
    next(it)
    assert 0 <= it.padding_fraction < 0.5


@pytest.mark.parametrize("packing", ["segments", "concat"])
@pytest.mark.parametrize("block_bytes", [512, 1 << 20])  # more blocks than rows; fewer
def test_resume_is_exact_and_the_global_batch_is_the_same_on_any_process_count(tmp_path, packing, block_bytes,
                                                                                monkeypatch):
    monkeypatch.setattr(docs_lib, "BLOCK_BYTES", block_bytes)
    path = write_jsonl(tmp_path / "a.jsonl", n=400)
    docs = Documents("jsonl", str(path), ("text",))
    stream = PackedStream(docs, Encoder(), "train", seq_len=L, global_batch=4, seed=3, packing=packing)
    it = iter(stream)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # JSON round trip, as the checkpoint stores it
    expected = [next(it) for _ in range(6)]
    resumed = iter(stream)
    resumed.set_state(state)
    for a in expected:
        b = next(resumed)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # two processes, each packing only its rows, resumed from the one-process state: the same global batches
    halves = [iter(stream.for_process(p, 2)) for p in (0, 1)]
    for h in halves:
        h.set_state(state)
    for a in expected:
        parts = [next(h) for h in halves]
        assert all(np.array_equal(a[k], np.concatenate([p[k] for p in parts])) for k in a)
    if block_bytes == 512:  # each row reads only its own blocks
        assert len(docs.blocks) > 8 and not set(stream.block_order(0, 0)) & set(stream.block_order(0, 1))
    with pytest.raises(ValueError, match="seq_len"):
        PackedStream(docs, Encoder(), "train", seq_len=L + 1, global_batch=4, seed=3,
                     packing=packing).__iter__().set_state(state)


def test_train_and_validation_are_disjoint_and_eval_is_one_finite_pass(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", n=400)
    cfg = DataConfig(corpus="jsonl", path=str(path), seq_len=L, global_batch=2, validation_fraction=0.2)
    val = packed_stream(cfg, "validation", train=False)
    val_docs = {rid.rsplit("/", 1)[1] for rid, _ in val.docs.split_records(val.blocks[0], "validation", 0.2)}
    assert 40 < len(val_docs) < 130
    moved = tmp_path / "elsewhere" / "deeper"  # the split does not depend on where the corpus lives
    moved.mkdir(parents=True)
    (moved / "a.jsonl").write_bytes(path.read_bytes())
    for where in (moved / "a.jsonl", moved, moved / "*.jsonl"):
        docs = docs_lib.Documents("jsonl", str(where), ("text",))
        assert {rid.rsplit("/", 1)[1] for rid, _ in docs.split_records(docs.blocks[0], "validation", 0.2)} == val_docs
    n = sum(int(b["weights"].sum() > 0) for b in val)  # a finite pass
    assert n > 0
    assert len(list(val)) == len(list(val))  # iterating again starts over


def test_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="data.corpus=hf needs the optional datasets library")
    ds = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [f"train document {i}" for i in range(50)]}),
        "validation": datasets.Dataset.from_dict({"text": [f"held out {i}" for i in range(10)]})})
    ds.save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(corpus="hf", path=str(tmp_path / "ds"), seq_len=L, global_batch=2)
    train = bytes(batches(packed_stream(cfg, "train"), 1)[0]["inputs"].reshape(-1).astype(np.uint8))
    val = bytes(next(iter(packed_stream(cfg, "validation", train=False)))["inputs"].reshape(-1).astype(np.uint8))
    assert b"train document" in train and b"held out" not in train and b"held out" in val


def _bad_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    (tmp_path / "int.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "y" * 100}) + "\n")
    chat = write_chat(tmp_path / "chat.parquet")
    return [
        (dict(corpus="jsonl", path=str(tmp_path / "a.jsonl"), text_field="body"), ["a.jsonl", "no field 'body'"]),
        (dict(corpus="parquet", path=str(chat), fields="prompt,answer"), ["chat.parquet", "'answer'"]),
        (dict(corpus="jsonl", path=str(tmp_path / "int.jsonl")), ["int.jsonl", "'text'", "not a string"]),
        (dict(corpus="jsonl", path=str(tmp_path / "empty.jsonl")), ["empty.jsonl", "empty file"]),
        (dict(corpus="jsonl", path=str(tmp_path / "long.jsonl"), truncate=False), ["long.jsonl", "data.truncate",
                                                                                   "data.seq_len=32"]),
        (dict(corpus="parquet", path=str(tmp_path / "fake.parquet")), ["fake.parquet", "not a Parquet file"]),
        (dict(corpus="jsonl", path=str(tmp_path / "none*.jsonl")), ["none*.jsonl", "matches no file"]),
        (dict(corpus="stdlib", packing="segments"), ["data.packing='segments'", "document corpus"]),
        (dict(corpus="jsonl", path=str(tmp_path / "long.jsonl"), validation_fraction=0.99), ["long.jsonl",
                                                                                         "no document in split"]),
        (dict(corpus="jsonl", path=str(tmp_path / "int.jsonl").replace("int", "a"), global_batch=400),
         ["a.jsonl", "data.global_batch=400", "at most"]),
    ]


def test_bad_inputs_are_one_message_naming_file_and_field(tmp_path):
    write_jsonl(tmp_path / "a.jsonl")
    for kw, needles in _bad_inputs(tmp_path):
        with pytest.raises(ValueError) as e:
            DataConfig(**{"seq_len": L, **kw})
        assert all(n in str(e.value) for n in needles), (kw, str(e.value))
        assert "\n" not in str(e.value)


def test_cli_refuses_bad_documents_with_exit_2_and_writes_nothing(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl")
    for i, (kw, needles) in enumerate(_bad_inputs(tmp_path)[:6] + _bad_inputs(tmp_path)[-2:]):
        run_dir = tmp_path / f"run{i}"
        sets = [a for k, v in {**kw, "seq_len": L}.items() for a in ("--set", f"data.{k}={v}")]
        code = cli.main(["gpt-small", "--tiny", "--run-dir", str(run_dir), *sets])
        err = capsys.readouterr().err
        assert code == cli.EXIT_USAGE and err.startswith("spmd-train: error: "), err
        assert needles[0] in err and not run_dir.exists(), err


def test_spmd_tokenize_writes_token_id_parquet_that_trains_as_stored(tmp_path, capsys):
    from test_tokenize import _bpe  # tests/ is on the path, as for helpers/
    from tokenizers import Tokenizer

    from trainers.launch import tokenize as tokenize_cli

    chat = write_chat(tmp_path / "chat.parquet")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(pq.read_table(chat).column("prompt").to_pylist() + pq.read_table(chat).column(
        "response").to_pylist()))
    tok = _bpe([text], tmp_path / "tokenizer.json")
    out = tmp_path / "tok"
    argv = [str(chat), "--format", "parquet", "--fields", "prompt,response", "--tokenizer", str(tok), "--out",
            str(out), "--no-progress", "--validation-fraction", "0.2"]
    assert tokenize_cli.main(argv) == 0
    assert "train with: --set data.corpus=parquet" in capsys.readouterr().out
    assert tokenize_cli.main(argv) == 2 and "--overwrite" in capsys.readouterr().err  # never replaced silently
    train, val = (pq.read_table(out / f"{s}.parquet") for s in ("train", "validation"))
    assert train.num_rows + val.num_rows == 120 and val.num_rows > 5
    t = Tokenizer.from_file(str(tok))
    first = train.column("prompt").to_pylist()[0]
    assert t.decode(first).startswith("Q")
    # the prepared folder trains with its own splits, the ids as stored (end token included)
    cfg = DataConfig(corpus="parquet", path=str(out), fields="prompt,response", seq_len=L, global_batch=2,
                     vocab_size=t.get_vocab_size())
    stream = packed_stream(cfg, "validation", train=False)
    assert stream.docs.hash_split is False
    batch = next(iter(stream))
    seg = batch["segment_ids"][0]
    doc = np.concatenate([batch["inputs"][0][seg == 1], batch["targets"][0][seg == 1][-1:]])
    row = val.to_pylist()[0]
    assert doc.tolist() == row["prompt"] + row["response"]
    assert tokenize_cli.main([str(tmp_path / "nope.parquet"), "--format", "parquet", "--tokenizer", str(tok),
                              "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_two_processes_train_the_same_weighted_losses_and_resume_on_one(tmp_path):
    """2 processes x 4 devices vs 1 x 8 on a Parquet chat corpus, prompt masked: the same global batches
    (each process packs only its rows), so the same losses (the loss over weighted tokens of the
    global batch, summed across processes); a 2-process checkpoint resumes on 1 process exactly."""
    import os
    import shutil
    import sys

    from test_distributed import _close, _launch, _train_losses

    from trainers.launch import command
    from trainers.loop import train

    chat = write_chat(tmp_path / "chat.parquet", n=300, row_group=8)
    args = ["gpt-small", "--tiny", "--mesh", "data=2,tensor=4", "--rules", "dp_tp", "--steps", "4", "--set",
            "checkpoint.every_steps=2", "--set", "run.eval_batches=0", "--set", "run.progress=false", "--set",
            "data.corpus=parquet", "--set", f"data.path={chat}", "--set", "data.fields=prompt,response",
            "--set", f"data.seq_len={L}", "--set", "data.global_batch=8"]
    one, two, resumed = (str(tmp_path / n) for n in ("1x8", "2x4", "2x4-to-1x8"))
    train(command.build_config(cli.parse_args([*args, "--run-dir", one])))
    code, out, _ = _launch([sys.executable, "-m", "trainers", *args, "--run-dir", two], 2, 4)
    assert code == 0, out[-3000:]
    ref = _train_losses(one)
    assert sorted(ref) == [1, 2, 3, 4] and _close(_train_losses(two), ref), (_train_losses(two), ref)
    shutil.copytree(os.path.join(two, "checkpoints", "2"), os.path.join(resumed, "checkpoints", "2"))
    again = train(command.build_config(cli.parse_args([*args, "--run-dir", resumed])))
    assert again.start_step == 2 and _close(_train_losses(resumed), {k: ref[k] for k in (3, 4)})


def test_hf_without_the_datasets_library_says_how_to_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "ds").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match=r"needs the Hugging Face datasets library; pip install 'spmd\[hf\]'"):
        DataConfig(corpus="hf", path=str(tmp_path / "ds"), seq_len=L)


def test_token_array_readers_refuse_a_document_corpus(tmp_path):
    from trainers.data import load_corpus, make_loader

    cfg = DataConfig(corpus="jsonl", path=str(write_jsonl(tmp_path / "a.jsonl")), seq_len=L)
    for read in (lambda: load_corpus(cfg, "train"), lambda: make_loader(cfg, "train")):
        with pytest.raises(ValueError, match="packed_stream"):
            read()
