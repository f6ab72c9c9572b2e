"""ray_credit: Ray-native RL for LLM search agents with turn-level credit assignment.

Importing the package is cheap: it needs numpy and pyarrow only. torch is imported by
the losses and the learner, Ray by the actors and the pipeline, each when used. The
rollout services, the learner and the pipeline layer below are re-exported lazily:
``ray_credit.Generator`` or ``ray_credit.train`` imports its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ray_credit.batch import COLUMNS, BatchValidationError, TrajectoryBatch
from ray_credit.estimators import ESTIMATORS, Estimator, get_estimator, register_estimator
from ray_credit.pipeline import _LAZY as _PIPELINE
from ray_credit.signals import SIGNALS, JudgedSignal, Signal, get_signal, register_signal

# name -> module that defines it (imported on first access, PEP 562)
_LAZY = {
    "Generator": "ray_credit.actors.generator",
    "GeneratorConfig": "ray_credit.actors.generator",
    "make_generator_actor": "ray_credit.actors.generator",
    "Retriever": "ray_credit.actors.retriever",
    "RemoteRetriever": "ray_credit.actors.retrieval_server",
    "make_retriever_actor": "ray_credit.actors.retriever",
    "serve_retriever": "ray_credit.actors.retrieval_server",
    "parse_retrieve_request": "ray_credit.actors.retrieval_server",
    "retrieve_response": "ray_credit.actors.retrieval_server",
    "InfoGainScorer": "ray_credit.actors.scorer",
    "JudgePool": "ray_credit.actors.judge",
    "make_scorer_actor": "ray_credit.actors.scorer",
    "load_model": "ray_credit.models",
    "StoragePath": "ray_credit.storage",
    "LearnerConfig": "ray_credit.actors.learner",
    "LearnerGroup": "ray_credit.actors.learner_group",
    "make_world": "ray_credit.data",
    "WorldConfig": "ray_credit.data",
    "load_corpus": "ray_credit.data",
    "load_qa": "ray_credit.data",
    # the pipeline layer: the loop, a run's settings, one training run (its own lazy names,
    # but for the scripts' main)
    **{name: module for name, module in _PIPELINE.items() if name != "main"},
    "WarmStartConfig": "ray_credit.warm_start",
    "parse_config": "ray_credit.config",
}

__all__ = [
    "COLUMNS",
    "ESTIMATORS",
    "SIGNALS",
    "BatchValidationError",
    "Estimator",
    "JudgedSignal",
    "Signal",
    "TrajectoryBatch",
    "get_estimator",
    "get_signal",
    "register_estimator",
    "register_signal",
    *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_credit' has no attribute {name!r}")
