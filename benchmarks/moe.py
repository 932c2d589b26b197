"""MoE: dropless grouped expert matmuls against the top-k FLOP count, and step time against dense dispatch.

- **matmul FLOPs**: the MoE layer alone (``value_and_grad`` of a loss of ``MoE(x)`` wrt its
  parameters and ``x``), compiled per layout; every ``dot`` of the per-device program
  (:func:`benchmarks.mfu.dot_flops`; the grouped loops times the blocks they ran, which the layer
  reports) against the top-k count per device: ``2 x 3 x k x T x 3 D F``
  (forward + 2 backward matmuls of SwiGLU's three ``D x F`` matrices for each of the ``k x T``
  assignments) plus the router ``2 x 3 x T x D x E``; goal <= 1.1 dropless. The dense dispatch
  (every expert on every token's slot grid, ``C = T``: capacity factor ``E / k``) is the baseline.
- **parity**: grouped vs dense dispatch on the same layout (loss, output, every gradient).
- **step time**: the GPT train step (:func:`benchmarks.common.gpt_setup`, MoE blocks) dropless
  grouped vs dense dispatch on the same layout, interleaved in the same run (median of rounds).

``--quick``: a tiny shape (one block in the step), the FLOP rows on data2_expert4 only and the step time on dp8 only.

    python -m benchmarks.moe [--quick] [--output PATH]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshes
import spmd
from benchmarks import common
from benchmarks.common import Row
from benchmarks.mfu import dot_flops
from spmd.models import MoE, grouped

GOAL = 1.1
# name -> (mesh axis sizes, rule preset)
LAYOUTS = {"dp8": ({"data": 8}, "dp"), "data4_expert2": ({"data": 4, "expert": 2}, "dp_ep"),
           "data2_expert4": ({"data": 2, "expert": 4}, "dp_ep")}


def shape(quick: bool) -> tuple[int, int, int, int, int, int]:
    """(d_model, expert width F, experts E, k, global batch, length): gpt-moe's shape, or a tiny one."""
    return (32, 64, 8, 2, 8, 16) if quick else (128, 256, 8, 2, 16, 128)


def layer_step(layout: str, dense: bool, quick: bool):
    """(compiled value_and_grad of the layer's loss wrt (params, x), with the layer's computed expert rows
    per assignment as aux; params, x) on ``layout``."""
    d, f, e, k, batch, length = shape(quick)
    sizes, rules = LAYOUTS[layout]
    mesh, rules = meshes.make_mesh(sizes), spmd.get_rules(rules)
    cf = e / k if dense else 0.0
    graphdef, params, _ = spmd.init_params(
        lambda: MoE(d, f, e, k, rngs=nnx.Rngs(0), capacity_factor=cf, report_rows=True), rules, mesh)

    def loss(params, x_BLD):
        with spmd.use_rules(rules, mesh):
            y_BLD, stats = nnx.merge(graphdef, params)(x_BLD)
        return jnp.mean(y_BLD ** 2) + 0.01 * stats["aux_loss"] + 0.001 * stats["z_loss"], stats["expert_rows"]

    tokens = jax.sharding.NamedSharding(mesh, rules.spec(("batch", "length", "embed"), kind="activations",
                                                         mesh_sizes=sizes, what="MoE input"))
    x = jax.device_put(np.random.default_rng(0).standard_normal((batch, length, d)).astype(np.float32), tokens)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return step.lower(params, x).compile(), params, x


def executed_flops(compiled, rows_per_assignment: float, t: int, k: int, groups: int) -> tuple[float, float]:
    """(matmul FLOPs per device as executed, static bound): the grouped loops run once per used block,
    a count known at run time (``rows / b``, rows as the layer reports them: the mean over devices)."""
    text = compiled.as_text()
    static, once = dot_flops(text, 0)[0], dot_flops(text)[0]
    blocks = rows_per_assignment * t * k / grouped.block_rows(t * k, groups)
    return static + (once - static) * blocks, once


