"""Training speed on one GPU: the toolkit's train step beside a PyTorch step and a hand-written jax step.

Two Llama shapes at sequence 4096, bf16 compute over f32 master weights, AdamW (b 0.9/0.95, weight
decay 0.1, clip 1.0), random tokens:

- ``llama-1b``: the Llama-3.2-1B shape (d 2048, 16 layers, 32/8 heads, d_ff 8192, vocab 128256, tied);
- ``llama-8b-w4``: the Llama-3-8B width with 4 layers (d 4096, 32/8 heads, d_ff 14336, vocab 128256).

For each, in the same run on the same GPU, each in its own process (one framework's allocator at a
time):

- **toolkit**: ``trainers.setup.build``'s train step (guard, metrics and all) with its defaults:
  attention ``auto``, the stack form ``auto`` picks, and the remat policy the planner ranks first
  for one device of this GPU; its step estimate is kept for the planner-vs-measured row;
- **toolkit, tuned**: the same with the flags that should be fastest (the stack unrolled, remat off
  where the compiled step fits); **lean**: the defaults with the spike guard and the update checks off
  (what those cost);
- **torch**: transformers ``LlamaForCausalLM`` of the same config, ``torch.autocast`` bf16 over f32
  parameters, SDPA (flash) attention, ``torch.compile``, fused AdamW: the single-GPU step torchtitan
  runs;
- **jax**: a hand-written step of the same model (no toolkit code: einsums, cuDNN attention, a
  Python loop over layers, optax AdamW): the overhead anchor;
- **peak**: bf16 ``8192^3`` matmuls back to back through XLA and through PyTorch; the larger is the
  MFU denominator.

Reported per step: tokens/s, MFU (``spmd.models.flops_per_step``, attention included, over the
measured peak), peak device memory and compile time (the first step's time less a timed step). The
figures go to a JSON file and the ``gpu_train`` section of RESULTS.md. A job that fails or runs out
of time is reported as such; the others still run. ``--tiny`` runs the same code on tiny models on
whatever device jax has (the tests run it on CPU; torch parts are skipped where torch is missing).
Without a GPU and without ``--tiny`` it prints "no GPU: skipped".

    python -m benchmarks.gpu_train [--tiny] [--only JOB ...] [--budget S] [--json PATH] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SEQ = 4096
SEQ_TINY = 128
MARK = "@@gpu_train "
JSON_DEFAULT = Path(__file__).resolve().with_name("gpu_train.json")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama-style model shape and the global batch it trains with (rows of ``seq`` tokens)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    tied: bool
    batch: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


MODELS = {
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 128256, True, 2),
    "llama-8b-w4": Shape(4096, 4, 32, 8, 14336, 128256, False, 2),
}
TINY = {
    "llama-1b": Shape(64, 2, 4, 2, 128, 512, True, 2),
    "llama-8b-w4": Shape(128, 2, 4, 2, 256, 512, False, 2),
}
KINDS = ("toolkit", "tuned", "lean", "torch", "jax")
# lean: the toolkit step with the spike guard and the update checks off (what they cost)
LEAN = ("run.spike_factor=0", "run.max_update_ratio=0", "run.max_param_growth=0")


def jobs(models: Sequence[str]) -> list[str]:
    """Job names in run order: the peak and attention, per model the toolkit, torch and jax steps, then the
    tuned and lean toolkit steps."""
    out = ["peak", "attention"]
    for kind in ("toolkit", "torch", "jax"):
        out += [f"{kind}:{m}" for m in models]
    return out + [f"tuned:{m}" for m in models] + [f"lean:{m}" for m in models]


# ----------------------------------------------------------------------------------------- children
def _emit(result: dict[str, Any]) -> None:
    print(MARK + json.dumps(result), flush=True)


def _time_steps(step: Callable[[], Any], sync: Callable[[Any], Any], rounds: int, steps: int) -> tuple[float, float, Any]:
    """(first call's seconds, median per-step seconds over ``rounds`` x ``steps``, last output)."""
    t0 = time.perf_counter()
    out = sync(step())
    first = time.perf_counter() - t0
    out = sync(step())  # a second warm step (allocator, autotuning caches)
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        out = sync(out)
        per_round.append((time.perf_counter() - t0) / steps)
    return first, statistics.median(per_round), out


def _jax_memory(device: Any, compiled: Any = None) -> tuple[int, str]:
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "allocator peak"
    if compiled is not None:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        return int(total), "compiled program (arguments + outputs - aliased + temporaries)"
    return 0, "unknown"


def _jax_batch(shape: Shape, seq: int, sharding: Any = None) -> dict[str, Any]:
    import jax
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, shape.vocab, size=(shape.batch, seq + 1), dtype=np.int32)
    put = (lambda a: jax.device_put(a, sharding)) if sharding is not None else jax.device_put
    return {"inputs": put(tokens[:, :-1]), "targets": put(tokens[:, 1:])}


