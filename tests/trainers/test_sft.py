"""Fine-tuning on a chat dataset in Parquet with the prompt masked (trainers.examples.sft): the loss is over response tokens only, and it falls."""

import pytest

from trainers.config import override
from trainers.examples import sft
from trainers.loop import train


@pytest.mark.slow
def test_sft_example_learns_the_responses(tmp_path):
    cfg = override(sft.config(sft.write_chat(tmp_path / "chat.parquet", n=600), tmp_path / "run", steps=30, tiny=True),
                   ["mesh.axes=data=2,fsdp=2,tensor=2", "lr.warmup_steps=5", "lr.peak_lr=1e-2",
                    "checkpoint.every_steps=30", "run.eval_every=30"])  # one save and one eval, at the end
    result = train(cfg)
    first = result.losses[min(result.losses)]
    final = result.eval_metrics[max(result.eval_metrics)]
    # the prompt ("12+7=") carries no weight: about a third of a record's targets are the response + end token
    assert 0.15 < final["loss_weight"] < 0.6, final
    assert final["loss"] < 0.6 * first, (first, final)  # per weighted token
    assert 0 < final["document_loss"] < first and final["documents"] > 1
