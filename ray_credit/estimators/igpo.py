"""IGPO: information-gain turn rewards, group-normalized and accumulated backwards.

Paper: "Information Gain-based Policy Optimization" (IGPO), arXiv 2510.14967 (ICLR 2026).
The equations are numbered as restated in the A2TGPO paper (arXiv 2605.06200, Section 3,
Eq. (2)-(5)); the numbers come from the authors' updated code (upstream commit 745078b,
CHANGELOG_20260201). The math, the official code's boundary rule and a worked example:
docs/algorithms.md, section 6.

``m_t`` is the mean log-probability of the gold answer's tokens given the context after
turn ``t`` (``t = 0``: the prompt alone). A non-final turn ``k`` of trajectory ``i`` gets
its information gain, the final (answer) turn gets the outcome::

    IG_t = exp(m_t) - exp(m_{t-1})                 # Eq. (2)-(3), mode "prob_diff"
         = m_t - m_{t-1}                           # mode "log_prob_diff" (745078b train.sh)
    r_{i,k} = IG_{i,k} (k < T_i),  r_{i,T_i} = outcome_i            # Eq. (4)
    n = (r - mean_g r) / (sqrt(var_g r + var_eps) + eps)             # Eq. (4), population var
    A_{i,k} = n_{i,k} + gamma * A_{i,k+1}                            # Eq. (5)

``norm_mode="joint"`` (the paper, the code's default) pools every reward of the group
(IGs and outcomes, all turns of all trajectories); ``"separate"`` (the release's
``train.sh``) normalizes outcomes among the group's outcomes and IGs among its IGs.
:func:`info_gain` computes Eq. (3) from the scorer's mean log-probs.

Defaults: ``gamma = 1`` (train.sh), ``eps = 1e-6`` and ``var_eps = 1e-8`` with the
population variance (745078b: ``std = sqrt(var + 1e-8)``, then ``/(std + 1e-6)``).

Degenerate cases: a pool with one value (count <= 1) is centered to 0; an all-equal pool
gives 0. A non-final turn whose ``turn_info_gain`` is null has no reward of its own
(``n = 0``, it only passes on ``gamma * A_{k+1}``), counted in ``igpo/missing_info_gain``.
An IG on the final turn is not used (the outcome is that turn's reward), counted in
``igpo/final_turn_info_gain_ignored``. An IG of exactly 0 is a real reward (the code's
1e-10 encoding keeps it too). ``turn_rewards`` holds 0 on a turn with no reward.

Departures from the official code (``official_compat=True`` restores them): the code marks
turn boundaries where the *normalized* reward is non-zero, so a turn whose normalized
value is exactly 0 (e.g. every outcome of a group equal under ``"separate"``), or that
has no reward, is not a turn: its tokens take the advantage of the next boundary turn,
and turns after the last boundary get 0. The paper makes every turn a boundary. The
original release (bff163b: discounted token returns minus a per-*token-position* group
mean, no std division) is not implemented: the authors replaced it with the turn-level
code above in Feb 2026, and a per-position baseline compares tokens of different turns
across trajectories, which a turn-level batch does not represent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    NormSpec,
    check_norm_params,
    check_var_eps,
    normalize_where,
    reverse_discounted_sum,
)

NormMode = Literal["joint", "separate"]
NORM_MODES = get_args(NormMode)
IG_MODES = ("prob_diff", "log_prob_diff")


@dataclass(frozen=True)
class IGPOConfig:
    """IGPO knobs (defaults: the paper's and 745078b's; see the module docstring)."""

    gamma: float = 1.0
    """Discount of the backward accumulation, Eq. (5)."""
    norm_mode: NormMode = "joint"
    """"joint": IGs and outcomes pooled per group; "separate": each kind on its own."""
    eps: float = 1e-6
    """Added to the std in the denominator."""
    std_ddof: int = 0
    """0: population variance (745078b); 1: sample variance."""
    var_eps: float = 1e-8
    """Added to the variance inside the square root (745078b)."""
    official_compat: bool = False
    """True: turns whose normalized reward is exactly 0 (or missing) are not boundaries."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.std_ddof, eps=self.eps)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is a discount in [0, 1], got {self.gamma}")
        check_var_eps(self.var_eps)

    def norm_spec(self) -> NormSpec:
        return NormSpec(ddof=self.std_ddof, eps=self.eps, singleton="center", var_eps=self.var_eps)


