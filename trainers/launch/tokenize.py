"""``spmd-tokenize SOURCE --tokenizer tokenizer.json --out DIR``: encode a text folder once for training.

    spmd-tokenize ~/corpus --tokenizer tokenizer.json --out ~/corpus-tok
    spmd-train gpt-small --set data.corpus=tokens --set data.path=~/corpus-tok \\
        --set data.vocab_size=32000 --set model.vocab_size=32000

The format and its reader: :mod:`trainers.data.prepare`. With ``--format jsonl|parquet|hf`` (and
``--fields``) SOURCE is a document corpus, written as token-id Parquet by
:mod:`trainers.data.pretokenize` for ``data.corpus=parquet``; see docs/data.md.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spmd-tokenize",
        description="Encode a text folder (or file) with a Hugging Face tokenizer.json into one memory-mapped "
                    "token file per split (DIR/train.bin, DIR/validation.bin, each with a .json of metadata); "
                    "train on it with --set data.corpus=tokens --set data.path=DIR.",
    )
    p.add_argument("source", metavar="SOURCE", help="a folder of text files (split by document) or one text file "
                                                    "(split by token position)")
    p.add_argument("--tokenizer", required=True, metavar="TOKENIZER_JSON", help="a tokenizers tokenizer.json")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (created if missing)")
    p.add_argument("--validation-fraction", type=float, default=0.05,
                   help="share of documents (of tokens, for one file) in the validation split (default 0.05)")
    p.add_argument("--separator", default="", metavar="TOKEN",
                   help="the token that ends each document (default: the tokenizer's end-of-text token, if any)")
    p.add_argument("--suffixes", default=None, help="comma-separated file endings that count as text (default: "
                                                    "the text corpus's, .txt,.md,.rst,.py,.json,.jsonl,.csv,.html,.tex)")
    p.add_argument("--format", default="", choices=("", "jsonl", "parquet", "hf"),
                   help="SOURCE is a document corpus in this format (files, a glob or a folder; hf: a "
                        "save_to_disk folder): write DIR/train.parquet, DIR/validation.parquet of token ids")
    p.add_argument("--fields", default="text", help="with --format: the record fields, e.g. prompt,response "
                                                    "(default text)")
    p.add_argument("--overwrite", action="store_true", help="replace a prepared corpus already in DIR")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse, then :func:`trainers.data.prepare.prepare`; a ValueError or OSError becomes exit status 2."""
    args = parse_args(argv)
    import os

    # imported after parsing: --help answers without starting jax
    from trainers.data import checks
    from trainers.data import corpus as corpus_lib
    from trainers.data import prepare as prepare_lib

    try:
        prepared = ("train.parquet",) if args.format else ("train.json",)
        if not args.overwrite and os.path.exists(os.path.join(os.path.expanduser(args.out), prepared[0])):
            raise ValueError(f"--out={args.out!r} already holds a prepared corpus; pass --overwrite to replace it")
        if args.format:
            return _documents(args)
        kw = {}
        if args.suffixes is not None:
            kw["suffixes"] = tuple(s.strip() for s in args.suffixes.split(",") if s.strip())
            if not kw["suffixes"]:
                raise ValueError(f"--suffixes={args.suffixes!r} names no file endings; give e.g. .txt,.md")
        source = os.path.expanduser(args.source)
        if os.path.isfile(source):  # binary input is refused, not encoded
            checks.check_text_file(source, key="SOURCE")
        elif os.path.isdir(source):
            checks.check_text_files(source, corpus_lib.text_files(source, kw.get("suffixes", corpus_lib.TEXT_SUFFIXES)),
                                    key="SOURCE")
        metas = prepare_lib.prepare(args.source, args.tokenizer, args.out, validation_fraction=args.validation_fraction,
                                    separator=args.separator, progress=args.progress, **kw)
    except (ValueError, OSError) as e:
        print(f"spmd-tokenize: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    train = metas["train"]
    for split, meta in metas.items():
        print(f"{split}: {meta['count']:,} tokens ({meta['dtype']}) from {len(meta['files'])} files -> "
              f"{os.path.join(args.out, split + '.bin')}")
    print(f"vocab {train['vocab_size']}, separator {train['separator']!r}; train with: --set data.corpus=tokens "
          f"--set data.path={args.out} --set data.vocab_size={train['vocab_size']} "
          f"--set model.vocab_size={train['vocab_size']}")
    return 0


def _documents(args: argparse.Namespace) -> int:
    from trainers.data.pretokenize import prepare_documents

    fields = tuple(f.strip() for f in args.fields.split(",") if f.strip())
    if not fields:
        raise ValueError(f"--fields={args.fields!r} names no field; give e.g. text or prompt,response")
    meta = prepare_documents(args.source, args.format, fields, args.tokenizer, args.out,
                             validation_fraction=args.validation_fraction, separator=args.separator,
                             progress=args.progress)
    for split, m in meta.items():
        print(f"{split}: {m['rows']:,} documents, {m['tokens']:,} tokens -> {m['path']}")
    print(f"train with: --set data.corpus=parquet --set data.path={args.out} --set data.fields={','.join(fields)} "
          "(data.vocab_size and model.vocab_size covering the tokenizer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