def flops_rows(layout: str, quick: bool) -> list[Row]:
    d, f, e, k, batch, length = shape(quick)
    t = batch * length // 8
    topk = 2 * 3 * k * t * 3 * d * f + 2 * 3 * t * d * e
    (grouped_step, params, x), (dense, _, _) = layer_step(layout, False, quick), layer_step(layout, True, quick)
    ep = LAYOUTS[layout][0].get("expert", 1)
    local = e // ep
    (gl, g_rows), gg = grouped_step(params, x)
    (dl, _), dg = dense(params, x)
    g_f, _ = executed_flops(grouped_step, float(g_rows), t, k, local)
    d_f = dot_flops(dense.as_text())[0]
    why = (f"rows computed per assignment {float(g_rows):.4f} (mean over devices); the grouped loops run once per "
           f"block that holds rows (a run-time trip count), the rest of the program as compiled")
    if ep > 1:
        why += (f"; ep={ep}: buffers hold the worst case, ep x T x min(k, E/ep) = {min(ep * t * min(k, local), e * t)} "
                f"rows, each device computes the rows it received for its {local} experts")
    exchange = []
    if ep > 1:  # what the dispatch moves per device, against the rows the router sent (T x k) and the old slot grid
        mesh = meshes.make_mesh(LAYOUTS[layout][0])
        sent = max(o.bytes for o in spmd.hlo.collectives(grouped_step, mesh) if o.kind == "all-to-all" and not o.backward)
        routed = t * k * d * 4
        exchange = [Row(f"MoE layer {layout}: dropless dispatch all-to-all bytes per device", f"{sent}",
                        f"routed rows T x k x D x 4 = {routed}", sent / routed, "<= 1.0", sent / routed <= 1.0,
                        f"static rows per destination T x min(k, E/ep) = {t * min(k, local)} (a token's k experts "
                        f"are distinct); the [E, T, D] slot grid sent before: {e * t * d * 4} bytes, "
                        f"{e * t * d * 4 / routed:.1f}x; the combine moves as many; XLA:CPU has no ragged all-to-all: "
                        "on GPU and TPU model.moe_exchange=auto sends the routed rows only (ragged)")]
    loss_diff = abs(float(gl) - float(dl))
    grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(dg)))
    theory = f"2 x 3 x k x T x 3DF + router 2 x 3 x T x D x E = {topk:.4g} (T = {t}, D = {d}, F = {f}, E = {e}, k = {k})"
    return [
        Row(f"MoE layer {layout}: dropless grouped matmul FLOPs per device (executed)", f"{g_f:.4g}", theory, g_f / topk,
            f"<= {GOAL}", g_f / topk <= GOAL, why + "; the gate-weighted sum's dot included"),
        Row(f"MoE layer {layout}: dense dispatch matmul FLOPs per device (before)", f"{d_f:.4g}", theory, d_f / topk,
            "reported", None, f"every expert on every token's slot grid: E x T = {e * t} rows"),
        Row(f"MoE layer {layout}: grouped vs dense dispatch, max abs difference (loss, gradients)",
            f"{max(loss_diff, grad_diff):.2e}", "1e-05", max(loss_diff, grad_diff) / 1e-5, "<= 1",
            max(loss_diff, grad_diff) <= 1e-5, f"loss {float(gl):.6f}; gradients wrt every parameter and x"),
        *exchange,
    ]


def step_rows(layout: str, quick: bool, rounds: int, steps: int) -> list[Row]:
    d, f, e, k, batch, length = shape(quick)
    base, _, _ = common.gpt_config(quick, one_block=True)
    cfg = dataclasses.replace(base, d_model=d, n_experts=e, experts_per_token=k, moe_d_ff=f)
    sizes, rules = LAYOUTS[layout]
    mesh = meshes.make_mesh(sizes)
    setups = {name: common.gpt_setup(dataclasses.replace(cfg, capacity_factor=cf), mesh, rules, batch, length)
              for name, cf in (("grouped", 0.0), ("dense", e / k))}
    holders = {name: s.state for name, s in setups.items()}

    def round_of(name):
        def one() -> float:
            state, s = holders[name], setups[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _ = s.compiled(state, s.batch)
            jax.block_until_ready(state)
            holders[name] = state
            return (time.perf_counter() - t0) / steps
        return one

    for name in setups:
        round_of(name)()  # warm-up
    times = common.interleaved(rounds, {name: round_of(name) for name in setups})
    g, dn = statistics.median(times["grouped"]), statistics.median(times["dense"])
    return [Row(f"gpt-moe shape {layout}: train step time, dropless grouped vs dense dispatch", f"{g * 1e3:.1f} ms",
                f"{dn * 1e3:.1f} ms = dense dispatch (C = T)", g / dn, "reported", None,
                f"median of {rounds} interleaved rounds of {steps} steps; {cfg.n_layers} MoE blocks, "
                f"global batch {batch} x {length}")]


def run(options: common.Options, command: str = "python -m benchmarks.moe") -> list[Row]:
    common.setup_devices(options.real_devices)
    started = common.load()
    rounds, steps = (2, 1) if options.quick else (5, 3)
    rows: list[Row] = []
    after: list[str] = []
    if len(jax.devices()) < 8:
        after.append(f"skipped: the layouts need 8 devices, {len(jax.devices())} present")
    else:
        # quick (the test suite's smoke run): the FLOPs of one expert-parallel layout, the step time on dp8
        for layout in ("data2_expert4",) if options.quick else LAYOUTS:
            rows += flops_rows(layout, options.quick)
            print(f"{layout}: FLOPs done", flush=True)
        for layout in ("dp8", "data4_expert2", "data2_expert4") if not options.quick else ("dp8",):
            rows += step_rows(layout, options.quick, rounds, steps)
            print(f"{layout}: step time done", flush=True)
    d, f, e, k, batch, length = shape(options.quick)
    before = [f"- MoE layer: D = {d}, F = {f}, E = {e}, k = {k}, softmax router, f32; global batch {batch} x {length} "
              f"on 8 devices (T = {batch * length // 8} tokens per device); FLOPs from the compiled per-device program",
              "- dense dispatch = the capacity path at C = T (capacity factor E / k), what dropless ran before"]
    common.report("moe", "MoE: grouped expert matmuls vs the top-k count", rows, options, command,
                  before=before, after=after, started_load=started)
    return rows


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.moe") -> int:
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
