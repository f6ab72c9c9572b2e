"""Credit as parts: the turn-reward terms, normalizers, transforms and weightings the
estimators are made of, each a named, pure, vectorized function with its own settings.

An advantage is built in four steps, each a kind of part:

* **reward terms** give every turn a reward (``outcome``, TSPO's ``folr``, IGPO's
  ``info_gain``, Search-P1's ``path``, GiGPO's ``discounted_outcome`` and ``invalid``);
  a weighted sum of terms is a reward too (``outcome + 0.5*folr``);
* a **normalizer** turns rewards into advantages by comparing each with its peers: the
  prompt ``group`` (GRPO), ``leave_one_out`` (RLOO), the ``turn_position`` within the group
  (TSPO, A²TGPO's turn group), every turn of the group pooled (``group_turns``, IGPO) or
  the ``anchor_state`` (GiGPO);
* **transforms** act on a normalized term: ``discount`` (IGPO's backward sum over the
  turns) and ``rescaled_sum`` (A²TGPO's variance-rescaled sum over the IG turns);
  normalized terms add up with weights, like rewards;
* **weightings** act on the final advantage: CW-GRPO's judged ``contribution``, A²TGPO's
  ``adaptive_clip`` (a per-turn clip scale for the loss) and ``segments`` (turns without a
  reward of their own take the next one's, as A²TGPO's official code).

Each part declares the columns it reads, the signals that write them (with their
settings) and the learner settings it needs. :mod:`ray_credit.estimators.compose` puts
parts together (``folr + 0.3*info_gain | turn_position(padding="none") | contribution``)
and checks that a composition can work before anything runs. docs/algorithms.md, section
10, writes out what each part computes and how sums of parts combine.

Every function here takes the batch and returns numpy arrays over flat turns (float64);
nothing loops over groups in Python. This module imports only numpy and pyarrow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.config import check_fields
from ray_credit.estimators._group import (
    NormSpec,
    SingletonPolicy,
    broadcast_to_turns,
    check_norm_params,
    check_var_eps,
    equals_any,
    group_all,
    group_normalize,
    key_stats,
    next_marked,
    normalize_where,
    reverse_discounted_sum,
)

__all__ = [
    "PARTS",
    "Advantage",
    "Part",
    "Rewards",
    "get_part",
]

Kind = Literal["reward", "normalizer", "transform", "weighting"]
KINDS = ("reward", "normalizer", "transform", "weighting")


# --------------------------------------------------------------------------- results


@dataclass
class Rewards:
    """What a reward term (or a weighted sum of them) gives: one reward per flat turn."""

    values: np.ndarray
    """float64 per flat turn; 0 where the term gives no reward."""
    defined: np.ndarray | None
    """Where the term gives a reward (bool per flat turn); None: on every turn."""
    per_traj: np.ndarray | None
    """One value per trajectory when the reward is one per trajectory (outcome, on every
    turn or on the last; Search-P1's path): what a per-trajectory normalizer reads. None
    when turns have rewards of their own."""
    turn_groups: np.ndarray
    """Per prompt group: True where the rewards may differ between a trajectory's turns
    (TSPO's latent reward in an all-wrong group, an information gain)."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Term:
    """One normalized term of an advantage, kept for the weightings that read it."""

    rewards: tuple[str, ...]
    """The names of the reward terms it normalizes."""
    normalized: np.ndarray
    """The normalizer's output (before transforms), float64 per flat turn."""
    defined: np.ndarray | None


@dataclass
class Advantage:
    """Advantages per flat turn, and the normalized terms they were made of."""

    values: np.ndarray
    defined: np.ndarray | None
    terms: list[Term]
    metrics: dict[str, float] = field(default_factory=dict)
    clip_scale: np.ndarray | None = None
    rewards: Rewards | None = None
    """The rewards of a one-term advantage (written as ``turn_rewards``)."""


# --------------------------------------------------------------------------- the part


@dataclass(frozen=True)
class Part:
    """A named piece of a credit estimator.

    ``fn`` depends on ``kind``: a reward term is ``fn(batch, config) -> Rewards``; a
    normalizer ``fn(batch, rewards, config) -> (values, metrics)``; a transform and a
    weighting ``fn(batch, advantage, config) -> Advantage``. ``config_cls`` is a frozen
    dataclass whose defaults are the paper's. ``requires`` lists the batch columns the part
    reads; ``signals(config)`` the signals that write them, with their settings;
    ``learner`` the learner settings the part needs (dotted LearnerConfig fields).
    ``papers`` names the methods that use the part (docs/estimators.md's parts table).
    """

    name: str
    kind: Kind
    fn: Callable[..., Any]
    config_cls: type
    requires: tuple[str, ...] = ()
    description: str = ""
    signals: Callable[[Any], Mapping[str, Mapping[str, Any]]] | None = None
    learner: Mapping[str, Any] = field(default_factory=dict)
    papers: tuple[str, ...] = ()
    per_turn: Callable[[Any], bool] | None = None
    """Reward terms: whether a trajectory's turns may get different rewards (None: they
    may; a reward of one value per trajectory says False and gives ``per_traj``)."""
    final_turn: Callable[[Any], bool] | None = None
    """Reward terms: whether the final turn gets a reward (None: it does)."""
    every_turn: Callable[[Any], bool] | None = None
    """Reward terms: whether every turn gets a reward (None: it does)."""
    zero: Callable[[Any], bool] | None = None
    """Reward terms: whether these settings make every reward 0 (None: no settings do), so
    that a composition of nothing else is refused (every advantage would be 0)."""
    penalty: bool = False
    """Reward terms: a penalty, larger where the policy did worse (1 on an invalid turn),
    so it takes a negative weight; a positive one is refused, and so is a composition whose
    rewards that are not penalties all have negative weights."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"part {self.name!r}: kind is one of {KINDS}, got {self.kind!r}")
        if not dataclasses.is_dataclass(self.config_cls):
            raise TypeError(f"part {self.name!r}: config_cls must be a dataclass")

    def config(self, **params: Any) -> Any:
        """The part's settings: its defaults with ``params`` (unknown names refused)."""
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(params) - fields)
        if unknown:
            raise ValueError(
                f"part {self.name!r} has no setting {', '.join(map(repr, unknown))}; "
                f"its settings: {', '.join(sorted(fields)) or 'none'}"
            )
        return self.config_cls(**params)

    def signals_of(self, config: Any) -> dict[str, dict[str, Any]]:
        return {} if self.signals is None else {k: dict(v) for k, v in self.signals(config).items()}


@dataclass(frozen=True)
class NoSettings:
    """A part without settings."""


PARTS: dict[str, Part] = {}


def register_part(part: Part, *, overwrite: bool = False) -> Part:
    """Add a part to :data:`PARTS` under its name (refuses to shadow one unless told)."""
    if not isinstance(part, Part):
        raise TypeError(f"register_part takes a Part, got {type(part).__name__}")
    if part.name in PARTS and not overwrite:
        raise ValueError(f"a part named {part.name!r} is already registered; pick another name")
    PARTS[part.name] = part
    return part


def get_part(name: str) -> Part:
    try:
        return PARTS[name]
    except KeyError:
        by_kind = {k: sorted(p.name for p in PARTS.values() if p.kind == k) for k in KINDS}
        listed = "; ".join(f"{k}s: {', '.join(v)}" for k, v in by_kind.items())
        raise ValueError(f"unknown part {name!r} ({listed})") from None


# --------------------------------------------------------------------------- helpers


def _every(batch: TrajectoryBatch, value: bool) -> np.ndarray:
    return np.full(batch.num_groups, value)


def _traj_rewards(batch: TrajectoryBatch, per_traj: np.ndarray, metrics=None) -> Rewards:
    """A reward that is one value per trajectory, on each of its turns."""
    per_traj = np.asarray(per_traj, dtype=np.float64)
    return Rewards(
        broadcast_to_turns(batch, per_traj), None, per_traj, _every(batch, False), metrics or {}
    )


def _spec(cfg: Any) -> NormSpec:
    return NormSpec(
        ddof=cfg.ddof,
        eps=cfg.eps,
        norm_by_std=cfg.by_std,
        singleton=cfg.singleton,
        var_eps=cfg.var_eps,
    )


@dataclass(frozen=True)
class _NormKnobs:
    """The statistics every normalizer shares (see ``NormSpec``)."""

    ddof: int = 0
    """0: population std; 1: sample std."""
    eps: float = 1e-6
    """Added to the std in the denominator."""
    var_eps: float = 0.0
    """Added to the variance inside the square root."""
    by_std: bool = True
    """False: subtract the mean only."""
    singleton: SingletonPolicy = "center"
    """A peer set of one: "center" (0) or "zero_mean_unit_std" (the value itself, verl GRPO)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(std_ddof=self.ddof, eps=self.eps, singleton_policy=self.singleton)
        check_var_eps(self.var_eps)


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} is a discount in [0, 1], got {value!r}")


# --------------------------------------------------------------------------- rewards


@dataclass(frozen=True)
class OutcomeSettings:
    at: Literal["every", "last"] = "every"
    """"every": the outcome on every turn (GRPO); "last": on the final turn only (IGPO)."""

    def __post_init__(self) -> None:
        check_fields(self)


def _outcome(batch: TrajectoryBatch, cfg: OutcomeSettings) -> Rewards:
    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    if cfg.at == "every":
        return _traj_rewards(batch, outcome)
    last = batch.is_last_turn
    values = np.zeros(batch.num_turns)
    values[last] = outcome  # one last turn per trajectory, in order
    return Rewards(values, last, outcome, _every(batch, False))


@dataclass(frozen=True)
class FOLRSettings:
    alpha: float = 1.0
    """TSPO Eq. (6): the partial reward of the turns up to the first gold in a wrong
    trajectory."""
    groups: Literal["all_wrong", "all"] = "all_wrong"
    """Where the latent reward applies: "all_wrong" groups (TSPO's best, the outcome
    elsewhere) or "all" groups."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"folr alpha is a partial reward in [0, 1], got {self.alpha!r}")


def _folr(batch: TrajectoryBatch, cfg: FOLRSettings) -> Rewards:
    from ray_credit.estimators.tspo import folr_rewards

    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    all_wrong = group_all(batch, outcome == 0)
    eligible = all_wrong if cfg.groups == "all_wrong" else _every(batch, True)
    a, b, cut, partial = folr_rewards(batch, cfg.alpha, eligible=eligible[batch.group_index])
    owner = batch.turn_traj_index
    position = batch.turn_position
    values = np.where(position < cut[owner], a[owner], b[owner]).astype(np.float64)
    metrics = {
        "all_wrong_group_frac": float(all_wrong.mean()),
        "partial_reward_turns": float(cut[partial].sum()),
        "null_contains_gold": float(batch.column("turn_contains_gold").flatten().null_count),
    }
    return Rewards(values, None, None, eligible.copy(), metrics)


@dataclass(frozen=True)
class InfoGainSettings:
    mode: Literal["prob_diff", "log_prob_diff"] = "prob_diff"
    """What the info-gain signal computes (IGPO: probability; A²TGPO: log-probability)."""
    zero: Literal["keep", "drop"] = "keep"
    """An information gain of exactly 0: a reward ("keep", the papers) or no reward
    ("drop", A²TGPO's official code, whose mask is "reward != 0")."""

    def __post_init__(self) -> None:
        check_fields(self)


def _info_gain(batch: TrajectoryBatch, cfg: InfoGainSettings) -> Rewards:
    from ray_credit.estimators.igpo import ig_turns

    gains, is_ig, counts = ig_turns(batch)
    if cfg.zero == "drop":
        zero = is_ig & (gains == 0)
        counts["zero_dropped"] = float(np.count_nonzero(zero))
        is_ig = is_ig & ~zero
    values = np.where(is_ig, gains, np.float64(0.0))
    return Rewards(values, is_ig, None, _every(batch, True), counts)


@dataclass(frozen=True)
class PathSettings:
    """Search-P1's path-centric reward (the settings of ``SearchP1Config`` but GRPO's)."""

    lambda_path: float = 0.3
    lambda_outcome: float = 0.6
    lambda_format: float = 0.1
    soft_alpha: float = 0.8
    variant: Literal["equations", "algorithm3"] = "equations"
    format_full: float = 0.1
    format_partial: float = 0.05
    correct_threshold: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self)
        self.search_p1()  # its checks

    def search_p1(self) -> Any:
        from ray_credit.estimators.search_p1 import SearchP1Config

        return SearchP1Config(**dataclasses.asdict(self))


