"""A2TGPO: hand-computed vectors, a slow reference loop, degenerate cases, contract."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from ray_credit.batch import BatchValidationError, TrajectoryBatch
from ray_credit.estimators import get_estimator
from ray_credit.estimators.a2tgpo import A2TGPOConfig, a2tgpo
from ray_credit.testing import make_batch, random_batch

TOL = 1e-5


def run(batch, **params):
    return get_estimator("a2tgpo")(batch, **params)


def turn_lists(batch, column="turn_advantages"):
    return [row[column] for row in batch.to_records()]


def assert_rows(batch, expected, column="turn_advantages"):
    got = turn_lists(batch, column)
    assert len(got) == len(expected)
    for row, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(row, want, atol=TOL, rtol=0)


# --------------------------------------------------------------------------- vectors
# hand-computed: r = [[0, .3, 0, .1, 0, 1], [0, 0, .1, 0, 0, 0], [0, -.1, 0, .2, 0, 0]],
# row 2 masked at 5. Rows: (IG .3, IG .1, outcome 1), (IG .1, outcome 0), (IG -.1, IG .2, 0).
def vector_batch():
    return make_batch(
        [
            {"reward": 1.0, "turns": 3, "turn_info_gain": [0.3, 0.1, None]},
            {"reward": 0.0, "turns": 2, "turn_info_gain": [0.1, None]},
            {"reward": 0.0, "turns": 3, "turn_info_gain": [-0.1, 0.2, None]},
        ]
    )


VECTOR_CLIP = [[1.163738, 0.861367, 1.0], [1.0, 1.0], [0.836262, 1.138633, 1.0]]


@pytest.mark.parametrize("official_compat", [False, True])
def test_turn_group_vector_gamma_1(official_compat):
    out = run(vector_batch(), official_compat=official_compat)
    assert_rows(
        out,
        [[1.461889, 1.114217, 1.41421], [-0.707105, -0.707105], [-0.754784, -0.407112, -0.707105]],
    )
    assert_rows(out, VECTOR_CLIP, column="turn_clip_scale")
    # Hand check: 0.3 * (1.224745 - 1) / sqrt(2) + 1.41421.
    np.testing.assert_allclose(
        turn_lists(out)[0][0], 0.3 * (1.224745 - 1) / math.sqrt(2) + 1.41421, atol=TOL
    )


def test_turn_group_vector_gamma_09():
    out = run(vector_batch(), gamma=0.9)
    assert_rows(
        out,
        [[1.483102, 1.114217, 1.41421], [-0.707105, -0.707105], [-0.775997, -0.407112, -0.707105]],
    )
    assert_rows(out, VECTOR_CLIP, column="turn_clip_scale")


def test_joint_vector():
    out = run(vector_batch(), norm_mode="joint")
    assert_rows(
        out,
        [[2.468846, 2.16024, 2.468846], [-0.925817, -0.617211], [-1.543029, -0.617211, -0.617211]],
    )
    assert_rows(out, [[1.0] * 3, [1.0] * 2, [1.0] * 3], column="turn_clip_scale")


@pytest.mark.parametrize("norm_mode", ["joint", "separate"])
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_joint_and_separate_are_igpo_with_paper_boundaries(norm_mode, gamma):
    batch = random_batch(3, num_groups=10, group_size=4, max_turns=5, null_frac=0.2)
    ours = run(batch, norm_mode=norm_mode, gamma=gamma, official_compat=True)
    igpo = get_estimator("igpo")(batch, norm_mode=norm_mode, gamma=gamma)
    np.testing.assert_array_equal(
        ours.turn_values("turn_advantages"), igpo.turn_values("turn_advantages")
    )
    assert ours.metrics["a2tgpo/missing_info_gain"] == igpo.metrics["igpo/missing_info_gain"]


def test_turn_key_position_vs_ig_ordinal():
    # Row A has no IG at turn 0, so its IG .3 is at position 1 but is its 0th IG turn.
    batch = make_batch(
        [
            {"reward": 1.0, "turns": 3, "turn_info_gain": [None, 0.3, None]},
            {"reward": 0.0, "turns": 3, "turn_info_gain": [0.1, 0.5, None]},
        ]
    )
    o = 0.5 / (math.sqrt(0.25 + 1e-8) + 1e-6)  # outcomes {1, 0}
    z = 0.1 / (math.sqrt(0.01 + 1e-8) + 1e-6)  # a pair of IGs 0.2 apart
    s = 0.3 * math.tanh(z / 2)  # beta * (2 sigmoid(z) - 1)
    gamma = 0.9
    # Paper: position groups {B: .1} (singleton -> 0) and {A: .3, B: .5} -> A -z, B +z.
    paper = run(batch, gamma=gamma)
    assert_rows(
        paper, [[o, 0.3 * -z + o, o], [0.3 * gamma * z / math.sqrt(2) - o, 0.3 * z - o, -o]]
    )
    assert_rows(paper, [[1, 1 - s, 1], [1, 1 + s, 1]], column="turn_clip_scale")
    assert paper.metrics["a2tgpo/singleton_turn_group_gains"] == 1
    assert paper.metrics["a2tgpo/missing_info_gain"] == 1
    # Code copy: ordinal groups {A: .3, B: .1} -> A +z, B -z, and {B: .5} -> 0; A's first
    # turn has no IG, so no boundary: its tokens join A's IG turn's segment.
    compat = run(batch, gamma=gamma, official_compat=True)
    assert_rows(compat, [[0.3 * z + o, 0.3 * z + o, o], [0.3 * -z / math.sqrt(2) - o, -o, -o]])
    assert_rows(compat, [[1 + s, 1 + s, 1], [1 - s, 1, 1]], column="turn_clip_scale")
    assert compat.metrics["a2tgpo/merged_turns"] == 1
    assert paper.metrics["a2tgpo/merged_turns"] == 0


def test_zero_info_gain_is_an_ig_turn_in_the_paper_and_dropped_by_the_code():
    # One group: A [search, answer] and B the same, both outcome 0; IG 0.25 on A's
    # search, exactly 0.0 on B's. The code's IG mask is "reward != 0": B's search is no
    # IG turn, A's is alone in its turn group, and every advantage is 0 (the official
    # figure). The paper's turn group {0.25, 0} normalizes to +-1.
    batch = make_batch(
        [
            {"reward": 0.0, "turns": 2, "turn_info_gain": [0.25, None]},
            {"reward": 0.0, "turns": 2, "turn_info_gain": [0.0, None]},
        ]
    )
    compat = run(batch, official_compat=True)
    assert_rows(compat, [[0.0, 0.0], [0.0, 0.0]])
    assert_rows(compat, [[1.0, 1.0], [1.0, 1.0]], column="turn_clip_scale")
    assert compat.metrics["a2tgpo/zero_info_gain_dropped"] == 1
    assert compat.metrics["a2tgpo/merged_turns"] == 1
    paper = run(batch)
    g = 0.125 / (math.sqrt(0.125**2 + 1e-8) + 1e-6)  # ~1
    c = 0.3 * math.tanh(g / 2)
    assert_rows(paper, [[0.3 * g, 0.0], [-0.3 * g, 0.0]])  # [0.3, 0] and [-0.3, 0]
    assert_rows(paper, [[1 + c, 1.0], [1 - c, 1.0]], column="turn_clip_scale")  # 1.1386
    assert paper.metrics["a2tgpo/zero_info_gain_dropped"] == 0


# --------------------------------------------------------------------------- reference
def normalize(values, ddof, eps, var_eps):
    n = len(values)
    if n <= 1:
        return [0.0] * n
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - ddof)
    std = math.sqrt(var + var_eps)
    return [(v - mean) / (std + eps) for v in values]


def reference_turn_group(
    batch,
    *,
    gamma=1.0,
    ig_weight=0.3,
    clip_beta=0.3,
    eps=1e-6,
    std_ddof=0,
    var_eps=1e-8,
    official_compat=False,
):
    """Straight from Eq. (6)-(11), one group, turn group and trajectory at a time."""
    # A batch, or its records already converted (the bench times the loop alone).
    records = batch if isinstance(batch, list) else batch.to_records()
    ig_turns = []  # per trajectory: the positions of its IG turns, in order
    for rec in records:
        gains = rec["turn_info_gain"]
        # the code's IG mask is "reward != 0": an IG of exactly 0 is no IG turn there
        dropped = (None, 0.0) if official_compat else (None,)
        ig_turns.append([k for k in range(len(gains) - 1) if gains[k] not in dropped])

    groups = defaultdict(list)
    for i, rec in enumerate(records):
        groups[rec["group_id"]].append(i)
    outcome_adv, g_hat = {}, {}
    for members in groups.values():
        outcomes = [records[i]["outcome_reward"] for i in members]
        outcome_adv.update(zip(members, normalize(outcomes, std_ddof, eps, var_eps), strict=True))
        turn_groups = defaultdict(list)  # turn index -> [((traj, position), gain)]
        for i in members:
            for ordinal, k in enumerate(ig_turns[i]):
                index = ordinal if official_compat else k
                turn_groups[index].append(((i, k), records[i]["turn_info_gain"][k]))
        for entries in turn_groups.values():
            values = normalize([g for _, g in entries], std_ddof, eps, var_eps)
            g_hat.update(zip([key for key, _ in entries], values, strict=True))

    advantages, clips = [], []
    for i, rec in enumerate(records):
        turns = len(rec["turn_info_gain"])
        adv, clip = [outcome_adv[i]] * turns, [1.0] * turns
        positions = ig_turns[i]
        n = len(positions)
        for a, k in enumerate(positions):
            total = sum(gamma ** (b - a) * g_hat[(i, positions[b])] for b in range(a, n))
            adv[k] = ig_weight * total / math.sqrt(n - a) + outcome_adv[i]
            sigmoid = 1.0 / (1.0 + math.exp(-g_hat[(i, k)]))
            clip[k] = 1.0 + clip_beta * (2.0 * sigmoid - 1.0)
        if official_compat:  # a turn with no boundary of its own joins the next segment
            for k in reversed(range(turns - 1)):
                if k not in positions:
                    adv[k], clip[k] = adv[k + 1], clip[k + 1]
        advantages.append(adv)
        clips.append(clip)
    return advantages, clips


CONFIGS = [
    {},
    {"gamma": 0.9},
    {"official_compat": True},
    {"official_compat": True, "gamma": 0.7, "ig_weight": 1.0, "clip_beta": 0.5},
    {"std_ddof": 1, "eps": 1e-4, "var_eps": 0.0, "gamma": 0.5, "ig_weight": 0.0},
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
    advantages, clips = reference_turn_group(batch, **params)
    assert_rows(out, advantages)
    assert_rows(out, clips, column="turn_clip_scale")


@pytest.mark.parametrize("official_compat", [False, True])
def test_matches_reference_loop_with_zero_gains(official_compat):
    records = random_batch(11, num_groups=12, group_size=5, max_turns=6).to_records()
    rng = np.random.default_rng(0)
    for rec in records:  # about a third of the gains exactly 0
        rec["turn_info_gain"] = [
            0.0 if g is not None and rng.random() < 0.3 else g for g in rec["turn_info_gain"]
        ]
    batch = TrajectoryBatch.from_records(records)
    out = run(batch, official_compat=official_compat, gamma=0.8)
    advantages, clips = reference_turn_group(batch, official_compat=official_compat, gamma=0.8)
    assert_rows(out, advantages)
    assert_rows(out, clips, column="turn_clip_scale")
    assert (out.metrics["a2tgpo/zero_info_gain_dropped"] > 0) == official_compat


def test_reference_sees_turn_keys():
    # A guard that the two turn keys really differ on random batches with null gains.
    batch = random_batch(5, num_groups=20, group_size=4, max_turns=6, null_frac=0.3)
    paper, _ = reference_turn_group(batch)
    compat, _ = reference_turn_group(batch, official_compat=True)
    assert any(not np.allclose(a, b) for a, b in zip(paper, compat, strict=True))


# --------------------------------------------------------------------------- degenerate
def test_null_and_final_gains_are_counted():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 3, "turn_info_gain": [None, 0.4, 0.9]},
            {"group": "a", "reward": 0.0, "turns": 3, "turn_info_gain": [0.1, None, None]},
        ]
    )
    for mode in ("turn_group", "joint", "separate"):
        out = run(batch, norm_mode=mode)
        assert out.metrics["a2tgpo/missing_info_gain"] == 2
        assert out.metrics["a2tgpo/final_turn_info_gain_ignored"] == 1
    advantages, clips = reference_turn_group(batch)
    assert_rows(run(batch), advantages)
    assert_rows(run(batch), clips, column="turn_clip_scale")


def test_singletons_and_equal_groups():
    batch = make_batch(
        [
            {"group": "one", "reward": 1.0, "turns": 3, "turn_info_gain": [0.2, -0.4, None]},
            {"group": "eq", "reward": 1.0, "turns": 2, "turn_info_gain": [0.5, None]},
            {"group": "eq", "reward": 1.0, "turns": 2, "turn_info_gain": [0.5, None]},
        ]
    )
    out = run(batch)
    assert_rows(out, [[0.0] * 3, [0.0] * 2, [0.0] * 2])
    assert_rows(out, [[1.0] * 3, [1.0] * 2, [1.0] * 2], column="turn_clip_scale")
    assert out.metrics["a2tgpo/singleton_turn_group_gains"] == 2


def test_no_info_gain_at_all_is_grpo_with_population_std():
    batch = make_batch(
        [
            {"reward": 1.0, "turns": 3, "turn_info_gain": [None, None, None]},
            {"reward": 0.0, "turns": 1, "turn_info_gain": [None]},
        ]
    )
    out = run(batch)
    o = 0.5 / (math.sqrt(0.25 + 1e-8) + 1e-6)
    assert_rows(out, [[o] * 3, [-o]])
    assert out.metrics["a2tgpo/missing_info_gain"] == 2


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"gamma": 1.5}, "gamma"),
        ({"ig_weight": -0.1}, "ig_weight"),
        ({"clip_beta": 1.0}, "clip_beta"),
        ({"clip_beta": -0.1}, "clip_beta"),
        ({"norm_mode": "turn-group"}, "norm_mode"),
        ({"std_ddof": 2}, "std_ddof"),
        ({"eps": -1.0}, "eps"),
        ({"var_eps": -1e-8}, "var_eps"),
    ],
)
def test_config_validation(params, match):
    with pytest.raises(ValueError, match=match):
        A2TGPOConfig(**params)


def test_missing_column():
    with pytest.raises(BatchValidationError, match="turn_info_gain"):
        run(make_batch([{"reward": 1.0, "turns": 2}]))


# --------------------------------------------------------------------------- contract
def test_pure_and_deterministic():
    batch = random_batch(7, num_groups=6, group_size=4)
    before = batch.table
    first = run(batch, gamma=0.9)
    second = a2tgpo(batch, A2TGPOConfig(gamma=0.9))
    assert batch.table.equals(before) and "turn_clip_scale" not in batch
    for column in ("turn_advantages", "turn_clip_scale"):
        np.testing.assert_array_equal(first.turn_values(column), second.turn_values(column))
        assert first.turn_values(column).dtype == np.float32


def test_registered():
    estimator = get_estimator("a2tgpo")
    assert estimator.config_cls is A2TGPOConfig
    assert set(estimator.requires) >= {"group_id", "outcome_reward", "turns", "turn_info_gain"}


# name -> reference(rows, config) over batch.to_records(); bench/estimators.py times it.
REFERENCES = {
    "a2tgpo": lambda rows, c: reference_turn_group(
        rows,
        gamma=c.gamma,
        ig_weight=c.ig_weight,
        clip_beta=c.clip_beta,
        eps=c.eps,
        std_ddof=c.std_ddof,
        var_eps=c.var_eps,
        official_compat=c.official_compat,
    )[0]
}
