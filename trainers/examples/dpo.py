"""Preference tuning (DPO) on pairs in JSONL, against a frozen copy of the starting model: a worked example.

    python -m trainers.examples.dpo /tmp/dpo          # writes /tmp/dpo/pairs.jsonl, trains, prints eval
    spmd-train gpt-small --simulate-devices 8 --set run.objective=dpo --set data.corpus=jsonl \\
        --set data.path=pairs.jsonl --set data.fields=prompt,chosen,rejected --set data.seq_len=64

:func:`write_pairs` writes a synthetic preference set a simple rule decides: after a prompt of
letters, the chosen response is digits that are all even, the rejected one digits that are all odd
(``{"prompt": "qwe:", "chosen": "4826", "rejected": "1597"}``). :func:`config` is the ``gpt-small``
recipe on it with ``run.objective=dpo``: each pair's two documents packed side by side in a row,
the loss and the TRL-named metrics (``rewards/accuracies``: how often the chosen response earns the
higher reward) over the pairs of the global batch. See docs/post-training.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from trainers.config import Config, DPOConfig
from trainers.data import DataConfig
from trainers.recipes import gpt_small


def write_pairs(path: str | Path, n: int = 2000, seed: int = 0) -> Path:
    """``n`` records ``{"prompt", "chosen", "rejected"}`` as JSONL: a 3-letter prompt, 4 even digits chosen,
    4 odd digits rejected."""
    rng = np.random.default_rng(seed)
    letters, even, odd = np.array(list("abcdefghijklmnopqrstuvwxyz")), np.array(list("02468")), np.array(list("13579"))
    path = Path(path)
    with open(path, "w") as f:
        for _ in range(n):
            record = {"prompt": "".join(rng.choice(letters, 3)) + ":", "chosen": "".join(rng.choice(even, 4)),
                      "rejected": "".join(rng.choice(odd, 4))}
            f.write(json.dumps(record) + "\n")
    return path


def config(path: str | Path, run_dir: str | Path, *, steps: int = 100, tiny: bool = False) -> Config:
    """``gpt-small`` trained with DPO on the pairs at ``path`` (``tiny``: its small model)."""
    base = gpt_small(tiny=tiny)
    data = DataConfig(corpus="jsonl", path=str(path), fields="prompt,chosen,rejected", seq_len=32, global_batch=16,
                      validation_fraction=0.1)
    run = dataclasses.replace(base.run, name="dpo", run_dir=str(run_dir), steps=steps, eval_every=steps,
                              eval_batches=4, log_every=max(steps // 10, 1), progress=False, tensorboard=False,
                              objective="dpo")
    lr = dataclasses.replace(base.lr, warmup_steps=min(base.lr.warmup_steps, max(steps // 10, 1)))
    return dataclasses.replace(base, data=data, run=run, lr=lr, dpo=DPOConfig(beta=0.1, pairs_per_row=4))


def main(argv: list[str] | None = None) -> int:
    import meshes
    from trainers.loop import train

    out = Path((argv if argv is not None else sys.argv[1:] or ["/tmp/spmd-dpo"])[0])
    out.mkdir(parents=True, exist_ok=True)
    meshes.simulate_cpu_devices(8)
    result = train(config(write_pairs(out / "pairs.jsonl"), out / "run"))
    print({k: round(v, 4) for k, v in result.eval_metrics[max(result.eval_metrics)].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
