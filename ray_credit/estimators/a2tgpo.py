"""A2TGPO: turn-group IG normalization, variance-rescaled accumulation, adaptive turn clipping.

Paper: "A2TGPO: Agentic Turn-Group Policy Optimization with Adaptive Turn-level Clipping",
arXiv 2605.06200, Section 4, Eq. (6)-(11). Numbers checked against a copy of the authors'
code (``compute_igpo_step_advantage``, mode ``turn-group-v1d``). The math, conventions and
a worked example: docs/algorithms.md, section 7.

An IG turn is a non-final turn with a non-null ``turn_info_gain`` (IGPO's Eq. (3)). For
prompt group ``q``, IG turn ``k`` of trajectory ``i`` (its ``k``-th IG turn, ``n_i`` of them)::

    G_{q,k} = {IG_{j,k} : trajectories j of q that have turn k}                   # Eq. (6)
    g_{i,k} = (IG_{i,k} - mean G_{q,k}) / (sqrt(var G_{q,k} + var_eps) + eps)     # Eq. (7)
    D_{i,k} = sum_{j=k}^{n_i-1} gamma^(j-k) g_{i,j},   D~_{i,k} = D_{i,k} / sqrt(n_i - k)  # Eq. (8)
    O_i = outcome normalized within q (same std rule)
    A_{i,k} = alpha * D~_{i,k} + O_i,     A (final turn) = O_i                     # Eq. (9)
    c_{i,k} = 1 + beta * (2 * sigmoid(g_{i,k}) - 1),   c (final turn) = 1          # Eq. (11)

The loss (Eq. (10), (12)) widens the clip bounds to ``1 - eps_low*c, 1 + eps_high*c``;
this estimator only writes ``turn_clip_scale``. Defaults follow the authors' script:
``alpha = ig_weight = 0.3``, ``beta = clip_beta = 0.3`` (hard-coded in the code),
``gamma = 1``, population variance with ``var_eps = 1e-8`` and ``eps = 1e-6``.
``norm_mode="joint"``/``"separate"`` run IGPO's normalization and accumulation with every
turn a boundary (the code's boundary mask), no ``alpha``, and clip scale 1.

Degenerate cases: a turn group or outcome group with one member gives 0 (the paper's
"|G| = 1: rely on the outcome only"); all-equal groups give 0. A non-final turn with a
null IG gets ``A = O_i``, ``c = 1`` and is counted in ``a2tgpo/missing_info_gain``; an IG on
the final turn is not used (``a2tgpo/final_turn_info_gain_ignored``). An IG of exactly 0
is a real IG value (it joins its turn group).

``official_compat=True`` reproduces the code's turns instead: its IG mask is "reward !=
0", so an IG of exactly 0 is no IG turn (``a2tgpo/zero_info_gain_dropped``), and a
non-final turn without an IG turn of its own (null or 0) has no boundary: its tokens take
the advantage and clip scale of the trajectory's next IG turn, or of the final turn
(``a2tgpo/merged_turns``). Its turn groups are keyed by the ordinal among the row's IG
turns, where the paper keys them by the turn's position (the default); the two differ
only when a non-final turn has no IG.

Not reproduced, because they belong to the IG scorer or the loss, not the estimator: in
the code copy turn 0 only sets the baseline, taken after the first retrieval; the last IG
context stops at ``</search>`` (dropping the last retrieval result); the log-prob
difference is hard-coded (the paper says probability); and the loss re-derives turns as
runs of equal advantage.
Here turns come from the batch and the scorer decides what an IG means. The non-v1d
``turn-group`` mode (IG rescaled by a batch-level std ratio, discounted from the outcome,
then normalized per turn, plus ``1.5 * O_i``, no variance rescaling, no clip scale) is not
implemented: it is neither the paper's method nor the released script's setting, and
there are no reference numbers to check an implementation against.
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
    grpo_advantage,
    next_marked,
    normalize_where,
    reverse_discounted_sum,
)
from ray_credit.estimators.igpo import ig_turns, igpo_advantages

NormMode = Literal["turn_group", "joint", "separate"]
NORM_MODES = get_args(NormMode)


@dataclass(frozen=True)
class A2TGPOConfig:
    """A2TGPO knobs (defaults: the paper's and the authors' script; see the module docstring)."""

    gamma: float = 1.0
    """Discount of the backward IG accumulation, Eq. (8)."""
    ig_weight: float = 0.3
    """alpha in Eq. (9), the code's ``adv_rescale_alpha``."""
    clip_beta: float = 0.3
    """beta in Eq. (11): the clip scale lies in (1 - beta, 1 + beta)."""
    eps: float = 1e-6
    """Added to the std in the denominators."""
    std_ddof: int = 0
    """0: population variance (the code); 1: sample variance."""
    var_eps: float = 1e-8
    """Added to the variance inside the square root (the code)."""
    norm_mode: NormMode = "turn_group"
    """"turn_group" (A2TGPO); "joint" / "separate": IGPO's normalization, clip scale 1."""
    official_compat: bool = False
    """True: the code's turns (an IG of 0 or null is no IG turn and joins the next
    segment; turn groups keyed by the IG-turn ordinal, not the turn position)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.std_ddof, eps=self.eps)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is a discount in [0, 1], got {self.gamma}")
        if not 0 <= self.ig_weight < np.inf:
            raise ValueError(
                f"ig_weight must be a finite number >= 0 (an infinite weight makes the "
                f"advantages inf or NaN), got {self.ig_weight}"
            )
        if not 0.0 <= self.clip_beta < 1.0:
            raise ValueError(
                f"clip_beta must be in [0, 1) so the clip scale stays > 0, got {self.clip_beta}"
            )
        check_var_eps(self.var_eps)

    def norm_spec(self) -> NormSpec:
        return NormSpec(ddof=self.std_ddof, eps=self.eps, singleton="center", var_eps=self.var_eps)


def a2tgpo(batch: TrajectoryBatch, config: A2TGPOConfig) -> TrajectoryBatch:
    spec = config.norm_spec()
    if config.norm_mode != "turn_group":
        advantages, _, counts = igpo_advantages(
            batch, gamma=config.gamma, norm_mode=config.norm_mode, spec=spec, official_compat=False
        )
        clip_scale = np.ones(batch.num_turns)
    else:
        advantages, clip_scale, counts = turn_group_advantages(batch, config, spec)
    metrics = {f"a2tgpo/{name}": value for name, value in counts.items()}
    return batch.with_turn_columns(
        {"turn_advantages": advantages, "turn_clip_scale": clip_scale}, metrics=metrics
    )


def turn_group_advantages(
    batch: TrajectoryBatch, config: A2TGPOConfig, spec: NormSpec
) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Eq. (6)-(11) over flat turns: ``(advantages, clip_scales, counts)``.

    Works on the IG turns only, in flat order: trajectory ``i`` contributes its ``n_i``.
    """
    gains, is_ig, counts = ig_turns(batch)
    zero = is_ig & (gains == 0) if config.official_compat else np.zeros_like(is_ig)
    counts["zero_info_gain_dropped"] = float(np.count_nonzero(zero))
    is_ig &= ~zero  # the code's IG mask is "reward != 0"
    ig_first, n_ig = _ig_runs(batch, is_ig)
    # Eq. (6)-(7): normalize within the composite key (prompt group, turn index).
    keys, num_keys = _turn_group_keys(batch, config, is_ig, ig_first, n_ig)
    g_hat, sizes = normalize_where(gains[np.flatnonzero(is_ig)], keys, num_keys, spec)
    counts["singleton_turn_group_gains"] = float(np.count_nonzero(sizes == 1))
    del keys  # drop large temporaries early: a lower peak footprint means fewer page faults

    # Eq. (9): A = alpha * D~ + O_i; the final turn (and any turn without IG) gets O_i.
    ig_term = _rescaled_accumulation(g_hat, n_ig, config.gamma)
    ig_term *= config.ig_weight
    advantages = np.repeat(grpo_advantage(batch, spec), batch.turn_counts)
    at = np.flatnonzero(is_ig)
    advantages[at] += ig_term
    del ig_term  # (as above)
    # Eq. (11): c = 1 + beta * (2 * sigmoid(g) - 1), and 2 * sigmoid(x) - 1 = tanh(x / 2).
    g_hat *= 0.5
    clip = np.tanh(g_hat, out=g_hat)
    clip *= config.clip_beta
    clip += 1.0
    clip_scale = np.ones(batch.num_turns)
    clip_scale[at] = clip
    # The code's segments: a turn that is neither an IG turn nor the final one has no
    # boundary of its own, so its tokens take the next boundary's advantage and clip scale.
    merged = ~(is_ig | batch.is_last_turn) if config.official_compat else zero
    counts["merged_turns"] = float(np.count_nonzero(merged))
    if counts["merged_turns"]:
        take = next_marked(~merged)
        advantages, clip_scale = advantages[take], clip_scale[take]
    return advantages, clip_scale, counts


