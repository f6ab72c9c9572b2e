"""Unit tests for the CW-GRPO estimator (hand-computed vectors)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ray_credit.batch import BatchValidationError
from ray_credit.estimators import get_estimator
from ray_credit.estimators.cw_grpo import CWGRPOConfig
from ray_credit.testing import make_batch, random_batch

CW = get_estimator("cw_grpo")
A = 0.866024  # GRPO advantage of a success (failure: -A) in a [1, 1, 0, 0] group, sample std


def per_traj(batch) -> list[list[float]]:
    return [row["turn_advantages"] for row in batch.to_records()]


def assert_rows(actual: list[list[float]], expected: list[list[float]], atol: float = 1e-5) -> None:
    assert [len(r) for r in actual] == [len(r) for r in expected]
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)


def vector_batch(last_judged: int = 1, null_turn: tuple[int, int] | None = None):
    """Hand-computed: rewards [1,1,0,0]; rollout 0 p = [0,1,0 | last], rollout 1 p = [0,0 | last]."""
    rows = [
        {
            "reward": 1,
            "turns": 4,
            "judge_utility": [0, 1, 0, last_judged],
            "judge_correct": [1, 1, 1, 1],
        },
        {"reward": 1, "turns": 3, "judge_utility": [0, 0, last_judged], "judge_correct": [1, 1, 1]},
        {"reward": 0, "turns": 3, "judge_utility": [None] * 3, "judge_correct": [None] * 3},
        {"reward": 0, "turns": 1, "judge_utility": [None], "judge_correct": [None]},
    ]
    if null_turn is not None:
        i, k = null_turn
        rows[i]["judge_correct"][k] = None
    return make_batch(rows)


FAILED = [[-A] * 3, [-A]]


# ----------------------------------------------------------------------------- vectors
@pytest.mark.parametrize(
    "alpha, last_judged, expected",
    [
        (100, 1, [[0, 1.299036, 0, A], [0, 0, A]]),  # quirk a: the last round dilutes
        (100, 0, [[0, 2.598072, 0, A], [0, 0, A]]),  # quirk b: all-zero p zeroes the searches
        (3, 1, [[0.117637, 2.362798, 0.117637, A], [A] * 3]),
        (0, 1, [[A] * 4, [A] * 3]),
    ],
)
def test_official_vectors(alpha: float, last_judged: int, expected: list[list[float]]) -> None:
    out = CW(vector_batch(last_judged), alpha=alpha, official_compat=True)
    assert_rows(per_traj(out), expected + FAILED)


@pytest.mark.parametrize(
    "alpha, expected",
    [
        (math.inf, [[0, 2.598072, 0, A], [A] * 3]),
        (100, [[0, 2.598072, 0, A], [A] * 3]),
        (3, [[0.117637, 2.362798, 0.117637, A], [A] * 3]),
        (0, [[A] * 4, [A] * 3]),
    ],
)
@pytest.mark.parametrize("last_judged", [0, 1])
def test_paper_vectors(alpha: float, expected: list[list[float]], last_judged: int) -> None:
    # Paper mode never reads the final round's judgement.
    out = CW(vector_batch(last_judged), alpha=alpha)
    assert_rows(per_traj(out), expected + FAILED)
    assert out.metrics["cw_grpo/redistributed_trajs"] == 2
    # only the first has a round judged useless beside useful ones: the second is GRPO's
    assert out.metrics["cw_grpo/reweighted_trajs"] == (0 if alpha == 0 else 1)
    assert out.metrics["cw_grpo/null_judgement_turns"] == 0


def test_default_alpha_is_inf_paper_mode() -> None:
    assert CWGRPOConfig().alpha == math.inf and not CWGRPOConfig().official_compat
    assert_rows(per_traj(CW(vector_batch())), [[0, 2.598072, 0, A], [A] * 3] + FAILED)


def test_inf_threshold_moves_the_official_switch() -> None:
    # alpha = 3 takes the official alpha = inf path once the threshold is <= 3.
    out = CW(vector_batch(), alpha=3, official_compat=True, inf_threshold=3)
    assert_rows(per_traj(out), [[0, 1.299036, 0, A], [0, 0, A]] + FAILED)


# ----------------------------------------------------------------------------- nulls
def test_paper_null_on_search_round_falls_back_to_grpo() -> None:
    out = CW(vector_batch(null_turn=(0, 1)), alpha=3)
    assert_rows(per_traj(out), [[A] * 4, [A] * 3] + FAILED)
    assert out.metrics["cw_grpo/null_judgement_trajs"] == 1
    assert out.metrics["cw_grpo/null_judgement_turns"] == 1
    assert out.metrics["cw_grpo/redistributed_trajs"] == 1
    assert out.metrics["cw_grpo/reweighted_trajs"] == 0  # the other one's rounds are alike


def test_paper_null_on_final_round_is_ignored() -> None:
    out = CW(vector_batch(null_turn=(0, 3)), alpha=3)
    assert_rows(per_traj(out), [[0.117637, 2.362798, 0.117637, A], [A] * 3] + FAILED)
    assert out.metrics["cw_grpo/null_judgement_turns"] == 0


def test_official_null_is_read_as_zero_and_counted() -> None:
    # p = [0, null->0, 0 | 1]: alpha=inf path gives 0 on every search round of rollout 0.
    out = CW(vector_batch(null_turn=(0, 1)), alpha=100, official_compat=True)
    assert_rows(per_traj(out), [[0, 0, 0, A], [0, 0, A]] + FAILED)
    assert out.metrics["cw_grpo/null_judgement_trajs"] == 1
    assert out.metrics["cw_grpo/null_judgement_turns"] == 1
    # On the alpha=inf path the final round is read too (quirk a), so its null counts.
    out = CW(vector_batch(null_turn=(0, 3)), alpha=100, official_compat=True)
    assert_rows(per_traj(out), [[0, 2.598072, 0, A], [0, 0, A]] + FAILED)
    assert out.metrics["cw_grpo/null_judgement_turns"] == 1
    out = CW(vector_batch(null_turn=(0, 3)), alpha=3, official_compat=True)
    assert out.metrics["cw_grpo/null_judgement_turns"] == 0


def test_official_never_judges_failed_trajectories() -> None:
    # Rewards [0, -1]: the failed trajectory 0 has A^O > 0. Officially its p is forced to 0
    # (quirk c), so the alpha=inf path zeroes its search rounds; the paper keeps it uniform.
    batch = make_batch(
        [
            {"reward": 0, "turns": 3, "judge_utility": [1, 1, 1], "judge_correct": [1, 1, 1]},
            {"reward": -1, "turns": 1, "judge_utility": [1], "judge_correct": [1]},
        ]
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_rows(per_traj(CW(batch, alpha=100, official_compat=True)), [[0, 0, a], [-a]])
    assert_rows(per_traj(CW(batch, alpha=3, official_compat=True)), [[a, a, a], [-a]])
    assert_rows(per_traj(CW(batch)), [[a, a, a], [-a]])


def test_paper_switch_is_success_official_switch_is_sign() -> None:
    # Rewards [1, 0.5, 0.5]: trajectory 0 succeeds with A^O > 0, trajectory 1 succeeds with A^O < 0.
    judged = {"judge_utility": [1, 0, 1], "judge_correct": [1, 1, 1]}
    batch = make_batch(
        [
            {"reward": 1, "turns": 3, **judged},
            {"reward": 0.5, "turns": 3, **judged},
            {"reward": 0.5, "turns": 1, "judge_utility": [1], "judge_correct": [1]},
        ]
    )
    a_pos = (1 - 2 / 3) / (math.sqrt(1 / 12) + 1e-6)
    a_neg = (0.5 - 2 / 3) / (math.sqrt(1 / 12) + 1e-6)
    assert_rows(per_traj(CW(batch)), [[2 * a_pos, 0, a_pos], [2 * a_neg, 0, a_neg], [a_neg]])
    official = CW(batch, alpha=math.inf, official_compat=True)  # p sum includes the last round
    assert_rows(per_traj(official), [[a_pos, 0, a_pos], [a_neg] * 3, [a_neg]])


# ----------------------------------------------------------------------------- reference
def ref_outcome_advantage(records: list[dict], cfg: CWGRPOConfig) -> list[float]:
    groups: dict[str, list[float]] = {}
    for rec in records:
        groups.setdefault(rec["group_id"], []).append(rec["outcome_reward"])
    out = []
    for rec in records:
        rewards, r = groups[rec["group_id"]], rec["outcome_reward"]
        n = len(rewards)
        if n == 1:
            mean = 0.0 if cfg.singleton_policy == "zero_mean_unit_std" else r
            std = 1.0
        else:
            mean = sum(rewards) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (n - cfg.std_ddof))
        out.append((r - mean) / (std + cfg.eps) if cfg.norm_by_std else r - mean)
    return out


def ref_softmax(values: list[float], alpha: float) -> list[float]:
    top = max(values)
    if math.isinf(alpha):
        winners = [x == top for x in values]
        return [w / sum(winners) for w in winners]
    weights = [math.exp(alpha * (x - top)) for x in values]
    return [w / sum(weights) for w in weights]


def ref_cw_grpo(records: list[dict], cfg: CWGRPOConfig) -> tuple[list[list[float]], dict]:
    """Straight from the paper (Designs 1-3), one trajectory at a time."""
    counts = {"redistributed": 0, "null_trajs": 0, "null_turns": 0}
    result = []
    for rec, a in zip(records, ref_outcome_advantage(records, cfg), strict=True):
        u, v = rec["judge_utility"], rec["judge_correct"]
        turns = len(u)
        rounds = turns - 1
        success = rec["outcome_reward"] > 0
        factors = [1.0] * turns
        if rounds == 0:
            result.append([a])
            continue
        if cfg.official_compat:
            p = [(u[t] or 0) * (v[t] or 0) if success else 0 for t in range(turns)]
            if cfg.alpha >= cfg.inf_threshold:
                c = [p[t] / max(sum(p), 1e-6) for t in range(rounds)]
                read = range(turns)
            else:
                c = ref_softmax(p[:rounds], cfg.alpha)
                read = range(rounds)
            nulls = sum(1 for t in read if success and (u[t] is None or v[t] is None))
            if a >= 0:
                counts["redistributed"] += 1
                factors[:rounds] = [ct * rounds for ct in c]
        else:
            nulls = sum(1 for t in range(rounds) if success and (u[t] is None or v[t] is None))
            if success and nulls == 0:
                counts["redistributed"] += 1
                c = ref_softmax([u[t] * v[t] for t in range(rounds)], cfg.alpha)
                factors[:rounds] = [ct * rounds for ct in c]
        counts["null_turns"] += nulls
        counts["null_trajs"] += nulls > 0
        result.append([a * f for f in factors])
    return result, counts


CONFIGS = [
    {},
    {"alpha": 0.0},
    {"alpha": 1.0, "std_ddof": 0},
    {"alpha": 3.0, "singleton_policy": "center"},
    {"alpha": 100.0, "norm_by_std": False},
    {"official_compat": True},
    {"official_compat": True, "alpha": 3.0},
    {"official_compat": True, "alpha": 100.0, "singleton_policy": "center", "std_ddof": 0},
    {"official_compat": True, "alpha": 5.0, "inf_threshold": 2.0, "norm_by_std": False},
    {"official_compat": True, "alpha": 0.0},
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("params", CONFIGS)
def test_matches_loop_reference(seed: int, params: dict) -> None:
    batch = random_batch(
        seed,
        num_groups=12,
        group_size=5,
        max_turns=6,
        singleton_frac=0.2,
        null_frac=0.15,
        binary_reward=seed % 2 == 0,
    )
    out = CW(batch, **params)
    expected, counts = ref_cw_grpo(batch.to_records(), CWGRPOConfig(**params))
    assert_rows(per_traj(out), expected, atol=2e-5)
    assert out.metrics["cw_grpo/redistributed_trajs"] == counts["redistributed"]
    assert out.metrics["cw_grpo/null_judgement_trajs"] == counts["null_trajs"]
    assert out.metrics["cw_grpo/null_judgement_turns"] == counts["null_turns"]


@pytest.mark.parametrize("alpha", [0.0, 2.0, math.inf])
def test_paper_mode_preserves_trajectory_mean(alpha: float) -> None:
    batch = random_batch(7, null_frac=0.0, binary_reward=False)
    out = CW(batch, alpha=alpha)
    outcome = get_estimator("grpo")(batch)
    for row, grpo_row in zip(per_traj(out), per_traj(outcome), strict=True):
        if len(row) > 1:  # Design 3: the mean over the search rounds is A^O
            assert np.mean(row[:-1]) == pytest.approx(grpo_row[0], abs=1e-5)
        assert row[-1] == pytest.approx(grpo_row[0], abs=1e-6)


# ----------------------------------------------------------------------------- degenerate
def test_direct_answers_and_alpha_zero_equal_grpo() -> None:
    batch = random_batch(3, max_turns=1)
    np.testing.assert_allclose(
        CW(batch).turn_values("turn_advantages"),
        get_estimator("grpo")(batch).turn_values("turn_advantages"),
    )
    batch = random_batch(4)
    np.testing.assert_allclose(
        CW(batch, alpha=0.0).turn_values("turn_advantages"),
        get_estimator("grpo")(batch).turn_values("turn_advantages"),
        atol=1e-6,
    )


def test_singleton_group() -> None:
    batch = make_batch(
        [{"reward": 1, "turns": 3, "judge_utility": [1, 0, 0], "judge_correct": [1, 1, 0]}]
    )
    a = 1 / (1 + 1e-6)
    assert_rows(per_traj(CW(batch)), [[2 * a, 0, a]])
    assert_rows(per_traj(CW(batch, singleton_policy="center")), [[0, 0, 0]])


@pytest.mark.parametrize(
    "params",
    [
        {"alpha": -1.0},
        {"alpha": math.nan},
        {"inf_threshold": 0.0},
        {"std_ddof": 2},
        {"eps": -1.0},
        {"singleton_policy": "mean"},
    ],
)
def test_config_validation(params: dict) -> None:
    # NaN is refused by check_fields (TypeError, "takes a number, not NaN"), the rest by range
    with pytest.raises((TypeError, ValueError)):
        CWGRPOConfig(**params)


def test_rejects_non_binary_judgement() -> None:
    batch = make_batch(
        [{"reward": 1, "turns": 2, "judge_utility": [2, 1], "judge_correct": [1, 1]}]
    )
    with pytest.raises(ValueError, match="judge_utility=2"):
        CW(batch)


def test_missing_judge_column_is_a_clear_error() -> None:
    batch = make_batch([{"reward": 1, "turns": 2, "judge_utility": [1, 1]}])
    with pytest.raises(BatchValidationError, match="judge_correct"):
        CW(batch)


def test_pure_and_deterministic() -> None:
    batch = random_batch(11)
    before = batch.table
    first, second = CW(batch, alpha=3.0), CW(batch, alpha=3.0)
    assert batch.table.equals(before) and "turn_advantages" not in batch
    assert batch.metrics == {}
    np.testing.assert_array_equal(
        first.turn_values("turn_advantages"), second.turn_values("turn_advantages")
    )


def test_registered() -> None:
    assert CW.name == "cw_grpo" and CW.config_cls is CWGRPOConfig
    assert set(CW.requires) >= {
        "group_id",
        "outcome_reward",
        "turns",
        "judge_utility",
        "judge_correct",
    }


# name -> reference(rows, config) over batch.to_records(); bench/estimators.py times it.
REFERENCES = {"cw_grpo": lambda rows, config: ref_cw_grpo(rows, config)[0]}
