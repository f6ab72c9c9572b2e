"""Unit tests for the Search-P1 estimator (hand-computed vectors)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ray_credit.batch import BatchValidationError, TrajectoryBatch
from ray_credit.estimators import get_estimator
from ray_credit.estimators.search_p1 import SearchP1Config, path_centric_reward
from ray_credit.testing import make_batch, random_batch

SP1 = get_estimator("search_p1")
FIELDS = (
    "sp1_planner_score",
    "sp1_plan_steps",
    "sp1_effective_steps_self",
    "sp1_effective_steps_ref",
    "sp1_ref_plan_steps",
    "sp1_outcome_accuracy",
    "sp1_outcome_reasoning",
)
SEARCH4 = ["search"] * 4 + ["answer"]  # n_actions = 4, r_f = 0.1


def evaluator(planner=1.0, plan=3, exec_self=2, covered=2, ref=2, acc=0.5, reason=0.8) -> dict:
    """The hand-computed case's inputs by default."""
    return dict(zip(FIELDS, (planner, plan, exec_self, covered, ref, acc, reason), strict=True))


def rewards(batch) -> list[float]:
    return [row["turn_rewards"][0] for row in batch.to_records()]


def with_observations(batch: TrajectoryBatch, where: dict[int, list[int]]) -> TrajectoryBatch:
    """Give turns ``where[row]`` a tool response."""
    records = batch.to_records()
    for row, turns in where.items():
        for k in turns:
            records[row]["turns"][k]["observation"] = "Doc 1 (Title: x) y"
    return TrajectoryBatch.from_records(records)


