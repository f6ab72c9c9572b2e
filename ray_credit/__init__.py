"""ray_credit: Ray-native RL for LLM search agents with turn-level credit assignment.

Importing the package is cheap: it needs numpy and pyarrow only. torch is imported by
the losses and the learner, Ray by the actors and the pipeline, each when used.
"""

from ray_credit.batch import COLUMNS, BatchValidationError, TrajectoryBatch
from ray_credit.estimators import ESTIMATORS, Estimator, get_estimator, register_estimator

__all__ = [
    "COLUMNS",
    "ESTIMATORS",
    "BatchValidationError",
    "Estimator",
    "TrajectoryBatch",
    "get_estimator",
    "register_estimator",
]
__version__ = "0.1.0"
