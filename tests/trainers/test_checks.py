"""The one checks pass (trainers.checks): rules registered per stage, run in order, skipped without their
inputs, and the three policies callers choose (raise, report, prune). No compiles; the model is traced
abstractly at most.
"""

from __future__ import annotations

import dataclasses

import pytest

from spmd.pipeline import PipelineConfig
from trainers import override, recipe
from trainers.checks import (
    REGISTRY,
    STAGES,
    Compiled,
    Context,
    Issue,
    Registry,
    buildable,
    check,
    first_fatal,
    raise_first_fatal,
    report,
)
from trainers.checks.config import check_local_sgd
from trainers.checks.layout import check_batch, check_heads, check_pipeline
from trainers.planning.blockers import device_splits
from trainers.planning.diagnose import diagnose
from trainers.planning.planner import Layout, estimate_layout


@pytest.fixture(scope="module")
def cfg():
    return recipe("gpt-small", tiny=True)  # n_heads = n_kv_heads = 4, global batch 8


def issue(message="m", fix="", fatal=False, stage="config", **kw):
    return Issue("config", "p", None, message, fix, fatal, stage=stage, **kw)


def test_issue_fields_key_and_stage():
    i = Issue("batch", "batch", "batch", "no split", "use 8", True, stage="layout", key="data.global_batch")
    assert (i.kind, i.path, i.dim, i.stage, i.key, i.fatal) == ("batch", "batch", "batch", "layout", "data.global_batch", True)
    assert str(i) == "no split: use 8" and str(issue("alone")) == "alone"
    assert issue().key == "p"  # no key: the path
    with pytest.raises(ValueError, match=r"Issue.stage='nowhere'; valid: config, layout, data, checkpoint, compiled"):
        issue(stage="nowhere")


def test_policies():
    notes, bad, worse = issue("note"), issue("bad", "fix it", True, key="model.d_ff"), issue("worse", fatal=True)
    assert buildable([notes]) and not buildable([notes, bad]) and buildable([])
    assert first_fatal([notes, bad, worse]) is bad and first_fatal([notes]) is None
    raise_first_fatal([notes])  # nothing fatal: nothing raised
    with pytest.raises(ValueError, match=r"^bad: fix it$"):
        raise_first_fatal([notes, bad, worse])
    assert report([notes, bad]) == ["config p: note", "FATAL config model.d_ff: bad: fix it"]


def test_a_registry_runs_stages_in_order_skips_rules_without_inputs_and_stamps_the_stage():
    reg = Registry()
    seen = []

    @reg.rule("compiled")
    def late(ctx):
        seen.append("late")
        return [issue("late")]

    @reg.rule("config")
    def early(ctx):
        seen.append("early")
        return [issue("early", stage="layout")]  # reported under its rule's stage

    @reg.rule("layout", needs=("sizes",))
    def on_mesh(ctx):
        seen.append("on_mesh")
        return [issue("mesh", fatal=True)]

    found = check(registry=reg, stages=("compiled", "config", "layout"))  # no mesh: on_mesh skipped
    assert seen == ["early", "late"] and [(i.message, i.stage) for i in found] == [("early", "config"), ("late", "compiled")]
    found = check(registry=reg, mesh_shape={"data": 2}, select=("on_mesh",))
    assert [(i.message, i.stage) for i in found] == [("mesh", "layout")]
    assert reg.names("config") == ["early"] and check(registry=reg, stages=("data",)) == []


def test_the_registry_refuses_what_it_cannot_run():
    reg = Registry()
    reg.rule("data", "one")(lambda ctx: [])
    with pytest.raises(ValueError, match="already registered"):
        reg.rule("data", "one")(lambda ctx: [])
    with pytest.raises(ValueError, match=r"stage 'runtime'; valid: config"):
        reg.rule("runtime")
    with pytest.raises(ValueError, match="not Context fields"):
        reg.rule("data", needs=("mesh",))
    with pytest.raises(ValueError, match=r"stages \['layot'\]"):
        check(registry=reg, stages=("layot",))
    with pytest.raises(ValueError, match=r"no rules \['two'\] in stages \['data'\]; valid: one"):
        check(registry=reg, stages=("data",), select=("two",))


def test_the_pass_registers_every_stage_in_order():
    assert tuple(REGISTRY.rules) == STAGES
    assert REGISTRY.names("layout") == ["heads", "task", "divisibility", "batch", "pipeline", "context_experts",
                                        "replicated"]
    assert REGISTRY.names("config") == ["local_sgd", "pipeline_on_mesh", "pipelined_task"]
    assert REGISTRY.names("compiled") == ["activation_split", "collectives", "remat"]
    assert all(REGISTRY.names(s) for s in STAGES)


def test_context_fills_from_the_config_and_given_fields_win(cfg):
    ctx = Context.of(cfg, rules="tp", global_batch=None)
    assert (ctx.rules, ctx.global_batch, ctx.grad_accum, ctx.seq_len) == ("tp", cfg.data.global_batch,
                                                                          cfg.run.grad_accum, cfg.data.seq_len)
    assert ctx.gpt == cfg.model and ctx.variables is None  # no task: the built-in GPT
    assert Context.of(None).gpt is None and Context.of(None).rules is None