def _path_is_zero(cfg: PathSettings) -> bool:
    """Eq. (4) with no weight on the path or the outcome, and none (or no format reward)
    on the format; or Algorithm 3 without a format reward, which gates the rest on it."""
    no_format = cfg.format_full == cfg.format_partial == 0
    if cfg.variant == "algorithm3" and no_format:
        return True
    return cfg.lambda_path == cfg.lambda_outcome == 0 and (cfg.lambda_format == 0 or no_format)


def _path(batch: TrajectoryBatch, cfg: PathSettings) -> Rewards:
    from ray_credit.estimators.search_p1 import path_centric_reward

    parts = path_centric_reward(batch, cfg.search_p1())
    metrics = {
        "evaluator_missing": float(parts["missing"].sum()),
        "format_zero": float((parts["format"] == 0).sum()),
        "path_mean": float(parts["path"].mean()),
    }
    return _traj_rewards(batch, parts["total"], metrics)


@dataclass(frozen=True)
class DiscountedOutcomeSettings:
    gamma: float = 0.95
    """GiGPO Eq. (5): the outcome on the final turn, times gamma per turn before it."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_unit("discounted_outcome gamma", self.gamma)


def _discounted_outcome(batch: TrajectoryBatch, cfg: DiscountedOutcomeSettings) -> Rewards:
    from ray_credit.estimators.gigpo import _outcome_returns

    outcome = batch.traj_values("outcome_reward").astype(np.float64)
    values = _outcome_returns(batch, outcome, cfg.gamma)
    return Rewards(values, None, None, _every(batch, True))


def _invalid(batch: TrajectoryBatch, cfg: NoSettings) -> Rewards:
    actions = batch.column("turns").flatten().field("action")
    invalid = equals_any(actions, "invalid")
    return Rewards(
        invalid.astype(np.float64),
        None,
        None,
        _every(batch, True),
        {"turns": float(np.count_nonzero(invalid))},
    )


# --------------------------------------------------------------------------- normalizers


@dataclass(frozen=True)
class GroupSettings(_NormKnobs):
    """GRPO's statistics (verl): sample std, a one-member group keeps its value."""

    ddof: int = 1
    singleton: SingletonPolicy = "zero_mean_unit_std"


