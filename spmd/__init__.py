"""spmd: Mesh + logical dims -> shardings, collectives, parallel layers, inspection, reference models.

    import meshes, spmd
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    graphdef, params, shardings = spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), "dp_tp", mesh)
"""

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
