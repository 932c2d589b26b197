"""Golden values: the main job's first training losses, pinned.

These are the losses of ``spmd-train gpt-small`` (data=2 x fsdp=2 x tensor=2, 8 simulated CPU devices)
as the trainer computed them before the model seam was generalised (``train(cfg, task)``); the built-in
GPT now runs through that seam and must give the same numbers. Update them only for a change that is
meant to alter the main job's numerics (model, data order, initialisation, optimizer), and say so in
the commit; a refactor must leave them alone. The tolerance allows last-bit differences of another CPU.
"""

import sys

import pytest

from trainers import override, recipe, train

# The main job trains on the running Python's own stdlib source, so each Python release has its own
# data and losses. The numerics do not depend on the jax version: jax 0.12.0.1 (Python 3.12) trained
# on Python 3.11.7's stdlib gives the 3.11.7 values (recorded with jax 0.10.2) bit for bit.
GOLDEN_BY_PYTHON = {
    (3, 11, 7): {1: 5.925017356872559, 2: 5.959300518035889, 3: 5.635720252990723},
    (3, 12, 1): {1: 5.956433296203613, 2: 5.994670867919922, 3: 5.719952583312988},
}
GOLDEN = GOLDEN_BY_PYTHON.get(sys.version_info[:3])


@pytest.mark.skipif(GOLDEN is None, reason="golden losses are recorded for the stdlib (the main job's data) of Python "
                    + ", ".join(".".join(map(str, v)) for v in GOLDEN_BY_PYTHON) + " only")
def test_main_job_first_losses_are_pinned(tmp_path):
    cfg = override(recipe("gpt-small"), ["run.steps=3", "run.log_every=1", "run.eval_batches=0", "run.progress=false",
                                         "run.tensorboard=false", "checkpoint.async_save=false", "lr.total_steps=300",
                                         f"run.run_dir={tmp_path}"])  # the main job's 300-step LR schedule
    losses = train(cfg).losses
    assert losses == pytest.approx(GOLDEN, rel=1e-6, abs=0)
    assert losses != pytest.approx({k: v * (1 + 1e-5) for k, v in GOLDEN.items()}, rel=1e-6, abs=0)  # it can fail