def _group(batch: TrajectoryBatch, rewards: Rewards, cfg: GroupSettings):
    per_traj = group_normalize(batch, rewards.per_traj, _spec(cfg))
    return broadcast_to_turns(batch, per_traj), {}


@dataclass(frozen=True)
class LeaveOneOutSettings:
    singleton: SingletonPolicy = "zero_mean_unit_std"
    """A one-member group: "zero_mean_unit_std" keeps its value (verl), "center" gives 0."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_norm_params(singleton_policy=self.singleton)


def _leave_one_out(batch: TrajectoryBatch, rewards: Rewards, cfg: LeaveOneOutSettings):
    centered = group_normalize(
        batch, rewards.per_traj, NormSpec(norm_by_std=False, singleton=cfg.singleton)
    )
    n = batch.group_sizes.astype(np.float64)
    scale = np.divide(n, n - 1, out=np.ones_like(n), where=n > 1)  # r - mean of the others
    return broadcast_to_turns(batch, centered * scale[batch.group_index]), {}


@dataclass(frozen=True)
class TurnPositionSettings(_NormKnobs):
    """TSPO Eq. (7): each turn against the same turn of its group's other trajectories."""

    padding: Literal["final_reward", "none"] = "final_reward"
    """"final_reward": a shorter trajectory stands in the later turns' statistics with its
    final reward (TSPO Discussion 1); "none": real turns only (A²TGPO's turn group)."""
    index: Literal["position", "ordinal"] = "position"
    """Which turns are peers: the same position ("position") or the same ordinal among the
    turns that have a reward ("ordinal", A²TGPO's official code)."""


