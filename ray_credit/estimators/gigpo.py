"""GiGPO: group-in-group advantages, an episode term plus an anchor-state step term.

Paper: "Group-in-Group Policy Optimization for LLM Agent Training" (Feng et al., 2025,
arXiv 2505.10978), Eq. (5) step returns and the two-level advantage; numbers and quirks
follow the official verl-agent code (``core_gigpo.py``). The math and a worked example:
docs/algorithms.md, section 8.

Each turn is one GiGPO environment step. The anchor state of turn ``k`` is what the
policy saw before acting: the ``question`` for ``k = 0``, the observation of turn ``k-1``
otherwise (a null observation or question, e.g. after an invalid action with no feedback,
is the empty string ``""``, counted in ``gigpo/null_anchors``)::

    R_k = r_k + gamma * R_{k+1},  r_k = 0 except r_last = outcome        # Eq. (5)
    R_k -= c * [action_k = "invalid"];  s_k = outcome - c * [action_k = "invalid"]
    A^E_k = s_k - mean_g(s)            mean_norm                          # episode term
          = (s_k - mean_g(s)) / (std_g(s) + eps)      mean_std_norm
    A^S_k = the same with R_k normalized within its anchor group          # step term
    A_k   = A^E_k + step_weight * A^S_k

``g`` is the prompt group. With ``cross_steps=True`` (verl-agent's default) the episode
statistics run over every turn-row of the group, so longer trajectories weigh more;
with False they run over one value per trajectory, the score ``s_0`` of its first
turn-row (as verl-agent takes the first row of each trajectory), and each turn-row is
still normalized with its own ``s_k``. Anchor groups: within a prompt group,
identical anchor strings (vectorized with pyarrow), or with ``enable_similarity`` a
greedy clustering: in order of first appearance an anchor joins the first cluster whose
representative (first member) has ``SequenceMatcher(None, anchor, rep).ratio() >=
similarity_threshold``, else it starts a cluster. That needs string comparisons, so it
is a Python loop, run over the unique (group, anchor) pairs only (exact duplicates
always share a cluster, as in the official row-by-row loop).

Defaults: verl-agent's config (``mode="mean_norm"``, ``step_weight=1``, exact anchors,
threshold 0.95, sample std, eps 1e-6) with the search script's ``gamma=0.95``. The search
script ``run_search.sh`` also sets ``mode="mean_std_norm"``, ``enable_similarity=True``,
``similarity_threshold=0.9`` and ``invalid_action_penalty=0.01``.

Degenerate cases: a prompt group with one episode value (one row, or one trajectory
with ``cross_steps=False``) gets mean 0 and std 1, so ``A^E = s / (1 + eps)``, **not
centered** (verl GRPO). A one-member anchor group is **centered**: ``A^S = 0``. An
all-equal set gives 0 (std is exactly 0).

With ``cross_steps=False`` and a penalty, a group whose first-row scores are all equal
has std 0: a later penalized row is then divided by ``eps`` alone (the official code does
the same); ``gigpo/episode_zero_std_rows`` counts such rows, and ``cross_steps=True``
(the default) avoids them.

Departures from verl-agent: only ``"invalid"`` turns are penalized (``"truncated"`` is a
valid action here); a null action counts as valid (``gigpo/null_actions``).
``similarity_threshold=1`` is allowed (it equals exact grouping; the official code
asserts a threshold in (0, 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Literal, get_args

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ray_credit.batch import TrajectoryBatch, valid_mask
from ray_credit.config import check_fields
from ray_credit.estimators._base import Estimator
from ray_credit.estimators._group import (
    NormSpec,
    check_norm_params,
    equals_any,
    key_stats,
    normalize_where,
    segments_longest_first,
)

Mode = Literal["mean_norm", "mean_std_norm"]
MODES = get_args(Mode)


@dataclass(frozen=True)
class GiGPOConfig:
    """GiGPO knobs (defaults: verl-agent's config, gamma of its search script)."""

    gamma: float = 0.95
    """Discount of the step returns (Eq. 5); run_search.sh uses 0.95."""
    step_weight: float = 1.0
    """omega, the weight of the step (anchor-group) term."""
    mode: Mode = "mean_norm"
    """"mean_norm": subtract the mean; "mean_std_norm": also divide by std + eps (run_search.sh)."""
    enable_similarity: bool = False
    """Group near-identical anchors (difflib ratio >= similarity_threshold), not only identical ones."""
    similarity_threshold: float = 0.95
    """Similarity needed to join a cluster, in (0, 1]; run_search.sh uses 0.9."""
    eps: float = 1e-6
    """Added to the std in the denominator (mean_std_norm)."""
    std_ddof: int = 1
    """1: sample std (verl-agent's torch.std); 0: population std."""
    cross_steps: bool = True
    """Episode statistics over all turn-rows (verl-agent); False: one outcome per trajectory."""
    invalid_action_penalty: float = 0.0
    """Subtracted from an invalid turn's return and episode reward (run_search.sh: 0.01)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.std_ddof, eps=self.eps)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is a discount in [0, 1], got {self.gamma}")
        if not 0.0 <= self.step_weight < np.inf:
            raise ValueError(f"step_weight must be a finite number >= 0, got {self.step_weight}")
        if not 0.0 < self.similarity_threshold <= 1.0:
            raise ValueError(
                f"similarity_threshold must be in (0, 1], got {self.similarity_threshold}"
            )
        if not 0.0 <= self.invalid_action_penalty < np.inf:
            raise ValueError(
                f"invalid_action_penalty must be a finite number >= 0, got {self.invalid_action_penalty}"
            )


def anchor_groups(batch: TrajectoryBatch, config: GiGPOConfig) -> tuple[np.ndarray, int, int]:
    """Anchor-group code of every flat turn (numbered by first appearance), their count,
    and the number of null anchors read as ``""``."""
    questions = batch.column("question")
    observations = batch.column("turns").flatten().field("observation")
    # Turn k's anchor is the question (k = 0) or observation k-1: encode the texts once and
    # shift the codes. Observations never recorded all read "": no need to hash them.
    recorded = observations.null_count < len(observations)
    texts = pa.concat_arrays([questions, observations]) if recorded else questions
    text_code, dictionary, empty = _encode_null_as_empty(texts)
    n = len(batch)
    obs_code = text_code[n:] if recorded else np.broadcast_to(empty, batch.num_turns)
    anchor_code = _shift_to_anchors(batch, obs_code, text_code[:n])
    null_anchors = 0
    if questions.null_count or observations.null_count:
        valid = _shift_to_anchors(batch, valid_mask(observations), valid_mask(questions))
        null_anchors = batch.num_turns - int(np.count_nonzero(valid))

    # Anchor groups: distinct (prompt group, anchor) pairs, numbered by first appearance
    # (as Arrow's hash encoding numbers its dictionary).
    composite = np.repeat(batch.group_index * len(dictionary), batch.turn_counts)
    composite += anchor_code
    pairs = pc.dictionary_encode(pa.array(composite))
    pair_of_turn = pairs.indices.to_numpy().astype(np.int64)
    if not config.enable_similarity:
        return pair_of_turn, len(pairs.dictionary), null_anchors
    pair_first = np.unique(pair_of_turn, return_index=True)[1]  # first turn of each pair
    texts = dictionary.take(pa.array(anchor_code[pair_first])).to_pylist()
    groups = batch.group_index[batch.turn_traj_index[pair_first]]
    cluster = _similarity_clusters(groups, texts, config.similarity_threshold)
    return cluster[pair_of_turn], int(cluster.max()) + 1, null_anchors


def _shift_to_anchors(
    batch: TrajectoryBatch, per_turn: np.ndarray, per_traj: np.ndarray
) -> np.ndarray:
    """What each flat turn's anchor reads: ``per_turn`` of the previous turn (the
    observation of turn k-1), or on a trajectory's first turn its ``per_traj`` (question)."""
    has_turns = batch.turn_counts > 0
    out = np.empty(batch.num_turns, dtype=per_turn.dtype)
    out[1:] = per_turn[:-1]
    out[batch.turn_offsets[:-1][has_turns]] = per_traj[has_turns]
    return out


