"""Supervised fine-tuning on a chat dataset in Parquet, the prompt left out of the loss: a worked example.

    python -m trainers.examples.sft /tmp/sft          # writes /tmp/sft/chat.parquet, trains, prints eval
    spmd-train gpt-small --simulate-devices 8 --set data.corpus=parquet --set data.path=chat.parquet \\
        --set data.fields=prompt,response --set data.seq_len=64

:func:`write_chat` writes a small arithmetic chat dataset (``{"prompt": "12+7=", "response": "19"}``).
:func:`config` is the ``gpt-small`` recipe on it: documents packed with segment ids
(``data.packing=segments``), prompt tokens weighted 0, so the loss is the mean over response tokens
(and each response's end token) of the global batch. See docs/data.md.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from trainers.config import Config
from trainers.data import DataConfig
from trainers.recipes import gpt_small


def write_chat(path: str | Path, n: int = 2000, seed: int = 0) -> Path:
    """``n`` records ``{"prompt": "a+b=", "response": "c"}`` (a, b < 100) as Parquet, 256 rows per row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 100, n), rng.integers(0, 100, n)
    table = pa.table({"prompt": [f"{x}+{y}=" for x, y in zip(a, b)], "response": [str(x + y) for x, y in zip(a, b)]})
    path = Path(path)
    pq.write_table(table, path, row_group_size=256)
    return path


def config(path: str | Path, run_dir: str | Path, *, steps: int = 200, tiny: bool = False) -> Config:
    """``gpt-small`` fine-tuned on the chat Parquet at ``path``, prompt masked (``tiny``: its small model)."""
    base = gpt_small(tiny=tiny)
    data = DataConfig(corpus="parquet", path=str(path), fields="prompt,response", seq_len=64, global_batch=16,
                      validation_fraction=0.1)
    run = dataclasses.replace(base.run, name="sft", run_dir=str(run_dir), steps=steps, eval_every=steps,
                              eval_batches=4, log_every=max(steps // 10, 1), progress=False, tensorboard=False)
    return dataclasses.replace(base, data=data, run=run)


def main(argv: list[str] | None = None) -> int:
    import meshes
    from trainers.loop import train

    out = Path((argv if argv is not None else sys.argv[1:] or ["/tmp/spmd-sft"])[0])
    out.mkdir(parents=True, exist_ok=True)
    meshes.simulate_cpu_devices(8)
    result = train(config(write_chat(out / "chat.parquet"), out / "run"))
    print({k: round(v, 4) for k, v in result.eval_metrics[max(result.eval_metrics)].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
