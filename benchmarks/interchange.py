"""Pretrained checkpoints: sharded import (peak RSS, throughput) and generation (prefill, decode tokens/s).

- **import**: a random Llama-shaped Hugging Face checkpoint of >= 1 GiB (f32; 64 MiB with
  ``--quick``) written to a temporary folder, then imported by 2 processes x 4 simulated CPU devices
  on ``fsdp=4 x tensor=2`` (rules ``fsdp_tp``) with ``spmd.interchange.read_params``. Each process
  resets its peak RSS (``/proc/self/clear_refs``) before the load and reports ``VmHWM - VmRSS before``
  against its share of the state (the bytes of its devices' shards) plus the largest single tensor;
  goal <= 1.3 x. Throughput per process: the bytes it read / its load time, against its raw read of
  the files with both processes reading at once (page cache, warmed first); goal >= 0.5 x.
- **generation**: ``spmd.models.generate`` on one device of a smaller model (f32), batch 4: decode
  tokens/s from the difference of two runs (1 and N+1 new tokens), against the memory-bandwidth
  bound of reading the weights and the KV cache once per decode step (bandwidth measured here as a
  jitted sum over 512 MiB); prefill tokens/s against the FLOP bound (2 x params FLOPs per token at
  a measured f32 matmul rate).

    python -m benchmarks.interchange [--quick] [--output PATH]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common
from benchmarks.common import Row, fmt_bytes

RSS_GOAL, READ_GOAL = 1.3, 0.5


def _model(quick: bool):
    from spmd.models import GPTConfig

    if quick:
        return GPTConfig(vocab_size=4096, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=1536, norm_eps=1e-5,
                         tied_head_scale=False)
    return GPTConfig(vocab_size=32768, d_model=1024, n_layers=13, n_heads=16, n_kv_heads=8, d_ff=4096, norm_eps=1e-5,
                     tied_head_scale=False)


def write_checkpoint(cfg, out: str) -> int:
    """A random checkpoint of ``cfg`` (one parameter on the host at a time); returns its bytes."""
    import jax
    from flax import nnx

    from spmd.interchange import save_pretrained
    from spmd.models import GPT
    from spmd.sharding import abstract_module

    abstract = nnx.to_pure_dict(nnx.state(abstract_module(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32) * 0.02, abstract)
    save_pretrained(out, cfg, params, max_shard_bytes=512 << 20)
    return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(pid: int, port: int, path: str, out: str) -> None:
    """One of 2 processes: import ``path`` onto fsdp=4 x tensor=2, write its figures to ``out``."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    from flax import nnx

    import meshes
    from spmd.interchange import pretrained_config, read_params
    from spmd.interchange.safetensors_io import SafetensorsFolder
    from spmd.models import GPT
    from spmd.variables import init_model

    cfg = pretrained_config(path)
    mesh = meshes.make_mesh({"fsdp": 4, "tensor": 2})
    mv = init_model(lambda: GPT(cfg, rngs=nnx.Rngs(0)), "fsdp_tp", mesh, abstract=True)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), mv.params,
                            mv.shardings["params"])
    from jax.experimental import multihost_utils

    folder = SafetensorsFolder(path)
    largest = max(int(np.prod(s)) * 4 for s in folder.shapes.values())
    raw_read(path)  # warm the page cache
    multihost_utils.sync_global_devices("raw")
    raw = raw_read(path)  # both processes read every file at once, as they load at once
    multihost_utils.sync_global_devices("load")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    t = time.perf_counter()
    params = read_params(path, cfg, abstract, folder=folder)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t
    peak = _status("VmHWM") - before
    share = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "peak": peak, "share": share, "largest": largest, "read": folder.bytes_read,
                   "raw_s": raw, "raw_bytes": folder.nbytes()}, f)


def raw_read(path: str) -> float:
    t = time.perf_counter()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass
    return time.perf_counter() - t


