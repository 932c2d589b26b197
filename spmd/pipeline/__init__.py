"""Pipeline parallelism over the ``pipe`` mesh axis: schedules as data, a shard_map engine, config.

    from spmd.pipeline import PipelineConfig, get_schedule
    print(get_schedule("1f1b", 4, 8))          # the timeline, stages x ticks
    loss, aux = model.loss(tokens, targets, pipeline=PipelineConfig("1f1b", microbatches=8))
"""

from spmd.pipeline.config import SCHEDULES, PipelineConfig, microbatches, pipe_stages, pipelined_loss
from spmd.pipeline.engine import build_tables, pipeline_loss
from spmd.pipeline.schedules import (
    BACKWARD, FORWARD, IDLE, NAMES, Schedule, get_schedule, gpipe, interleaved, one_f_one_b,
)

__all__ = [
    "BACKWARD", "FORWARD", "IDLE", "NAMES", "PipelineConfig", "SCHEDULES", "Schedule", "build_tables",
    "get_schedule", "gpipe", "interleaved", "microbatches", "one_f_one_b", "pipe_stages", "pipeline_loss",
    "pipelined_loss",
]
