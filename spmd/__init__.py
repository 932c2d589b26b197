"""spmd: Mesh + logical dims -> shardings, collectives, parallel layers, inspection, reference models.

    import meshes, spmd
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    graphdef, params, shardings = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), "dp_tp", mesh)
"""

import importlib
import warnings

from spmd import collectives, hlo, inspection, models, pipeline, rules, sharding, variables
from spmd.constraints import constrain, use_rules
from spmd.rules import Rules, get_rules
from spmd.sharding import batch_sharding, init_params, optimizer_shardings, param_shardings
from spmd.stack import Stack
from spmd.variables import init_model

__all__ = [
    "Rules", "get_rules", "use_rules", "constrain", "init_model", "init_params", "param_shardings",
    "optimizer_shardings", "batch_sharding", "Stack",
    "collectives", "hlo", "inspection", "models", "pipeline", "rules", "sharding", "variables",
]

# Names that moved off the package face: old name -> (module, name). Still reachable, with a warning.
_MOVED = {
    **{n: ("spmd.rules", n) for n in ("DP", "DP_TP", "FSDP", "FSDP_TP", "LOGICAL_DIMS", "NONE", "TP", "RulesError")},
    "PRESETS": ("spmd.rules", "RULE_SETS"),
    **{n: ("spmd.sharding", n) for n in ("abstract_model", "logical_dims", "path_str", "replicated", "spec_for")},
    **{n: ("spmd.inspection", n) for n in ("Memory", "format_sharding_table", "memory", "sharding_table",
                                           "tree_bytes_per_device")},
    "flops": ("spmd.inspection", "compiled_flops"),
    **{n: ("spmd.hlo", n) for n in ("Collective", "format_collectives", "summarize")},
    **{n: ("spmd.pipeline", n) for n in ("PipelineConfig", "Schedule", "get_schedule")},
    **{n: ("spmd.variables", n) for n in ("ModelVars", "format_decisions")},
    "current": ("spmd.constraints", "active_layout"),
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        module, new = _MOVED[name]
        warnings.warn(f"spmd.{name} is deprecated; use {module}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")
