"""The estimator contract: a named pure function over a TrajectoryBatch plus its config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields

__all__ = ["Estimator", "ZERO_ADVANTAGE_TOL", "advantage_metrics"]

# A group whose every turn advantage is below this in magnitude gives no gradient.
ZERO_ADVANTAGE_TOL = 1e-6


@dataclass(frozen=True)
class Estimator:
    """A credit estimator: ``estimator(batch, **params) -> TrajectoryBatch``.

    ``fn(batch, config)`` must be pure (no I/O, no mutation of ``batch``), deterministic,
    and return ``batch.with_turn_columns({"turn_advantages": ..., ...})``. ``config_cls``
    is a frozen dataclass whose defaults are the paper's; ``requires`` lists the columns
    ``fn`` reads. Calling the estimator checks ``requires``, builds the config from
    ``params`` (or takes ``config=``) and runs ``fn``. Summary statistics of the
    advantages (:func:`advantage_metrics`) are for whoever consumes the batch (the
    pipeline reports its share of zero-advantage groups itself), not computed on every
    estimator call.

    The rest is the method's recipe, which a pipeline is built from:

    * ``signals``: the signals (``ray_credit.signals``) whose columns ``fn`` reads, each
      with the settings the paper uses (``{"info_gain": {"mode": "log_prob_diff"}}``);
      the pipeline runs them as stages before the estimator.
    * ``learner``: the learner settings the paper trains with that differ from the
      learner's defaults (verl's): :class:`~ray_credit.actors.learner.LearnerConfig`
      fields, dotted into its loss section (``"loss.ratio_level": "turn"``, ``"kl_coef"``).
      A pipeline starts from them and reports any departure.
    * ``group_local``: the output on a batch is the concatenation of the outputs on its
      parts when it is split at group boundaries (every statistic is within a group), so
      the pipeline may run it on each chunk as soon as it is generated. False: it runs
      once per step, on the step's whole batch.
    * ``composition``: ``composition(config)`` is the composition of parts
      (:mod:`ray_credit.estimators.compose`) this estimator equals with that config, as
      text (None where a setting has no part); a test holds every paper estimator to it.
    """

    name: str
    fn: Callable[[TrajectoryBatch, Any], TrajectoryBatch]
    config_cls: type
    requires: tuple[str, ...]
    description: str = ""
    signals: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    learner: Mapping[str, Any] = field(default_factory=dict)
    group_local: bool = True
    composition: Callable[[Any], str | None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(
                f"an Estimator's name is a str (what get_estimator looks it up by), got "
                f"{self.name!r} ({type(self.name).__name__})"
            )
        if not self.name.strip():
            raise ValueError(
                f"an Estimator's name is a non-empty str (what get_estimator looks it up "
                f"by), got {self.name!r}"
            )
        if not callable(self.fn):
            raise TypeError(
                f"estimator {self.name!r}: fn is the function fn(batch, config) -> batch, "
                f"got {self.fn!r} ({type(self.fn).__name__})"
            )
        if isinstance(self.requires, (str, bytes)) or not isinstance(self.requires, (tuple, list)):
            raise TypeError(
                f"estimator {self.name!r}: requires is a tuple of column names, e.g. "
                f"('turns',), got {self.requires!r} ({type(self.requires).__name__})"
            )
        bad = [c for c in self.requires if not isinstance(c, str) or not c]
        if bad:
            raise TypeError(
                f"estimator {self.name!r}: requires holds column names (non-empty str), "
                f"got {bad[0]!r} in {self.requires!r}"
            )
        object.__setattr__(self, "requires", tuple(self.requires))  # frozen: a list -> tuple
        if not isinstance(self.config_cls, type) or not dataclasses.is_dataclass(self.config_cls):
            raise TypeError(
                f"estimator {self.name!r}: config_cls must be a dataclass, got {self.config_cls!r}"
            )
        if isinstance(self.signals, (str, tuple, list)):
            raise TypeError(
                f"estimator {self.name!r}: signals maps each signal's name to the settings "
                "the paper uses, e.g. {'info_gain': {}}"
            )
        check_fields(self)  # description, group_local

    def make_config(self, config: Any = None, **params: Any) -> Any:
        if config is not None and not isinstance(config, self.config_cls):
            raise TypeError(
                f"estimator {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(params) - fields)
        if unknown:
            raise TypeError(
                f"estimator {self.name!r} got unknown parameter(s) {unknown}; "
                f"{self.config_cls.__name__} has {sorted(fields)}"
            )
        if config is None:
            return self.config_cls(**params)
        return dataclasses.replace(config, **params) if params else config

    def __call__(
        self, batch: TrajectoryBatch, config: Any = None, **params: Any
    ) -> TrajectoryBatch:
        if not isinstance(batch, TrajectoryBatch):
            raise TypeError(
                f"estimator {self.name!r} takes a TrajectoryBatch, got {type(batch).__name__}"
            )
        cfg = self.make_config(config, **params)
        batch.require(self.requires, by=f"estimator {self.name!r}")
        return self.fn(batch, cfg)


def advantage_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    """Summary of ``turn_advantages``: moments and the share of zero-advantage groups.

    A group whose every turn advantage is below :data:`ZERO_ADVANTAGE_TOL` in magnitude
    gives no gradient (GRPO's all-correct and all-wrong groups); that share is the
    number turn-level credit assignment exists to lower.
    """
    adv = batch.turn_values("turn_advantages").astype(np.float64)
    nonzero = np.concatenate(([0], np.cumsum(np.abs(adv) >= ZERO_ADVANTAGE_TOL)))
    nonzero_per_traj = nonzero[batch.turn_offsets[1:]] - nonzero[batch.turn_offsets[:-1]]
    nonzero_per_group = np.bincount(
        batch.group_index, weights=nonzero_per_traj, minlength=batch.num_groups
    )
    return {
        "adv/mean": float(adv.mean()),
        "adv/std": float(adv.std()),
        "adv/max_abs": float(np.abs(adv).max()),
        "adv/zero_advantage_group_frac": float((nonzero_per_group == 0).mean()),
    }
