"""GRPO, Dr.GRPO and RLOO against hand-computed vectors and a per-group loop reference."""

import math

import numpy as np
import pytest

from ray_credit.estimators import get_estimator
from ray_credit.estimators.grpo import GRPOConfig, RLOOConfig
from ray_credit.testing import make_batch, random_batch


def advantages(batch):
    """Turn advantages of each trajectory, as nested lists."""
    return batch.table.column("turn_advantages").to_pylist()


def per_traj(batch):
    return [a[0] for a in advantages(batch)]


def scores_batch(groups):
    return make_batch(
        [{"group": g, "reward": r, "turns": 2} for g, rs in groups.items() for r in rs]
    )


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1, 0, 0, 0], [1.499997, -0.499999, -0.499999, -0.499999]),
        ([1, 1, 0], [0.577349, 0.577349, -1.154699]),
        ([1, 0, 0], [1.154698, -0.577349, -0.577349]),
        ([1, 1, 1], [0, 0, 0]),
        ([0.7], [0.699999]),  # singleton: verl does not center
    ],
)
def test_grpo_vectors(scores, expected):
    out = get_estimator("grpo")(scores_batch({"g": scores}))
    np.testing.assert_allclose(per_traj(out), expected, atol=2e-6)


def test_grpo_two_groups_vector():
    out = get_estimator("grpo")(scores_batch({"a": [1, 0], "b": [0.5, 0.5, 0.2]}))
    np.testing.assert_allclose(
        per_traj(out), [0.707106, -0.707106, 0.577347, 0.577347, -1.154694], atol=2e-6
    )


def test_dr_grpo_and_rloo_vectors():
    batch = scores_batch({"g": [1, 0, 0, 0]})
    np.testing.assert_allclose(
        per_traj(get_estimator("dr_grpo")(batch)), [0.75, -0.25, -0.25, -0.25], atol=1e-7
    )
    np.testing.assert_allclose(
        per_traj(get_estimator("grpo")(batch, norm_by_std=False)),
        [0.75, -0.25, -0.25, -0.25],
        atol=1e-7,
    )
    np.testing.assert_allclose(
        per_traj(get_estimator("rloo")(batch)), [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-6
    )


def test_population_std_and_singleton_center():
    batch = scores_batch({"g": [1, 1, 0], "s": [0.7]})
    out = get_estimator("grpo")(batch, std_ddof=0, singleton_policy="center")
    np.testing.assert_allclose(per_traj(out), [0.707105, 0.707105, -1.414211, 0.0], atol=2e-6)
    assert per_traj(get_estimator("rloo")(batch, singleton_policy="center"))[3] == 0.0


def test_every_turn_gets_the_trajectory_advantage():
    out = get_estimator("grpo")(make_batch([{"reward": 1, "turns": 3}, {"reward": 0, "turns": 1}]))
    adv = advantages(out)
    assert len(adv[0]) == 3 and len(set(adv[0])) == 1 and len(adv[1]) == 1


# ---------------------------------------------------------------------- loop reference
def reference(rows, *, kind, eps=1e-6, ddof=1, norm_by_std=True, singleton="zero_mean_unit_std"):
    """Turn advantages of ``rows`` (``batch.to_records()``), one group at a time."""
    groups = {}
    for i, row in enumerate(rows):
        groups.setdefault(row["group_id"], []).append(i)
    out = [None] * len(rows)
    for members in groups.values():
        scores = [rows[i]["outcome_reward"] for i in members]
        n = len(scores)
        for i, s in zip(members, scores, strict=True):
            if n == 1:
                if singleton == "center":
                    a = 0.0
                elif kind == "rloo":
                    a = s
                else:
                    a = s / (1 + eps) if norm_by_std else s
            elif kind == "rloo":
                a = s - (sum(scores) - s) / (n - 1)
            else:
                mean = sum(scores) / n
                std = math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - ddof))
                a = (s - mean) / (std + eps) if norm_by_std else s - mean
            out[i] = [a] * len(rows[i]["turns"])
    return out