def child_peak(tiny: bool) -> dict[str, Any]:
    """The bf16 matmul peak: ``n^3`` products dispatched back to back (best of 5 rounds), through XLA and,
    where installed, through PyTorch (cuBLAS); the larger is the MFU denominator."""
    import jax
    import jax.numpy as jnp

    n, reps = (256, 2) if tiny else (8192, 20)
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
    mm = jax.jit(jnp.matmul)

    def chain() -> Any:
        return [mm(a, b) for _ in range(reps)]

    jax.block_until_ready(chain())
    best = min(_time_steps(chain, jax.block_until_ready, 1, 1)[1] for _ in range(5)) / reps
    out = {"jax_flops_s": 2.0 * n**3 / best, "n": n, "device": jax.devices()[0].device_kind}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        ta, tb = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def tchain() -> Any:
            return [ta @ tb for _ in range(reps)]

        tchain()
        torch.cuda.synchronize()
        tbest = min(_time_steps(tchain, lambda x: torch.cuda.synchronize(), 1, 1)[1] for _ in range(5)) / reps
        out["torch_flops_s"] = 2.0 * n**3 / tbest
    out["flops_s"] = max(out["jax_flops_s"], out.get("torch_flops_s", 0.0))
    return out


def _toolkit_config(shape: Shape, seq: int, sets: Sequence[str]) -> Any:
    from spmd.models import GPTConfig
    from trainers import override, recipe

    model = GPTConfig(vocab_size=shape.vocab, d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads,
                      n_kv_heads=shape.n_kv_heads, d_ff=shape.d_ff, rope_theta=500_000.0, norm_eps=1e-5,
                      tie_embeddings=shape.tied, tied_head_scale=False, dtype="bfloat16", remat=False)
    cfg = override(recipe("gpt-125m"), [f"data.seq_len={seq}", f"data.global_batch={shape.batch}", "run.steps=1000",
                                        "lr.warmup_steps=10"])
    return override(dataclasses.replace(cfg, model=model), list(sets))


def _planner_pick(cfg: Any, hardware: str) -> tuple[Any, dict[str, Any]]:
    """``cfg`` with the planner's first-ranked remat for one device of ``hardware``, and its estimate."""
    from trainers.planning.planner import plan

    base = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, axes="data=-1"))
    ranked = plan(base, 1, hardware).ranked
    if not ranked:
        return cfg, {"planner": f"no layout fits one {hardware}"}
    best = ranked[0]
    picked = best.layout.apply(base)
    return picked, {"planner_step_s": best.roofline.step_s, "planner_memory": best.memory.total,
                    "planner_layout": str(best.layout)}


