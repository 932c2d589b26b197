"""Config-stage checks: what one config's sections need of each other, before any mesh or device.

    check_local_sgd(cfg) -> [Issue("config", "local_sgd", ..., fatal=True)] or []

``trainers.Config`` runs the config stage when it is built (``--set`` fails at once); single-field
checks stay with their section's dataclass (:func:`check_fsdp_gather` for ``run.fsdp_gather``).
"""

from __future__ import annotations

from typing import Any

from trainers.checks.issue import Issue
from trainers.checks.layout import check_pipeline

FSDP_GATHER = ("per_microbatch", "per_step")  # run.fsdp_gather: when gradient accumulation gathers FSDP weights
_AUTO = "auto"  # mesh.axes: the planner picks the layout (trainers.config.AUTO)


def check_fsdp_gather(value: str) -> None:
    """``run.fsdp_gather`` is one of :data:`FSDP_GATHER`, or a ValueError naming them."""
    if value not in FSDP_GATHER:
        raise ValueError(f"run.fsdp_gather={value!r}; valid: {', '.join(FSDP_GATHER)} "
                         "(per_microbatch: least memory; per_step: fewest bytes over fsdp)")


def _config(path: str, message: str, fix: str, key: str) -> Issue:
    return Issue("config", path, None, message, fix, fatal=True, stage="config", key=key)


def check_local_sgd(cfg: Any) -> list[Issue]:
    """What local SGD (``local_sgd.every`` >= 1) cannot run on: a data axis under 2 without
    ``local_sgd.groups``, groups that do not divide over data (the first found; both read the mesh spec).
    MoE blocks, a pipeline, context parallelism and accumulation with ``run.fsdp_gather=per_step``
    compose (tests/trainers/test_local_sgd_compose.py)."""
    every = cfg.local_sgd.every
    if not cfg.local_sgd.enabled:
        return []
    if cfg.mesh.axes == _AUTO:
        return []
    spec, groups = cfg.mesh.spec, cfg.local_sgd.groups
    ici, dcn = dict(spec.ici).get("data", 1), dict(spec.dcn).get("data", 1)
    data = ici * dcn
    if ici <= 0 or dcn <= 0:  # an inferred (-1) size is checked on the mesh
        return []
    if not groups and data < 2:
        return [_config("local_sgd", f"local_sgd.every={every} needs replica groups over the data axis, but mesh.axes="
                        f"{cfg.mesh.axes!r} gives data={data}; give data >= 2 (e.g. data=2,fsdp=4), "
                        "local_sgd.groups >= 2, or set local_sgd.every=0", "", "mesh.axes")]
    if groups % data:
        return [_config("local_sgd", f"local_sgd.groups={groups} does not divide over data={data} (mesh.axes="
                        f"{cfg.mesh.axes!r}): give a multiple of {data} (each data shard runs groups/{data} of them)",
                        "", "local_sgd.groups")]
    return []


def check_pipeline_on_mesh(cfg: Any) -> list[Issue]:
    """:func:`~trainers.checks.layout.check_pipeline` with the axis sizes ``mesh.axes`` fixes (ICI x DCN;
    an inferred -1 axis skips the checks that need its size; ``mesh.axes=auto``: nothing yet)."""
    if not cfg.pipeline.enabled or cfg.mesh.axes == _AUTO:
        return []
    spec = cfg.mesh.spec
    dcn = dict(spec.dcn)
    sizes = {a: s * dcn.get(a, 1) for a, s in spec.ici}
    return check_pipeline(cfg.model, cfg.pipeline, cfg.rules, sizes, global_batch=cfg.data.global_batch,
                          grad_accum=cfg.run.grad_accum)


def check_pipelined_task(cfg: Any, task: Any) -> list[Issue]:
    """A pipelined config needs a task whose loss pipelines its ``spmd.Stack`` (``Task.pipelined``):
    say where its model's stacks are, or that it has none."""
    if not cfg.pipeline.enabled or task.pipelined:
        return []
    from flax import nnx

    import spmd

    model = spmd.sharding.abstract_module(lambda: task.model(nnx.Rngs(cfg.run.seed)))
    stacks = ["/".join(map(str, path)) or "<root>" for path, node in nnx.iter_graph(model) if isinstance(node, spmd.Stack)]
    found = (f"its model has spmd.Stack blocks at {stacks}: run them in the loss with "
             "spmd.pipeline.pipelined_loss(cfg.pipeline, stage_fn, head_fn, stack_state, head_state, x, targets) "
             "(see spmd.models.GPT.loss) and set Task(pipelined=True)") if stacks else \
        "its model has no spmd.Stack: put the repeated blocks in one, pipeline them in the loss, and set Task(pipelined=True)"
    return [_config("pipeline", f"pipeline.schedule={cfg.pipeline.schedule!r} cannot run task {task.name!r} "
                    f"(Task.pipelined=False): {found}", "or set pipeline.schedule=none to train it unpipelined", "pipeline.schedule")]