def _turn_position(batch: TrajectoryBatch, rewards: Rewards, cfg: TurnPositionSettings):
    defined = rewards.defined
    at = np.arange(batch.num_turns) if defined is None else np.flatnonzero(defined)
    owner = batch.turn_traj_index[at]
    if cfg.index == "position":
        column = batch.turn_position[at]
        length = batch.turn_counts
    else:  # the ordinal among the trajectory's turns that have a reward
        length = np.bincount(owner, minlength=len(batch))
        first = np.concatenate(([0], np.cumsum(length)[:-1]))
        column = np.arange(len(at)) - first[owner]
    width = max(int(length.max(initial=0)), 1)
    group = batch.group_index
    keys = group[owner] * width + column
    values = rewards.values[at]
    if cfg.padding == "final_reward":  # each trajectory's final reward in its missing columns
        missing = width - length
        pad_traj = np.repeat(np.arange(len(batch)), missing)
        pad_first = np.concatenate(([0], np.cumsum(missing)[:-1]))
        pad_column = length[pad_traj] + np.arange(len(pad_traj)) - pad_first[pad_traj]
        final = rewards.values[batch.turn_offsets[1:] - 1]
        keys = np.concatenate((keys, group[pad_traj] * width + pad_column))
        values = np.concatenate((values, final[pad_traj]))
    spec = _spec(cfg)
    normalized, _ = normalize_where(values, keys, batch.num_groups * width, spec)
    out = np.zeros(batch.num_turns)
    out[at] = normalized[: len(at)]
    traj_level = ~rewards.turn_groups
    if cfg.padding == "none" and traj_level.any():
        # A group whose rewards are one per trajectory is compared as trajectories (GRPO
        # with these statistics), not by turns that only its longer trajectories reach.
        per_traj = rewards.values[batch.turn_offsets[1:] - 1]
        count, mean, std = key_stats(
            per_traj, group, batch.num_groups, ddof=cfg.ddof, var_eps=cfg.var_eps
        )
        single = count <= 1  # a lone trajectory follows cfg.singleton, as normalize_where
        centered = cfg.singleton == "center"  # 0; else its value (mean 0, std 1)
        mean = np.where(single, per_traj[_first_of_group(batch)] if centered else 0.0, mean)
        scale = np.ones_like(std)
        if cfg.by_std:
            scale = 1.0 / (np.where(single, 1.0, std) + cfg.eps)
            scale[single & centered] = 1.0  # the lone value is its own mean: 0 either way
        traj_adv = (per_traj - mean[group]) * scale[group]
        turn_groups = np.repeat(traj_level[group], batch.turn_counts)
        if defined is not None:
            turn_groups &= defined
        out[turn_groups] = np.repeat(traj_adv, batch.turn_counts)[turn_groups]
    return out, {}


