"""Subword tokenizers and pre-tokenized corpora: ``spmd-tokenize`` writes the format once, training
reads it memory-mapped, a resume never tokenizes again; bad paths and tokenizers are one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import REPO

from trainers.data import DataConfig, corpus, load_corpus, make_loader
from trainers.data import prepare as prepare_lib
from trainers.data import tokenizer as tok_lib
from trainers.launch import cli
from trainers.launch import tokenize as tokenize_cli
from trainers.logger import read_metrics

VOCAB = 512


def _bpe(files: list[Path], path: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer trained on files, saved as path (a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """50 stdlib files in a folder, a 512-token BPE tokenizer trained on them, the folder tokenized."""
    tmp = tmp_path_factory.mktemp("tok")
    src = tmp / "src"
    src.mkdir()
    for i, rel in enumerate(corpus.stdlib_files("train")[:50]):
        shutil.copy(corpus.stdlib_root() / rel, src / f"{i:02d}_{Path(rel).name}")
    tokenizer = _bpe(sorted(src.iterdir()), tmp / "tokenizer.json")
    out = tmp / "tokens"
    assert tokenize_cli.main([str(src), "--tokenizer", str(tokenizer), "--out", str(out), "--no-progress"]) == 0
    return src, tokenizer, out


def test_prepared_format_matches_the_tokenizer_and_the_text_split(prepared):
    src, tokenizer, out = prepared
    tok, sha = tok_lib.load_tokenizer(tokenizer)
    eot = tok.token_to_id("<|endoftext|>")
    files = corpus.text_files(src)
    for split in corpus.SPLITS:
        meta = json.loads((out / f"{split}.json").read_text())
        assert (meta["dtype"], meta["vocab_size"], meta["tokenizer_sha256"], meta["separator"]) == (
            "uint16", VOCAB, sha, "<|endoftext|>")
        assert meta["files"] == corpus.split_files(files, split, 0.05)  # the byte-level text corpus's split
        tokens = load_corpus(DataConfig(corpus="tokens", path=str(out), vocab_size=VOCAB), split)
        assert isinstance(tokens, np.memmap) and tokens.shape == (meta["count"],)
        # the same ids as encoding on the fly, each document ended by the end-of-text token
        on_the_fly = load_corpus(DataConfig(corpus="text", path=str(src), vocab_size=VOCAB, tokenizer=str(tokenizer)),
                                 split)
        np.testing.assert_array_equal(tokens, on_the_fly)
        assert int((tokens == eot).sum()) == len(meta["files"]) and tokens[-1] == eot
    first = tok.encode((src / meta["files"][0]).read_text(), add_special_tokens=False).ids
    np.testing.assert_array_equal(tokens[: len(first)], first)
    assert tokens.max() < VOCAB and len(files) == 50


def test_entry_runs_as_a_module_without_path(prepared, tmp_path):
    src, tokenizer, _ = prepared
    out = tmp_path / "tokens"
    argv = [sys.executable, "-m", "trainers.launch.tokenize", str(src), "--tokenizer", str(tokenizer), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "data.corpus=tokens" in done.stdout and "100%" in done.stderr  # the summary and the progress bar
    assert (out / "train.bin").read_bytes() == (prepared[2] / "train.bin").read_bytes()
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--overwrite" in again.stderr  # never replaces a corpus silently


def _eval_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["split"] == "eval"}


def test_gpt_trains_on_the_prepared_corpus_and_resumes_without_tokenizing(prepared, tmp_path, monkeypatch):
    _, tokenizer, out = prepared
    run_dir = str(tmp_path / "run")
    argv = ["gpt-small", "--tiny", "--simulate-devices", "8", "--run-dir", run_dir,
            "--set", "data.corpus=tokens", "--set", f"data.path={out}", "--set", f"data.tokenizer={tokenizer}",
            "--set", f"data.vocab_size={VOCAB}", "--set", f"model.vocab_size={VOCAB}",
            "--set", "run.eval_every=10", "--set", "run.eval_batches=2", "--set", "checkpoint.every_steps=10",
            "--set", "lr.peak_lr=1e-2", "--set", "run.progress=false"]
    assert cli.main([*argv, "--steps", "30"]) == 0
    losses = _eval_losses(run_dir)
    assert sorted(losses) == [10, 20, 30] and losses[30] < losses[10] - 0.2, losses
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a resume must not tokenize")

    monkeypatch.setattr(tok_lib, "encode_documents", no_tokenizing)
    monkeypatch.setattr(prepare_lib, "prepare", no_tokenizing)
    assert cli.main([*argv, "--steps", "40"]) == 0
    assert sorted(_eval_losses(run_dir)) == [10, 20, 30, 40]
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_byte_level_default_is_unchanged():
    cfg = DataConfig()
    assert (cfg.tokenizer, cfg.separator, cfg.vocab_size) == ("", "", 256)
    files = corpus.stdlib_files("train")[:20]
    expected = b"".join((corpus.stdlib_root() / f).read_bytes() + b"\0" for f in files)
    n = len(expected) - 1000
    tokens = load_corpus(DataConfig(max_tokens=n), "train")
    assert tokens.dtype == np.uint8 and tokens.tobytes() == expected[:n]  # independent of the corpus code
    batch = next(make_loader(DataConfig(max_tokens=n, seq_len=16, global_batch=4), "train", process_index=0,
                             process_count=1))
    windows = np.frombuffer(expected[: (n - 1) // 16 * 16], np.uint8).reshape(-1, 16)  # window i: [16 i, 16 i + 16)
    assert all((windows == row).all(1).any() for row in batch["inputs"])


def _error(argv: list[str], capsys) -> str:
    assert cli.main(["gpt-small", "--tiny", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spmd-train: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_paths_and_tokenizers_are_one_line_errors(prepared, tmp_path, capsys):
    src, tokenizer, out = prepared
    empty_dir, no_text, empty_file = tmp_path / "empty", tmp_path / "binaries", tmp_path / "empty.txt"
    empty_dir.mkdir()
    no_text.mkdir()
    (no_text / "weights.bin").write_bytes(b"\1\2")
    empty_file.write_text("")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model": ')
    text = ["--set", "data.corpus=text", "--set"]
    cases = [
        (text + [f"data.path={tmp_path / 'nope'}"], ["data.path=", "nope", "does not exist", ".txt"]),
        (text + [f"data.path={empty_file}"], ["data.path=", "empty file", ".txt"]),
        (text + [f"data.path={no_text}"], ["data.path=", "no text files", ".txt"]),
        (text + [f"data.path={empty_dir}"], ["data.path=", "no text files"]),
        (["--set", "data.corpus=tokens", "--set", f"data.path={src}"], ["data.path=", "no train.json", "spmd-tokenize"]),
        (["--set", "data.corpus=tokens", "--set", f"data.path={tmp_path / 'nope'}"], ["does not exist", "spmd-tokenize"]),
        (["--set", f"data.tokenizer={tmp_path / 'missing.json'}"], ["data.tokenizer=", "does not exist", "tokenizer.json"]),
        (["--set", f"data.tokenizer={corrupt}"], ["data.tokenizer=", "not a readable tokenizer", "tokenizer.json"]),
        (["--set", f"data.tokenizer={tokenizer}"], ["data.vocab_size=256", f"{VOCAB} tokens", "model.vocab_size"]),
        (["--set", f"data.tokenizer={tokenizer}", "--set", f"data.vocab_size={VOCAB}", "--set", "data.separator=<s>",
          "--set", f"model.vocab_size={VOCAB}"], ["data.separator='<s>'", "<|endoftext|>"]),
        (["--set", "data.corpus=tokens", "--set", f"data.path={out}"], ["data.vocab_size=256", f"{VOCAB}", "model.vocab_size"]),
    ]
    for argv, needles in cases:
        err = _error(argv, capsys)
        assert all(n in err for n in needles), (argv, err)
    other = _bpe(sorted(src.iterdir())[:5], tmp_path / "other.json", vocab=300)
    err = _error(["--set", "data.corpus=tokens", "--set", f"data.path={out}", "--set", f"data.tokenizer={other}",
                  "--set", f"data.vocab_size={VOCAB}", "--set", f"model.vocab_size={VOCAB}"], capsys)
    assert "is not the tokenizer" in err and "data.tokenizer=" in err
    # negative control: the same keys, valid, pass
    assert cli.main(["gpt-small", "--tiny", "--set", "data.corpus=tokens", "--set", f"data.path={out}", "--set",
                     f"data.vocab_size={VOCAB}", "--set", f"model.vocab_size={VOCAB}", "--print-config"]) == 0


def test_tokenize_command_errors_exit_2(prepared, tmp_path, capsys):
    src, tokenizer, _ = prepared
    (tmp_path / "binaries").mkdir()
    (tmp_path / "binaries" / "x.bin").write_bytes(b"\0")
    cases = [
        ([str(tmp_path / "nope"), "--tokenizer", str(tokenizer)], "SOURCE="),
        ([str(tmp_path / "binaries"), "--tokenizer", str(tokenizer)], "no text files"),
        ([str(src), "--tokenizer", str(tmp_path / "missing.json")], "--tokenizer="),
        ([str(src), "--tokenizer", str(tokenizer), "--separator", "<nope>"], "--separator='<nope>'"),
    ]
    for argv, needle in cases:
        assert tokenize_cli.main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("spmd-tokenize: error: ") and needle in err, err
    assert not (tmp_path / "out" / "train.json").exists()


def test_help_is_instant_without_jax():
    code = "import sys; from trainers.launch import tokenize; tokenize.parse_args(['x', '--tokenizer', 't', '--out', 'o']);" \
           " assert 'jax' not in sys.modules, 'jax imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_run_written_before_the_tokenizer_keys_resumes():
    from trainers.config import Config, config_changes

    old = Config().to_dict()
    for key in ("tokenizer", "separator"):
        del old["data"][key]
    assert config_changes(old, Config().to_dict()) == []  # absent = the default: byte-level
    new = Config(data=DataConfig(separator="", tokenizer="", corpus="stdlib", seed=1)).to_dict()
    assert config_changes(old, new) == [("data.seed", 0, 1)]  # negative control: a real change is reported
