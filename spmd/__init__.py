"""spmd: Mesh + logical dims -> shardings, collectives, parallel layers, inspection, reference models.

    import meshes, spmd
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    graphdef, params, shardings = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), "dp_tp", mesh)
"""

from spmd import collectives, hlo, inspection, models, pipeline, variables
from spmd.constraints import constrain, current, use_rules
from spmd.hlo import Collective, format_collectives, summarize
from spmd.pipeline import PipelineConfig, Schedule, get_schedule
from spmd.inspection import Memory, flops, format_sharding_table, memory, sharding_table, tree_bytes_per_device
from spmd.rules import DP, DP_TP, FSDP, FSDP_TP, LOGICAL_DIMS, NONE, PRESETS, TP, Rules, RulesError, get_rules
from spmd.sharding import (
    abstract_model,
    batch_sharding,
    init_params,
    logical_dims,
    optimizer_shardings,
    param_shardings,
    path_str,
    replicated,
    spec_for,
)
from spmd.stack import Stack
from spmd.variables import ModelVars, format_decisions, init_model

__all__ = [
    "Collective", "PipelineConfig", "Schedule", "get_schedule", "pipeline", "DP", "DP_TP", "FSDP", "FSDP_TP", "LOGICAL_DIMS", "Memory", "NONE", "PRESETS", "Rules", "RulesError",
    "Stack", "TP", "abstract_model", "batch_sharding", "collectives", "constrain", "current", "flops",
    "format_collectives", "format_sharding_table", "hlo", "init_params", "inspection", "logical_dims", "memory",
    "models", "optimizer_shardings", "param_shardings", "path_str", "replicated", "get_rules", "sharding_table", "spec_for",
    "summarize", "tree_bytes_per_device", "use_rules", "variables", "ModelVars", "format_decisions", "init_model",
]