def test_layout_stage_is_the_checks_of_one_layout(cfg):
    sizes = {"data": 2, "tensor": 8}
    found = check(cfg, stages=("layout",), mesh_shape=sizes)
    assert found == diagnose(cfg.model, cfg.rules, sizes, global_batch=cfg.data.global_batch,
                             grad_accum=cfg.run.grad_accum, pipeline=cfg.pipeline, seq_len=cfg.data.seq_len)
    assert found[0] == check_heads(cfg.model, cfg.rules, sizes)[0] and found[0].key == "model.n_heads"
    assert {i.stage for i in found} == {"layout"} and not buildable(found)
    assert buildable(check(cfg, mesh_shape={"data": 2, "tensor": 4}))  # negative control: a layout that builds
    assert check(cfg, stages=("config", "data", "checkpoint", "compiled")) == []  # nothing to read: nothing found


def test_batch_issue_names_the_key_and_the_valid_multiple(cfg):
    (i,) = check(cfg, stages=("layout",), mesh_shape={"data": 3}, rules="dp", select=("batch",))
    assert i == check_batch(cfg.data.global_batch, cfg.run.grad_accum, "dp", {"data": 3})[0]
    assert (i.key, i.fatal) == ("data.global_batch", True) and "use data.global_batch a multiple of 3" in i.fix


def test_the_planner_prunes_on_the_pipeline_rule(cfg):
    pipe = PipelineConfig(schedule="1f1b", microbatches=3)
    sizes = {"pipe": 2}
    piped = check(cfg, stages=("layout",), mesh_shape=sizes, rules="dp", pipeline=pipe, select=("pipeline",))
    assert piped == check_pipeline(cfg.model, pipe, "dp", sizes, global_batch=cfg.data.global_batch)
    layout = Layout((("data", 1), ("pipe", 2)), "dp", False, "1f1b", 3)
    e = estimate_layout(cfg, layout, "h100")
    assert not e.buildable and e.issues == tuple(piped) and e.reason == str(piped[0])


def test_blockers_read_the_tensor_sizes_from_the_pass(cfg):
    assert device_splits(cfg).tensor == (1, 2, 4)  # heads 4: tensor 3 or 8 do not divide


def test_config_stage_runs_when_the_config_is_built(cfg):
    three = dataclasses.replace(cfg.local_sgd, every=4, groups=3)
    two = override(cfg, ["mesh.axes=data=2,fsdp=4"])
    (i,) = check_local_sgd(_unchecked(two, local_sgd=three))
    assert (i.stage, i.key, i.fatal) == ("config", "local_sgd.groups", True)
    with pytest.raises(ValueError) as e:
        dataclasses.replace(two, local_sgd=three)
    assert str(e.value) == str(i)  # raise_first_fatal: the issue's message and fix, as before
    with pytest.raises(ValueError, match=r"batch of 8 .* does not split into pipeline.microbatches=3"):
        override(cfg, ["pipeline.schedule=1f1b", "pipeline.microbatches=3"])  # at --set time, as before


def _unchecked(cfg, **changes):
    """``cfg`` with ``changes`` and no checks run (a config the pass must refuse)."""
    out = object.__new__(type(cfg))
    for f in dataclasses.fields(cfg):
        object.__setattr__(out, f.name, changes.get(f.name, getattr(cfg, f.name)))
    return out


def test_compiled_stage_reads_the_compiled_facts(cfg):
    log = ('W0101 spmd_partitioner.cc:630] [spmd] Involuntary full rematerialization. The compiler was not able to go '
           'from sharding {devices=[1,8]<=[8]} to {devices=[8,1]<=[8]} without doing a full rematerialization, '
           'metadata={op_name="jit(step)/transpose" source_file="model.py" source_line=42}.\n')
    (remat,) = check(cfg, stages=("compiled",), compiled=Compiled(log=log))
    assert (remat.kind, remat.stage, remat.fatal) == ("remat", "compiled", False)
    mib = 1 << 20
    (split,) = check(cfg, stages=("compiled",), compiled=Compiled(activations=(171 * mib, 22 * mib, 177 * mib, 2 * mib,
                                                                               2, ("fsdp",))))
    assert split.kind == "activations" and check(cfg, stages=("compiled",), compiled=Compiled()) == []


def test_task_stages_read_the_task(cfg):
    from trainers.task import Task, lm_model

    task = Task(model=lm_model(cfg.model), loss=lambda m, b, r: 0.0, data=[], name="t", vocab_size=10,
                checks=lambda c, rules, sizes: [issue("from the task", fatal=True, stage="layout")])
    piped = dataclasses.replace(cfg, pipeline=PipelineConfig(schedule="1f1b", microbatches=2))
    (config,) = check(piped, stages=("config",), task=task)
    assert config.key == "pipeline.schedule" and "Task.pipelined=False" in config.message
    found = check(cfg, stages=("layout",), task=task, mesh_shape={"data": 2})
    assert [i.message for i in found if i.fatal] == ["from the task"]  # the task's checks, not the GPT's heads rule
    (ids,) = check(cfg, stages=("data",), task=task, batch={"inputs": [[1, 12]]})
    assert (ids.stage, ids.key, ids.fatal) == ("data", "Task.vocab_size", True) and "[1, 12]" in ids.message
    assert check(cfg, stages=("data",), task=task, batch={"inputs": [[1, 9]]}) == []