def _encode_null_as_empty(strings: pa.Array) -> tuple[np.ndarray, pa.Array, int]:
    """Dictionary codes of ``strings`` (a numpy view), the dictionary (which holds ``""``)
    and the code of ``""``, which a null gets too."""
    encoded = pc.dictionary_encode(strings)  # nulls stay null: cheaper than fill_null first
    dictionary, codes = encoded.dictionary, encoded.indices
    empty = pc.index(dictionary, "").as_py()
    if empty < 0:  # no "" among the values: give it the next code
        empty = len(dictionary)
        dictionary = pa.concat_arrays([dictionary, pa.array([""], dictionary.type)])
    if codes.null_count:
        codes = pc.fill_null(codes, empty)
    return codes.to_numpy(), dictionary, empty


def _similarity_clusters(groups: np.ndarray, texts: list[str], threshold: float) -> np.ndarray:
    """Greedy clustering of unique (group, anchor) pairs given in order of first appearance."""
    cluster = np.empty(len(texts), dtype=np.int64)
    representatives: dict[int, list[tuple[int, str]]] = {}
    for i, (group, text) in enumerate(zip(groups.tolist(), texts, strict=True)):
        reps = representatives.setdefault(group, [])
        for code, rep in reps:
            if SequenceMatcher(None, text, rep).ratio() >= threshold:
                cluster[i] = code
                break
        else:
            cluster[i] = i  # a fresh code; renumbered densely below
            reps.append((i, text))
    return np.unique(cluster, return_inverse=True)[1].reshape(-1)


