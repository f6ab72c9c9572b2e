"""The training loop: weight publication, the asynchronous runner, stages."""

from ray_credit.pipeline.checkpointing import checkpoint_state, checkpoints, resolve_checkpoint
from ray_credit.pipeline.runner import (
    Pipeline,
    PipelineConfig,
    StageError,
    actor_stage,
    estimator_stage,
)
from ray_credit.pipeline.weights import WeightPublisher, WeightSyncError

__all__ = [
    "Pipeline",
    "PipelineConfig",
    "StageError",
    "WeightPublisher",
    "WeightSyncError",
    "actor_stage",
    "checkpoint_state",
    "checkpoints",
    "estimator_stage",
    "resolve_checkpoint",
]
