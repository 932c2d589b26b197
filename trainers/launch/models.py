"""``spmd-export`` and ``spmd-generate``: a trained run (or a Hugging Face folder) out to ``transformers``, or to text.

    spmd-export runs/x --to hf out/              # newest step; runs/x/500 for one step
    spmd-generate runs/x --prompt "def main(" --max-new-tokens 64 --temperature 0.8 --top-k 50 --seed 1
    spmd-generate hf:llama-folder --prompt "Hello" --ids

Exit statuses as ``spmd-train``: 2 for a user error (the message names it; ``--debug`` adds the traceback),
nothing written; 130 for Ctrl-C (answered within a second, also mid-compile).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from trainers.launch.exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE


def _simulate(n: int) -> None:
    if n:
        import meshes

        meshes.simulate_cpu_devices(n)


def _fail(prog: str, e: BaseException, debug: bool, code: int = EXIT_USAGE) -> int:
    if debug:
        traceback.print_exc()
    hint = ""
    if type(e).__name__ == "NoUsableCheckpointError":
        hint = ("\n  (the run has no step to read: train it further, or give RUN_DIR/STEP naming a complete step; "
                "--debug shows the traceback)")
    print(f"{prog}: error: {str(e).strip() or type(e).__name__}{hint}", file=sys.stderr)
    return code


def _debug(args: argparse.Namespace) -> bool:
    return args.debug or os.environ.get("SPMD_DEBUG", "") not in ("", "0")


def _interrupted(prog: str, note: str, argv: list[str] | None) -> int:
    """Ctrl-C that reached Python: one line, exit 130 (the process is gone at once from a shell)."""
    from trainers.launch import cli

    print(f"{prog}: interrupted (Ctrl-C); {note}", file=sys.stderr)
    if argv is None:
        cli._exit_now(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spmd-export", description="Write a run's step as a Hugging Face folder "
                                "(config.json + safetensors + the run's tokenizer.json) that transformers loads.")
    p.add_argument("source", metavar="RUN_DIR[/STEP]")
    p.add_argument("--to", choices=["hf", "peft"], default="hf",
                   help="the format (hf: Hugging Face safetensors, LoRA adapters merged in; peft: a LoRA run's "
                        "adapters as PEFT's adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out", metavar="OUT", help="a new or empty directory")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors shard (default 2 GB)")
    p.add_argument("--allow-model-change", action="store_true",
                   help="export a model the Hugging Face family computes differently (a MoE trained with "
                        "model.capacity_factor > 0 becomes dropless); refused without it, saying what changes")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error (also: SPMD_DEBUG=1)")
    args = p.parse_args(argv)
    note = f"{args.out} may hold an incomplete export: remove it before exporting again"
    if argv is None:
        from trainers.launch import cli

        cli.answer_ctrl_c("spmd-export", note)
    try:
        from trainers.checkpoint import NoUsableCheckpointError
        from trainers.pretrained import export_run

        try:
            files = export_run(args.source, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30),
                               allow_model_change=args.allow_model_change, to=args.to)
        except (ValueError, OSError, NoUsableCheckpointError) as e:
            return _fail("spmd-export", e, _debug(args))
    except KeyboardInterrupt:
        return _interrupted("spmd-export", note, argv)
    print(f"wrote {len(files)} files to {args.out}: {', '.join(files)}")
    return EXIT_OK


def generate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spmd-generate", description="Continue a prompt with a trained run's model "
                                "or a Hugging Face folder (KV cache; temperature 0 is greedy). Tokens are printed "
                                "as they are made.")
    p.add_argument("source", metavar="RUN_DIR[/STEP] | hf:PATH")
    p.add_argument("--prompt", required=True, help="text (or, with --ids, token ids separated by spaces or commas)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="at most the model's positions (max_position_embeddings or sliding window) less the prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0, help="0: all tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: all tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ids", action="store_true", help="the prompt and the output as token ids")
    p.add_argument("--simulate-devices", type=int, default=0, metavar="N", help="N simulated CPU devices")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error (also: SPMD_DEBUG=1)")
    args = p.parse_args(argv)
    if argv is None:
        from trainers.launch import cli

        cli.answer_ctrl_c("spmd-generate", "the tokens so far are above")
    try:
        return _generate(args)
    except KeyboardInterrupt:
        print(file=sys.stdout, flush=True)
        return _interrupted("spmd-generate", "the tokens so far are above", argv)


def _generate(args: argparse.Namespace) -> int:
    try:
        _simulate(args.simulate_devices)
        import numpy as np

        from spmd.models import generate
        from trainers import pretrained
        from trainers.checkpoint import NoUsableCheckpointError
    except ValueError as e:
        return _fail("spmd-generate", e, _debug(args))
    try:
        if pretrained.hf_path(args.source) is None and not os.path.isdir(pretrained.split_source(args.source)[0]):
            raise ValueError(f"{args.source!r} is not a run directory; give RUN_DIR, RUN_DIR/STEP or hf:PATH")
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {args.max_new_tokens}: give an integer >= 1")
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
        limit, where = pretrained.max_positions(args.source)
        if prompt.size + args.max_new_tokens > limit:
            room = limit - prompt.size
            raise ValueError(f"--max-new-tokens {args.max_new_tokens} with a prompt of {prompt.size} tokens exceeds the "
                             f"model's {limit} positions ({where}); "
                             + (f"give --max-new-tokens <= {room}" if room > 0 else "give a shorter prompt"))
        model = pretrained.load_model(args.source, *_one_device())
        stream = _Stream(tokenizer, args.ids)
        out = generate(model, prompt[None], args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                       on_tokens=stream)
        np.asarray(out)  # every token has been streamed once the program is done
    except (ValueError, OSError, NoUsableCheckpointError) as e:
        return _fail("spmd-generate", e, _debug(args))
    stream.close()
    return EXIT_OK


class _Stream:
    """Prints the generated tokens as they arrive: ids separated by spaces, or the text they decode to so far
    (the decoding of every token made, so subwords join as the tokenizer joins them; a character whose
    bytes are not all there yet waits for them)."""

    def __init__(self, tokenizer, ids: bool) -> None:
        self.tokenizer, self.ids, self.printed = tokenizer, ids, ""
        self.tokens: list[int] = []

    def __call__(self, token_B) -> None:
        self.tokens.append(int(token_B[0]))
        if self.ids:
            self._write(("" if len(self.tokens) == 1 else " ") + str(self.tokens[-1]))
        else:
            self._text(self._decode().rstrip("\ufffd"))

    def _decode(self) -> str:
        from trainers import pretrained

        return pretrained.decode(self.tokenizer, self.tokens)

    def _text(self, text: str) -> None:
        if text.startswith(self.printed):  # else the tokenizer rewrote earlier text: wait for the end
            self._write(text[len(self.printed):])
            self.printed = text

    def _write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        if not self.ids:
            text = self._decode()
            self._write(text[len(self.printed):] if text.startswith(self.printed) else "\n" + text)
        self._write("\n")


def _one_device():
    import meshes

    return meshes.single_device_mesh(), "none"
