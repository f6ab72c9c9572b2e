"""The pipeline layer: a run's settings, its checks, its services, the asynchronous loop,
evaluation, outputs, and :func:`train`, which reads top to bottom as the run's story.

Rooms, one job each: ``configs`` (the run config and its sections, ``load_config``),
``preflight`` (checks before Ray starts), ``questions`` (held-out split, reference plans),
``services`` (Ray, retriever, generators, judges, scorer, learner), ``evaluation``
(held-out EM and its paired change), ``outputs`` (where a run writes), ``runner`` (the
loop), ``plan`` (a method's recipe made into stages), ``recipe`` (:func:`train`) and
``cli`` (a pipeline script's ``main``). The names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module that defines it (imported on first access, PEP 562: the configs pull in
# torch through the learner's config)
_LAZY = {
    **dict.fromkeys(
        ("Pipeline", "PipelineConfig", "StageError", "actor_stage", "estimator_stage"),
        "ray_credit.pipeline.runner",
    ),
    **dict.fromkeys(
        ("checkpoint_state", "checkpoints", "resolve_checkpoint"),
        "ray_credit.pipeline.checkpointing",
    ),
    **dict.fromkeys(("WeightPublisher", "WeightSyncError"), "ray_credit.pipeline.weights"),
    **dict.fromkeys(
        (
            "EMBEDDED_CONFIG",
            "DataConfig",
            "EvalConfig",
            "JudgeConfig",
            "ResourcesConfig",
            "RetrieverConfig",
            "RunConfig",
            "load_config",
        ),
        "ray_credit.pipeline.configs",
    ),  # fmt: skip
    "train": "ray_credit.pipeline.recipe",
    "main": "ray_credit.pipeline.cli",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_credit.pipeline' has no attribute {name!r}")