def _first_of_group(batch: TrajectoryBatch) -> np.ndarray:
    starts = batch.group_starts
    return starts if batch.group_order is None else batch.group_order[starts]


@dataclass(frozen=True)
class GroupTurnsSettings(_NormKnobs):
    """IGPO Eq. (4): every reward of the group's turns in one pool (745078b's statistics)."""

    var_eps: float = 1e-8


def _group_turns(batch: TrajectoryBatch, rewards: Rewards, cfg: GroupTurnsSettings):
    keys = np.repeat(batch.group_index, batch.turn_counts)
    out, size = normalize_where(rewards.values, keys, batch.num_groups, _spec(cfg), rewards.defined)
    return out, {"singleton_pools": float(np.count_nonzero(size == 1))}


@dataclass(frozen=True)
class AnchorStateSettings(_NormKnobs):
    """GiGPO's step groups: the turns of a prompt group that acted from the same state."""

    ddof: int = 1
    similarity: bool = False
    """Also group near-identical states (difflib ratio >= threshold)."""
    threshold: float = 0.95
    by_std: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"anchor_state threshold must be in (0, 1], got {self.threshold!r}")


def _anchor_state(batch: TrajectoryBatch, rewards: Rewards, cfg: AnchorStateSettings):
    from ray_credit.estimators.gigpo import GiGPOConfig, anchor_groups

    anchors = GiGPOConfig(enable_similarity=cfg.similarity, similarity_threshold=cfg.threshold)
    anchor, count, null_anchors = anchor_groups(batch, anchors)
    out, size = normalize_where(rewards.values, anchor, count, _spec(cfg), rewards.defined)
    return out, {
        "anchor_groups": float(count),
        "singleton_anchor_groups": float(np.count_nonzero(size == 1)),
        "null_anchors": float(null_anchors),
    }


