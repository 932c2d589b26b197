"""Objectives beyond next-token prediction, each a loss over packed rows (docs/post-training.md).

    from trainers.objectives.dpo import dpo_loss_fn, dpo_task
"""
