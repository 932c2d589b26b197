"""A pipelined config is checked when it is built: layers into pipe x virtual stages, the batch into
microbatches (and each microbatch over the batch axes), interleaved M a multiple of pipe. Each bad
value fails with a message naming the numbers, before anything compiles; the good neighbours pass
(negative controls), and the pipelined recipe loads."""

import json
import re

import pytest

from spmd.pipeline import get_schedule
from trainers import override, recipe
from trainers.checks.layout import check_pipeline
from trainers.launch import cli
from trainers.recipes import RECIPES

PP = ["mesh.axes=data=2,pipe=4", "rules=dp", "model.n_layers=8", "data.global_batch=32", "pipeline.schedule=1f1b",
      "pipeline.microbatches=8"]


def pp(*sets):
    return override(recipe("gpt-small", tiny=True), [*PP, *sets])


def test_a_good_pipelined_config_builds():
    cfg = pp()
    assert cfg.pipeline.schedule == "1f1b" and cfg.pipeline.microbatches == 8 and cfg.model.n_layers == 8
    assert pp("pipeline.schedule=interleaved", "pipeline.virtual_stages=2").pipeline.virtual_stages == 2


@pytest.mark.parametrize("sets, message", [
    (["model.n_layers=6"], "model.n_layers=6 does not split into pipe=4 x pipeline.virtual_stages=1 = 4 equal chunks"),
    (["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "model.n_layers=12"],
     "model.n_layers=12 does not split into pipe=4 x pipeline.virtual_stages=2 = 8"),
    (["data.global_batch=36"], re.escape("batch of 36 (data.global_batch=36 / run.grad_accum=1) does not split into "
                                         "pipeline.microbatches=8: use data.global_batch a multiple of 8")),
    (["run.grad_accum=8"], re.escape("batch of 4 (data.global_batch=32 / run.grad_accum=8) does not split into "
                                     "pipeline.microbatches=8: use data.global_batch a multiple of 64")),
    (["pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "pipeline.microbatches=2", "data.global_batch=4"],
     "interleaved schedule needs pipeline.microbatches=2 to be a multiple of pipe=4"),
    (["pipeline.schedule=zb-v", "pipeline.virtual_stages=2", "pipeline.microbatches=6", "data.global_batch=12"],
     "zb-v schedule needs pipeline.microbatches=6 to be a multiple of pipe=4"),
    (["pipeline.schedule=zb-v"], "'zb-v' runs 2 chunks per stage: set pipeline.virtual_stages=2, got 1"),
    (["data.global_batch=8"], r"pipeline microbatch of 1 rows \(data.global_batch=8 / run.grad_accum=1 / "
                              r"pipeline.microbatches=8\) does not divide by data=2: use data.global_batch a multiple of 16"),
])
def test_bad_pipeline_settings_fail_when_the_config_is_built(sets, message):
    with pytest.raises(ValueError, match=message):
        pp(*sets)


def test_neighbouring_good_values_pass():
    """Negative controls for each rejection above."""
    assert pp("model.n_layers=4").model.n_layers == 4
    assert pp("pipeline.schedule=interleaved", "pipeline.virtual_stages=2", "model.n_layers=16").model.n_layers == 16
    assert pp("pipeline.schedule=zb-v", "pipeline.virtual_stages=2").pipeline.schedule == "zb-v"
    assert pp("data.global_batch=48").data.global_batch == 48
    assert pp("run.grad_accum=8", "pipeline.microbatches=4", "data.global_batch=256").run.grad_accum == 8
    assert pp("data.global_batch=16").data.global_batch == 16
    # unpipelined, or with the pipe axis inferred (-1), the checks that need its size wait for the mesh
    assert override(recipe("gpt-small", tiny=True), ["model.n_layers=6", "mesh.axes=data=2,pipe=4"]).model.n_layers == 6
    assert pp("mesh.axes=data=2,pipe=-1", "model.n_layers=6").model.n_layers == 6
    with pytest.raises(ValueError, match="model.n_layers=6 does not split into pipe=4"):
        pp("mesh.axes=data=-1,pipe=4", "model.n_layers=6")  # pipe is known, data is not


def test_the_cli_rejects_a_bad_pipeline_before_compiling(capsys):
    args = ["gpt-small", "--tiny", "--mesh", "data=2,pipe=4", "--rules", "dp", "--set", "pipeline.schedule=1f1b",
            "--set", "pipeline.microbatches=4", "--set", "model.n_layers=6", "--print-config"]
    assert cli.main(args) == 2
    assert "model.n_layers=6 does not split into pipe=4" in capsys.readouterr().err
    assert cli.main([*args[:-3], "--set", "model.n_layers=8", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["microbatches"] == 4


def test_check_pipeline_lists_every_problem_and_nothing_without_a_pipeline():
    cfg = recipe("gpt-small", tiny=True)  # 2 layers, batch 8, no pipeline
    sizes = {"data": 1, "pipe": 4}
    bad = dataclasses_replace_pipeline(cfg, "interleaved", 3, 2)
    issues = check_pipeline(cfg.model, bad, "dp", sizes, global_batch=8)
    assert [i.dim for i in issues] == ["layers", "batch", None] and all(i.fatal for i in issues)
    assert check_pipeline(cfg.model, cfg.pipeline, "dp", sizes, global_batch=8) == []


def dataclasses_replace_pipeline(cfg, schedule, m, v):
    import dataclasses

    return dataclasses.replace(cfg.pipeline, schedule=schedule, microbatches=m, virtual_stages=v)


@pytest.mark.parametrize("tiny", [False, True])
def test_the_pipelined_recipe_loads_and_its_schedule_is_valid(tiny):
    assert "gpt-small-pp" in RECIPES
    cfg = recipe("gpt-small-pp", tiny=tiny)
    small = recipe("gpt-small", tiny=tiny)
    assert cfg.mesh.axes == "data=2,pipe=4" and cfg.pipeline.schedule == "1f1b" and cfg.pipeline.microbatches == 8
    assert cfg.model.d_model == small.model.d_model and cfg.data == (small.data if not tiny else cfg.data)
    schedule = cfg.pipeline.make_schedule(4, cfg.model.n_layers)
    schedule.validate()
    assert schedule.bubble_fraction == pytest.approx(3 / 11)
    assert schedule.bubble_fraction == get_schedule("1f1b", 4, 8).bubble_fraction
