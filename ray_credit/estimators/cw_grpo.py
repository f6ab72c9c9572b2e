"""CW-GRPO: the GRPO outcome advantage redistributed over search rounds by judged contribution.

Paper: "Enhancing LLM-based Search Agents via Contribution Weighted Group Relative Policy
Optimization", arXiv 2604.14267 (ACL 2026), Key Designs 1-3; official code
``zsxmwjz/CW-GRPO`` @ 11508ad (``compute_cw_grpo_advantage`` and the contribution block of
``ray_trainer.compute_advantage``). Comments cite the paper by Key Design rather than by
equation number. The math, the official code's quirks and a worked example:
docs/algorithms.md, section 4.

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

``official_compat=True`` reproduces the official code: alpha >=
``inf_threshold`` gives ``c = p / max(sum of p over ALL rounds incl. the last, 1e-6)``
(quirks a, b: a judged last round dilutes the weights, all-zero p zeroes the search
rounds); the switch is ``A^O < 0 -> factor 1`` instead of success; null judgements are read
as 0 (still counted); trajectories with ``outcome_reward <= 0`` are never judged, so their
p is 0 (quirk c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    GRPOKnobs,
    count_per_traj,
    grpo_advantage,
)

# The official alpha = inf path divides by max(sum p, 1e-6): a constant of the code, not eps.
OFFICIAL_SUM_FLOOR = 1e-6


@dataclass(frozen=True)
class CWGRPOConfig(GRPOKnobs):
    """CW-GRPO knobs (defaults: the paper's; see the module docstring)."""

    alpha: float = math.inf
    """Softmax temperature over judged contributions; 0 is GRPO, math.inf the argmax limit."""
    official_compat: bool = False
    """Reproduce the official code instead of the paper (see the module docstring)."""
    inf_threshold: float = 10.0
    """official_compat only: alpha >= this takes the official alpha = inf path."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0 (math.inf allowed), got {self.alpha!r}")
        if not self.inf_threshold > 0:
            raise ValueError(f"inf_threshold must be > 0, got {self.inf_threshold!r}")


def _judgements(batch: TrajectoryBatch) -> tuple[np.ndarray, np.ndarray]:
    """Where ``p = u * v`` is 1 per flat turn (Design 1; a null reads 0), and where both
    judgements are present. Judgements are validated to be 0 or 1, so p is 0 or 1."""
    u, u_valid = batch.turn_view("judge_utility")  # arbitrary where null
    v, v_valid = batch.turn_view("judge_correct")
    judged = u_valid & v_valid
    binary = ((u == 0) | (u == 1)) & ((v == 0) | (v == 1))
    bad = np.flatnonzero(judged & ~binary)
    if len(bad):
        k = int(bad[0])
        traj = batch.column("traj_id")[int(batch.turn_traj_index[k])].as_py()
        raise ValueError(
            f"traj_id={traj!r}, turn {int(batch.turn_position[k])}: judge_utility={u[k]:g}, "
            f"judge_correct={v[k]:g}; CW-GRPO judgements are 0 or 1 (null when the judge failed)"
        )
    return (u == 1) & (v == 1) & judged, judged


def cw_grpo(batch: TrajectoryBatch, config: CWGRPOConfig) -> TrajectoryBatch:
    outcome_advantage = grpo_advantage(batch, config.norm_spec())
    p_one, judged = _judgements(batch)
    nonfinal = ~batch.is_last_turn
    by_kind, metrics = _advantage_by_kind(batch, config, outcome_advantage, p_one, judged)
    # Each flat turn reads its trajectory's row: kind 0 on the final turn, else 1 + p
    # (gathered in the column's storage type, float32).
    at = np.repeat(np.arange(0, 3 * len(batch), 3), batch.turn_counts)
    at += nonfinal.view(np.int8) + (p_one & nonfinal).view(np.int8)
    advantages = by_kind.astype(np.float32).ravel()[at]
    return batch.with_turn_columns({"turn_advantages": advantages}, metrics=metrics)


def _advantage_by_kind(
    batch: TrajectoryBatch,
    config: CWGRPOConfig,
    outcome_advantage: np.ndarray,
    p_one: np.ndarray,
    judged: np.ndarray,
) -> tuple[np.ndarray, dict[str, float]]:
    """Design 2-3 per trajectory: the advantage of its final turn, of a round with p = 0
    and of a round with p = 1 (an ``(n, 3)`` matrix), and the metrics."""
    factors, counts = round_factors(batch, config, outcome_advantage >= 0, p_one, judged)
    metrics = {f"cw_grpo/{name}": value for name, value in counts.items()}
    return outcome_advantage[:, None] * factors, metrics


def round_factors(
    batch: TrajectoryBatch,
    config: Any,
    non_negative: np.ndarray,
    p_one: np.ndarray,
    judged: np.ndarray,
) -> tuple[np.ndarray, dict[str, float]]:
    """Design 2-3 as factors on a trajectory's advantage: for its final turn (1), a round
    with p = 0 and a round with p = 1 (an ``(n, 3)`` matrix), and the counts.

    A redistributed trajectory's rounds get ``c * (T - 1)``, ``c = w / sum w``; every other
    turn 1. With p in {0, 1}, ``w`` and ``sum w`` follow from per-trajectory counts of the
    rounds with p = 1 and of the rounds judged null. ``config`` has ``alpha``,
    ``official_compat`` and ``inf_threshold``; ``non_negative`` (per trajectory, the sign
    of its outcome advantage) is the official code's switch.
    """
    nonfinal = ~batch.is_last_turn
    rounds = (batch.turn_counts - 1).astype(np.float64)
    success = batch.traj_values("outcome_reward") > 0
    ones = count_per_traj(batch, p_one & nonfinal)  # rounds with p = 1
    unjudged = count_per_traj(batch, ~judged & nonfinal)  # rounds with a null judgement
    read = success
    if config.official_compat:
        ones = ones * success  # quirk c: failed trajectories are never judged
        if config.alpha >= config.inf_threshold:  # quirks a, b: the sum includes the last round
            total = count_per_traj(batch, p_one) * success
            w0, w1, weight_sum = 0.0, 1.0, np.maximum(total, OFFICIAL_SUM_FLOOR)
            read = success & (rounds > 0)  # every round, the last one too
            unjudged = count_per_traj(batch, ~judged)
        else:
            w0, w1, weight_sum = _round_weights(ones, rounds, config.alpha)
        w1 = np.where(success, w1, w0)  # quirk c: a failed trajectory's p = 1 reads as 0
        redistributed = (rounds > 0) & non_negative  # the switch is sign(A^O)
    else:
        w0, w1, weight_sum = _round_weights(ones, rounds, config.alpha)
    null_turns = unjudged * read  # official: read as 0; paper: falls back
    if not config.official_compat:  # failed or null-judged: uniform 1/R weights, factor 1
        redistributed = success & (rounds > 0) & (null_turns == 0)

    factors = np.ones((len(batch), 3))
    at = np.flatnonzero(redistributed)  # these have rounds, so a positive weight sum
    for kind, weight in ((1, w0), (2, w1)):
        weight = weight[at] if np.ndim(weight) else weight
        factors[at, kind] = (weight / weight_sum[at]) * rounds[at]  # Design 3: c * (T - 1)
    # of those, the ones whose rounds' weights are not uniform: only there does the judge
    # change GRPO's advantage (at alpha = inf, a round judged useless beside a useful one)
    moved = redistributed & (
        ((ones < rounds) & ~np.isclose(factors[:, 1], 1.0))
        | ((ones > 0) & ~np.isclose(factors[:, 2], 1.0))
    )
    counts = {
        "redistributed_trajs": float(np.count_nonzero(redistributed)),
        "reweighted_trajs": float(np.count_nonzero(moved)),
        "null_judgement_trajs": float(np.count_nonzero(null_turns)),
        "null_judgement_turns": float(null_turns.sum()),
    }
    return factors, counts


def _round_weights(
    ones: np.ndarray, rounds: np.ndarray, alpha: float
) -> tuple[np.ndarray, float, np.ndarray]:
    """Design 2, ``softmax(alpha * p)`` over a trajectory's rounds, from its counts: with p
    in {0, 1} a round's weight is ``exp(alpha * (p - max p))``, one of two values.

    Returns the weight of a p = 0 round, of a p = 1 round, and their sum over the rounds
    (``n_1 + (R - n_1) * w_0``, with ``n_1`` rounds at p = 1). ``alpha = inf`` is the
    limit: weight 1 on the rounds with the largest p, 0 elsewhere.
    """
    below_max = 0.0 if math.isinf(alpha) else math.exp(-alpha)
    w0 = np.where(ones > 0, below_max, 1.0)  # p = 0 is the max when no round has p = 1
    return w0, 1.0, ones + (rounds - ones) * w0


def cw_grpo_composition(config: CWGRPOConfig) -> str:
    from ray_credit.estimators.grpo import group_text

    return (
        f"outcome | {group_text(config)} | contribution(alpha={config.alpha!r}, official_compat="
        f"{config.official_compat}, inf_threshold={config.inf_threshold!r})"
    )


ESTIMATORS = (
    Estimator(
        "cw_grpo",
        cw_grpo,
        CWGRPOConfig,
        ("group_id", "outcome_reward", "turns", "judge_utility", "judge_correct"),
        "GRPO advantage redistributed over search rounds by judged contribution (CW-GRPO)",
        signals={"cw_grpo_judgement": {}},
        learner={"kl_coef": 1e-3},  # the official recipe: low_var_kl (k3) loss, coef 0.001
        composition=cw_grpo_composition,
    ),
)
