"""TSPO against hand-computed vectors, the paper's worked example, and a per-group loop reference."""

import math

import numpy as np
import pytest

from ray_credit.estimators import get_estimator
from ray_credit.estimators.tspo import TSPOConfig
from ray_credit.testing import make_batch, random_batch

tspo = get_estimator("tspo")


def advantages(batch):
    return batch.table.column("turn_advantages").to_pylist()


def traj(correct, t_star, turns):
    """A trajectory stated as in the paper: (correct, 1-based t*, number of turns)."""
    contains = [t_star is not None and k + 1 == t_star for k in range(turns)]
    return {"reward": float(correct), "turns": turns, "turn_contains_gold": contains}


def assert_nested(got, want, atol=2e-6):
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=atol)


def test_paper_table2_example():
    # alpha = 1; O1 correct (gold at turn 2), O2 near miss (gold at turn 2), OG never.
    batch = make_batch([traj(True, 2, 4), traj(False, 2, 4), traj(False, None, 4)])
    out = tspo(batch, strategy="all_groups")
    assert out.table.column("turn_rewards").to_pylist() == [
        [1, 1, 1, 1],
        [1, 1, 0, 0],
        [0, 0, 0, 0],
    ]
    adv = np.array(advantages(out))
    np.testing.assert_allclose(adv[:, 0], [0.707105, 0.707105, -1.414211], atol=2e-6)  # turn 1
    np.testing.assert_allclose(adv[:, 2], [1.414211, -0.707105, -0.707105], atol=2e-6)  # turn 3


def test_example_a_padding_with_final_reward():
    batch = make_batch([traj(True, None, 3), traj(False, 2, 3), traj(False, None, 2)])
    out = tspo(batch, alpha=0.5, strategy="all_groups")
    assert out.table.column("turn_rewards").to_pylist() == [[1, 1, 1], [0.5, 0.5, 0], [0, 0]]
    assert_nested(
        advantages(out), [[1.224742, 1.224742, 1.414211], [0, 0, -0.707105], [-1.224742, -1.224742]]
    )


@pytest.mark.parametrize("strategy", ["all_groups", "all_wrong"])
def test_example_b_all_wrong_group(strategy):
    batch = make_batch([traj(False, 1, 2), traj(False, 3, 3), traj(False, None, 1)])
    out = tspo(batch, alpha=0.5, strategy=strategy)
    assert_nested(
        advantages(out), [[0.707104, -0.707104], [0.707104, 1.414208, 1.414208], [-1.414208]]
    )


def test_example_c_all_zero():
    batch = make_batch([traj(False, None, 2), traj(False, None, 3)])
    assert_nested(advantages(tspo(batch)), [[0, 0], [0, 0, 0]], atol=0)


def test_all_wrong_strategy_uses_grpo_on_mixed_groups():
    rows = [traj(True, None, 3), traj(False, 2, 3), traj(False, None, 2)]
    out = tspo(make_batch(rows), alpha=0.5)  # default strategy: all_wrong
    grpo = [1.414211, -0.707105, -0.707105]  # population std, like Eq. (7)
    assert_nested(advantages(out), [[grpo[0]] * 3, [grpo[1]] * 3, [grpo[2]] * 2])
    assert out.metrics["tspo/turn_level_group_frac"] == 0.0


def test_alpha_zero_is_grpo_and_sample_std_option():
    rows = [traj(False, 1, 2), traj(False, 3, 3), traj(False, None, 1)]
    assert_nested(advantages(tspo(make_batch(rows), alpha=0.0)), [[0, 0], [0, 0, 0], [0]], atol=0)
    col = [traj(True, None, 1), traj(True, None, 1), traj(False, None, 1)]
    out = tspo(make_batch(col), strategy="all_groups", std_ddof=1)
    assert_nested(advantages(out), [[0.577349], [0.577349], [-1.154699]])


def test_no_padding_uses_only_real_turns():
    batch = make_batch([traj(True, None, 3), traj(False, 2, 3), traj(False, None, 2)])
    out = tspo(batch, alpha=0.5, strategy="all_groups", padding="none")
    # Column 3 holds only trajectories 1 and 2: rewards [1, 0] -> +-1.
    np.testing.assert_allclose(
        [a[2] for a in advantages(out)[:2]], [0.999999, -0.999999], atol=2e-6
    )