def _ig_runs(batch: TrajectoryBatch, is_ig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory: the index of its first IG turn among all IG turns, and ``n_i``."""
    dtype = np.int32 if batch.num_turns < 2**31 else np.int64
    seen = np.zeros(batch.num_turns + 1, dtype=dtype)  # IG turns before each flat turn
    np.cumsum(is_ig, out=seen[1:])
    first = seen[batch.turn_offsets[:-1]].astype(np.int64)
    return first, seen[batch.turn_offsets[1:]] - first


def _turn_group_keys(
    batch: TrajectoryBatch,
    config: A2TGPOConfig,
    is_ig: np.ndarray,
    ig_first: np.ndarray,
    n_ig: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Eq. (6): the (prompt group, turn index) key of each IG turn, and the key count.
    The turn index is the position (the flat turn minus the trajectory's first one) or,
    for ``official_compat``, the ordinal among the trajectory's IG turns."""
    at = np.flatnonzero(is_ig)
    width = int(batch.turn_counts.max())
    if config.official_compat:
        index, first = np.arange(len(at)), ig_first
    else:
        index, first = at, batch.turn_offsets[:-1]
    keys = np.repeat(batch.group_index * width - first, n_ig)
    keys += index
    return keys, batch.num_groups * width


def _rescaled_accumulation(g_hat: np.ndarray, n_ig: np.ndarray, gamma: float) -> np.ndarray:
    """Eq. (8) over the IG turns: ``D_{i,k} / sqrt(n_i - k)``, the exponent and ``n_i - k``
    counting IG turns (``n_i - k``: this one and those after it in the trajectory)."""
    accumulated = reverse_discounted_sum(g_hat.copy(), n_ig, gamma)
    remaining = np.repeat(np.cumsum(n_ig), n_ig)
    remaining -= np.arange(len(g_hat))
    accumulated /= np.sqrt(remaining)
    return accumulated


def a2tgpo_composition(config: A2TGPOConfig) -> str:
    from ray_credit.estimators.igpo import IGPOConfig, igpo_composition

    stats = f"ddof={config.std_ddof}, eps={config.eps!r}, var_eps={config.var_eps!r}"
    if config.norm_mode != "turn_group":
        igpo = IGPOConfig(
            gamma=config.gamma,
            norm_mode=config.norm_mode,
            std_ddof=config.std_ddof,
            eps=config.eps,
            var_eps=config.var_eps,
        )
        return igpo_composition(igpo, mode="log_prob_diff")
    compat = config.official_compat
    gain = f"info_gain(mode='log_prob_diff', zero={'drop' if compat else 'keep'!r})"
    turn_group = (
        f"turn_position(padding='none', index={'ordinal' if compat else 'position'!r}, {stats})"
    )
    ig = f"{gain} | {turn_group} | rescaled_sum(gamma={config.gamma!r})"
    outcome = f"outcome | group(singleton='center', {stats})"
    text = f"{config.ig_weight!r}*({ig}) + ({outcome}) | adaptive_clip(beta={config.clip_beta!r})"
    return text + (" | segments" if compat else "")


ESTIMATORS = (
    Estimator(
        "a2tgpo",
        a2tgpo,
        A2TGPOConfig,
        ("group_id", "outcome_reward", "turns", "turn_info_gain"),
        "turn-group IG normalization, variance-rescaled accumulation, adaptive clip (A2TGPO)",
        # ATGPO_multihop_qwen3_4B.sh: log-prob IG, the turn-level
        # ratio with its own clip range (scaled per turn by turn_clip_scale), no KL.
        signals={"info_gain": {"mode": "log_prob_diff"}},
        learner={"loss.ratio_level": "turn", "loss.clip_low": 3e-3, "loss.clip_high": 4e-3},
        composition=a2tgpo_composition,
    ),
)
