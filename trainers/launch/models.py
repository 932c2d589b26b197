"""``spmd-export`` and ``spmd-generate``: a trained run (or a Hugging Face folder) out to ``transformers``, or to text.

    spmd-export runs/x --to hf out/              # newest step; runs/x/500 for one step
    spmd-generate runs/x --prompt "def main(" --max-new-tokens 64 --temperature 0.8 --top-k 50 --seed 1
    spmd-generate hf:llama-folder --prompt "Hello" --ids

Exit statuses as ``spmd-train``: 2 for a user error (the message names it), nothing written.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainers.launch.exits import EXIT_OK, EXIT_USAGE


def _simulate(n: int) -> None:
    if n:
        import meshes

        meshes.simulate_cpu_devices(n)


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spmd-export", description="Write a run's step as a Hugging Face folder "
                                "(config.json + safetensors + the run's tokenizer.json) that transformers loads.")
    p.add_argument("source", metavar="RUN_DIR[/STEP]")
    p.add_argument("--to", choices=["hf"], default="hf", help="the format (hf: Hugging Face safetensors)")
    p.add_argument("out", metavar="OUT", help="a new or empty directory")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors shard (default 2 GB)")
    args = p.parse_args(argv)
    try:
        from trainers.pretrained import export_run

        files = export_run(args.source, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except (ValueError, OSError) as e:
        print(f"spmd-export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {len(files)} files to {args.out}: {', '.join(files)}")
    return EXIT_OK


def generate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spmd-generate", description="Continue a prompt with a trained run's model "
                                "or a Hugging Face folder (KV cache; temperature 0 is greedy).")
    p.add_argument("source", metavar="RUN_DIR[/STEP] | hf:PATH")
    p.add_argument("--prompt", required=True, help="text (or, with --ids, token ids separated by spaces or commas)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: all tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ids", action="store_true", help="the prompt and the output as token ids")
    p.add_argument("--simulate-devices", type=int, default=0, metavar="N", help="N simulated CPU devices")
    args = p.parse_args(argv)
    try:
        _simulate(args.simulate_devices)
        import numpy as np

        from spmd.models import generate
        from trainers import pretrained

        if pretrained.hf_path(args.source) is None and not os.path.isdir(pretrained.split_source(args.source)[0]):
            raise ValueError(f"{args.source!r} is not a run directory; give RUN_DIR, RUN_DIR/STEP or hf:PATH")
        tokenizer = None if args.ids else pretrained.tokenizer_for(args.source)
        if args.ids:
            try:
                prompt = np.asarray([int(t) for t in args.prompt.replace(",", " ").split()], np.int32)
            except ValueError:
                raise ValueError(f"--ids: the prompt must be integers, got {args.prompt!r}") from None
        else:
            prompt = pretrained.encode(tokenizer, args.prompt)
        if prompt.size == 0:
            raise ValueError("--prompt is empty")
        model = pretrained.load_model(args.source, *_one_device())
        out = np.asarray(generate(model, prompt[None], args.max_new_tokens, args.temperature, args.top_k,
                                  args.top_p, args.seed))[0]
    except (ValueError, OSError) as e:
        print(f"spmd-generate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(" ".join(map(str, out)) if args.ids else pretrained.decode(tokenizer, out))
    return EXIT_OK


def _one_device():
    import meshes

    return meshes.single_device_mesh(), "none"
