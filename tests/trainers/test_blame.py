"""Who is blamed for an error: a task's contract violation and an error in a task installed into
site-packages are the task's (exit 2, the task's frame named), never "internal error, a bug in spmd";
an error inside the toolkit's own dependencies while the toolkit calls them stays a toolkit bug."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import jax
import pytest

from tests.helpers import byom_task
from trainers.blame import ContractError, InternalError, TaskError, attribute, frame_owner, owner
from trainers.config import override
from trainers.launch import cli
from trainers.loop import train

SITE_TASK = """
    import dataclasses

    from tests.helpers import byom_task


    def _loss(model, batch, rngs):
        return batch["no_such_key"]  # a bug in the task


    task = dataclasses.replace(byom_task.make_task(), loss=_loss, name="site")


    def fails_later(args):
        raise RuntimeError("the task's data server is down")
"""


@pytest.fixture
def installed_task(tmp_path, monkeypatch):
    """A task package installed into a ``site-packages`` folder, as ``pip install`` puts one."""
    package = tmp_path / "lib" / "python3" / "site-packages" / "sitetask"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(SITE_TASK))
    monkeypatch.syspath_prepend(str(package.parent))
    yield package
    sys.modules.pop("sitetask", None)


def test_frames_are_owned_by_where_their_file_is(installed_task):
    assert frame_owner(jax.__file__) == "library"  # a dependency of the toolkit
    assert frame_owner(dataclasses.__file__) == "library"  # the standard library
    assert frame_owner(cli.__file__) == "toolkit"
    assert frame_owner(str(installed_task / "__init__.py")) == "task"  # installed, but not the toolkit's dependency
    assert frame_owner(__file__) == "task"


def _cfg(task, tmp_path):
    return override(task.config, [f"run.run_dir={tmp_path / 'run'}", "run.steps=1", "run.progress=false",
                                  "run.tensorboard=false", "lr.warmup_steps=0", "mesh.axes=data=-1", "rules=dp"])


def test_a_loss_returning_a_vector_is_the_tasks_contract_violation(tmp_path):
    """The toolkit's own check of the loss's result used to be reported as a bug in spmd (exit 1)."""
    def per_example_loss(model, batch, rngs):
        return (model(batch["x"]) ** 2).mean(-1)  # [B], not a scalar

    task = dataclasses.replace(byom_task.make_task(), loss=per_example_loss)
    with pytest.raises(TaskError, match=r"must return a float scalar loss.*shape \(8?\d*,\).*The contract: "
                                        r"loss\(model, batch, rngs\) -> scalar"):
        train(_cfg(task, tmp_path), task)
    assert isinstance(attribute(ContractError("x"), "t", "the loss", "{}"), TaskError)


def test_an_installed_tasks_error_is_the_tasks(installed_task, tmp_path, capsys, monkeypatch):
    code = cli.main(["sitetask:task", "--tiny", "--simulate-devices", "8", "--mesh", "data=-1", "--rules", "dp",
                     "--run-dir", str(tmp_path / "run"), "--set", "run.progress=false"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "KeyError: 'no_such_key'" in err and "task 'site'" in err and "bug in spmd" not in err, err
    assert "internal error" not in err

    import sitetask

    from trainers.launch import command

    monkeypatch.setattr(command, "run", sitetask.fails_later)  # raised after start-up, outside the first batch
    code = cli.main(["gpt-small"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "the task's code raised RuntimeError: the task's data server is down at " in err, err
    assert "site-packages/sitetask/__init__.py:" in err and "internal error" not in err, err


def test_a_dependency_failing_under_the_toolkit_is_still_a_toolkit_bug():
    """Negative control: jax raising inside the toolkit's own call stays an internal error."""
    import numpy as np

    from spmd.models import attention

    q = np.zeros((1, 4, 2, 8), np.float32)
    try:
        attention.naive(q, q[:, :, :, :3], q)
    except Exception as e:  # noqa: BLE001
        assert owner(e) == "toolkit"
        assert isinstance(attribute(e, "t", "the loss", "{}"), InternalError)
    else:
        raise AssertionError("no exception")
