"""TSPO: turn-level advantages from the First-Occurrence Latent Reward (FOLR).

Paper: "TSPO: Breaking the Double Homogenization Dilemma in Multi-turn Search Policy
Optimization", arXiv 2601.22776 (ACL Findings 2026), Section 3.2, Eq. (6)-(7),
Discussion 1-2 and Algorithm 1 (Appendix D.4).

For trajectory ``i`` with turns ``k = 1..K_i``, outcome ``r_i^out`` and ``t*_i`` the first
turn whose observation contains a gold answer (``turn_contains_gold``)::

    r_{i,k} = alpha        if r_i^out = 0 and k <= t*_i      # Eq. (6) / Algorithm 1 line 9
            = r_i^out      otherwise                        # 1 for a correct answer

    r_{i,k} := r_{i,K_i}   for K_i < k <= K_max(group)      # Discussion 1: padding
    A_{i,k} = (r_{i,k} - mean_j r_{j,k}) / (std_j r_{j,k} + eps)   # Eq. (7), per column

Strategies (Discussion 2, Algorithm 1): ``"all_groups"`` applies Eq. (7) to every group;
``"all_wrong"`` applies it only to groups whose outcomes are all 0 and gives the other
groups the GRPO trajectory advantage (Algorithm 1 line 21) on every turn.

Defaults: ``alpha = 1`` (the value of the paper's worked example, Table 2; the paper
reports 0.5 and 1 performing alike), population std (``std_ddof=0``, the only choice
that reproduces the example's +0.71/-1.41), ``eps = 1e-6`` (not given in the paper;
verl's value), ``strategy="all_wrong"`` (the paper's best, Section 5.1).

Degenerate cases: an all-equal column gives 0 (std is exactly 0). A one-trajectory
group has one value per column and gets 0. A trajectory with no gold in any observation
has no ``t*`` and gets ``r_i^out`` on every turn. With ``alpha = 0`` TSPO is GRPO with
population std. Null entries of ``turn_contains_gold`` are read as "not contained" and
counted in ``tspo/null_contains_gold``.

Departures: Eq. (7)'s text says "trajectories that contain turn k" while Discussion 1
pads every trajectory to the group's longest; ``padding="final_reward"`` (default)
follows Discussion 1, ``padding="none"`` uses only real turns. Outcomes other than 0/1
(e.g. F1) follow Algorithm 1 line 9: a trajectory is "wrong" when its outcome is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    NormSpec,
    broadcast_to_turns,
    check_norm_params,
    column_normalize,
    group_all,
    grpo_advantage,
    to_dense,
    turn_mask,
)

STRATEGIES = ("all_groups", "all_wrong")
PADDINGS = ("final_reward", "none")


@dataclass(frozen=True)
class TSPOConfig:
    """TSPO knobs (defaults: the paper's; see the module docstring)."""

    alpha: float = 1.0
    """Partial reward for turns up to the first gold occurrence in a wrong trajectory."""
    strategy: str = "all_wrong"
    """"all_wrong": FOLR only in all-wrong groups, GRPO elsewhere; "all_groups": everywhere."""
    eps: float = 1e-6
    """Added to the std in the denominator of Eq. (7)."""
    std_ddof: int = 0
    """0: population std (reproduces the paper's example); 1: sample std."""
    padding: str = "final_reward"
    """"final_reward": pad short trajectories with their last turn's reward (Discussion 1)."""

    def __post_init__(self) -> None:
        check_norm_params(std_ddof=self.std_ddof, eps=self.eps)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha is a partial reward in [0, 1] (Eq. 6), got {self.alpha}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.padding not in PADDINGS:
            raise ValueError(f"padding must be one of {PADDINGS}, got {self.padding!r}")


def folr_rewards(batch: TrajectoryBatch, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Eq. (6) for every flat turn, and which turns got the partial reward."""
    counts, starts = batch.turn_counts, batch.turn_offsets[:-1]
    contains = batch.turn_values("turn_contains_gold", null=False).astype(np.int32)
    seen = np.cumsum(contains) - contains  # golds strictly before each turn, batch-wide
    seen_at_start = seen[starts]
    golds = seen[batch.turn_offsets[1:] - 1] + contains[batch.turn_offsets[1:] - 1] - seen_at_start
    # k <= t* <=> the trajectory has a gold, and none of it shows before turn k.
    none_before = seen == np.repeat(seen_at_start, counts)
    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    partial = np.repeat((outcome == 0) & (golds > 0), counts) & none_before
    return np.where(partial, alpha, np.repeat(outcome, counts)), partial


def tspo(batch: TrajectoryBatch, config: TSPOConfig) -> TrajectoryBatch:
    spec = NormSpec(ddof=config.std_ddof, eps=config.eps, singleton="center")
    mask = turn_mask(batch)
    rewards, partial = folr_rewards(batch, config.alpha)
    final = rewards[batch.turn_offsets[1:] - 1]
    dense = to_dense(batch, rewards, fill=final)  # Discussion 1: pad with the final reward
    counted = np.ones_like(mask) if config.padding == "final_reward" else mask
    advantages = column_normalize(batch, dense, counted, spec)[mask]  # Eq. (7)

    outcome = batch.traj_values("outcome_reward")
    all_wrong = group_all(outcome == 0, batch.group_index, batch.num_groups)
    turn_level_groups = np.ones_like(all_wrong)
    if config.strategy == "all_wrong":
        turn_level_groups = all_wrong
        trajectory_level = grpo_advantage(batch, spec)  # Algorithm 1, line 21
        turn_level = broadcast_to_turns(batch, all_wrong[batch.group_index])
        advantages = np.where(turn_level, advantages, broadcast_to_turns(batch, trajectory_level))

    metrics = {
        "tspo/turn_level_group_frac": float(turn_level_groups.mean()),
        "tspo/all_wrong_group_frac": float(all_wrong.mean()),
        "tspo/partial_reward_turn_frac": float(partial.sum() / batch.num_turns),
        "tspo/null_contains_gold": float(
            batch.num_turns - batch.turn_valid("turn_contains_gold").sum()
        ),
    }
    return batch.with_turn_columns(
        {"turn_rewards": rewards, "turn_advantages": advantages}, metrics=metrics
    )


ESTIMATORS = (
    Estimator(
        "tspo",
        tspo,
        TSPOConfig,
        ("group_id", "outcome_reward", "turns", "turn_contains_gold"),
        "first-occurrence latent reward, per-turn group normalization (TSPO)",
    ),
)