def gigpo(batch: TrajectoryBatch, config: GiGPOConfig) -> TrajectoryBatch:
    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    actions = batch.column("turns").flatten().field("action")
    invalid = equals_any(actions, "invalid")
    by_std = config.mode == "mean_std_norm"

    # Step term: the returns (Eq. (5): the outcome is the only reward, on the final turn;
    # penalties come after) normalized within anchor groups, singleton -> 0 (centered).
    anchor, num_anchor_groups, null_anchors = anchor_groups(batch, config)
    returns = _outcome_returns(batch, outcome, config.gamma)
    penalty = None
    if config.invalid_action_penalty and invalid.any():
        penalty = config.invalid_action_penalty * invalid
        returns -= penalty
    spec = NormSpec(ddof=config.std_ddof, eps=config.eps, norm_by_std=by_std, singleton="center")
    step_term, anchor_sizes = normalize_where(returns, anchor, num_anchor_groups, spec)
    del anchor  # drop large temporaries early: a lower peak footprint means fewer page faults

    # Episode term: statistics per prompt group, singleton -> mean 0, std 1 (not centered).
    advantages, zero_std_rows = _episode_term(batch, config, outcome, penalty)
    step_term *= config.step_weight
    advantages += step_term

    metrics = {
        "gigpo/anchor_groups": float(num_anchor_groups),
        "gigpo/singleton_anchor_groups": float(np.count_nonzero(anchor_sizes == 1)),
        "gigpo/invalid_turns": float(np.count_nonzero(invalid)),
        "gigpo/null_anchors": float(null_anchors),
        "gigpo/null_actions": float(actions.null_count),
        "gigpo/episode_zero_std_rows": float(zero_std_rows),
    }
    return batch.with_turn_columns(
        {"turn_rewards": returns, "turn_advantages": advantages}, metrics=metrics
    )