def test_null_contains_gold_is_counted_as_not_contained():
    batch = make_batch(
        [
            {"reward": 0, "turns": 2, "turn_contains_gold": [None, True]},
            {"reward": 0, "turns": 2, "turn_contains_gold": [None, False]},
        ]
    )
    out = tspo(batch)
    assert out.metrics["tspo/null_contains_gold"] == 2.0
    assert out.table.column("turn_rewards").to_pylist() == [[1, 1], [0, 0]]


def test_missing_signal_column_says_who_fills_it():
    with pytest.raises(ValueError, match="turn_contains_gold.*qa.turn_contains_gold"):
        tspo(make_batch([{"reward": 1}]))


@pytest.mark.parametrize(
    "params", [{"alpha": 1.5}, {"strategy": "mixed"}, {"padding": "zero"}, {"std_ddof": 3}]
)
def test_config_validation(params):
    with pytest.raises(ValueError):
        TSPOConfig(**params)


# ---------------------------------------------------------------------- loop reference
def reference(rows, config):
    """Eq. (6), Discussion 1, Eq. (7), Algorithm 1: one group at a time, one turn at a time.

    ``rows`` is ``batch.to_records()``; returns the turn advantages of each row.
    """
    alpha, strategy, eps = config.alpha, config.strategy, config.eps
    ddof, padding = config.std_ddof, config.padding
    groups = {}
    for i, row in enumerate(rows):
        groups.setdefault(row["group_id"], []).append(i)

    def norm(values):
        n = len(values)
        mean = sum(values) / n
        if n - ddof <= 0:
            return [0.0] * n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - ddof))
        return [(v - mean) / (std + eps) for v in values]

    out = [None] * len(rows)
    for members in groups.values():
        rewards = {}
        for i in members:
            outcome = rows[i]["outcome_reward"]
            contains = [bool(c) for c in rows[i]["turn_contains_gold"]]  # null: not contained
            t_star = contains.index(True) if True in contains else None
            rewards[i] = [
                alpha if outcome == 0 and t_star is not None and k <= t_star else outcome
                for k in range(len(contains))
            ]
        all_wrong = all(rows[i]["outcome_reward"] == 0 for i in members)
        if strategy == "all_wrong" and not all_wrong:
            scalar = norm([rows[i]["outcome_reward"] for i in members])
            for i, a in zip(members, scalar, strict=True):
                out[i] = [a] * len(rewards[i])
            continue
        width = max(len(r) for r in rewards.values())
        for i in members:
            out[i] = [None] * len(rewards[i])
        for k in range(width):
            column = []
            for i in members:
                if k < len(rewards[i]):
                    column.append((i, rewards[i][k]))
                elif padding == "final_reward":
                    column.append((i, rewards[i][-1]))
            normalized = norm([v for _, v in column])
            for (i, _), a in zip(column, normalized, strict=True):
                if k < len(rewards[i]):
                    out[i][k] = a
    return out


REFERENCES = {"tspo": reference}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"strategy": "all_groups"},
        {"alpha": 0.5, "std_ddof": 1},
        {"strategy": "all_groups", "padding": "none", "alpha": 0.3},
        {"padding": "none", "std_ddof": 1},  # trajectory-level groups take their own stats
        {"eps": 0.05, "alpha": 0.0},
    ],
)
def test_matches_reference_on_random_batches(seed, params):
    singletons = 0.2 if seed % 2 == 0 else 0.0  # ragged and equal-size group layouts
    batch = random_batch(seed, num_groups=12, singleton_frac=singletons, binary_reward=seed < 2)
    config = TSPOConfig(**params)
    out = tspo(batch, config)
    ref = reference(batch.to_records(), config)
    got = advantages(out)
    for g, w in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert batch.metrics == {} and "turn_advantages" not in batch  # input untouched
    assert out.table.equals(tspo(batch, config).table)  # deterministic


def test_first_occurrence_not_last():
    # Gold at turns 2 and 4 of a wrong trajectory: only turns 1-2 get the partial reward.
    batch = make_batch([{"reward": 0, "turns": 5, "turn_contains_gold": [0, 1, 0, 1, 0]}])
    assert tspo(batch, alpha=0.5).table.column("turn_rewards").to_pylist() == [[0.5, 0.5, 0, 0, 0]]
