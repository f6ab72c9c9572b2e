"""Credit estimators: pure, vectorized functions ``(TrajectoryBatch, **params) -> TrajectoryBatch``.

Every module in this package that does not start with ``_`` is imported here and
contributes the :class:`Estimator` objects listed in its ``ESTIMATORS`` tuple, so adding
an estimator is one new file (plus its test) and nothing else. A user registers their own
at run time with :func:`register_estimator`, or passes a callable wherever a name is taken.

This package imports only numpy and pyarrow (no torch, no Ray).
"""

from __future__ import annotations

from collections.abc import Callable

from ray_credit._registry import discover
from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators._base import Estimator, advantage_metrics

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "advantage_metrics",
    "get_estimator",
    "register_estimator",
    "resolve_estimator",
]

ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(estimator: Estimator, *, overwrite: bool = False) -> Estimator:
    """Add an estimator to :data:`ESTIMATORS` (refuses to shadow a name unless told)."""
    if not isinstance(estimator, Estimator):
        raise TypeError(f"register_estimator takes an Estimator, got {type(estimator).__name__}")
    if estimator.name in ESTIMATORS and not overwrite:
        raise ValueError(
            f"an estimator named {estimator.name!r} is already registered; "
            "pick another name or pass overwrite=True"
        )
    ESTIMATORS[estimator.name] = estimator
    return estimator


def get_estimator(name: str) -> Estimator:
    """The registered estimator called ``name``; an unknown name lists the valid ones."""
    if not isinstance(name, str):
        raise TypeError(
            f"get_estimator takes an estimator's name (a str), got {name!r} "
            f"({type(name).__name__}); registered: {sorted(ESTIMATORS)}"
        )
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise KeyError(
            f"unknown estimator {name!r}; registered: {sorted(ESTIMATORS)}. "
            "Register your own with ray_credit.estimators.register_estimator."
        ) from None


EstimatorLike = str | Estimator | Callable[..., TrajectoryBatch]


def resolve_estimator(spec: EstimatorLike) -> Callable[..., TrajectoryBatch]:
    """A name, an :class:`Estimator` or any callable ``(batch, **params) -> batch``."""
    if isinstance(spec, str):
        return get_estimator(spec)
    if callable(spec):
        return spec
    raise TypeError(f"an estimator is a name or a callable, got {type(spec).__name__}")


discover(__name__, __path__, "ESTIMATORS", register_estimator)
