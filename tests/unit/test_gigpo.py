"""Unit tests for the GiGPO estimator (hand-computed vectors)."""

from __future__ import annotations

import dataclasses
import math
from difflib import SequenceMatcher

import numpy as np
import pyarrow as pa
import pytest

from ray_credit.batch import TURN_STRUCT, TrajectoryBatch
from ray_credit.estimators import get_estimator
from ray_credit.estimators.gigpo import GiGPOConfig, anchor_groups, gigpo
from ray_credit.testing import make_batch, random_batch

ATOL = 1e-5
GIGPO = get_estimator("gigpo")
PARIS_DOT = "Doc 1: Paris is the capital of France."
PARIS_BANG = "Doc 1: Paris is the capital of France!"
UNRELATED = "Doc 3: The Amazon river flows through Brazil and Peru."


def trajectory(traj_id, reward, steps, *, group="g0", question="Q"):
    """``steps`` is a list of (action, observation) pairs, one per turn."""
    return {
        "group_id": group,
        "traj_id": traj_id,
        "question": question,
        "gold_answers": ["gold"],
        "turns": [{"action": a, "observation": o, "policy_version": 0} for a, o in steps],
        "outcome_reward": float(reward),
    }


def vector_batch(a_actions=("search", "search", "answer")) -> TrajectoryBatch:
    """Hand-computed: A has 3 turns and succeeds, B has 2 and fails; anchors [Q,o1,o2|Q,o1]."""
    a_obs = ("o1", "o2", None)
    return TrajectoryBatch.from_records(
        [
            trajectory("A", 1.0, list(zip(a_actions, a_obs, strict=True))),
            trajectory("B", 0.0, [("search", "o1"), ("answer", None)]),
        ]
    )


def advantages(batch: TrajectoryBatch, **params) -> np.ndarray:
    return GIGPO(batch, **params).turn_values("turn_advantages").astype(np.float64)


def close(actual, expected, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- hand-computed


def test_step_returns_and_anchor_groups():
    batch = vector_batch()
    out = GIGPO(batch)
    close(out.turn_values("turn_rewards"), [0.9025, 0.95, 1.0, 0.0, 0.0])
    codes, count, nulls = anchor_groups(batch, GiGPOConfig())
    assert codes.tolist() == [0, 1, 2, 0, 1] and count == 3 and nulls == 0
    metrics = out.metrics
    assert metrics["gigpo/anchor_groups"] == 3
    assert metrics["gigpo/singleton_anchor_groups"] == 1
    assert metrics["gigpo/invalid_turns"] == 0
    assert metrics["gigpo/null_anchors"] == 0


def test_mean_norm_vector():
    close(advantages(vector_batch()), [0.85125, 0.875, 0.4, -1.05125, -1.075])


def test_mean_std_norm_vector():
    expected = [1.437401, 1.437401, 0.730295, -1.802549, -1.802549]
    close(advantages(vector_batch(), mode="mean_std_norm"), expected)


@pytest.mark.parametrize(
    ("cross_steps", "expected"),
    [(True, [0.730295] * 3 + [-1.095443] * 2), (False, [0.707106] * 3 + [-0.707106] * 2)],
)
def test_episode_term_alone(cross_steps, expected):
    got = advantages(vector_batch(), mode="mean_std_norm", step_weight=0.0, cross_steps=cross_steps)
    close(got, expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("mean_std_norm", [0.707106, 0.707106, 0.0, -0.707106, -0.707106]),
        ("mean_norm", [0.45125, 0.475, 0.0, -0.45125, -0.475]),
    ],
)
def test_step_term_alone(mode, expected):
    batch = vector_batch()
    step_term = advantages(batch, mode=mode) - advantages(batch, mode=mode, step_weight=0.0)
    close(step_term, expected)
    # omega scales only the step term.
    half = advantages(batch, mode=mode, step_weight=0.5) - advantages(
        batch, mode=mode, step_weight=0.0
    )
    close(half, 0.5 * np.asarray(expected))