def child_toolkit(shape: Shape, seq: int, kind: str, rounds: int, steps: int) -> dict[str, Any]:
    import jax

    import meshes
    from spmd.stack import stack_form
    from trainers import override
    from trainers.planning.auto import detect_hardware
    from trainers.setup import build

    device = jax.devices()[0]
    hardware = detect_hardware(device)
    cfg, info = _planner_pick(_toolkit_config(shape, seq, ()), hardware)
    mesh = meshes.single_device_mesh(device)
    limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    tries: list[list[str]] = [list(LEAN) if kind == "lean" else []]
    if kind == "tuned":
        tries = [["model.scan_layers=unrolled", "model.remat=false", "model.remat_policy=none"],
                 ["model.scan_layers=unrolled", "model.remat_policy=save_dots"],
                 ["model.scan_layers=unrolled"]]
    for sets in tries:
        run_cfg = override(cfg, sets)
        run = build(run_cfg, mesh=mesh)
        batch = _jax_batch(shape, seq, run.batch_sharding)
        t0 = time.perf_counter()
        compiled = run.train_step.lower(run.stepped.abstract, batch).compile()
        lower_compile = time.perf_counter() - t0
        m = compiled.memory_analysis()
        need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        if limit and need > 0.95 * limit and sets is not tries[-1]:
            info.setdefault("skipped", []).append(f"{' '.join(sets)}: needs {need / 2**30:.1f} GiB")
            del run, compiled, batch
            continue
        holder = {"state": run.stepped.state}

        def step() -> Any:
            holder["state"], metrics = run.train_step(holder["state"], batch)
            return metrics

        first, step_s, metrics = _time_steps(step, jax.block_until_ready, rounds, steps)
        memory, how = _jax_memory(device, compiled)
        model = run_cfg.model
        form = stack_form(model.scan_layers, model.n_layers, device.platform)
        return {**info, "step_s": step_s, "compile_s": lower_compile + max(first - step_s, 0.0),
                "memory": memory, "memory_how": how, "batch": shape.batch, "loss": float(metrics["loss"]),
                "flags": " ".join(sets) or "defaults",
                "form": f"stack {form}, remat {model.policy}, attention {model.attention}"}
    raise RuntimeError("no configuration fits")


def child_jax(shape: Shape, seq: int, remat: str, rounds: int, steps: int) -> dict[str, Any]:
    """A hand-written Llama step: bf16 compute over f32 params, cuDNN attention on GPU, optax AdamW."""
    import jax
    import jax.numpy as jnp
    import optax

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    d, hd, h, kv, f, v = shape.d_model, shape.head_dim, shape.n_heads, shape.n_kv_heads, shape.d_ff, shape.vocab
    keys = iter(jax.random.split(jax.random.key(0), 16 * shape.n_layers + 4))

    def w(*dims: int) -> jax.Array:
        return jax.random.normal(next(keys), dims, jnp.float32) * (1.0 / math.sqrt(dims[0]))

    params: dict[str, Any] = {"embed": jax.random.normal(next(keys), (v, d), jnp.float32) * 0.02,
                              "norm": jnp.ones((d,), jnp.float32),
                              "layers": [{"wq": w(d, h * hd), "wk": w(d, kv * hd), "wv": w(d, kv * hd),
                                          "wo": w(h * hd, d), "w1": w(d, f), "w3": w(d, f), "w2": w(f, d),
                                          "n1": jnp.ones((d,), jnp.float32), "n2": jnp.ones((d,), jnp.float32)}
                                         for _ in range(shape.n_layers)]}
    if not shape.tied:
        params["head"] = w(d, v)
    inv = 1.0 / (500_000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]

    def rms(x, g):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * g).astype(jnp.bfloat16)

    def rope(x):
        a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(jnp.bfloat16)

    def block(x, p):
        p = jax.tree.map(lambda t: t.astype(jnp.bfloat16), p)
        b_, l_ = x.shape[:2]
        y = rms(x, p["n1"])
        q = rope((y @ p["wq"]).reshape(b_, l_, h, hd))
        k = rope((y @ p["wk"]).reshape(b_, l_, kv, hd))
        vv = (y @ p["wv"]).reshape(b_, l_, kv, hd)
        o = jax.nn.dot_product_attention(q, k, vv, is_causal=True, implementation="cudnn" if on_gpu else None)
        x = x + o.reshape(b_, l_, h * hd) @ p["wo"]
        y = rms(x, p["n2"])
        return x + (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]

    policy = {"none": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
              "full": jax.checkpoint_policies.nothing_saveable}[remat]
    layer = block if remat == "none" else jax.checkpoint(block, policy=policy)

    def loss_fn(p, batch):
        x = p["embed"].astype(jnp.bfloat16)[batch["inputs"]]
        for lp in p["layers"]:
            x = layer(x, lp)
        x = rms(x, p["norm"])
        head = p["embed"].T if shape.tied else p["head"]
        logits = (x @ head.astype(jnp.bfloat16)).astype(jnp.float32)
        logz = jax.nn.logsumexp(logits, -1)
        picked = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        return jnp.mean(logz - picked)

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(state, batch):
        p, o = state
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, o = tx.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    train_step = jax.jit(train_step.__wrapped__, donate_argnums=0)
    batch = _jax_batch(shape, seq)
    t0 = time.perf_counter()
    compiled = train_step.lower((params, opt_state), batch).compile()
    lower_compile = time.perf_counter() - t0
    holder = {"state": (params, opt_state)}
    del params, opt_state

    def step() -> Any:
        holder["state"], loss = train_step(holder["state"], batch)
        return loss

    first, step_s, loss = _time_steps(step, jax.block_until_ready, rounds, steps)
    memory, how = _jax_memory(device, compiled)
    return {"step_s": step_s, "compile_s": lower_compile + max(first - step_s, 0.0),
            "memory": memory, "memory_how": how, "batch": shape.batch, "loss": float(loss),
            "flags": f"remat {remat}", "form": "python loop over layers, cuDNN attention" if on_gpu else "python loop"}