# ----------------------------------------------------------------------------- vectors
def test_paper_vectors() -> None:
    batch = make_batch(
        [
            {"group": "a", "reward": 0, "actions": SEARCH4, **evaluator()},
            {"group": "b", "reward": 1, "actions": SEARCH4, **evaluator(1.2, 4, 4, 2, 2, 0, 0)},
        ]
    )
    parts = path_centric_reward(batch, SearchP1Config())
    np.testing.assert_allclose(parts["self"], [1 / 3, 1.2], atol=1e-6)
    np.testing.assert_allclose(parts["ref"], [0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(parts["path"], [0.5, 1.2], atol=1e-6)
    np.testing.assert_allclose(parts["outcome"], [0.56, 1.0], atol=1e-6)
    np.testing.assert_allclose(parts["format"], [0.1, 0.1])
    np.testing.assert_allclose(rewards(SP1(batch)), [0.496, 0.97], atol=1e-5)
    np.testing.assert_allclose(rewards(SP1(batch, format_full=1.0)), [0.586, 1.06], atol=1e-5)
    algorithm3 = path_centric_reward(batch, SearchP1Config(variant="algorithm3"))
    np.testing.assert_allclose(algorithm3["self"], [2 / 3, 1.2], atol=1e-6)
    np.testing.assert_allclose(algorithm3["ref"], [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(rewards(SP1(batch, variant="algorithm3")), [0.646, 0.97], atol=1e-5)
    # Each group has one trajectory: verl's singleton policy gives A = R / (1 + eps).
    advantages = [row["turn_advantages"] for row in SP1(batch).to_records()]
    np.testing.assert_allclose(advantages, [[0.496] * 5, [0.97] * 5], atol=1e-5)


def test_grpo_over_total_reward() -> None:
    batch = make_batch(
        [
            {"reward": 0, "actions": SEARCH4, **evaluator()},
            {"reward": 1, "actions": SEARCH4, **evaluator(1.2, 4, 4, 2, 2, 0, 0)},
        ]
    )
    out = SP1(batch)
    spread = (0.97 - 0.496) / 2 / (math.sqrt(2 * ((0.97 - 0.496) / 2) ** 2) + 1e-6)
    np.testing.assert_allclose(
        out.turn_values("turn_advantages"), [-spread] * 5 + [spread] * 5, atol=1e-5
    )
    assert out.to_records()[0]["turn_rewards"] == pytest.approx([0.496] * 5, abs=1e-6)
    dr = SP1(batch, norm_by_std=False).turn_values("turn_advantages")
    np.testing.assert_allclose(dr, [-0.237] * 5 + [0.237] * 5, atol=1e-5)


# ----------------------------------------------------------------------------- format
def test_format_reward() -> None:
    ev = evaluator()
    batch = make_batch(
        [
            {"actions": SEARCH4, **ev},  # valid, answer, call: full
            {"actions": ["search", "invalid", "answer"], **ev},  # invalid + response: partial
            {"actions": ["search", "invalid", "answer"], **ev},  # invalid, no response: 0
            {"actions": ["answer"], **ev},  # no tool call, no response: 0
            {"actions": ["answer"], **ev},  # no tool call, a response: partial
            {"actions": ["search", "search", "truncated"], **ev},  # no answer: 0
            {"actions": ["search", "search"], **ev},  # final turn is not an answer: 0
        ]
    )
    batch = with_observations(batch, {1: [0], 4: [0], 5: [0, 1], 6: [0]})
    parts = path_centric_reward(batch, SearchP1Config())
    np.testing.assert_allclose(parts["format"], [0.1, 0.05, 0, 0, 0.05, 0, 0])
    gated = path_centric_reward(batch, SearchP1Config(variant="algorithm3"))
    assert (gated["total"][parts["format"] == 0] == 0).all()
    assert (gated["total"][parts["format"] > 0] > 0).all()
    # Eq. (4) has no gate: a wrong answer without format still earns path and soft outcome.
    assert (parts["total"] > 0).all()
    assert SP1(batch, variant="algorithm3").metrics["search_p1/format_zero"] == 4


def test_zero_denominators_make_the_track_zero() -> None:
    batch = make_batch(
        [
            {"actions": SEARCH4, **evaluator(plan=0, exec_self=0)},  # S_self = 0, S_ref = 0.5
            {"actions": SEARCH4, **evaluator(ref=0, covered=0)},  # S_ref = 0, S_self = 1/3
            {"actions": ["answer"], **evaluator()},  # n_actions = 0: both tracks 0 in Eq. (6)/(7)
        ]
    )
    batch = with_observations(batch, {2: [0]})
    parts = path_centric_reward(batch, SearchP1Config())
    np.testing.assert_allclose(parts["path"], [0.5, 1 / 3, 0], atol=1e-6)
    algorithm3 = path_centric_reward(batch, SearchP1Config(variant="algorithm3"))
    np.testing.assert_allclose(algorithm3["path"], [1.0, 2 / 3, 1.0], atol=1e-6)


# ----------------------------------------------------------------------------- missing evaluator
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("variant", ["equations", "algorithm3"])
def test_missing_evaluator_keeps_binary_outcome_and_format(field: str, variant: str) -> None:
    rows = [{"reward": r, "actions": SEARCH4, **evaluator()} for r in (0, 1)]
    for row in rows:
        row[field] = None
    rows.append({"reward": 0, "actions": SEARCH4, **evaluator()})
    out = SP1(make_batch(rows), variant=variant)
    full = 0.496 if variant == "equations" else 0.646
    np.testing.assert_allclose(rewards(out), [0.01, 0.61, full], atol=1e-5)
    assert out.metrics["search_p1/evaluator_missing"] == 2


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "field, value",
    [
        ("sp1_planner_score", 0.7),
        ("sp1_planner_score", math.nan),
        ("sp1_outcome_accuracy", 0.3),
        ("sp1_outcome_reasoning", 0.6),
        ("sp1_plan_steps", -1),
        ("sp1_effective_steps_self", 4),
        ("sp1_effective_steps_ref", 3),
        ("sp1_ref_plan_steps", -2),
    ],
)
def test_rejects_garbage_evaluator_values(field: str, value: float) -> None:
    rows = [{"actions": SEARCH4, **evaluator()}, {"actions": SEARCH4, **evaluator(), field: value}]
    with pytest.raises(ValueError, match=rf"traj_id='t1'.*{field}"):
        SP1(make_batch(rows))


def test_missing_column_is_a_clear_error() -> None:
    ev = evaluator()
    del ev["sp1_outcome_reasoning"]
    with pytest.raises(BatchValidationError, match="sp1_outcome_reasoning"):
        SP1(make_batch([{"actions": SEARCH4, **ev}]))


def test_null_action_is_an_error() -> None:
    records = make_batch([{"actions": SEARCH4, **evaluator()}]).to_records()
    for turn in records[0]["turns"]:  # a hand-built batch may leave actions unrecorded
        turn["action"] = None
    with pytest.raises(ValueError, match="turns.action"):
        SP1(TrajectoryBatch.from_records(records))


@pytest.mark.parametrize(
    "params",
    [
        {"lambda_path": -0.1},
        {"lambda_format": math.inf},
        {"soft_alpha": 1.5},
        {"variant": "eq"},
        {"format_partial": -1.0},
        {"correct_threshold": math.nan},
        {"std_ddof": 3},
        {"eps": -1.0},
        {"singleton_policy": "drop"},
    ],
)
def test_config_validation(params: dict) -> None:
    # NaN is refused by check_fields (TypeError, "takes a number, not NaN"), the rest by range
    with pytest.raises((TypeError, ValueError)):
        SearchP1Config(**params)


# ----------------------------------------------------------------------------- reference
def ref_total(rec: dict, cfg: SearchP1Config) -> tuple[float, bool]:
    """Eq. (4)-(8) or Algorithm 3 for one trajectory, straight from the paper."""
    actions = [turn["action"] for turn in rec["turns"]]
    n_actions = actions.count("search")
    valid = "invalid" not in actions and "truncated" not in actions
    has_answer = actions[-1] == "answer"
    has_response = any(turn["observation"] is not None for turn in rec["turns"])
    if valid and has_answer and n_actions > 0:
        r_f = cfg.format_full
    elif has_answer and has_response:
        r_f = cfg.format_partial
    else:
        r_f = 0.0
    planner, n_plan, n_exec, n_cov, n_ref, acc, reason = (rec[f] for f in FIELDS)
    missing = any(rec[f] is None for f in FIELDS)

    def div(a: float, b: float) -> float:
        return a / b if b else 0.0

    if missing:
        path, soft = 0.0, 0.0
    elif cfg.variant == "equations":
        s_self = planner * div(n_exec, n_plan) * div(n_exec, n_actions)
        s_ref = div(n_cov, n_ref) * div(n_cov, n_actions)
        path, soft = max(s_self, s_ref), cfg.soft_alpha * acc + (1 - cfg.soft_alpha) * reason
    else:
        path = max(planner * div(n_exec, n_plan), div(n_cov, n_ref))
        soft = cfg.soft_alpha * acc + (1 - cfg.soft_alpha) * reason
    outcome = 1.0 if rec["outcome_reward"] >= cfg.correct_threshold else soft
    total = cfg.lambda_path * path + cfg.lambda_outcome * outcome + cfg.lambda_format * r_f
    if cfg.variant == "algorithm3" and r_f == 0:
        total = 0.0
    return total, missing


def ref_search_p1(records: list[dict], cfg: SearchP1Config) -> tuple[list[float], list[float], int]:
    totals, missing = zip(*(ref_total(rec, cfg) for rec in records), strict=True)
    groups: dict[str, list[float]] = {}
    for rec, total in zip(records, totals, strict=True):
        groups.setdefault(rec["group_id"], []).append(total)
    advantages = []
    for rec, total in zip(records, totals, strict=True):
        values = groups[rec["group_id"]]
        n = len(values)
        if n == 1:
            mean, std = (0.0 if cfg.singleton_policy == "zero_mean_unit_std" else total), 1.0
        else:
            mean = sum(values) / n
            std = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - cfg.std_ddof))
        advantages.append((total - mean) / (std + cfg.eps) if cfg.norm_by_std else total - mean)
    return list(totals), advantages, sum(missing)


def messy_batch(seed: int) -> TrajectoryBatch:
    """random_batch plus invalid/truncated turns, tool responses, empty plans and null fields."""
    rng = random.Random(seed)
    base = random_batch(
        seed,
        num_groups=10,
        group_size=5,
        max_turns=5,
        singleton_frac=0.2,
        binary_reward=seed % 2 == 0,
    )
    records = base.to_records()
    for rec in records:
        for turn in rec["turns"]:
            if rng.random() < 0.1:
                turn["action"] = rng.choice(["invalid", "truncated", "search"])
            if turn["action"] == "search" and rng.random() < 0.7:
                turn["observation"] = "Doc 1 (Title: x) y"
        if rng.random() < 0.1:
            rec["sp1_plan_steps"] = rec["sp1_effective_steps_self"] = 0
        if rng.random() < 0.1:
            rec["sp1_ref_plan_steps"] = rec["sp1_effective_steps_ref"] = 0
        if rng.random() < 0.1:
            rec[rng.choice(FIELDS)] = None
    return TrajectoryBatch.from_records(records)


CONFIGS = [
    {},
    {"variant": "algorithm3"},
    {"std_ddof": 0, "singleton_policy": "center", "soft_alpha": 0.5},
    {"variant": "algorithm3", "norm_by_std": False, "correct_threshold": 0.5},
    {
        "lambda_path": 0.4,
        "lambda_outcome": 1.0,
        "lambda_format": 1.0,
        "format_full": 1.0,
        "format_partial": 0.5,
        "eps": 1e-4,
    },
]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("params", CONFIGS)
def test_matches_loop_reference(seed: int, params: dict) -> None:
    batch = messy_batch(seed)
    out = SP1(batch, **params)
    totals, advantages, missing = ref_search_p1(batch.to_records(), SearchP1Config(**params))
    np.testing.assert_allclose(
        out.turn_values("turn_rewards"), np.repeat(totals, batch.turn_counts), atol=1e-5, rtol=1e-6
    )
    np.testing.assert_allclose(
        out.turn_values("turn_advantages"),
        np.repeat(advantages, batch.turn_counts),
        atol=2e-5,
        rtol=1e-6,
    )
    assert out.metrics["search_p1/evaluator_missing"] == missing


def test_plain_random_batch_runs() -> None:
    out = SP1(random_batch(5))
    assert np.isfinite(out.turn_values("turn_advantages")).all()


# ----------------------------------------------------------------------------- contract
def test_pure_and_deterministic() -> None:
    batch = messy_batch(9)
    before = batch.table
    first, second = SP1(batch), SP1(batch)
    assert (
        batch.table.equals(before)
        and "turn_advantages" not in batch
        and "turn_rewards" not in batch
    )
    assert batch.metrics == {}
    np.testing.assert_array_equal(
        first.turn_values("turn_advantages"), second.turn_values("turn_advantages")
    )


def test_registered() -> None:
    assert SP1.name == "search_p1" and SP1.config_cls is SearchP1Config
    assert set(SP1.requires) >= {"group_id", "outcome_reward", "turns", *FIELDS}


def _reference_turn_advantages(rows: list[dict], cfg: SearchP1Config) -> list[list[float]]:
    _, advantages, _ = ref_search_p1(rows, cfg)
    return [[a] * len(row["turns"]) for row, a in zip(rows, advantages, strict=True)]


# name -> reference(rows, config) over batch.to_records(); bench/estimators.py times it.
REFERENCES = {"search_p1": _reference_turn_advantages}