def _grpo_reference(rows, config):
    return reference(
        rows,
        kind="grpo",
        eps=config.eps,
        ddof=config.std_ddof,
        norm_by_std=config.norm_by_std,
        singleton=config.singleton_policy,
    )


# name -> reference(rows, config); bench/estimators.py times these against the estimators.
REFERENCES = {
    "grpo": _grpo_reference,
    "dr_grpo": _grpo_reference,
    "rloo": lambda rows, config: reference(rows, kind="rloo", singleton=config.singleton_policy),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "params",
    [{}, {"std_ddof": 0}, {"norm_by_std": False}, {"singleton_policy": "center"}, {"eps": 0.1}],
)
def test_grpo_matches_reference(seed, params):
    # Even seeds: ragged groups (key path); odd seeds: equal-size contiguous groups (block path).
    singletons = 0.3 if seed % 2 == 0 else 0.0
    batch = random_batch(seed, num_groups=12, singleton_frac=singletons, binary_reward=seed < 2)
    out = get_estimator("grpo")(batch, **params)
    ref = REFERENCES["grpo"](batch.to_records(), GRPOConfig(**params))
    for got, want in zip(advantages(out), ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("singleton", ["zero_mean_unit_std", "center"])
def test_rloo_matches_reference(seed, singleton):
    batch = random_batch(seed, num_groups=12, singleton_frac=0.3, binary_reward=False)
    out = get_estimator("rloo")(batch, singleton_policy=singleton)
    ref = REFERENCES["rloo"](batch.to_records(), RLOOConfig(singleton_policy=singleton))
    for got, want in zip(advantages(out), ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_config_is_rejected():
    batch = scores_batch({"g": [1, 0]})
    with pytest.raises(ValueError, match="std_ddof"):
        get_estimator("grpo")(batch, std_ddof=2)
    with pytest.raises(ValueError, match="singleton_policy"):
        get_estimator("grpo")(batch, singleton_policy="drop")
    with pytest.raises(TypeError, match="unknown parameter"):
        get_estimator("grpo")(batch, alpha=1)


@pytest.mark.parametrize(
    "name, params, error, match",
    [
        ("grpo", {"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
        ("grpo", {"eps": math.inf}, ValueError, "eps must be a finite number > 0"),
        ("grpo", {"eps": "1e-6"}, TypeError, "eps"),
        ("grpo", {"std_ddof": 1.0}, TypeError, "std_ddof"),
        ("igpo", {"var_eps": math.inf}, ValueError, "var_eps must be a finite number"),
        ("a2tgpo", {"ig_weight": math.inf}, ValueError, "ig_weight must be a finite number"),
        ("tspo", {"alpha": math.nan}, (TypeError, ValueError), "alpha"),
    ],
)
def test_estimator_configs_refuse_what_would_make_advantages_wrong(name, params, error, match):
    """eps = 0 divides an all-equal group by 0, an infinite eps zeroes every advantage, an
    infinite weight makes them inf; a value of the wrong type is named, not coerced."""
    with pytest.raises(error, match=match):
        get_estimator(name).make_config(**params)


def test_estimator_registry_arguments_are_checked():
    from ray_credit.estimators import Estimator

    with pytest.raises(TypeError, match="takes an estimator's name"):
        get_estimator(GRPOConfig)
    with pytest.raises(TypeError, match="fn is the function"):
        Estimator(name="mine", fn=None, config_cls=GRPOConfig, requires=())
    with pytest.raises(TypeError, match="requires is a tuple of column names"):
        Estimator(name="mine", fn=lambda b, c: b, config_cls=GRPOConfig, requires="turns")
    with pytest.raises(ValueError, match="non-empty str"):
        Estimator(name=" ", fn=lambda b, c: b, config_cls=GRPOConfig, requires=())
