"""IGPO: hand-computed vectors, a slow reference loop, degenerate cases, contract."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from ray_credit.batch import BatchValidationError
from ray_credit.estimators import get_estimator
from ray_credit.estimators.igpo import IGPOConfig, igpo, info_gain
from ray_credit.testing import make_batch, random_batch

TOL = 1e-5


def run(batch, **params):
    return get_estimator("igpo")(batch, **params)


def turn_lists(batch, column="turn_advantages"):
    return [row[column] for row in batch.to_records()]


def assert_rows(batch, expected, column="turn_advantages"):
    got = turn_lists(batch, column)
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(row, want, atol=TOL, rtol=0)


# --------------------------------------------------------------------------- vectors
# hand-computed: r = [[0, .2, 0, -.1, 0, 1.0], [0, 0, .05, 0, 0, 0]], row 2 masked at 5.
# Row 1: turns IG .2, IG -.1, outcome 1.0; row 2: turn IG .05, outcome 0.
def vector_batch():
    return make_batch(
        [
            {"reward": 1.0, "turns": 3, "turn_info_gain": [0.2, -0.1, None]},
            {"reward": 0.0, "turns": 2, "turn_info_gain": [0.05, None]},
        ]
    )


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (1.0, [[1.032772, 1.108341, 1.939597], [-1.032772, -0.57936]]),
        (0.9, [[0.747375, 0.914381, 1.939597], [-0.974836, -0.57936]]),
    ],
)
@pytest.mark.parametrize("official_compat", [False, True])
def test_joint_vectors(gamma, expected, official_compat):
    # No normalized value is 0 here, so both boundary rules agree.
    assert_rows(run(vector_batch(), gamma=gamma, official_compat=official_compat), expected)


def test_joint_hand_check():
    out = run(vector_batch())
    assert_rows(out, [[0.2, -0.1, 1.0], [0.05, 0.0]], column="turn_rewards")
    # Pool {.2, -.1, 1, .05, 0}: mean .23, population std .396989.
    std = math.sqrt(np.var([0.2, -0.1, 1.0, 0.05, 0.0]) + 1e-8) + 1e-6
    n = [(x - 0.23) / std for x in (0.2, -0.1, 1.0, 0.05, 0.0)]
    assert_rows(out, [[n[0] + n[1] + n[2], n[1] + n[2], n[2]], [n[3] + n[4], n[4]]])


@pytest.mark.parametrize(
    ("gamma", "expected"),
    [
        (1.0, [[0.999998, -0.224736, 0.999998], [-0.999998, -0.999998]]),
        (0.9, [[0.932472, -0.324736, 0.999998], [-0.999998, -0.999998]]),
    ],
)
def test_separate_vectors_official(gamma, expected):
    # Row 2's IG .05 is the mean of the group's IGs: normalized to exactly 0, so in the
    # official code it is no boundary and merges into the answer turn.
    out = run(vector_batch(), norm_mode="separate", gamma=gamma, official_compat=True)
    assert_rows(out, expected)
    assert out.metrics["igpo/merged_turns"] == 1


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_separate_paper_mode_by_hand(gamma):
    out = run(vector_batch(), norm_mode="separate", gamma=gamma)
    outcome = 0.5 / (math.sqrt(0.25 + 1e-8) + 1e-6)  # outcomes {1, 0}
    ig = 0.15 / (math.sqrt(0.015 + 1e-8) + 1e-6)  # IGs {.2, -.1, .05}: deviations .15, -.15, 0
    row1 = [ig + gamma * (-ig + gamma * outcome), -ig + gamma * outcome, outcome]
    # Row 2's IG turn normalizes to 0 but stays a boundary: 0 + gamma * A_answer.
    row2 = [gamma * -outcome, -outcome]
    assert_rows(out, [row1, row2])
    assert out.metrics["igpo/merged_turns"] == 0
    if gamma == 0.9:
        np.testing.assert_allclose(row2[0], -0.8999982, atol=TOL)


@pytest.mark.parametrize("gain", [1e-10, 0.0])
def test_zero_info_gain_is_a_reward(gain):
    # r = [[0, 1e-10, 0, 1], [0, .3, 0, 0]]; our schema stores a zero gain as 0.0 (not null).
    batch = make_batch(
        [
            {"reward": 1.0, "turns": 2, "turn_info_gain": [gain, None]},
            {"reward": 0.0, "turns": 2, "turn_info_gain": [0.3, None]},
        ]
    )
    expected = [[0.856784, 1.652369], [-0.856784, -0.795585]]
    for compat in (False, True):
        out = run(batch, official_compat=compat)
        assert_rows(out, expected)
        assert out.metrics["igpo/missing_info_gain"] == 0


@pytest.mark.parametrize("official_compat", [False, True])
def test_equal_outcomes_in_separate(official_compat):
    # r = [[0, .2, 0, 1], [0, -.2, 0, 1]]: the answer turns normalize to 0 and get 0.
    batch = make_batch(
        [
            {"reward": 1.0, "turns": 2, "turn_info_gain": [0.2, None]},
            {"reward": 1.0, "turns": 2, "turn_info_gain": [-0.2, None]},
        ]
    )
    out = run(batch, norm_mode="separate", official_compat=official_compat)
    assert_rows(out, [[0.999995, 0.0], [-0.999995, 0.0]])
    assert out.metrics["igpo/merged_turns"] == (2 if official_compat else 0)


def test_info_gain_vector():
    prev, cur = np.mean([-2.0, -1.0]), np.mean([-0.5, -0.3])
    np.testing.assert_allclose(info_gain(prev, cur), 0.44719, atol=TOL)
    np.testing.assert_allclose(info_gain(prev, cur, mode="log_prob_diff"), 1.1, atol=1e-12)
    # Vectorized, and the chain of gains telescopes to the total change.
    m = np.array([-3.0, -2.0, -0.5, -0.1])
    np.testing.assert_allclose(info_gain(m[:-1], m[1:]).sum(), np.exp(m[-1]) - np.exp(m[0]))
    with pytest.raises(ValueError, match="mode"):
        info_gain(0.0, 1.0, mode="prob")


# --------------------------------------------------------------------------- reference
def normalize(values, ddof, eps, var_eps):
    n = len(values)
    if n <= 1:
        return [0.0] * n
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - ddof)
    std = math.sqrt(var + var_eps)
    return [(v - mean) / (std + eps) for v in values]


def reference_igpo(
    batch,
    *,
    gamma=1.0,
    norm_mode="joint",
    official_compat=False,
    eps=1e-6,
    std_ddof=0,
    var_eps=1e-8,
):
    """Straight from Eq. (4)-(5), one group and one trajectory at a time."""
    # A batch, or its records already converted (the bench times the loop alone).
    records = batch if isinstance(batch, list) else batch.to_records()
    groups = defaultdict(list)
    for i, rec in enumerate(records):
        groups[rec["group_id"]].append(i)
    normalized = {}  # (traj, turn) -> normalized reward
    for members in groups.values():
        pools = defaultdict(list)  # pool name -> [((traj, turn), reward)]
        for i in members:
            gains = records[i]["turn_info_gain"]
            last = len(gains) - 1
            for k, gain in enumerate(gains):
                if k == last:
                    kind, reward = "outcome", records[i]["outcome_reward"]
                elif gain is not None:
                    kind, reward = "ig", gain
                else:
                    continue
                pools["all" if norm_mode == "joint" else kind].append(((i, k), reward))
        for pool in pools.values():
            values = normalize([r for _, r in pool], std_ddof, eps, var_eps)
            normalized.update(zip([key for key, _ in pool], values, strict=True))
    result = []
    for i, rec in enumerate(records):
        turns = len(rec["turn_info_gain"])
        advantages = [0.0] * turns
        running = 0.0
        for k in reversed(range(turns)):
            n = normalized.get((i, k))
            if official_compat:
                if n is not None and n != 0.0:
                    running = n + gamma * running
            else:
                running = (n or 0.0) + gamma * running
            advantages[k] = running
        result.append(advantages)
    return result


CONFIGS = [
    {},
    {"gamma": 0.9},
    {"norm_mode": "separate"},
    {"norm_mode": "separate", "gamma": 0.7, "official_compat": True},
    {"official_compat": True, "gamma": 0.95},
    {"norm_mode": "separate", "official_compat": True},
    {"std_ddof": 1, "eps": 1e-4, "var_eps": 0.0, "gamma": 0.5},
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("params", CONFIGS)
def test_matches_reference_loop(seed, params):
    batch = random_batch(
        seed,
        num_groups=12,
        group_size=5,
        max_turns=6,
        singleton_frac=0.2,
        null_frac=0.15,
        binary_reward=seed % 2 == 0,
    )
    out = run(batch, **params)
    expected = reference_igpo(batch, **params)
    assert_rows(out, expected)


def test_reference_sees_merging():
    # A guard that the reference and the two modes really differ where they should.
    batch = random_batch(5, num_groups=20, group_size=4, max_turns=6, null_frac=0.3)
    paper = reference_igpo(batch, gamma=0.8)
    compat = reference_igpo(batch, gamma=0.8, official_compat=True)
    assert any(not np.allclose(a, b) for a, b in zip(paper, compat, strict=True))
    assert run(batch, gamma=0.8, official_compat=True).metrics["igpo/merged_turns"] > 0


# --------------------------------------------------------------------------- degenerate
def test_null_and_final_gains_are_counted():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 3, "turn_info_gain": [None, 0.4, 0.9]},
            {"group": "a", "reward": 0.0, "turns": 3, "turn_info_gain": [0.1, None, None]},
        ]
    )
    out = run(batch, gamma=0.5)
    assert out.metrics["igpo/missing_info_gain"] == 2
    assert out.metrics["igpo/final_turn_info_gain_ignored"] == 1
    assert_rows(out, [[0.0, 0.4, 1.0], [0.1, 0.0, 0.0]], column="turn_rewards")
    assert_rows(out, reference_igpo(batch, gamma=0.5))


def test_singletons_and_equal_groups():
    batch = make_batch(
        [
            {"group": "one", "reward": 1.0, "turns": 1, "turn_info_gain": [None]},
            {"group": "eq", "reward": 0.5, "turns": 2, "turn_info_gain": [0.5, None]},
            {"group": "eq", "reward": 0.5, "turns": 2, "turn_info_gain": [0.5, None]},
            {"group": "sep", "reward": 1.0, "turns": 2, "turn_info_gain": [0.3, None]},
        ]
    )
    for mode in ("joint", "separate"):
        rows = turn_lists(run(batch, norm_mode=mode))
        np.testing.assert_array_equal(rows[0] + rows[1] + rows[2], [0.0] * 5)
    assert_rows(run(batch, norm_mode="separate"), [[0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # "separate": the lone trajectory's IG and outcome are each a pool of one.
    assert run(batch, norm_mode="separate").metrics["igpo/singleton_pool_rewards"] == 3
    # "joint": the lone trajectory's two rewards form one pool and are not zero.
    joint = turn_lists(run(batch, gamma=0.5))[3]
    np.testing.assert_allclose(joint, [-0.5, 1.0], atol=TOL)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"gamma": 1.5}, "gamma"),
        ({"gamma": -0.1}, "gamma"),
        ({"norm_mode": "pooled"}, "norm_mode"),
        ({"std_ddof": 2}, "std_ddof"),
        ({"eps": -1.0}, "eps"),
        ({"var_eps": -1e-8}, "var_eps"),
    ],
)
def test_config_validation(params, match):
    with pytest.raises(ValueError, match=match):
        IGPOConfig(**params)


def test_unknown_parameter_and_missing_column():
    batch = make_batch([{"reward": 1.0, "turns": 2}])
    with pytest.raises(TypeError, match="unknown parameter"):
        run(vector_batch(), alpha=1.0)
    with pytest.raises(BatchValidationError, match="turn_info_gain"):
        run(batch)


# --------------------------------------------------------------------------- contract
def test_pure_and_deterministic():
    batch = random_batch(7, num_groups=6, group_size=4)
    before = batch.table
    first = run(batch, norm_mode="separate", gamma=0.9)
    second = igpo(batch, IGPOConfig(norm_mode="separate", gamma=0.9))
    assert batch.table.equals(before) and "turn_advantages" not in batch
    np.testing.assert_array_equal(
        first.turn_values("turn_advantages"), second.turn_values("turn_advantages")
    )
    assert first.turn_values("turn_advantages").dtype == np.float32


def test_registered():
    estimator = get_estimator("igpo")
    assert estimator.config_cls is IGPOConfig
    assert set(estimator.requires) >= {"group_id", "outcome_reward", "turns", "turn_info_gain"}


# name -> reference(rows, config) over batch.to_records(); bench/estimators.py times it.
REFERENCES = {
    "igpo": lambda rows, c: reference_igpo(
        rows,
        gamma=c.gamma,
        norm_mode=c.norm_mode,
        official_compat=c.official_compat,
        eps=c.eps,
        std_ddof=c.std_ddof,
        var_eps=c.var_eps,
    )
}