def test_similarity_grouping_vector():
    assert SequenceMatcher(None, PARIS_BANG, PARIS_DOT).ratio() == pytest.approx(0.9737, abs=1e-4)
    steps = [("search", PARIS_DOT), ("search", PARIS_BANG), ("search", UNRELATED), ("answer", None)]
    batch = TrajectoryBatch.from_records([trajectory("A", 1.0, steps)])
    # Anchors: [Q, PARIS_DOT, PARIS_BANG, UNRELATED].
    similar, count, _ = anchor_groups(
        batch, GiGPOConfig(enable_similarity=True, similarity_threshold=0.9)
    )
    assert similar.tolist() == [0, 1, 1, 2] and count == 3
    strict, _, _ = anchor_groups(
        batch, GiGPOConfig(enable_similarity=True, similarity_threshold=0.99)
    )
    assert strict.tolist() == [0, 1, 2, 3]
    exact, _, _ = anchor_groups(batch, GiGPOConfig(similarity_threshold=0.9))  # similarity off
    assert exact.tolist() == [0, 1, 2, 3]


def test_invalid_action_penalty_is_not_propagated():
    # A's middle turn is invalid: its return 0.95 -> 0.94 and its episode reward 1 -> 0.99;
    # A's first turn keeps 0.9025. Episode mean (1 + 0.99 + 1 + 0 + 0) / 5 = 0.598.
    batch = vector_batch(a_actions=("search", "invalid", "answer"))
    out = GIGPO(batch, invalid_action_penalty=0.01)
    close(out.turn_values("turn_rewards"), [0.9025, 0.94, 1.0, 0.0, 0.0])
    close(out.turn_values("turn_advantages"), [0.85325, 0.862, 0.402, -1.04925, -1.068])
    assert out.metrics["gigpo/invalid_turns"] == 1
    # No penalty: an invalid action changes nothing.
    close(advantages(batch), [0.85125, 0.875, 0.4, -1.05125, -1.075])


def test_episode_statistic_without_cross_steps_is_the_first_rows_penalized_score():
    # verl-agent's figure for one group: A [invalid, answer] and B [answer], both outcome
    # 0, penalty 0.1, mean_std_norm, one row per trajectory (A's first row, -0.1; B's, 0)
    # for the statistics. Normalizing by the unpenalized outcomes (std 0) gave -100001.
    batch = TrajectoryBatch.from_records(
        [
            trajectory("A", 0.0, [("invalid", "fix your action"), ("answer", None)]),
            trajectory("B", 0.0, [("answer", None)]),
        ]
    )
    out = GIGPO(batch, mode="mean_std_norm", invalid_action_penalty=0.1, cross_steps=False)
    z = 0.05 / (math.sqrt(0.005) + 1e-6)  # (s - mean) / (sample std + eps) for {-0.1, 0}
    close(out.turn_values("turn_advantages"), [-2 * z, z, 2 * z])  # [-1.414, 0.707, 1.414]
    assert out.metrics["gigpo/episode_zero_std_rows"] == 0


def test_rows_normalized_by_a_zero_std_are_counted():
    # First rows all score 0, so the group's std is 0; A's penalized second row is then
    # divided by eps alone, as in verl-agent: counted, not hidden.
    batch = TrajectoryBatch.from_records(
        [
            trajectory("A", 0.0, [("search", "doc"), ("invalid", None)]),
            trajectory("B", 0.0, [("answer", None)]),
        ]
    )
    out = GIGPO(batch, mode="mean_std_norm", invalid_action_penalty=0.1, cross_steps=False)
    assert out.metrics["gigpo/episode_zero_std_rows"] == 1
    assert (
        GIGPO(batch, mode="mean_std_norm", invalid_action_penalty=0.1).metrics[
            "gigpo/episode_zero_std_rows"
        ]
        == 0
    )


# ----------------------------------------------------------------------------- reference loop


def _mean(values):
    return sum(values) / len(values)


def _std(values, ddof):
    mu = _mean(values)
    dof = len(values) - ddof
    return math.sqrt(sum((v - mu) ** 2 for v in values) / dof) if dof > 0 else 0.0


