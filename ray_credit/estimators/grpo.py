"""GRPO, Dr.GRPO and RLOO: one outcome advantage per trajectory, copied onto every turn.

GRPO (Shao et al., 2024, DeepSeekMath Eq. 3; verl ``compute_grpo_outcome_advantage``)::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)          # std_ddof=1: verl's torch.std

Dr.GRPO (Liu et al., 2025) drops the std: ``A_i = r_i - mean_g(r)``.
RLOO (Ahmadian et al., 2024; verl ``compute_rloo_outcome_advantage``)::

    A_i = r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g(r))

Degenerate cases: an all-equal group gives A = 0 (std is exactly 0, eps guards it). A
singleton group follows ``singleton_policy``: ``"zero_mean_unit_std"`` (verl: A = r/(1+eps)
for GRPO, A = r for RLOO, **not centered**) or ``"center"`` (A = 0).

The shared conventions (std, eps, singleton groups) and worked examples:
docs/algorithms.md, sections 1 and 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    GRPOKnobs,
    NormSpec,
    SingletonPolicy,
    broadcast_to_turns,
    check_norm_params,
    grpo_advantage,
)


@dataclass(frozen=True)
class GRPOConfig(GRPOKnobs):
    """GRPO knobs; defaults reproduce verl's ``compute_grpo_outcome_advantage``."""


@dataclass(frozen=True)
class DrGRPOConfig(GRPOConfig):
    """Dr.GRPO: GRPO without the std division (verl ``norm_adv_by_std_in_grpo=False``)."""

    norm_by_std: bool = False


@dataclass(frozen=True)
class RLOOConfig:
    """RLOO knobs; defaults reproduce verl's ``compute_rloo_outcome_advantage``."""

    singleton_policy: SingletonPolicy = "zero_mean_unit_std"
    """One-member group: "zero_mean_unit_std" (verl keeps A = r) or "center" (A = 0)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(singleton_policy=self.singleton_policy)


def grpo(batch: TrajectoryBatch, config: GRPOConfig) -> TrajectoryBatch:
    advantage = grpo_advantage(batch, config.norm_spec()).astype(np.float32)
    return batch.with_turn_columns({"turn_advantages": broadcast_to_turns(batch, advantage)})


def rloo(batch: TrajectoryBatch, config: RLOOConfig) -> TrajectoryBatch:
    # r - mean_{j != i} r_j = n/(n-1) * (r - mean); a singleton keeps r or gets 0 (policy).
    advantage = grpo_advantage(
        batch, NormSpec(norm_by_std=False, singleton=config.singleton_policy)
    )
    n = batch.group_sizes.astype(np.float64)
    scale = np.divide(n, n - 1, out=np.ones_like(n), where=n > 1)  # 1 for a singleton
    advantage *= scale[0] if (scale == scale[0]).all() else scale[batch.group_index]
    return batch.with_turn_columns(
        {"turn_advantages": broadcast_to_turns(batch, advantage.astype(np.float32))}
    )


def grpo_composition(config: GRPOConfig) -> str:
    return f"outcome | {group_text(config)}"


def group_text(config: GRPOKnobs) -> str:
    """The ``group`` normalizer with GRPO's knobs, as a composition writes it."""
    return (
        f"group(ddof={config.std_ddof}, eps={config.eps!r}, by_std={config.norm_by_std}, "
        f"singleton={config.singleton_policy!r})"
    )


def rloo_composition(config: RLOOConfig) -> str:
    return f"outcome | leave_one_out(singleton={config.singleton_policy!r})"


_REQUIRES = ("group_id", "outcome_reward", "turns")
ESTIMATORS = (
    Estimator(
        "grpo",
        grpo,
        GRPOConfig,
        _REQUIRES,
        "group-normalized outcome reward (GRPO)",
        composition=grpo_composition,
    ),
    Estimator(
        "dr_grpo",
        grpo,
        DrGRPOConfig,
        _REQUIRES,
        "GRPO without std normalization (Dr.GRPO)",
        # Dr.GRPO sums token losses over a constant length
        learner={"loss.agg_mode": "seq-mean-token-sum-norm"},
        composition=grpo_composition,
    ),
    Estimator(
        "rloo",
        rloo,
        RLOOConfig,
        _REQUIRES,
        "leave-one-out baseline (RLOO)",
        composition=rloo_composition,
    ),
)
