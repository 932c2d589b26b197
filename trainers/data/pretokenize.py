"""Documents tokenized once: a JSONL, Parquet or saved-dataset corpus -> DIR/train.parquet, DIR/validation.parquet.

    spmd-tokenize chats/ --format parquet --fields prompt,response --tokenizer tokenizer.json --out DIR
    spmd-train ... --set data.corpus=parquet --set data.path=DIR --set data.fields=prompt,response

Each record becomes a row whose fields are lists of token ids (int32), the last field ending with the
tokenizer's end-of-text token; the loader uses them as stored (no tokenizing at train time) and
weights every field but the last 0, as for text. Splits are the loader's (a hash of each record's
id; a DatasetDict's own); the files are read block by block and written one row group per block,
each to a temporary name renamed when complete. See docs/data.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trainers.data import corpus as corpus_lib
from trainers.data import tokenizer as tok_lib
from trainers.data.documents import Documents


def prepare_documents(source: str, fmt: str, fields: tuple[str, ...], tokenizer: str, out: str, *,
                      validation_fraction: float = 0.05, separator: str = "",
                      progress: bool = True) -> dict[str, dict[str, Any]]:
    """Write ``out/{split}.parquet`` (see the module docstring); returns per split ``{"rows", "tokens", "path"}``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    corpus_lib._check_split("train", validation_fraction)
    docs = Documents(fmt, source, fields)
    tok, sha = tok_lib.load_tokenizer(tokenizer, key="--tokenizer")
    sep_token, sep = tok_lib.separator_id(tok, separator, key="--separator")
    out_dir = Path(out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(f, pa.list_(pa.int32())) for f in fields],
                       metadata={"tokenizer_sha256": sha, "separator": sep_token,
                                 "vocab_size": str(tok_lib.vocab_size_of(tok))})
    meta = {}
    for split in corpus_lib.SPLITS:
        path = out_dir / f"{split}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        rows = tokens = 0
        with pq.ParquetWriter(tmp, schema) as writer:
            for block in tqdm(docs.blocks_of(split), unit="block", desc=f"{split} {Path(source).name}",
                              disable=not progress):
                records = docs.split_records(block, split, validation_fraction)
                if not records:
                    continue
                columns: list[list[np.ndarray]] = [[] for _ in fields]
                for _, values in records:
                    for i, v in enumerate(values):
                        ids = np.asarray(v, np.int32) if isinstance(v, np.ndarray) else \
                            np.asarray(tok.encode(v, add_special_tokens=False).ids, np.int32)
                        if i == len(fields) - 1 and sep is not None:
                            ids = np.append(ids, np.int32(sep))
                        columns[i].append(ids)
                        tokens += ids.size
                rows += len(records)
                writer.write_table(pa.table({f: pa.array(c, pa.list_(pa.int32())) for f, c in zip(fields, columns)},
                                            schema=schema))
        if rows == 0:
            tmp.unlink()
            raise ValueError(f"SOURCE={source!r} has no record in split {split!r} (validation fraction "
                             f"{validation_fraction}); give more records or another --validation-fraction")
        os.replace(tmp, path)
        meta[split] = {"rows": rows, "tokens": tokens, "path": str(path)}
    return meta