def import_rows(quick: bool, tmp: str) -> tuple[list[Row], list[str]]:
    path = os.path.join(tmp, "ckpt")
    nbytes = write_checkpoint(_model(quick), path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    outs = [os.path.join(tmp, f"w{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.interchange", "--worker", str(i), str(port), path,
                               outs[i]], env=env) for i in range(2)]
    if any(p.wait(timeout=900) for p in procs):
        raise RuntimeError("an import worker failed")
    figures = [json.load(open(o)) for o in outs]
    rows = []
    for i, w in enumerate(figures):
        bound = w["share"] + w["largest"]
        rows.append(Row(f"import peak RSS growth, process {i} of 2 (4 devices, fsdp=4 x tensor=2)",
                        fmt_bytes(w["peak"]), f"{fmt_bytes(bound)} = share {fmt_bytes(w['share'])} + largest tensor "
                        f"{fmt_bytes(w['largest'])}", w["peak"] / bound, f"<= {RSS_GOAL}", w["peak"] / bound <= RSS_GOAL,
                        f"checkpoint {fmt_bytes(nbytes)}; load {w['seconds']:.2f} s"))
    for i, w in enumerate(figures):
        rate, raw_rate = w["read"] / w["seconds"], w["raw_bytes"] / w["raw_s"]
        rows.append(Row(f"import throughput, process {i} of 2 (bytes it read / its load time)",
                        f"{rate / 2**20:.0f} MiB/s", f"{raw_rate / 2**20:.0f} MiB/s raw read of the files by this "
                        "process, both processes at once (page cache)", rate / raw_rate, f">= {READ_GOAL}",
                        rate / raw_rate >= READ_GOAL, f"read {fmt_bytes(w['read'])} of {fmt_bytes(nbytes)} in "
                        f"{w['seconds']:.2f} s (whole rows of the tensors its devices hold, cut into device blocks)"))
    return rows, [f"- import: random Llama-shaped checkpoint of {fmt_bytes(nbytes)} (f32), 2 processes x 4 simulated "
                  "CPU devices, rules fsdp_tp; each process reads only its devices' slices"]


def bandwidth_and_peak(quick: bool = False) -> tuple[float, float]:
    """(bytes/s of a jitted sum over 512 MiB, f32 matmul FLOP/s at 2048^2) on the first device (``quick``:
    128 MiB and 1024^2, a smoke run's reported figures)."""
    import jax
    import jax.numpy as jnp

    n = 1024 if quick else 2048
    x = jnp.ones(((32 if quick else 128) << 20,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    bw = x.nbytes / min(common.timed(lambda: total(x).block_until_ready()) for _ in range(5))
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    peak = 2 * n**3 / min(common.timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    return bw, peak


def generation_rows(quick: bool) -> tuple[list[Row], list[str]]:
    import jax
    from flax import nnx

    from spmd.models import GPT, GPTConfig, generate, param_count

    cfg = GPTConfig(vocab_size=4096, d_model=512 if quick else 1024, n_layers=4 if quick else 8, n_heads=8,
                    n_kv_heads=4, d_ff=1536 if quick else 2816)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    b, p, n = 4, 64, 16 if quick else 64
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, p)).astype(np.int32)

    def run(k):
        return lambda: jax.block_until_ready(generate(model, prompt, k))

    run(1)(), run(n + 1)()  # compile both
    times = common.interleaved(3, {"one": lambda: common.timed(run(1)), "many": lambda: common.timed(run(n + 1))})
    one, many = min(times["one"]), min(times["many"])
    decode_s = (many - one) / n
    bw, peak = bandwidth_and_peak(quick)
    params = param_count(cfg)
    kv = 2 * cfg.n_layers * b * (p + n) * cfg.kv_heads * cfg.k * 4  # the whole cache is read every step
    bound_s = (params * 4 + kv) / bw
    prefill_flops = 2 * params * b * p
    rows = [Row(f"decode, batch {b}, one CPU device (f32)", f"{b / decode_s:.1f} tokens/s",
                f"{b / bound_s:.1f} tokens/s reading weights {fmt_bytes(params * 4)} + KV cache {fmt_bytes(kv)} once "
                f"per step at {bw / 1e9:.1f} GB/s", (b / decode_s) / (b / bound_s), "reported", None,
                f"{decode_s * 1e3:.1f} ms per step = (t({n + 1} tokens) - t(1)) / {n}"),
            Row(f"prefill, batch {b} x {p} tokens, one CPU device (f32)", f"{b * p / one:.0f} tokens/s",
                f"{b * p / (prefill_flops / peak):.0f} tokens/s at 2 x params FLOPs per token, "
                f"{peak / 1e9:.0f} GFLOP/s measured f32 matmul", (b * p / one) / (b * p / (prefill_flops / peak)),
                "reported", None, f"{one * 1e3:.0f} ms incl. sampling one token")]
    return rows, [f"- generation: GPT d_model={cfg.d_model}, n_layers={cfg.n_layers}, {params / 1e6:.1f}M params, "
                  f"GQA {cfg.n_heads}/{cfg.kv_heads} heads, prompt {p}, {n} new tokens, greedy; medians of 3 "
                  "interleaved rounds (minimum)"]


def run(options: common.Options, command: str) -> None:
    common.setup_devices(options.real_devices)
    with tempfile.TemporaryDirectory() as tmp:
        rows, before = import_rows(options.quick, tmp)
    gen_rows, gen_before = generation_rows(options.quick)
    common.report("interchange", "Pretrained checkpoints: sharded import and generation", rows + gen_rows, options,
                  command, before=before + gen_before)


def main(argv: list[str] | None = None, command: str = "python -m benchmarks.interchange") -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        worker(int(args[1]), int(args[2]), args[3], args[4])
        return 0
    return common.run_main(run, __doc__, command, argv)


if __name__ == "__main__":
    sys.exit(main())