# --------------------------------------------------------------------------- transforms


@dataclass(frozen=True)
class DiscountSettings:
    gamma: float = 1.0
    """IGPO Eq. (5): A_k = n_k + gamma * A_{k+1}, backwards over every turn."""
    boundaries: Literal["every_turn", "nonzero"] = "every_turn"
    """"every_turn" (the paper); "nonzero": a turn whose value is exactly 0 is no turn and
    passes the next one's on (IGPO's official code)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_unit("discount gamma", self.gamma)


def _discount(batch: TrajectoryBatch, adv: Advantage, cfg: DiscountSettings) -> Advantage:
    values = reverse_discounted_sum(
        adv.values.copy(), batch.turn_counts, cfg.gamma, skip_zeros=cfg.boundaries == "nonzero"
    )
    return dataclasses.replace(adv, values=values, defined=None)


@dataclass(frozen=True)
class RescaledSumSettings:
    gamma: float = 1.0
    """A²TGPO Eq. (8): D_k = sum_{j >= k} gamma^(j-k) g_j over the turns with a value, then
    divided by the square root of their number from k on."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check_unit("rescaled_sum gamma", self.gamma)


def _rescaled_sum(batch: TrajectoryBatch, adv: Advantage, cfg: RescaledSumSettings) -> Advantage:
    from ray_credit.estimators.a2tgpo import _rescaled_accumulation

    defined = adv.defined if adv.defined is not None else np.ones(batch.num_turns, dtype=bool)
    at = np.flatnonzero(defined)
    per_traj = np.bincount(batch.turn_traj_index[at], minlength=len(batch))
    values = np.zeros(batch.num_turns)
    values[at] = _rescaled_accumulation(adv.values[at], per_traj, cfg.gamma)
    return dataclasses.replace(adv, values=values, defined=adv.defined)


# --------------------------------------------------------------------------- weightings


