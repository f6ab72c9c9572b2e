"""TSPO: turn-level advantages from the First-Occurrence Latent Reward (FOLR).

Paper: "TSPO: Breaking the Double Homogenization Dilemma in Multi-turn Search Policy
Optimization", arXiv 2601.22776 (ACL Findings 2026), Section 3.2, Eq. (6)-(7),
Discussion 1-2 and Algorithm 1 (Appendix D.4). The math and a worked example:
docs/algorithms.md, section 3.

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

Outputs: ``turn_advantages`` and ``turn_rewards``, the reward Eq. (7) normalized (FOLR in
turn-level groups, the outcome in trajectory-level ones). The implementation never
builds a per-cell matrix: each trajectory's rewards are two runs (``a`` up to ``t*``,
``b`` after), and Eq. (7)'s column statistics come from a difference grid over
(turn column, group), so the cost is one pass over the trajectories plus a gather per turn.

Departures: Eq. (7)'s text says "trajectories that contain turn k" while Discussion 1
pads every trajectory to the group's longest; ``padding="final_reward"`` (default)
follows Discussion 1, ``padding="none"`` uses only real turns. Outcomes other than 0/1
(e.g. F1) follow Algorithm 1 line 9: a trajectory is "wrong" when its outcome is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    check_norm_params,
    group_all,
    group_stats,
)

Strategy = Literal["all_groups", "all_wrong"]
STRATEGIES = get_args(Strategy)
Padding = Literal["final_reward", "none"]
PADDINGS = get_args(Padding)


@dataclass(frozen=True)
class TSPOConfig:
    """TSPO knobs (defaults: the paper's; see the module docstring)."""

    alpha: float = 1.0
    """Partial reward for turns up to the first gold occurrence in a wrong trajectory."""
    strategy: Strategy = "all_wrong"
    """"all_wrong": FOLR only in all-wrong groups, GRPO elsewhere; "all_groups": everywhere."""
    eps: float = 1e-6
    """Added to the std in the denominator of Eq. (7)."""
    std_ddof: int = 0
    """0: population std (reproduces the paper's example); 1: sample std."""
    padding: Padding = "final_reward"
    """"final_reward": pad short trajectories with their last turn's reward (Discussion 1);
    "none": turn statistics over real turns only."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.std_ddof, eps=self.eps)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha is a partial reward in [0, 1] (Eq. 6), got {self.alpha}")


def folr_rewards(
    batch: TrajectoryBatch, alpha: float, eligible: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Eq. (6) in run-length form, one row per trajectory.

    Every trajectory's turn rewards are ``a`` on turns ``k < cut`` and ``b`` from ``cut``
    on (padding included): a wrong trajectory whose gold first shows at turn ``t*`` has
    ``a = alpha`` up to and including ``t*`` (``cut = t* + 1``) and ``b = 0`` after it
    (``b = alpha`` when ``t*`` is its last turn, the final reward it is padded with);
    every other trajectory, and any outside ``eligible`` (a mask over trajectories), has
    ``a = b = outcome``. Returns ``a, b, cut, partial`` (where the partial reward went).
    """
    counts, offsets = batch.turn_counts, batch.turn_offsets
    contains = batch.turn_values("turn_contains_gold", null=False)
    golds = np.flatnonzero(contains)  # flat indices of the gold turns, in order
    owners = np.take(batch.turn_traj_index, golds)
    first = np.flatnonzero(owners[1:] != owners[:-1]) + 1  # each owner's first gold...
    first = np.concatenate(([0], first)) if len(owners) else first  # ...the very first too
    with_gold = owners[first]
    t_star = counts.copy()  # past the end: no gold
    t_star[with_gold] = golds[first] - offsets[with_gold]
    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    partial = (outcome == 0) & (t_star < counts)
    if eligible is not None:
        partial &= eligible
    a = np.where(partial, alpha, outcome)
    b = np.where(partial & (t_star < counts - 1), 0.0, a)
    cut = np.where(partial, t_star + 1, counts)
    return a, b, cut, partial


def _column_stats(batch: TrajectoryBatch, a, b, cut, *, padding: str, ddof: int, eps: float):
    """Eq. (7) statistics of every (turn column, group): ``mean`` and ``1 / (std + eps)``.

    Each trajectory adds ``a`` to columns ``[0, cut)`` and ``b`` to ``[cut, end)``, with
    ``end`` past the widest column (padding) or its own length (no padding). Those runs
    are +/- steps in a ``(column, group)`` difference grid summed down the columns, so the
    cost is per trajectory, not per cell. Values are shifted by their group's first ``a``
    before squaring, so an all-equal column has a variance of exactly 0.
    """
    width, groups, g = int(batch.turn_counts.max()), batch.num_groups, batch.group_index
    first = (
        batch.group_starts if batch.group_order is None else batch.group_order[batch.group_starts]
    )
    shift = a[first]
    own_shift = shift[g]
    a0, b0 = a - own_shift, b - own_shift
    padded = padding == "final_reward"
    end = width if padded else batch.turn_counts

    # Each trajectory adds y on columns [0, end) and (x - y) on [0, cut); only FOLR's
    # partial trajectories have x != y. "Adds w on [0, c)" is w at column c - 1 of a
    # (column, group) grid, summed from the last column down.
    lead = np.flatnonzero(a0 != b0)
    lead_keys = (cut[lead] - 1) * groups + g[lead]
    run_keys = None if padded else (end - 1) * groups + g

    def below(keys, weights):
        grid = np.bincount(keys, weights, width * groups).astype(np.float64, copy=False)
        grid = grid.reshape(width, groups)[::-1]
        return np.cumsum(grid, axis=0, out=grid)[::-1]

    def column_sums(x, y):
        sums = below(lead_keys, x[lead] - y[lead])
        sums += np.bincount(g, y, groups) if padded else below(run_keys, y)
        return sums

    if padded:  # every trajectory is in every column of its group
        count = np.broadcast_to(batch.group_sizes.astype(np.float64), (width, groups))
    else:
        count = column_sums(np.ones(len(batch)), np.ones(len(batch)))
    total = column_sums(a0, b0)
    spread = column_sums(a0 * a0, b0 * b0)  # becomes the variance, then 1 / (std + eps)
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    spread -= np.multiply(total, mean, out=total)  # sum of squared deviations
    dof = count - ddof
    np.divide(spread, dof, out=spread, where=dof > 0)
    spread[(dof <= 0) | (count <= 1)] = 0.0  # a lone value normalizes to 0 (it is its mean)
    np.maximum(spread, 0.0, out=spread)  # shifted sums: only rounding can make it < 0
    np.sqrt(spread, out=spread)
    spread += eps
    mean += shift
    return mean, np.reciprocal(spread, out=spread)


def tspo(batch: TrajectoryBatch, config: TSPOConfig) -> TrajectoryBatch:
    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    all_wrong = group_all(batch, outcome == 0)
    turn_level = all_wrong if config.strategy == "all_wrong" else np.ones_like(all_wrong)
    # Trajectory-level groups (Algorithm 1, line 21) are GRPO on the outcome: their
    # trajectories keep the outcome on every turn (a = b = outcome). Padded, every column
    # of such a group holds exactly its outcomes, so the column statistics are the group's;
    # without padding the columns thin out and the group's own statistics go in instead.
    a, b, cut, partial = folr_rewards(batch, config.alpha, eligible=turn_level[batch.group_index])
    mean, inv_std = _column_stats(
        batch, a, b, cut, padding=config.padding, ddof=config.std_ddof, eps=config.eps
    )
    if config.padding == "none" and not turn_level.all():
        count, group_mean, group_std = group_stats(batch, outcome, ddof=config.std_ddof)
        inv = np.where(count <= 1, 1.0, 1.0 / (group_std + config.eps))
        np.copyto(mean, group_mean, where=~turn_level)  # broadcast down the columns
        np.copyto(inv_std, inv, where=~turn_level)

    # Per turn: its reward (b, then a on the first `cut` turns of the partial trajectories)
    # and its (group, column) cell. Per-trajectory values reach the turns by np.take over
    # one owner index, into few buffers: at ~143k turns, fresh pages and
    # np.repeat cost as much as the arithmetic.
    offsets, owner = batch.turn_offsets, batch.turn_traj_index
    width = mean.shape[0]
    index = np.int32 if batch.num_turns + mean.size < 2**31 else np.int64
    flat = np.arange(batch.num_turns, dtype=index)
    # Eq. (7) runs in float64: a reward such as alpha = 0.3 is not a float32 number, and
    # its rounding, divided by a small std, would show in the advantage.
    rewards = np.take(b, owner)
    lead_end = np.take((offsets[:-1] + np.where(partial, cut, 0)).astype(index), owner)
    np.copyto(rewards, config.alpha, where=flat < lead_end)
    cell = np.take((batch.group_index * width - offsets[:-1]).astype(index), owner, out=lead_end)
    cell += flat  # g * width + k
    advantages = np.take(np.ascontiguousarray(mean.T).ravel(), cell)
    np.subtract(rewards, advantages, out=advantages)
    advantages *= np.take(np.ascontiguousarray(inv_std.T).ravel(), cell)  # Eq. (7)

    null_contains = batch.column("turn_contains_gold").flatten().null_count
    metrics = {
        "tspo/turn_level_group_frac": float(turn_level.mean()),
        "tspo/all_wrong_group_frac": float(all_wrong.mean()),
        "tspo/partial_reward_turns": float(cut[partial].sum()),
        "tspo/null_contains_gold": float(null_contains),
    }
    return batch.with_turn_columns(
        {
            "turn_rewards": rewards.astype(np.float32),
            "turn_advantages": advantages.astype(np.float32),
        },
        metrics=metrics,
    )


def tspo_composition(config: TSPOConfig) -> str:
    groups = "all_wrong" if config.strategy == "all_wrong" else "all"
    return (
        f"folr(alpha={config.alpha!r}, groups={groups!r}) | turn_position(ddof="
        f"{config.std_ddof}, eps={config.eps!r}, padding={config.padding!r})"
    )


ESTIMATORS = (
    Estimator(
        "tspo",
        tspo,
        TSPOConfig,
        ("group_id", "outcome_reward", "turns", "turn_contains_gold"),
        "first-occurrence latent reward, per-turn group normalization (TSPO)",
        composition=tspo_composition,
    ),
)