def child_torch(shape: Shape, seq: int, rounds: int, steps: int) -> dict[str, Any]:
    """transformers' Llama, bf16 autocast over f32 params, SDPA, torch.compile, fused AdamW."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"torch/transformers not installed ({e.name})"}
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.d_model, intermediate_size=shape.d_ff,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
        max_position_embeddings=seq, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=shape.tied,
        use_cache=False)
    try:
        config._attn_implementation = "sdpa"
    except (AttributeError, ValueError):
        pass
    torch.manual_seed(0)
    with dev:
        model = transformers.LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab, (shape.batch, seq + 1), generator=gen).to(dev)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = compiled(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync(x: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        return x

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first, step_s, loss = _time_steps(step, sync, rounds, steps)
    memory = torch.cuda.max_memory_allocated() if cuda else 0
    return {"step_s": step_s, "compile_s": max(first - step_s, 0.0), "memory": int(memory),
            "memory_how": "torch.cuda.max_memory_allocated" if cuda else "unknown", "batch": shape.batch,
            "loss": float(loss.item()), "flags": "autocast bf16, sdpa, torch.compile, fused AdamW",
            "form": f"torch {torch.__version__}, transformers {transformers.__version__}, attention "
                    f"{getattr(model.config, '_attn_implementation', '?')}"}


def child_attention(tiny: bool) -> dict[str, Any]:
    """cuDNN attention with segment ids (as a mask) against blockwise: values, gradients and time, bf16."""
    import jax
    import jax.numpy as jnp

    from spmd.models import attention as attn

    if jax.devices()[0].platform != "gpu":
        return {"skipped": "cuDNN attention needs a GPU"}
    b, length, h, kv, k = (2, 256, 4, 2, 64) if tiny else (2, 4096, 32, 8, 64)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, length, h, k), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, length, kv, k), jnp.bfloat16)
    vv = jax.random.normal(keys[2], (b, length, kv, k), jnp.bfloat16)
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), length // 4)[None].repeat(b, 0)
    out = {}
    results = {}
    for impl in ("cudnn", "blockwise"):
        def loss(q, kk, vv, impl=impl):
            return jnp.sum(attn.attend(q, kk, vv, impl=impl, segment_ids=seg).astype(jnp.float32) ** 2)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        try:
            _, step_s, res = _time_steps(lambda fn=fn: fn(q, kk, vv), jax.block_until_ready, 3, 5)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        out[f"{impl}_s"] = step_s
        results[impl] = res
    if len(results) == 2:
        out["max_grad_diff"] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - c.astype(jnp.float32))) /
                                         jnp.max(jnp.abs(c.astype(jnp.float32))))
                                   for a, c in zip(jax.tree.leaves(results["cudnn"][1]),
                                                   jax.tree.leaves(results["blockwise"][1])))
        out["loss_rel_diff"] = float(abs(results["cudnn"][0] - results["blockwise"][0]) / abs(results["blockwise"][0]))
    out["shape"] = f"B {b}, L {length}, {h}/{kv} heads of {k}, 4 documents per row"
    return out


def child(job: str, tiny: bool, remat: str, rounds: int, steps: int) -> dict[str, Any]:
    seq = SEQ_TINY if tiny else SEQ
    if job == "peak":
        return child_peak(tiny)
    if job == "attention":
        return child_attention(tiny)
    kind, model = job.split(":")
    shape = (TINY if tiny else MODELS)[model]
    if kind in ("toolkit", "tuned", "lean"):
        return child_toolkit(shape, seq, kind, rounds, steps)
    if kind == "jax":
        return child_jax(shape, seq, remat, rounds, steps)
    if kind == "torch":
        return child_torch(shape, seq, rounds, steps)
    raise ValueError(f"unknown job {job!r}")


# ------------------------------------------------------------------------------------------- parent
def run_job(job: str, tiny: bool, timeout: float, remat: str, rounds: int, steps: int) -> dict[str, Any]:
    """One job in a fresh process (its own allocator); its result, or what went wrong."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_train", "--child", job, "--remat", remat,
           "--rounds", str(rounds), "--steps", str(steps)] + (["--tiny"] if tiny else [])
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    if job == "peak":  # jax and torch share the device in this one
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "wall_s": wall}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)[-900:], "wall_s": wall}


