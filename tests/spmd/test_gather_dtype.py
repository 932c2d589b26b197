"""FSDP weight all-gathers run in the compute dtype: under bf16 compute they move bf16, half of f32.

``spmd.models.layers.weight`` casts a parameter on its own shard (constrained to the parameter
layout) before the activation layout gathers it. The check reads the compiled step's HLO. The
CPU backend cannot run a bf16 all-gather: its ``float-normalization-bf16`` pass widens it to f32
(convert to bf16 and back to f32 before the gather, back to bf16 after), so the emitted
all-gather is f32 whose operand round-trips bf16; an accelerator runs it in bf16. The test reads
that round trip from the HLO (:func:`gathered_dtype`) and counts the bytes in the emitted program.
"""

import dataclasses
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers.gpt_util import BATCH, CFG, LAYOUTS, LENGTH
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd.hlo import collectives
from spmd.models import GPT, lm_loss
from spmd.models.layers import weight

BF16_CFG = dataclasses.replace(CFG, dtype="bfloat16")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[[^\]]*\]\S*\s+([\w\-]+)\(([^)]*)\)(.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_MOVES = ("bitcast", "copy", "reshape", "transpose")  # ops that move elements without changing them


def _instructions(text: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """{name: (dtype, op, operands, called computation, computation)} and {computation: root name}."""
    insts, roots, comp = {}, {}, None
    for line in text.splitlines():
        if (m := _COMP.match(line)) and not line.startswith(" "):
            comp = m.group(1)
        elif (m := _INSTR.match(line)) and comp is not None:
            name, dtype, op, args, rest = m.groups()
            called = re.search(r"calls=%([\w.\-]+)", rest)
            insts[name] = (dtype, op, re.findall(r"%([\w.\-]+)", args), called and called.group(1), comp)
            if line.lstrip().startswith("ROOT"):
                roots[comp] = name
    return insts, roots


def gathered_dtype(text: str, name: str) -> str:
    """The dtype of the data all-gather ``name`` moves: its own dtype, or bf16 when its f32 operand
    is a bf16 value converted back to f32 (the CPU backend's widening of a bf16 all-gather)."""
    insts, roots = _instructions(text)
    dtype, _, operands, _, _ = insts[name]
    src = operands[0]
    for _ in range(8):  # follow moves, and into a fusion's root
        s_dtype, op, ops, called, _ = insts[src]
        if op in _MOVES:
            src = ops[0]
        elif op == "fusion":
            src = roots[called]
        elif op == "convert" and s_dtype == "f32" and insts[ops[0]][0] == "bf16":
            return "bf16"
        else:
            break
    return dtype


def emitted(compiled, mesh) -> list:
    """The collectives as the CPU program emits them (spmd.hlo's accelerator view, where it has one,
    would report a widened all-gather at bf16 size already; here the HLO says which ones are)."""
    view = {"view": "emitted"} if "view" in inspect.signature(collectives).parameters else {}
    return collectives(compiled, mesh, **view)


@functools.cache
def grad_step(name: str):
    """(compiled value-and-grad of the bf16 GPT's loss, params, mesh) on layout ``name``."""
    sizes, rules = LAYOUTS[name]
    mesh, rules = meshes.make_mesh(sizes), spmd.get_rules(rules)
    graphdef, params, shardings = spmd.init_params(lambda: GPT(BF16_CFG, rngs=nnx.Rngs(0)), rules, mesh)
    batch_sh = spmd.batch_sharding(rules, mesh)

    def loss(params, inputs, targets):
        with spmd.use_rules(rules, mesh):
            return lm_loss(nnx.merge(graphdef, params)(inputs), targets)[0]

    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32, sharding=batch_sh)
    step = jax.jit(jax.value_and_grad(loss), out_shardings=(spmd.sharding.replicated(mesh), shardings))
    return step.lower(params, tokens, tokens).compile(), params, mesh


@pytest.mark.parametrize("name", ["fsdp8", "dp2_fsdp2_tp2"])
def test_bf16_compute_gathers_weights_in_bf16(name):
    compiled, params, mesh = grad_step(name)
    text, fsdp = compiled.as_text(), mesh.shape["fsdp"]
    gathers = [o for o in emitted(compiled, mesh) if o.kind == "all-gather" and "fsdp" in o.axes]
    assert gathers and all(o.axes == ("fsdp",) for o in gathers)
    dtypes = {o.name: gathered_dtype(text, o.name) for o in gathers}
    # Each matmul weight is gathered (once per layer, forward) at its activation-layout size, as
    # bf16 data: the emitted f32 bytes are exactly those of the f32 parameters. Only the norm
    # scales, which the norms use in f32 by design, gather f32 (D floats each).
    flat = {"/".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    scales = {p: a for p, a in flat.items() if p.endswith("scale")}
    matrices = {p: a for p, a in flat.items() if p not in scales}
    gathered = spmd.inspection.tree_bytes_per_device  # the gathered size is fsdp x a device's shard
    bf16 = [o for o in gathers if dtypes[o.name] == "bf16"]
    f32 = [o for o in gathers if dtypes[o.name] == "f32"]
    assert len(bf16) + len(f32) == len(gathers)
    assert sum(o.total_bytes for o in bf16) == fsdp * gathered(matrices)
    assert sum(o.total_bytes for o in f32) == fsdp * gathered(scales)
    assert {o.bytes for o in f32} <= {CFG.d_model * 4, 2 * CFG.d_model * 4}  # one scale, or two combined


@functools.cache
def one_weight(formulation: str):
    """A [D, F] weight W[D_fsdp, F] used in a bf16 matmul, cast by ``weight`` or the old way."""
    mesh = meshes.make_mesh({"fsdp": 8})
    rules = spmd.get_rules("fsdp")
    w_value = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("fsdp")))

    def f(w_value, x):
        w = nnx.Param(w_value, out_sharding=("embed", "mlp"), eager_sharding=False)  # as spmd.models.param makes it
        with spmd.use_rules(rules, mesh):
            if formulation == "weight":
                w_DF = weight(w, jnp.bfloat16)
            else:  # cast, then the activation layout: XLA gathers f32 and converts after
                w_DF = spmd.constrain(w[...].astype(jnp.bfloat16), ("embed", "mlp"))
        return x @ w_DF

    x = jnp.ones((8, 64), jnp.bfloat16)
    compiled = jax.jit(f).lower(w_value, x).compile()
    (op,) = [o for o in emitted(compiled, mesh) if o.kind == "all-gather"]
    return gathered_dtype(compiled.as_text(), op.name), op.bytes


def test_negative_control_cast_after_constraint_gathers_f32():
    """Casting and then constraining to the activation layout lets XLA gather the f32 shard and
    convert after: the check above must tell the two apart (same emitted bytes, other dtype)."""
    assert one_weight("weight") == ("bf16", 64 * 32 * 4)
    assert one_weight("cast_then_gather") == ("f32", 64 * 32 * 4)
