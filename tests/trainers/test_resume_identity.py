"""A resume is judged by the data, not by how its config spells it (trainers.data.manifest): a corpus file
rewritten in place is refused naming the file; the same files by another path, or ``data.packing`` spelled
as the default it resolves to, resume."""

from __future__ import annotations

import json
import os

import pytest

from trainers.config import Config, RunConfig, changes_since_last_run, override
from trainers.data import DataConfig
from trainers.data.manifest import MANIFEST_FILE, record
from trainers.logger import write_config


def _corpus(folder, texts):
    folder.mkdir(exist_ok=True)
    for i, chunk in enumerate(texts):
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))
    return folder


def _started(run_dir, data_path, packing=""):
    """A run directory as a run that checkpointed step 1 leaves it: config.json, the manifest, one step."""
    cfg = Config(data=DataConfig(corpus="jsonl", path=str(data_path), packing=packing),
                 run=RunConfig(run_dir=str(run_dir)))
    write_config(run_dir, cfg.to_dict())
    record(str(run_dir), cfg.data)
    (run_dir / "checkpoints" / "1").mkdir(parents=True)
    return cfg


TEXTS = [[f"document {i} of part 0 " * 5 for i in range(20)], [f"document {i} of part 1 " * 5 for i in range(20)]]


def test_a_file_changed_in_place_is_refused_naming_it(tmp_path):
    data = _corpus(tmp_path / "docs", TEXTS)
    cfg = _started(tmp_path / "run", data)
    assert changes_since_last_run(cfg) == []  # unchanged: resumes
    (data / "part-1.jsonl").write_text((data / "part-1.jsonl").read_text().replace("document 3", "document X"))
    with pytest.raises(ValueError, match=r"cannot resume .*the data its checkpoints point into has changed.*"
                                         r"part-1.jsonl changed \(same size, other bytes\)"):
        changes_since_last_run(cfg)
    (data / "part-1.jsonl").write_text("{\"text\": \"short\"}\n")
    with pytest.raises(ValueError, match=r"part-1.jsonl changed \(\d+ -> 18 bytes\)"):
        changes_since_last_run(cfg)
    (data / "part-2.jsonl").write_text("{\"text\": \"new\"}\n")
    with pytest.raises(ValueError, match=r"part-2.jsonl is new"):
        changes_since_last_run(cfg)


def test_the_same_data_by_another_path_or_an_equivalent_default_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _corpus(tmp_path / "docs", TEXTS)
    cfg = _started(tmp_path / "run", "docs")  # relative, as typed
    absolute = override(cfg, [f"data.path={data}", "data.packing=segments"])  # the default of a document corpus
    changed = {k for k, _, _ in changes_since_last_run(absolute)}
    assert changed == {"data.path", "data.packing"}  # listed in the log, not refused
    copy = _corpus(tmp_path / "copy", TEXTS)  # the same bytes elsewhere
    assert {k for k, _, _ in changes_since_last_run(override(cfg, [f"data.path={copy}"]))} == {"data.path"}
    # negative controls: other data by another path, and a packing that is not the one the run had
    other = _corpus(tmp_path / "other", [TEXTS[0], TEXTS[0]])
    with pytest.raises(ValueError, match=r"part-1.jsonl changed"):
        changes_since_last_run(override(cfg, [f"data.path={other}"]))
    with pytest.raises(ValueError, match=r"cannot resume .*data.packing: '' -> 'concat'"):
        changes_since_last_run(override(cfg, ["data.packing=concat"]))


@pytest.mark.slow
def test_a_run_records_its_datas_manifest(tmp_path):
    """The loop writes the manifest beside config.json (a 1-step run on a JSONL folder)."""
    from trainers.loop import train
    from trainers.recipes import recipe

    data = _corpus(tmp_path / "docs", TEXTS)
    cfg = override(recipe("gpt-small", tiny=True), [
        f"run.run_dir={tmp_path / 'run'}", "run.steps=1", "lr.total_steps=0", "lr.warmup_steps=0", "run.eval_batches=0",
        "data.corpus=jsonl", f"data.path={data}", "mesh.axes=data=-1", "rules=dp", "run.progress=false",
        "run.tensorboard=false"])
    train(cfg)
    manifest = json.loads((tmp_path / "run" / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == ["part-0.jsonl", "part-1.jsonl"]
    assert manifest["files"]["part-0.jsonl"]["size"] == os.path.getsize(data / "part-0.jsonl")
    assert not os.path.exists(tmp_path / "run" / "run.lock")  # released when the run ended