def reference_gigpo(batch: TrajectoryBatch, cfg: GiGPOConfig):
    """Slow per-group loop, straight from the paper and the official row-by-row clustering."""
    # A batch, or its records already converted (the bench times the loop alone).
    records = batch if isinstance(batch, list) else batch.to_records()
    members: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        members.setdefault(rec["group_id"], []).append(i)
    adv = [[0.0] * len(rec["turns"]) for rec in records]
    ret = [[0.0] * len(rec["turns"]) for rec in records]
    for group in members.values():
        rows = []
        for i in group:
            rec, turns = records[i], records[i]["turns"]
            running = 0.0
            returns = [0.0] * len(turns)
            for k in reversed(range(len(turns))):
                reward = rec["outcome_reward"] if k == len(turns) - 1 else 0.0
                running = reward + cfg.gamma * running
                returns[k] = running
            for k, turn in enumerate(turns):
                pen = cfg.invalid_action_penalty if turn["action"] == "invalid" else 0.0
                anchor = rec["question"] if k == 0 else turns[k - 1]["observation"]
                rows.append(
                    {
                        "i": i,
                        "k": k,
                        "anchor": "" if anchor is None else anchor,
                        "ret": returns[k] - pen,
                        "score": rec["outcome_reward"] - pen,
                    }
                )
        if cfg.cross_steps:
            values = [row["score"] for row in rows]
        else:  # one value per trajectory: its first row's score (verl-agent)
            values = [row["score"] for row in rows if row["k"] == 0]
        mu, sd = (0.0, 1.0) if len(values) == 1 else (_mean(values), _std(values, cfg.std_ddof))
        clusters: list[dict] = []
        for row in rows:
            for cl in clusters:
                if cfg.enable_similarity:
                    same = (
                        SequenceMatcher(None, row["anchor"], cl["rep"]).ratio()
                        >= cfg.similarity_threshold
                    )
                else:
                    same = row["anchor"] == cl["rep"]
                if same:
                    cl["rows"].append(row)
                    break
            else:
                clusters.append({"rep": row["anchor"], "rows": [row]})
        for cl in clusters:
            rets = [row["ret"] for row in cl["rows"]]
            s_mu, s_sd = (
                (rets[0], 1.0) if len(rets) == 1 else (_mean(rets), _std(rets, cfg.std_ddof))
            )
            for row in cl["rows"]:
                episode = row["score"] - mu
                step = row["ret"] - s_mu
                if cfg.mode == "mean_std_norm":
                    episode /= sd + cfg.eps
                    step /= s_sd + cfg.eps
                adv[row["i"]][row["k"]] = episode + cfg.step_weight * step
                ret[row["i"]][row["k"]] = row["ret"]
    return np.concatenate([np.asarray(a) for a in adv]), np.concatenate(
        [np.asarray(r) for r in ret]
    )


OBSERVATIONS = [PARIS_DOT, PARIS_BANG, UNRELATED, "Doc 2: Berlin.", "Doc 2: Berlin", "q1", "", None]


def gigpo_random_batch(seed: int, **kwargs) -> TrajectoryBatch:
    """random_batch with observations drawn from a small pool (so anchors repeat and nearly
    repeat, null included) and invalid / truncated actions."""
    rng = np.random.default_rng(seed)
    table = random_batch(rng, **kwargs).table
    base = TrajectoryBatch(table)
    t = base.num_turns
    pool = np.asarray(OBSERVATIONS, dtype=object)
    observation = pool[rng.integers(0, len(pool), t)]
    action = np.where(base.is_last_turn, "answer", "search").astype(object)
    action = np.where(rng.random(t) < 0.2, "invalid", action)
    action = np.where(rng.random(t) < 0.05, "truncated", action)
    struct = pa.StructArray.from_arrays(
        [
            pa.nulls(t, pa.string()),
            pa.array(action.tolist(), pa.string()),
            pa.nulls(t, pa.string()),
            pa.array(observation.tolist(), pa.string()),
            pa.array(np.zeros(t, np.int64)),
        ],
        fields=list(TURN_STRUCT),
    )
    turns = pa.ListArray.from_arrays(pa.array(base.turn_offsets.astype(np.int32)), struct)
    return TrajectoryBatch.from_table(
        table.set_column(table.column_names.index("turns"), "turns", turns)
    )