def _outcome_returns(batch: TrajectoryBatch, outcome: np.ndarray, gamma: float) -> np.ndarray:
    """Eq. (5) with the outcome as the only reward: ``R_last = outcome``, then
    ``R_k = gamma * R_{k+1}`` backwards, for all trajectories at once (longest first)."""
    order, last, longer = segments_longest_first(batch.turn_counts)
    returns = np.empty(batch.num_turns)
    value = outcome[order[: longer[0]]]  # trajectories with turns
    returns[last[: longer[0]]] = value
    for d in range(1, len(longer) - 1):
        value = gamma * value[: longer[d]]
        returns[last[: longer[d]] - d] = value
    return returns


def _episode_term(
    batch: TrajectoryBatch, config: GiGPOConfig, outcome: np.ndarray, penalty: np.ndarray | None
) -> tuple[np.ndarray, int]:
    """``A^E`` per turn: ``s_k`` against its prompt group's statistics (singleton: 0, 1),
    and the number of rows whose value differs from a group mean with std 0 (divided by
    ``eps`` alone in ``mean_std_norm``).

    Without penalties ``s_k`` is the trajectory's outcome on each of its turns, so
    ``A^E`` is one value per trajectory, and statistics over turn-rows (``cross_steps``)
    weigh each trajectory by its turn count.
    """
    group, num_groups, ddof = batch.group_index, batch.num_groups, config.std_ddof
    if penalty is None:
        weight = batch.turn_counts if config.cross_steps else None
        count, mean, std = key_stats(outcome, group, num_groups, ddof=ddof, weights=weight)
        values, keys = outcome, group
    else:  # s_k = outcome - penalty_k, one per turn-row
        values = np.repeat(outcome, batch.turn_counts) - penalty
        keys = np.repeat(group, batch.turn_counts)
        # cross_steps=False: one value per trajectory, its first row's (penalized) score
        first_rows = values[batch.turn_offsets[:-1]]
        stats_of = (values, keys) if config.cross_steps else (first_rows, group)
        count, mean, std = key_stats(*stats_of, num_groups, ddof=ddof)
    mean, std = np.where(count <= 1, 0.0, mean), np.where(count <= 1, 1.0, std)
    term = values - mean[keys]
    zero_std_rows = 0
    if config.mode == "mean_std_norm":
        zero_std_rows = int(np.count_nonzero((std[keys] == 0) & (term != 0)))
        term /= (std + config.eps)[keys]
    return (term if penalty is not None else np.repeat(term, batch.turn_counts)), zero_std_rows


def gigpo_composition(config: GiGPOConfig) -> str | None:
    """GiGPO as parts; None for ``cross_steps=False`` with a penalty (episode statistics
    over each trajectory's first row, each row normalized with its own score: no
    normalizer does that)."""
    penalty = config.invalid_action_penalty
    if not config.cross_steps and penalty:
        return None
    stats = f"ddof={config.std_ddof}, eps={config.eps!r}, by_std={config.mode == 'mean_std_norm'}"
    episode, step = "outcome", f"discounted_outcome(gamma={config.gamma!r})"
    if penalty:
        episode += f" - {penalty!r}*invalid"
        step += f" - {penalty!r}*invalid"
    # cross_steps: statistics over every turn-row of the group; else one per trajectory
    rows = "group_turns(var_eps=0.0, " if config.cross_steps else "group("
    rows += f"singleton='zero_mean_unit_std', {stats})"
    anchors = (
        f"anchor_state(similarity={config.enable_similarity}, threshold="
        f"{config.similarity_threshold!r}, {stats})"
    )
    return f"({episode} | {rows}) + {config.step_weight!r}*({step} | {anchors})"


ESTIMATORS = (
    Estimator(
        "gigpo",
        gigpo,
        GiGPOConfig,
        ("group_id", "outcome_reward", "turns", "question"),
        "episode-level plus anchor-state step-level group normalization (GiGPO)",
        learner={"kl_coef": 1e-3},  # the official recipe: KL loss 0.001 low_var_kl (k3)
        composition=gigpo_composition,
    ),
)