def info_gain(prev_mean_logprob, mean_logprob, mode: str = "prob_diff") -> np.ndarray:
    """Eq. (3): the gain between two length-normalized gold log-probs (vectorized)."""
    prev = np.asarray(prev_mean_logprob, dtype=np.float64)
    cur = np.asarray(mean_logprob, dtype=np.float64)
    if mode == "prob_diff":
        return np.exp(cur) - np.exp(prev)
    if mode == "log_prob_diff":
        return cur - prev
    raise ValueError(f"mode must be one of {IG_MODES}, got {mode!r}")


def ig_turns(batch: TrajectoryBatch) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """``turn_info_gain`` as stored (a flat float view), which turns are IG turns, and the
    counts. Read the view only where ``is_ig`` holds: elsewhere it is arbitrary.

    An IG turn is a non-final turn whose ``turn_info_gain`` is not null.
    """
    raw, valid = batch.turn_view("turn_info_gain")
    last = batch.is_last_turn
    is_ig = valid & ~last
    counts = {
        "missing_info_gain": float(batch.num_turns - np.count_nonzero(valid | last)),
        "final_turn_info_gain_ignored": float(np.count_nonzero(valid & last)),
    }
    return raw, is_ig, counts


def igpo_advantages(
    batch: TrajectoryBatch, *, gamma: float, norm_mode: str, spec: NormSpec, official_compat: bool
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Eq. (4)-(5) over flat turns: ``(advantages, rewards, counts)``."""
    gains, is_ig, counts = ig_turns(batch)
    rewards = np.where(is_ig, gains, np.float64(0.0))  # float64 (a bare 0.0 keeps float32)
    has_turns = batch.turn_counts > 0
    rewards[batch.turn_offsets[1:][has_turns] - 1] = batch.traj_values("outcome_reward")[has_turns]

    group = np.repeat(batch.group_index, batch.turn_counts)
    keys = group if norm_mode == "joint" else 2 * group + is_ig
    has_reward = batch.is_last_turn | is_ig  # Eq. (4): rewards is 0 everywhere else
    normalized, pool_size = normalize_where(rewards, keys, 2 * batch.num_groups, spec, has_reward)
    counts["singleton_pool_rewards"] = float(np.count_nonzero(pool_size == 1))

    # Paper: every turn is a boundary. 745078b: only turns whose normalized reward is != 0.
    merged = batch.num_turns - np.count_nonzero(normalized) if official_compat else 0
    counts["merged_turns"] = float(merged)
    advantages = reverse_discounted_sum(
        normalized, batch.turn_counts, gamma, skip_zeros=official_compat
    )
    return advantages, rewards, counts


def igpo(batch: TrajectoryBatch, config: IGPOConfig) -> TrajectoryBatch:
    advantages, rewards, counts = igpo_advantages(
        batch,
        gamma=config.gamma,
        norm_mode=config.norm_mode,
        spec=config.norm_spec(),
        official_compat=config.official_compat,
    )
    metrics = {f"igpo/{name}": value for name, value in counts.items()}
    return batch.with_turn_columns(
        {"turn_rewards": rewards, "turn_advantages": advantages}, metrics=metrics
    )


def igpo_composition(config: IGPOConfig, mode: str = "prob_diff") -> str:
    """IGPO as parts; ``mode`` is the info-gain signal's (A²TGPO's joint and separate
    modes are IGPO with the log-probability gain)."""
    norm = f"group_turns(ddof={config.std_ddof}, eps={config.eps!r}, var_eps={config.var_eps!r})"
    gain, outcome = f"info_gain(mode={mode!r})", "outcome(at='last')"
    if config.norm_mode == "joint":
        advantage = f"{gain} + {outcome} | {norm}"
    else:
        advantage = f"({gain} | {norm}) + ({outcome} | {norm})"
    boundaries = "nonzero" if config.official_compat else "every_turn"
    return f"{advantage} | discount(gamma={config.gamma!r}, boundaries={boundaries!r})"


ESTIMATORS = (
    Estimator(
        "igpo",
        igpo,
        IGPOConfig,
        ("group_id", "outcome_reward", "turns", "turn_info_gain"),
        "information-gain turn rewards, group-normalized, discounted backwards (IGPO)",
        signals={"info_gain": {"mode": "prob_diff"}},
        learner={"kl_coef": 1e-3},  # the official recipe: KL loss, coef 0.001 (k3)
        composition=igpo_composition,
    ),
)