CONFIGS = [
    GiGPOConfig(),
    GiGPOConfig(
        mode="mean_std_norm",
        enable_similarity=True,
        similarity_threshold=0.9,
        invalid_action_penalty=0.01,
    ),
    GiGPOConfig(mode="mean_std_norm", cross_steps=False, invalid_action_penalty=0.1, gamma=0.8),
    GiGPOConfig(
        mode="mean_norm",
        cross_steps=False,
        enable_similarity=True,
        similarity_threshold=0.5,
        step_weight=0.5,
        invalid_action_penalty=0.05,
    ),
    GiGPOConfig(mode="mean_std_norm", std_ddof=0, eps=1e-3, gamma=1.0),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.mode}-sim{c.enable_similarity}-x{c.cross_steps}"
)
def test_matches_reference_loop(seed, cfg):
    batch = gigpo_random_batch(seed, num_groups=12, group_size=5, max_turns=5, singleton_frac=0.2)
    out = GIGPO(batch, config=cfg)
    expected_adv, expected_ret = reference_gigpo(batch, cfg)
    np.testing.assert_allclose(
        out.turn_values("turn_advantages"), expected_adv, atol=ATOL, rtol=1e-5
    )
    np.testing.assert_allclose(out.turn_values("turn_rewards"), expected_ret, atol=ATOL, rtol=1e-5)
    actions = [turn["action"] for rec in batch.to_records() for turn in rec["turns"]]
    assert out.metrics["gigpo/invalid_turns"] == actions.count("invalid")
    assert out.metrics["gigpo/null_actions"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_plain_random_batch_matches_reference(seed):
    # random_batch itself: null observations (every later anchor is ""), all-equal groups.
    batch = random_batch(seed, num_groups=10, group_size=4, max_turns=6)
    for cfg in (GiGPOConfig(), GiGPOConfig(mode="mean_std_norm", cross_steps=False)):
        out = GIGPO(batch, config=cfg)
        np.testing.assert_allclose(
            out.turn_values("turn_advantages"), reference_gigpo(batch, cfg)[0], atol=ATOL, rtol=1e-5
        )
        null_anchors = int((batch.turn_position > 0).sum())
        assert out.metrics["gigpo/null_anchors"] == null_anchors


def test_similarity_clusters_equal_row_by_row_clustering():
    # Dedup before clustering must not change the official row-by-row result.
    batch = gigpo_random_batch(7, num_groups=6, group_size=8, max_turns=6, singleton_frac=0.0)
    for threshold in (0.5, 0.9, 0.97, 1.0):
        cfg = GiGPOConfig(enable_similarity=True, similarity_threshold=threshold)
        np.testing.assert_allclose(
            advantages(batch, config=cfg), reference_gigpo(batch, cfg)[0], atol=ATOL, rtol=1e-5
        )


# ----------------------------------------------------------------------------- degenerate cases


def test_singleton_group_episode_term_is_not_centered_and_step_term_is():
    batch = make_batch([{"group": "solo", "reward": 1.0, "turns": 1}])
    close(advantages(batch, mode="mean_std_norm"), [1.0 / (1.0 + 1e-6)])
    close(advantages(batch, mode="mean_norm"), [1.0])


def test_singleton_trajectory_without_cross_steps():
    # One trajectory of 3 turns: cross_steps=True has 3 equal rows (A^E = 0);
    # cross_steps=False has one value (mean 0, std 1, so A^E = outcome).
    steps = [("search", "o1"), ("search", "o2"), ("answer", None)]
    batch = TrajectoryBatch.from_records([trajectory("A", 1.0, steps)])
    close(advantages(batch, mode="mean_std_norm"), [0.0, 0.0, 0.0])
    close(advantages(batch, mode="mean_std_norm", cross_steps=False), [1.0 / (1.0 + 1e-6)] * 3)


def test_all_equal_group_gives_zero():
    rows = [{"group": "g", "reward": 1.0, "turns": 2, "question": "same"} for _ in range(4)]
    batch = make_batch(rows)
    for mode in ("mean_norm", "mean_std_norm"):
        close(advantages(batch, mode=mode), np.zeros(8))


def test_groups_do_not_share_anchor_groups():
    rows = [
        trajectory("a", 1.0, [("search", "o"), ("answer", None)], group="g1", question="Q"),
        trajectory("b", 0.0, [("search", "o"), ("answer", None)], group="g2", question="Q"),
    ]
    codes, count, _ = anchor_groups(TrajectoryBatch.from_records(rows), GiGPOConfig())
    assert count == 4 and len(set(codes.tolist())) == 4


def test_question_and_observation_with_the_same_text_share_an_anchor():
    rows = [
        trajectory("a", 1.0, [("search", "Q"), ("answer", None)]),
        trajectory("b", 0.0, [("answer", None)]),
    ]
    codes, _, _ = anchor_groups(TrajectoryBatch.from_records(rows), GiGPOConfig())
    assert codes.tolist() == [0, 0, 0]


def test_null_observation_and_question_are_empty_anchors():
    rows = [
        trajectory("a", 1.0, [("invalid", None), ("answer", None)]),
        trajectory("b", 0.0, [("invalid", ""), ("answer", None)]),
    ]
    # A batch refuses a null question; one built without validation may still carry it.
    table = TrajectoryBatch.from_records(rows).table
    at = table.column_names.index("question")
    table = table.set_column(at, "question", pa.nulls(2, pa.string()))
    batch = TrajectoryBatch(table, validate=False)
    codes, count, nulls = anchor_groups(batch, GiGPOConfig())
    assert codes.tolist() == [0, 0, 0, 0] and count == 1 and nulls == 3
    assert GIGPO(batch).metrics["gigpo/null_anchors"] == 3


def test_unrecorded_actions_count_as_valid():
    rows = [
        {**trajectory("a", 1.0, []), "turns": [{"observation": "o"}, {}]},
        {**trajectory("b", 0.0, []), "turns": [{}]},
    ]
    batch = TrajectoryBatch.from_records(rows)
    out = GIGPO(batch, invalid_action_penalty=0.5)
    assert out.metrics["gigpo/null_actions"] == 3 and out.metrics["gigpo/invalid_turns"] == 0
    close(out.turn_values("turn_rewards"), [0.95, 1.0, 0.0])


@pytest.mark.parametrize(
    "params",
    [
        {"gamma": 1.5},
        {"gamma": -0.1},
        {"step_weight": -1.0},
        {"step_weight": math.inf},
        {"mode": "std_norm"},
        {"similarity_threshold": 0.0},
        {"similarity_threshold": 1.5},
        {"eps": -1e-6},
        {"std_ddof": 2},
        {"invalid_action_penalty": -0.01},
    ],
)
def test_config_validation(params):
    with pytest.raises(ValueError):
        GiGPOConfig(**params)


def test_unknown_parameter_and_missing_column():
    with pytest.raises(TypeError, match="unknown parameter"):
        GIGPO(vector_batch(), temperature=1.0)
    assert set(GIGPO.requires) == {"group_id", "outcome_reward", "turns", "question"}


# ----------------------------------------------------------------------------- contract


def test_input_unchanged_and_deterministic():
    batch = gigpo_random_batch(3, num_groups=8, group_size=4, max_turns=4)
    before = batch.table
    cfg = GiGPOConfig(mode="mean_std_norm", enable_similarity=True, invalid_action_penalty=0.01)
    first, second = GIGPO(batch, config=cfg), GIGPO(batch, config=cfg)
    assert batch.table.equals(before) and "turn_advantages" not in batch
    assert first.table.equals(second.table)
    assert first.metrics == second.metrics


def test_registered():
    assert get_estimator("gigpo") is GIGPO
    assert GIGPO.fn is gigpo and GIGPO.config_cls is GiGPOConfig
    assert dataclasses.fields(GiGPOConfig)[0].name == "gamma"
    assert {f.name: f.default for f in dataclasses.fields(GiGPOConfig)} == {
        "gamma": 0.95,
        "step_weight": 1.0,
        "mode": "mean_norm",
        "enable_similarity": False,
        "similarity_threshold": 0.95,
        "eps": 1e-6,
        "std_ddof": 1,
        "cross_steps": True,
        "invalid_action_penalty": 0.0,
    }


# name -> reference(rows, config) over batch.to_records(); bench/estimators.py times it.
REFERENCES = {"gigpo": lambda rows, config: reference_gigpo(rows, config)[0]}
