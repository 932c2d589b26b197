"""Pipeline parallelism over the ``pipe`` mesh axis: schedules as data, a shard_map engine, config.

    from spmd.pipeline import PipelineConfig, get_schedule
    print(get_schedule("1f1b", 4, 8))          # the timeline, stages x ticks
    loss, aux = model.loss(tokens, targets, pipeline=PipelineConfig("1f1b", microbatches=8))
"""

from spmd.pipeline.builders import get_schedule
from spmd.pipeline.config import SCHEDULES, PipelineConfig, pipelined_loss
from spmd.pipeline.order import LayerOrder
from spmd.pipeline.schedules import NAMES, Schedule, SentBytes, send_plan, sent_bytes
from spmd.pipeline.sends import hlo_branch_counts, hlo_sent_bytes

__all__ = ["LayerOrder", "NAMES", "PipelineConfig", "SCHEDULES", "Schedule", "SentBytes", "get_schedule",
           "hlo_branch_counts", "hlo_sent_bytes", "pipelined_loss", "send_plan", "sent_bytes"]
