"""Corpora and the grain loader: determinism, epochs, process shards, resume, global assembly."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers.paths import REPO
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainers.data import DataConfig, Loader, TokenWindows, corpus, load_corpus, make_loader, to_global

L = 4  # seq_len in most tests
N_TOKENS = 8 * 12 * L + 1  # 96 windows of L + 1 tokens: 12 global batches of 8 per epoch


def arange_loader(seed=0, global_batch=8, process_index=0, process_count=1, shuffle=True, n=N_TOKENS):
    return Loader(np.arange(n), L, global_batch, seed, process_index, process_count, shuffle)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def window_ids(batch):
    """Which window each row is: the arange corpus makes window i start at token i * L."""
    return [int(x) // L for x in batch["inputs"][:, 0]]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])


# ----------------------------------------------------------------------------- loader


def test_batches_are_windows_with_shifted_targets():
    batch = next(arange_loader())
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].shape == batch["targets"].shape == (8, L)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # arange: next token is +1
    assert all(x % L == 0 for x in batch["inputs"][:, 0])  # windows start on stride boundaries
    assert len(TokenWindows(np.arange(N_TOKENS), L)) == 96
    assert len(TokenWindows(np.arange(N_TOKENS - 1), L)) == 95  # last window needs its extra target token


def test_same_seed_same_batches_different_seed_different_order():
    a, b, c = take(arange_loader(seed=3), 4), take(arange_loader(seed=3), 4), take(arange_loader(seed=4), 4)
    assert_same(a, b)
    assert [window_ids(x) for x in a] != [window_ids(x) for x in c]
    # Adjacent seeds must not replay each other shifted by an epoch.
    epoch1_seed3 = [window_ids(x) for x in take(arange_loader(seed=3), 24)[12:]]
    epoch0_seed4 = [window_ids(x) for x in take(arange_loader(seed=4), 12)]
    assert epoch1_seed3 != epoch0_seed4


def test_each_epoch_is_a_new_permutation_of_all_windows():
    loader = arange_loader()
    epoch0 = sum((window_ids(b) for b in take(loader, 12)), [])
    epoch1 = sum((window_ids(b) for b in take(loader, 12)), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(96))
    assert epoch0 != epoch1
    assert epoch0 != list(range(96))  # shuffled
    assert loader.epoch == pytest.approx(2.0)
    unshuffled = sum((window_ids(b) for b in take(arange_loader(shuffle=False), 13)), [])
    assert unshuffled == list(range(96)) + list(range(8))


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_are_disjoint_and_make_the_global_batch(process_count):
    steps = 14  # crosses the epoch boundary at step 12
    full = take(arange_loader(), steps)
    shards = [take(arange_loader(process_index=p, process_count=process_count), steps) for p in range(process_count)]
    for k in range(steps):
        assert all(s[k]["inputs"].shape == (8 // process_count, L) for s in shards)
        ids = [set(window_ids(s[k])) for s in shards]
        assert sum(len(x) for x in ids) == len(set().union(*ids)) == 8  # disjoint
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([s[k][key] for s in shards]), full[k][key])
    # Negative control: process 1 does not read process 0's rows.
    assert window_ids(shards[0][0]) != window_ids(shards[1][0])


def test_resume_continues_at_the_next_batch():
    loader = arange_loader(seed=7)
    take(loader, 5)
    state = json.loads(json.dumps(loader.get_state()))
    assert state["step"] == 5 and state["seed"] == 7
    expected = take(loader, 10)  # crosses the epoch boundary

    resumed = arange_loader(seed=7)
    resumed.set_state(state)
    assert_same(take(resumed, 10), expected)

    fresh = arange_loader(seed=7)  # negative control: no set_state
    assert window_ids(next(fresh)) != window_ids(expected[0])


def test_resume_on_a_different_process_count():
    single = arange_loader()
    take(single, 3)
    state = single.get_state()
    shards = []
    for p in range(2):
        loader = arange_loader(process_index=p, process_count=2)
        loader.set_state(state)
        shards.append(next(loader))
    np.testing.assert_array_equal(np.concatenate([s["inputs"] for s in shards]), next(single)["inputs"])


def test_set_state_rejects_another_stream():
    state = arange_loader(seed=1).get_state()
    with pytest.raises(ValueError, match=r"seed=1 but this loader has seed=2"):
        arange_loader(seed=2).set_state(state)
    with pytest.raises(ValueError, match=r"num_windows=96 but this loader has num_windows=48"):
        arange_loader(seed=1, n=48 * L + 1).set_state(state)
    with pytest.raises(ValueError, match=r"step must be a non-negative int, got -1"):
        arange_loader(seed=1).set_state({**state, "step": -1})
    with pytest.raises(ValueError, match=r"must have keys"):
        arange_loader(seed=1).set_state({"step": 0})


def test_loader_errors():
    with pytest.raises(ValueError, match=r"global_batch=6 is not divisible by process_count=4"):
        arange_loader(global_batch=6, process_count=4)
    with pytest.raises(ValueError, match=r"corpus of 4 tokens is shorter than one window .* \(seq_len=4\)"):
        Loader(np.arange(4), L, 2, 0, 0, 1)
    with pytest.raises(ValueError, match=r"process_index must be in \[0, process_count=2\), got 2"):
        arange_loader(process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"tokens must be a 1-D array, got shape \(2, 50\)"):
        Loader(np.zeros((2, 50), np.int32), L, 2, 0, 0, 1)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(corpus="wiki"), r"corpus must be one of .* got 'wiki'"),
        (dict(corpus="text"), r"corpus 'text' needs a path"),
        (dict(path="/x"), r"path is only read by corpus 'text', 'npy' or 'tokens', got path='/x' with corpus 'stdlib'"),
        (dict(seq_len=0), r"seq_len must be a positive int, got 0"),
        (dict(global_batch=-2), r"global_batch must be a positive int, got -2"),
        (dict(seed=-1), r"seed must be a non-negative int, got -1"),
        (dict(validation_fraction=1.0), r"validation_fraction must be in \[0, 1\), got 1.0"),
        (dict(max_tokens=0), r"max_tokens must be a positive int or None, got 0"),
        (dict(vocab_size=100), r"byte-level and needs vocab_size >= 256, got 100"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_make_loader_synthetic_and_split_names():
    cfg = DataConfig(corpus="synthetic", vocab_size=50, synthetic_tokens=2000, seq_len=8, global_batch=4)
    train, val = make_loader(cfg, "train", process_index=0, process_count=1), make_loader(cfg, "validation")
    bt, bv = next(train), next(val)
    assert bt["inputs"].shape == bv["inputs"].shape == (4, 8)
    assert bt["inputs"].max() < 50 and bt["inputs"].min() >= 0
    assert not np.array_equal(bt["inputs"], bv["inputs"])
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'validation'\), got 'test'"):
        make_loader(cfg, "test")
    with pytest.raises(ValueError, match=r"split must be one of .* got 'valid'"):
        corpus.stdlib_corpus("valid")


def test_synthetic_corpus():
    a, b = corpus.synthetic_corpus(500, 7, seed=0), corpus.synthetic_corpus(500, 7, seed=0)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int32 and a.shape == (500,) and set(np.unique(a)) == set(range(7))
    assert not np.array_equal(a, corpus.synthetic_corpus(500, 7, seed=1))
    with pytest.raises(ValueError, match=r"n_tokens must be a positive int, got 0"):
        corpus.synthetic_corpus(0, 7, 0)


# ----------------------------------------------------------------------------- stdlib


@pytest.fixture(scope="module")
def stdlib():
    return {s: (corpus.stdlib_files(s), corpus.stdlib_corpus(s)) for s in corpus.SPLITS}


def test_stdlib_corpus_is_real_and_split_by_file(stdlib):
    (train_files, train), (val_files, val) = stdlib["train"], stdlib["validation"]
    assert train.dtype == np.uint8 and train.ndim == 1 and train.size > 1_000_000 and val.size > 10_000
    assert not set(train_files) & set(val_files)
    assert len(val_files) < len(train_files) / 5
    assert "os.py" in set(train_files) | set(val_files)
    assert not any(f.startswith("site-packages/") or "/test/" in f for f in train_files)
    root = corpus.stdlib_root()
    assert train.size == sum((root / f).stat().st_size + 1 for f in train_files)
    assert int(np.sum(train == corpus.DOCUMENT_END)) == len(train_files)  # one separator per document
    first = (root / train_files[0]).read_bytes()
    assert bytes(train[: len(first)]) == first and train[len(first)] == corpus.DOCUMENT_END
    assert corpus.stdlib_corpus("train") is train  # cached: the second call reads nothing


def test_stdlib_split_is_the_same_in_another_process(stdlib):
    code = "from trainers.data import corpus; print('\\n'.join(corpus.stdlib_files('validation')))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    root = REPO
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    assert tuple(out.stdout.split()) == stdlib["validation"][0]


def test_stdlib_max_bytes_and_loader(stdlib):
    small = corpus.stdlib_corpus(max_bytes=1000)
    assert small.shape == (1000,)
    np.testing.assert_array_equal(small, stdlib["train"][1][:1000])
    loader = make_loader(DataConfig(seq_len=16, global_batch=4, max_tokens=2000), "train")
    text = bytes(next(loader)["inputs"][0].astype(np.uint8))
    assert text in bytes(small) + bytes(corpus.stdlib_corpus(max_bytes=2000)[1000:])


# ----------------------------------------------------------------------------- text and npy


def test_text_folder_split_by_file(tmp_path):
    for i in range(60):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n")
    (tmp_path / "skip.bin").write_bytes(b"\xff" * 100)
    train = corpus.text_corpus(tmp_path, validation_fraction=0.2)
    val = corpus.text_corpus(tmp_path, "validation", validation_fraction=0.2)
    docs = lambda t: set(bytes(t).split(b"\x00")) - {b""}  # noqa: E731
    assert not docs(train) & docs(val)
    assert docs(train) | docs(val) == {f"document {i}\n".encode() for i in range(60)}
    assert 3 <= len(docs(val)) <= 25
    assert 0xFF not in train  # suffix filter
    cfg = DataConfig(corpus="text", path=str(tmp_path), seq_len=4, global_batch=2, validation_fraction=0.2)
    np.testing.assert_array_equal(load_corpus(cfg, "validation"), val)


def test_text_file_split_by_position(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(1, 201)))
    train = corpus.text_corpus(path, validation_fraction=0.1)
    val = corpus.text_corpus(path, "validation", validation_fraction=0.1)
    assert train.size == 180 and val.size == 20
    assert bytes(train) + bytes(val) == path.read_bytes()
    batch = next(make_loader(DataConfig(corpus="text", path=str(path), seq_len=8, global_batch=2), "train"))
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)


def test_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"text corpus path .*nope.txt' does not exist"):
        corpus.text_corpus(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"empty corpus: no files with suffixes"):
        corpus.text_corpus(tmp_path)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty corpus: text file .*empty.txt' has 0 bytes"):
        corpus.text_corpus(tmp_path / "empty.txt")
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(ValueError, match=r"empty corpus: text folder .* no tokens in split 'validation'; 2 files"):
        corpus.text_corpus(tmp_path, "validation", validation_fraction=0.01)


def test_npy_corpus_is_memory_mapped_and_split_by_position(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.int32) % 300)
    train = corpus.npy_corpus(path, validation_fraction=0.25)
    val = corpus.npy_corpus(path, "validation", validation_fraction=0.25)
    assert isinstance(train, np.memmap) and train.size == 750 and val.size == 250
    np.testing.assert_array_equal(np.concatenate([train, val]), np.arange(1000) % 300)
    cfg = DataConfig(corpus="npy", path=str(path), seq_len=8, global_batch=2, vocab_size=300, max_tokens=100)
    assert load_corpus(cfg, "train").size == 100
    np.save(tmp_path / "floats.npy", np.zeros(10))
    with pytest.raises(ValueError, match=r"1-D integer array of token ids, got shape \(10,\) dtype float64"):
        corpus.npy_corpus(tmp_path / "floats.npy")
    with pytest.raises(FileNotFoundError, match=r"npy corpus path .*missing.npy' does not exist"):
        corpus.npy_corpus(tmp_path / "missing.npy")


# ----------------------------------------------------------------------------- global arrays


def test_to_global_on_eight_devices():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    local = next(arange_loader(global_batch=16))
    batch = to_global(local, sharding, 16)
    for key in ("inputs", "targets"):
        assert batch[key].shape == (16, L) and batch[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(batch[key]), local[key])
        for shard in batch[key].addressable_shards:
            assert shard.data.shape == (2, L)
            np.testing.assert_array_equal(np.asarray(shard.data), local[key][shard.index])
    with pytest.raises(ValueError, match=r"local batch 'inputs' has shape \(16, 4\); expected 32 rows"):
        to_global(local, sharding, 32)


def test_process_rows_single_process_and_bad_blocks():
    from trainers.data import process_rows

    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert process_rows(NamedSharding(mesh, P("data")), 16) == (0, 1)  # one process holds every row
    assert process_rows(NamedSharding(mesh, P()), 16) == (0, 1)
    loader = make_loader(DataConfig(seq_len=4, global_batch=8, max_tokens=2000), "train",
                         sharding=NamedSharding(mesh, P("data")))
    assert loader.local_batch == 8
    with pytest.raises(ValueError, match="either sharding or process_index"):
        make_loader(DataConfig(seq_len=4, global_batch=8, max_tokens=2000), "train", process_index=0,
                    sharding=NamedSharding(mesh, P("data")))


# ----------------------------------------------------------------------------- any task's data
def _examples(n=10):
    return [{"image": np.full((2, 2), i, np.float32), "label": np.int32(i)} for i in range(n)]


def test_example_loader_batches_any_pytree_and_resumes_exactly():
    from trainers.data import ExampleLoader

    a = ExampleLoader(_examples(), 4, seed=3, process_index=0, process_count=1)
    first = [next(a) for _ in range(5)]  # crosses an epoch boundary: 20 rows of 10 examples
    assert first[0]["image"].shape == (4, 2, 2) and first[0]["label"].dtype == np.int32
    epoch = np.concatenate([b["label"] for b in first])[:10]
    assert sorted(epoch) == list(range(10)) and list(epoch) != list(range(10))  # a permutation, shuffled
    b = ExampleLoader(_examples(), 4, seed=3, process_index=0, process_count=1)
    b.set_state(ExampleLoader(_examples(), 4, seed=3, process_index=0, process_count=1).get_state() | {"step": 3})
    np.testing.assert_array_equal(next(b)["label"], first[3]["label"])
    halves = [next(ExampleLoader(_examples(), 4, seed=3, process_index=p, process_count=2))["label"] for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(halves), first[0]["label"])  # processes read disjoint rows
    with pytest.raises(ValueError, match="num_examples=10 but this loader has num_examples=9"):
        ExampleLoader(_examples(9), 4, seed=3, process_index=0, process_count=1).set_state(a.get_state())
    with pytest.raises(TypeError, match="needs len"):
        ExampleLoader(iter(_examples()), 4, seed=3, process_index=0, process_count=1)


def test_iter_loader_resumes_a_grain_iterator_exactly_and_warns_otherwise(caplog):
    import grain

    from trainers.data import IterLoader

    ds = grain.MapDataset.source(_examples(12)).batch(3).to_iter_dataset()
    a = IterLoader(ds)
    assert a.resumable
    next(a), next(a)
    state = a.get_state()
    expected = next(a)["label"]
    b = IterLoader(ds)
    b.set_state(state)
    np.testing.assert_array_equal(next(b)["label"], expected)
    plain = IterLoader([{"label": np.arange(3)}] * 4)
    assert not plain.resumable
    with caplog.at_level("WARNING"):
        plain.set_state({"step": 2, "iterator": None})
    assert "not exactly resumable" in caplog.text
    with pytest.raises(RuntimeError, match="ran out after 6 batches"):
        for _ in range(5):
            next(plain)


def test_eval_batches_cover_the_set_once_with_a_mask():
    from trainers.data.loader import eval_batches

    got = list(eval_batches(_examples(10), 4, -1, process_index=0, process_count=1))
    assert len(got) == 3
    labels = np.concatenate([b["label"] for b, _ in got])
    masks = np.concatenate([m for _, m in got])
    assert list(labels[masks == 1]) == list(range(10)) and masks.sum() == 10  # each example once, padding masked
    two = list(eval_batches(_examples(10), 4, 2, process_index=1, process_count=2))
    assert [list(b["label"]) for b, _ in two] == [[2, 3], [6, 7]] and all(m.all() for _, m in two)


def test_to_global_takes_any_pytree():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    local = {"image": np.zeros((8, 2, 2), np.float32), "meta": (np.arange(8), np.ones((8,), bool))}
    batch = to_global(local, sharding, 8)
    assert batch["image"].shape == (8, 2, 2) and batch["meta"][1].dtype == bool
    with pytest.raises(ValueError, match=r"local batch 'meta/0' has shape \(4,\)"):
        to_global({"meta": (np.arange(4),)}, sharding, 8)


def test_token_loader_state_resumes_an_example_loader():
    """Run dirs written when the GPT task read through Loader (state keys num_windows, seq_len)
    resume now that it reads TokenWindows through ExampleLoader: same stream, same position."""
    from trainers.data import ExampleLoader, TokenWindows

    old = arange_loader(seed=3)
    take(old, 2)
    state = json.loads(json.dumps(old.get_state()))
    assert "num_windows" in state
    new = ExampleLoader(TokenWindows(np.arange(N_TOKENS), L), 8, 3)
    new.set_state(state)
    assert [window_ids(b) for b in take(new, 2)] == [window_ids(b) for b in take(old, 2)]
    with pytest.raises(ValueError, match=r"seq_len=16 but this loader has seq_len=8"):
        ExampleLoader(TokenWindows(np.arange(N_TOKENS), 8), 8, 3).set_state({**state, "seq_len": 16})