def measure(models: Sequence[str], tiny: bool, budget: float, only: Sequence[str], json_path: Path | None,
            rounds: int, steps: int) -> dict[str, Any]:
    """Run the jobs in order within ``budget`` seconds, writing the JSON after each."""
    results: dict[str, Any] = {"tiny": tiny, "seq": SEQ_TINY if tiny else SEQ,
                               "models": {m: dataclasses.asdict((TINY if tiny else MODELS)[m]) for m in models},
                               "jobs": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    deadline = time.perf_counter() + budget
    for job in jobs(models):
        if only and job not in only and job.split(":")[0] not in only:
            continue
        left = deadline - time.perf_counter()
        if left < 20:
            results["jobs"][job] = {"error": "not started: out of the time budget"}
            continue
        remat = "none"
        if job.startswith("jax:"):  # the anchor keeps the toolkit default's remat, to compare like with like
            form = results["jobs"].get("toolkit:" + job.split(":")[1], {}).get("form", "")
            remat = "full" if "remat full" in form else "save_dots" if "remat save" in form else "none"
        print(f"[gpu_train] {job} ({left:.0f} s left)", flush=True)
        results["jobs"][job] = run_job(job, tiny, left, remat, rounds, steps)
        print(f"[gpu_train] {job}: {json.dumps(results['jobs'][job])[:400]}", flush=True)
        if json_path is not None:
            json_path.write_text(json.dumps(results, indent=1))
    return results


def rows(results: dict[str, Any]) -> list[Any]:
    """RESULTS.md rows: per model tokens/s against torch, MFU, memory, compile; planner; attention."""
    from benchmarks.common import Row, fmt_bytes
    from spmd.models import GPTConfig, flops_per_step

    jobs_ = results["jobs"]
    seq = results["seq"]
    peak = jobs_.get("peak", {}).get("flops_s", float("nan"))
    out = []
    for name, fields in results["models"].items():
        shape = Shape(**fields)
        model = GPTConfig(vocab_size=shape.vocab, d_model=shape.d_model, n_layers=shape.n_layers,
                          n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, d_ff=shape.d_ff,
                          tie_embeddings=shape.tied)
        flops = flops_per_step(model, shape.batch, seq)
        tokens = shape.batch * seq
        torch_ = jobs_.get(f"torch:{name}", {})
        torch_tps = tokens / torch_["step_s"] if "step_s" in torch_ else float("nan")
        for kind in KINDS:
            r = jobs_.get(f"{kind}:{name}")
            if r is None:
                continue
            what = f"{name} ({shape.batch} x {seq}), {kind}"
            if "step_s" not in r:
                out.append(Row(what + ": tokens/s", "-", "-", float("nan"), "reported", None,
                               r.get("error") or r.get("skipped", "")))
                continue
            tps = tokens / r["step_s"]
            mfu = flops / r["step_s"] / peak
            detail = (f"{r['step_s'] * 1e3:.1f} ms/step; MFU {mfu:.3f}; memory {fmt_bytes(r['memory'])} "
                      f"({r['memory_how']}); compile {r['compile_s']:.1f} s; "
                      f"{r.get('form', '')}; {r.get('flags', '')}")
            if kind in ("toolkit", "tuned", "lean"):
                out.append(Row(what + ": tokens/s vs the PyTorch step", f"{tps:,.0f}",
                               f"{torch_tps:,.0f} torch" if torch_tps == torch_tps else "torch: not measured",
                               tps / torch_tps, ">= 1.0", tps >= torch_tps if torch_tps == torch_tps else None, detail))
                if name == "llama-1b":
                    out.append(Row(what + ": MFU", f"{mfu:.3f}", f"{peak / 1e12:.0f} TFLOP/s measured bf16 peak",
                                   mfu, ">= 0.50", mfu >= 0.50, f"{flops / 1e12:.1f} TFLOP/step (6N + attention)"))
                if "planner_step_s" in r and kind == "toolkit":
                    ratio = r["planner_step_s"] / r["step_s"]
                    out.append(Row(what + ": planner step estimate vs measured", f"{r['planner_step_s'] * 1e3:.1f} ms",
                                   f"{r['step_s'] * 1e3:.1f} ms measured", ratio, "[0.8, 1.25]", 0.8 <= ratio <= 1.25,
                                   r.get("planner_layout", "")))
            else:
                out.append(Row(what + ": tokens/s", f"{tps:,.0f}", f"{torch_tps:,.0f} torch", tps / torch_tps,
                               "reported", None, detail))
    att = jobs_.get("attention")
    if att and "cudnn_s" in att and "blockwise_s" in att:
        out.append(Row("attention with segment ids, fwd+bwd: cuDNN (mask) vs blockwise", f"{att['cudnn_s'] * 1e3:.2f} ms",
                       f"{att['blockwise_s'] * 1e3:.2f} ms blockwise", att["cudnn_s"] / att["blockwise_s"], "reported",
                       None, f"max gradient difference {att['max_grad_diff']:.2e} of the largest gradient, loss rel diff {att['loss_rel_diff']:.1e}; "
                       f"{att['shape']}"))
    elif att:
        out.append(Row("attention with segment ids: cuDNN vs blockwise", "-", "-", float("nan"), "reported", None,
                       "; ".join(f"{k}: {v}" for k, v in att.items() if k != "wall_s")))
    return out


def _driver() -> list[str]:
    """``- GPU ..., driver ...`` from nvidia-smi, where there is one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [f"- nvidia-smi: {out}"] if out else []


def main(argv: Sequence[str] | None = None, command: str = "python -m benchmarks.gpu_train") -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny models on whatever device jax has (a smoke test)")
    p.add_argument("--quick", action="store_true", help="the same as --tiny (the benchmark suite's smoke flag)")
    p.add_argument("--only", nargs="*", default=[], help="jobs or kinds to run (peak, toolkit, tuned, torch, jax, "
                                                          "attention, or KIND:MODEL)")
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--budget", type=float, default=330.0, help="seconds for all jobs together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None, help="where the measurements go (default benchmarks/gpu_train.json; with "
                                                "--tiny nowhere; '' = nowhere)")
    p.add_argument("--output", default=None, help="results file (default benchmarks/RESULTS.md; '' = do not write)")
    p.add_argument("--real-devices", action="store_true", help="accepted for the suite's sake: always real devices")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--remat", default="none", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tiny = args.tiny or args.quick
    if args.child is not None:
        try:
            _emit(child(args.child, tiny, args.remat, args.rounds, args.steps))
        except Exception as e:  # noqa: BLE001 - the parent reports it and goes on
            traceback.print_exc()
            _emit({"error": f"{type(e).__name__}: {str(e)[:600]}"})
        return 0
    from benchmarks import common

    options = common.Options(quick=tiny, real_devices=True,
                             output=common.RESULTS if args.output is None else (Path(args.output) if args.output else None))
    import jax

    title = "GPU: training speed against a PyTorch step"
    cmd = " ".join([command, *(argv if argv is not None else sys.argv[1:])])
    if not tiny and not any(d.platform == "gpu" for d in jax.devices()):
        print("no GPU: skipped")
        common.report("gpu_train", title, [], options, cmd, after=["no GPU: skipped"])
        return 0
    rounds, steps = (1, 2) if tiny else (args.rounds, args.steps)
    json_path = Path(args.json) if args.json else (JSON_DEFAULT if args.json is None and not tiny else None)
    models, only = args.models, args.only
    if tiny and not only:  # the smoke test: one model, the toolkit against both references
        models, only = models[:1], ["peak", "toolkit", "torch", "jax"]
    results = measure(models, tiny, args.budget, only, json_path, rounds, steps)
    shapes = "; ".join(f"{m}: d {s['d_model']}, {s['n_layers']} layers, {s['n_heads']}/{s['n_kv_heads']} heads, "
                       f"d_ff {s['d_ff']}, vocab {s['vocab']}{', tied' if s['tied'] else ''}"
                       for m, s in results["models"].items())
    common.report("gpu_train", title, rows(results), options, cmd, before=[*_driver(),
        f"- {shapes}; sequence {results['seq']}; bf16 compute, f32 params and AdamW; random tokens",
        f"- each job in its own process; median of {rounds} rounds x {steps} steps after 2 warm steps; "
        "compile = first step less a timed step"], after=_after(results))
    return 0


def _after(results: dict[str, Any]) -> list[str]:
    """Lines under the table: the peaks behind MFU and what the guard costs (default vs lean)."""
    jobs_, out = results["jobs"], []
    peak = jobs_.get("peak", {})
    if "jax_flops_s" in peak:
        out.append(f"peak: {peak['jax_flops_s'] / 1e12:.0f} TFLOP/s through XLA" + (
            f", {peak['torch_flops_s'] / 1e12:.0f} through PyTorch" if "torch_flops_s" in peak else "") +
            f" ({peak['n']}^3 bf16); MFU uses the larger")
    for name in results["models"]:
        default, lean = jobs_.get(f"toolkit:{name}", {}), jobs_.get(f"lean:{name}", {})
        if "step_s" in default and "step_s" in lean:
            cost = default["step_s"] - lean["step_s"]
            out.append(f"{name}: the spike guard and update checks cost {cost * 1e3:.1f} ms per step "
                       f"({cost / default['step_s']:.1%}; off: run.spike_factor=0 run.max_update_ratio=0 "
                       "run.max_param_growth=0)")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
