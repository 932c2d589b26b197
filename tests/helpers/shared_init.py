"""One initialisation per model config, placed on any layout: ``(graphdef, params, shardings)`` as
``spmd.init_params`` returns them, without compiling an initialisation per mesh.

``spmd.init_params`` compiles its ``init`` for every (config, rules, mesh): seconds of XLA:CPU each, for a
tiny GPT as much as the step a layout test is about. A test that compares a layout with one device only
needs the same starting values on both: here they are made once per config by ``spmd.init_params`` on one
device (the one-device reference's own initialisation) and ``jax.device_put`` onto each layout's shardings,
which ``spmd.param_shardings`` computes from the shapes alone, so a layout's parameters are bit-equal to
the reference's. Sharded initialisation itself (no device ever holds a whole array) stays with the tests
that build through ``spmd.init_params`` or a run's state builder (tests/helpers/gpt_util.py, the trainers'
runs), not this helper.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig


def _make(cfg: GPTConfig):
    return lambda: GPT(cfg, rngs=nnx.Rngs(0))


@functools.cache
def _values(cfg: GPTConfig) -> dict:
    """``GPT(cfg, rngs=nnx.Rngs(0))``'s parameters as host arrays, initialised once on one device."""
    _, params, _ = spmd.init_params(_make(cfg), spmd.get_rules("none"), meshes.single_device_mesh())
    return jax.tree.map(np.asarray, params)


def gpt_params(cfg: GPTConfig, rules, mesh) -> tuple[nnx.GraphDef, dict, dict]:
    """``spmd.init_params(lambda: GPT(cfg, rngs=nnx.Rngs(0)), rules, mesh)``: the same graphdef, shardings
    and values, the values placed from :func:`_values` instead of initialised on ``mesh``."""
    graphdef, abstract, _ = nnx.split(spmd.sharding.abstract_module(_make(cfg)), nnx.Param, ...)
    shardings = spmd.param_shardings(abstract, spmd.get_rules(rules) if isinstance(rules, str) else rules, mesh)
    return graphdef, jax.device_put(_values(cfg), shardings), shardings
