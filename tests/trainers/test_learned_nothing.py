"""A run that learned nothing does not succeed: a corpus whose documents lose every target to
truncation is refused before compiling (some losing them: one warning with the count), and a run
whose every step was skipped stops with exit 3, however short it is."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers.fault_worker import tiny_config

from trainers.data import DataConfig
from trainers.faults.guard import DivergenceError, GuardEvent, check_learned
from trainers.loop import train


def _chat(path, prompts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": prompts, "response": ["42"] * len(prompts)}), path)
    return str(path)


def _data(path, seq_len=64):
    return DataConfig(corpus="parquet", path=path, fields="prompt,response", seq_len=seq_len, global_batch=4)


def test_prompts_longer_than_the_row_are_refused_before_compiling(tmp_path, caplog):
    every = _chat(tmp_path / "long.parquet", ["7" * 100] * 40)
    with pytest.raises(ValueError, match=r"data.seq_len=64 cuts away every target of all \d+ documents read .*"
                                         r"field 'response'.*data.seq_len of at least 100 keeps a target of each"):
        _data(every)
    _data(every, seq_len=100)  # negative control: the first response token is the last target of the row
    some = _chat(tmp_path / "some.parquet", ["7" * 100] * 10 + ["1+1="] * 30)
    with caplog.at_level(logging.WARNING, logger="trainers.data.packing"):
        _data(some)
        _data(some)  # checked again (every config is): still one warning
    warnings = [r.getMessage() for r in caplog.records if "cuts away" in r.getMessage()]
    assert len(warnings) == 1 and "every target of 10 of the" in warnings[0], warnings


def test_a_run_that_skipped_every_step_is_not_a_success():
    event = GuardEvent(2, 1, "nonfinite", float("nan"), 0.0, 0.0)
    with pytest.raises(DivergenceError, match=r"no update was applied: run.guard='skip' skipped every one of the 2 "
                                              r"steps 1..2 .*step 2 \(batch 1\): loss or gradient norm is not finite"):
        check_learned(0, 2, 2, [event], "skip")
    check_learned(0, 2, 1, [event], "skip")  # one step applied
    check_learned(5, 5, 0, [], "skip")  # resumed at the end: no step taken


@pytest.mark.slow
def test_nan_loss_weights_on_every_step_exit_3_in_a_run_shorter_than_max_bad_steps(tmp_path):
    """The tiny run (2 steps, run.max_bad_steps=5) with every batch's loss weights NaN: every step is
    skipped, so the run stops with a DivergenceError (spmd-train's exit 3) instead of finishing."""
    def nan_weights(index, batch):
        return {**batch, "weights": np.full(batch["inputs"].shape, np.nan, np.float32)}

    with pytest.raises(DivergenceError, match=r"skipped every one of the 2 steps 1..2"):
        train(tiny_config(str(tmp_path / "run"), 2, "run.eval_batches=0"), batch_hook=nan_weights)
