"""CW-GRPO: the GRPO outcome advantage redistributed over search rounds by judged contribution.

Paper: "Enhancing LLM-based Search Agents via Contribution Weighted Group Relative Policy
Optimization", arXiv 2604.14267 (ACL 2026), Key Designs 1-3; official code
``zsxmwjz/CW-GRPO`` @ 11508ad (``compute_cw_grpo_advantage`` and the contribution block of
``ray_trainer.compute_advantage``), see ALGORITHMS.md section 4. The paper text we have
carries no equation numbers, so comments cite the Key Design.

A turn is a CW-GRPO "round". Trajectory ``i`` has ``T_i`` turns; its final turn is the
"last round" (an answer, or a search cut off at the turn limit) and ``R_i = T_i - 1``::

    A_i^O = GRPO outcome advantage (verl: sample std, eps 1e-6)
    p_i^t = u_i^t * v_i^t                       # Design 1, judge_utility * judge_correct
    c_i^t = softmax_t(alpha * p_i^t)            # Design 2, successful trajectory, t < T_i
          = 1 / R_i                             # Design 2, failed trajectory
    A_i^t = A_i^O * c_i^t * R_i   for t < T_i   # Design 3: mean over rounds is A_i^O
    A_i^T = A_i^O                 (final turn)

Defaults: ``alpha = inf`` (the paper's best ablation value; the official script's
``gamma=100`` takes its alpha = inf path), GRPO knobs as verl. ``alpha = inf`` is the
softmax limit: uniform over the rounds with the largest ``p``. ``alpha = 0`` is GRPO.

Degenerate cases: ``R_i = 0`` (a direct answer) keeps ``A_i^O``. "Successful" means
``outcome_reward > 0``. A null judgement (``u`` or ``v`` null) on any non-final turn of a
successful trajectory makes that trajectory fall back to uniform weights (plain GRPO);
counted in ``cw_grpo/null_judgement_trajs`` / ``cw_grpo/null_judgement_turns``. Final-turn
judgements are not read.

``official_compat=True`` reproduces the official code (ALGORITHMS.md 4.2-4.3): alpha >=
``inf_threshold`` gives ``c = p / max(sum of p over ALL rounds incl. the last, 1e-6)``
(quirks a, b: a judged last round dilutes the weights, all-zero p zeroes the search
rounds); the switch is ``A^O < 0 -> factor 1`` instead of success; null judgements are read
as 0 (still counted); trajectories with ``outcome_reward <= 0`` are never judged, so their
p is 0 (quirk c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import NormSpec, check_norm_params, grpo_advantage

# The official alpha = inf path divides by max(sum p, 1e-6): a constant of the code, not eps.
OFFICIAL_SUM_FLOOR = 1e-6


@dataclass(frozen=True)
class CWGRPOConfig:
    """CW-GRPO knobs (defaults: the paper's; see the module docstring)."""

    alpha: float = math.inf
    """Softmax temperature over judged contributions; 0 is GRPO, math.inf the argmax limit."""
    eps: float = 1e-6
    """Added to the std in the denominator of the GRPO outcome advantage."""
    std_ddof: int = 1
    """1: sample std (verl GRPO, which A^O inherits); 0: population std."""
    norm_by_std: bool = True
    """False: A^O = r - mean (Dr.GRPO-style outcome advantage)."""
    singleton_policy: str = "zero_mean_unit_std"
    """One-member group: "zero_mean_unit_std" (verl, A^O = r/(1+eps)) or "center" (A^O = 0)."""
    official_compat: bool = False
    """Reproduce the official code instead of the paper (see the module docstring)."""
    inf_threshold: float = 10.0
    """official_compat only: alpha >= this takes the official alpha = inf path."""

    def __post_init__(self) -> None:
        check_norm_params(
            std_ddof=self.std_ddof, eps=self.eps, singleton_policy=self.singleton_policy
        )
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0 (math.inf allowed), got {self.alpha!r}")
        if not self.inf_threshold > 0:
            raise ValueError(f"inf_threshold must be > 0, got {self.inf_threshold!r}")

    def norm_spec(self) -> NormSpec:
        return NormSpec(
            ddof=self.std_ddof,
            eps=self.eps,
            norm_by_std=self.norm_by_std,
            singleton=self.singleton_policy,
        )


def _judgements(batch: TrajectoryBatch) -> tuple[np.ndarray, np.ndarray]:
    """``p = u * v`` per flat turn (0 where null) and where both judgements are present."""
    valid = batch.turn_valid("judge_utility") & batch.turn_valid("judge_correct")
    u = batch.turn_values("judge_utility", null=0).astype(np.float64)
    v = batch.turn_values("judge_correct", null=0).astype(np.float64)
    bad = np.flatnonzero(valid & ~(np.isin(u, (0, 1)) & np.isin(v, (0, 1))))
    if len(bad):
        k = int(bad[0])
        traj = batch.column("traj_id")[int(batch.turn_traj_index[k])].as_py()
        raise ValueError(
            f"traj_id={traj!r}, turn {int(batch.turn_position[k])}: judge_utility={u[k]:g}, "
            f"judge_correct={v[k]:g}; CW-GRPO judgements are 0 or 1 (null when the judge failed)"
        )
    return u * v, valid  # Design 1


def _softmax_over_rounds(batch: TrajectoryBatch, p: np.ndarray, alpha: float) -> np.ndarray:
    """``softmax(alpha * p)`` over each trajectory's non-final turns (0 on final turns)."""
    traj, nonfinal = batch.turn_traj_index, ~batch.is_last_turn
    p_max = np.full(len(batch), -np.inf)
    np.maximum.at(p_max, traj[nonfinal], p[nonfinal])
    shifted = np.where(nonfinal, p - p_max[traj], 0.0)  # max-subtracted, <= 0
    # alpha = inf is the limit: uniform over the rounds with the largest p.
    weight = (shifted == 0) if math.isinf(alpha) else np.exp(alpha * shifted)
    weight = np.where(nonfinal, weight, 0.0)
    total = np.bincount(traj, weights=weight, minlength=len(batch))
    return weight / np.where(total > 0, total, 1.0)[traj]  # Design 2


def cw_grpo(batch: TrajectoryBatch, config: CWGRPOConfig) -> TrajectoryBatch:
    traj, nonfinal = batch.turn_traj_index, ~batch.is_last_turn
    outcome_advantage = grpo_advantage(batch, config.norm_spec())
    rounds = (batch.turn_counts - 1).astype(np.float64)
    success = batch.traj_values("outcome_reward") > 0
    p, judged = _judgements(batch)

    if config.official_compat:
        p = np.where(success[traj], p, 0.0)  # quirk c: failed trajectories are never judged
        if config.alpha >= config.inf_threshold:  # quirks a, b: the sum includes the last round
            total = np.bincount(traj, weights=p, minlength=len(batch))
            contribution = np.where(nonfinal, p / np.maximum(total, OFFICIAL_SUM_FLOOR)[traj], 0.0)
            read = success[traj] & (rounds[traj] > 0)  # every round, the last one too
        else:
            contribution = _softmax_over_rounds(batch, p, config.alpha)
            read = success[traj] & nonfinal
    else:
        contribution = _softmax_over_rounds(batch, p, config.alpha)
        read = success[traj] & nonfinal
    null_turn = read & ~judged  # official: read as 0; paper: the trajectory falls back
    null_trajs = np.bincount(traj, weights=null_turn, minlength=len(batch)) > 0
    if config.official_compat:
        redistributed = (rounds > 0) & (outcome_advantage >= 0)  # the switch is sign(A^O)
    else:  # failed or null-judged trajectories keep uniform 1/R weights: factor 1
        redistributed = success & (rounds > 0) & ~null_trajs

    weighted = redistributed[traj] & nonfinal
    factor = np.where(weighted, contribution * rounds[traj], 1.0)  # Design 3: c * (T - 1)
    advantages = outcome_advantage[traj] * factor
    metrics = {
        "cw_grpo/redistributed_trajs": float(redistributed.sum()),
        "cw_grpo/null_judgement_trajs": float(null_trajs.sum()),
        "cw_grpo/null_judgement_turns": float(null_turn.sum()),
    }
    return batch.with_turn_columns({"turn_advantages": advantages}, metrics=metrics)


ESTIMATORS = (
    Estimator(
        "cw_grpo",
        cw_grpo,
        CWGRPOConfig,
        ("group_id", "outcome_reward", "turns", "judge_utility", "judge_correct"),
        "GRPO advantage redistributed over search rounds by judged contribution (CW-GRPO)",
    ),
)