@dataclass(frozen=True)
class ContributionSettings:
    """CW-GRPO Designs 1-3 (the settings of ``CWGRPOConfig`` but GRPO's)."""

    alpha: float = math.inf
    """Softmax temperature over the judged contributions (inf: the argmax limit; 0: none)."""
    official_compat: bool = False
    """Reproduce the official code instead of the paper."""
    inf_threshold: float = 10.0
    """official_compat only: alpha >= this takes the official alpha = inf path."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.alpha >= 0:
            raise ValueError(f"contribution alpha must be >= 0 (inf allowed), got {self.alpha!r}")
        if not self.inf_threshold > 0:
            raise ValueError(f"inf_threshold must be > 0, got {self.inf_threshold!r}")


def _contribution(batch: TrajectoryBatch, adv: Advantage, cfg: ContributionSettings) -> Advantage:
    from ray_credit.estimators.cw_grpo import _judgements, round_factors

    p_one, judged = _judgements(batch)
    final = adv.values[batch.turn_offsets[1:] - 1]  # A^O for a trajectory-level advantage
    factors, metrics = round_factors(batch, cfg, final >= 0, p_one, judged)
    nonfinal = ~batch.is_last_turn
    kind = nonfinal.view(np.int8) + (p_one & nonfinal).view(np.int8)  # 0 final, 1 + p
    at = np.repeat(np.arange(0, 3 * len(batch), 3), batch.turn_counts) + kind
    values = adv.values * factors.ravel()[at]
    return dataclasses.replace(adv, values=values, metrics=metrics)


@dataclass(frozen=True)
class AdaptiveClipSettings:
    beta: float = 0.3
    """A²TGPO Eq. (11): c = 1 + beta * (2 * sigmoid(g) - 1), g the normalized term's value."""
    of: str = "info_gain"
    """The reward term whose normalized values set the clip scale."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"adaptive_clip beta must be in [0, 1) so c > 0, got {self.beta!r}")


def term_of(adv: Advantage, reward: str, by: str) -> Term:
    """The one normalized term of ``adv`` made from the reward term ``reward``."""
    found = [t for t in adv.terms if reward in t.rewards]
    if len(found) != 1:
        raise ValueError(
            f"{by} reads the normalized {reward} term, and the composition has {len(found)}"
        )
    return found[0]


def _adaptive_clip(batch: TrajectoryBatch, adv: Advantage, cfg: AdaptiveClipSettings) -> Advantage:
    term = term_of(adv, cfg.of, "adaptive_clip")
    defined = term.defined if term.defined is not None else np.ones(batch.num_turns, dtype=bool)
    at = np.flatnonzero(defined)
    scale = np.ones(batch.num_turns)
    g = term.normalized[at] * 0.5
    clip = np.tanh(g, out=g)  # 2 * sigmoid(x) - 1 = tanh(x / 2)
    clip *= cfg.beta
    clip += 1.0
    scale[at] = clip
    return dataclasses.replace(adv, clip_scale=scale)


@dataclass(frozen=True)
class SegmentsSettings:
    of: str = "info_gain"
    """The reward term whose turns (and the final turns) keep their own values."""

    def __post_init__(self) -> None:
        check_fields(self)


def _segments(batch: TrajectoryBatch, adv: Advantage, cfg: SegmentsSettings) -> Advantage:
    term = term_of(adv, cfg.of, "segments")
    own = batch.is_last_turn.copy()
    if term.defined is None:
        own[:] = True
    else:
        own |= term.defined
    merged = float(np.count_nonzero(~own))
    metrics = {"merged_turns": merged}
    if not merged:
        return dataclasses.replace(adv, metrics=metrics)
    take = next_marked(own)
    scale = None if adv.clip_scale is None else adv.clip_scale[take]
    return dataclasses.replace(adv, values=adv.values[take], clip_scale=scale, metrics=metrics)


# --------------------------------------------------------------------------- registry

_IG_COLUMNS = ("turns", "turn_info_gain")
for _part in (
    Part(
        "outcome", "reward", _outcome, OutcomeSettings, ("outcome_reward",),
        "the trajectory's outcome reward, on every turn or on the final one",
        papers=("GRPO", "RLOO", "CW-GRPO", "IGPO", "A²TGPO", "GiGPO"),
        per_turn=lambda c: False, every_turn=lambda c: c.at == "every",
    ),
    Part(
        "folr", "reward", _folr, FOLRSettings,
        ("outcome_reward", "turns", "turn_contains_gold"),
        "first-occurrence latent reward: alpha on a wrong trajectory's turns up to the first "
        "observation holding the gold answer",
        papers=("TSPO",), per_turn=lambda c: True,
    ),
    Part(
        "info_gain", "reward", _info_gain, InfoGainSettings, _IG_COLUMNS,
        "the gain in the gold answer's probability over a non-final turn",
        signals=lambda c: {"info_gain": {"mode": c.mode}},
        papers=("IGPO", "A²TGPO"), per_turn=lambda c: True, final_turn=lambda c: False,
        every_turn=lambda c: False,
    ),
    Part(
        "path", "reward", _path, PathSettings,
        ("outcome_reward", "turns", "sp1_planner_score", "sp1_plan_steps",
         "sp1_effective_steps_self", "sp1_effective_steps_ref", "sp1_ref_plan_steps",
         "sp1_outcome_accuracy", "sp1_outcome_reasoning"),
        "Search-P1's path-centric reward: plan execution, reference coverage, soft outcome, "
        "format",
        signals=lambda c: {"search_p1_evaluation": {}},
        papers=("Search-P1",), per_turn=lambda c: False, zero=_path_is_zero,
    ),
    Part(
        "discounted_outcome", "reward", _discounted_outcome, DiscountedOutcomeSettings,
        ("outcome_reward",), "the outcome on the final turn, discounted backwards",
        papers=("GiGPO",), per_turn=lambda c: True,
    ),
    Part(
        "invalid", "reward", _invalid, NoSettings, ("turns",),
        "1 on a turn whose action is invalid (a penalty with a negative weight)",
        papers=("GiGPO",), per_turn=lambda c: True, penalty=True,
    ),
    Part(
        "group", "normalizer", _group, GroupSettings, ("group_id",),
        "one value per trajectory against its prompt group", papers=("GRPO", "Dr.GRPO",
        "CW-GRPO", "Search-P1", "A²TGPO"),
    ),
    Part(
        "leave_one_out", "normalizer", _leave_one_out, LeaveOneOutSettings, ("group_id",),
        "one value per trajectory minus the mean of the group's others", papers=("RLOO",),
    ),
    Part(
        "turn_position", "normalizer", _turn_position, TurnPositionSettings, ("group_id",),
        "each turn against the same turn of the group's other trajectories",
        papers=("TSPO", "A²TGPO"),
    ),
    Part(
        "group_turns", "normalizer", _group_turns, GroupTurnsSettings, ("group_id",),
        "every turn's reward against all the rewards of its group's turns", papers=("IGPO",),
    ),
    Part(
        "anchor_state", "normalizer", _anchor_state, AnchorStateSettings,
        ("group_id", "question", "turns"),
        "each turn against the group's turns that acted from the same state",
        papers=("GiGPO",),
    ),
    Part(
        "discount", "transform", _discount, DiscountSettings, (),
        "backward discounted sum over every turn", papers=("IGPO",),
    ),
    Part(
        "rescaled_sum", "transform", _rescaled_sum, RescaledSumSettings, (),
        "backward sum over the turns with a value, over the square root of their number",
        papers=("A²TGPO",),
    ),
    Part(
        "contribution", "weighting", _contribution, ContributionSettings,
        ("outcome_reward", "turns", "judge_utility", "judge_correct"),
        "a successful trajectory's advantage moved onto the search rounds a judge finds useful "
        "and correct",
        signals=lambda c: {"cw_grpo_judgement": {}}, papers=("CW-GRPO",),
    ),
    Part(
        "adaptive_clip", "weighting", _adaptive_clip, AdaptiveClipSettings, (),
        "a per-turn scale of the loss's clip range from a normalized term",
        # The scale widens or narrows the turn-level ratio's clip range (A²TGPO Eq. 10).
        learner={"loss.ratio_level": "turn", "loss.clip_low": 3e-3, "loss.clip_high": 4e-3},
        papers=("A²TGPO",),
    ),
    Part(
        "segments", "weighting", _segments, SegmentsSettings, (),
        "turns without a reward of their own take the next rewarded turn's advantage",
        papers=("A²TGPO (official code)",),
    ),
):  # fmt: skip
    register_part(_part)
del _part
