"""run.profile_steps writes a jax.profiler trace that xprof (TensorBoard's profile plugin) reads;
run.memory_profile_step a device-memory profile."""

import glob
import json
import os

import pytest

from trainers import override, recipe, train
from trainers.trace import parse_steps


@pytest.mark.parametrize("text, expected", [("", None), ("5:7", (5, 7)), ("3", (3, 3)), ("2:2", (2, 2))])
def test_parse_steps(text, expected):
    assert parse_steps(text) == expected


@pytest.mark.parametrize("text", ["0:3", "7:5", "a:b", ":4", "-1:2"])
def test_bad_profile_steps_name_the_key(text):
    with pytest.raises(ValueError, match=r"run.profile_steps=.*START:END"):
        parse_steps(text)
    with pytest.raises(ValueError, match=r"run.profile_steps"):
        override(recipe("gpt-small", tiny=True), [f"run.profile_steps={text}"])


def test_profile_of_a_step_is_readable_by_xprof(tmp_path):
    raw = pytest.importorskip("xprof.convert.raw_to_tool_data")
    cfg = override(recipe("gpt-small", tiny=True), [
        f"run.run_dir={tmp_path}", "run.progress=false", "run.profile_steps=2:2", "run.memory_profile_step=2"])
    train(cfg)
    traces = glob.glob(str(tmp_path / "tensorboard" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1, traces
    data, _ = raw.xspace_to_tool_data(traces, "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    names = {e.get("name", "") for e in events if isinstance(e, dict)}
    assert any("jit_step" in n for n in names), "the train step's execution is in the trace"
    assert "train 2" in names, "the step annotation (TensorBoard's step breakdown) is in the trace"
    memory = tmp_path / "memory" / "step_2.prof"
    assert memory.is_file() and os.path.getsize(memory) > 0
