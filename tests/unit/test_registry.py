"""The estimator registry and the estimator contract shared by all of them."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import ray_credit
from ray_credit.estimators import (
    ESTIMATORS,
    Estimator,
    advantage_metrics,
    get_estimator,
    register_estimator,
    resolve_estimator,
)
from ray_credit.testing import random_batch

BUILTIN = {"grpo", "dr_grpo", "rloo", "tspo", "cw_grpo", "search_p1", "igpo", "a2tgpo", "gigpo"}


def test_every_builtin_is_registered():
    assert set(ESTIMATORS) >= BUILTIN


def test_estimators_import_neither_torch_nor_ray():
    code = "import sys, ray_credit.estimators; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match="unknown estimator 'tsp'.*'tspo'"):
        get_estimator("tsp")


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_contract(name):
    est = get_estimator(name)
    assert dataclasses.is_dataclass(est.config_cls) and est.config_cls.__dataclass_params__.frozen
    assert est.config_cls.__doc__ and est.fn.__module__.startswith("ray_credit.estimators.")
    batch = random_batch(7, num_groups=6, max_turns=5)
    out = est(batch)
    adv = out.turn_values("turn_advantages")
    assert adv.dtype == np.float32 and adv.shape == (batch.num_turns,) and np.isfinite(adv).all()
    assert "turn_advantages" not in batch and batch.metrics == {}
    assert all(
        key.startswith(f"{name}/") for key in out.metrics
    )  # estimators count under their name
    assert out.table.equals(est(batch).table)


@pytest.mark.parametrize("name", sorted(BUILTIN))
@pytest.mark.parametrize("singleton_frac", [0.0, 0.3])
def test_row_order_does_not_matter(name, singleton_frac):
    """Shuffled rows (groups no longer contiguous) give the same advantages, shuffled."""
    batch = random_batch(11, num_groups=10, max_turns=6, singleton_frac=singleton_frac)
    order = np.random.default_rng(0).permutation(len(batch))
    shuffled = batch.select(order)
    assert shuffled.group_order is not None
    est = get_estimator(name)
    expected = est(batch).select(order).turn_values("turn_advantages")
    np.testing.assert_allclose(
        est(shuffled).turn_values("turn_advantages"), expected, rtol=1e-5, atol=1e-6
    )


def test_advantage_metrics_count_zero_advantage_groups():
    from ray_credit.testing import make_batch

    batch = make_batch(
        [
            {"group": "wrong", "reward": 0, "turns": 2},
            {"group": "wrong", "reward": 0, "turns": 1},
            {"group": "mixed", "reward": 1, "turns": 1},
            {"group": "mixed", "reward": 0, "turns": 3},
        ]
    )
    metrics = advantage_metrics(get_estimator("grpo")(batch))
    assert metrics["adv/zero_advantage_group_frac"] == 0.5
    assert metrics["adv/max_abs"] == pytest.approx(0.707106, abs=1e-5)
    assert metrics["adv/mean"] == pytest.approx((0.707106 - 3 * 0.707106) / 7, abs=1e-5)


def test_user_estimator_registers_and_resolves():
    @dataclasses.dataclass(frozen=True)
    class HalfConfig:
        """Scale the outcome."""

        scale: float = 0.5

    def half(batch, config):
        values = batch.traj_values("outcome_reward")[batch.turn_traj_index] * config.scale
        return batch.with_turn_columns({"turn_advantages": values})

    est = register_estimator(Estimator("test_half", half, HalfConfig, ("outcome_reward",)))
    try:
        assert get_estimator("test_half") is est is ray_credit.get_estimator("test_half")
        with pytest.raises(ValueError, match="already registered"):
            register_estimator(est)
        batch = random_batch(0, num_groups=2)
        out = resolve_estimator("test_half")(batch, scale=2.0)
        np.testing.assert_allclose(
            out.turn_values("turn_advantages"),
            2 * batch.traj_values("outcome_reward")[batch.turn_traj_index],
        )
    finally:
        ESTIMATORS.pop("test_half")
    plain = resolve_estimator(lambda b: b)
    assert callable(plain)
    with pytest.raises(TypeError):
        resolve_estimator(3)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_group_local_estimators_run_per_chunk(name):
    """What lets the pipeline run an estimator on each chunk as it is generated: on a
    batch split at group boundaries, the parts' advantages are the whole batch's."""
    est = get_estimator(name)
    assert est.group_local
    batch = random_batch(5, num_groups=9, max_turns=5, singleton_frac=0.2)
    whole = dict(zip(batch.column("traj_id").to_pylist(), est(batch).to_records(), strict=True))
    parts = np.random.default_rng(1).integers(0, 3, batch.num_groups)[batch.group_index]
    for part in range(3):
        chunk = est(batch.select(np.flatnonzero(parts == part)))
        for row in chunk.to_records():
            np.testing.assert_allclose(
                row["turn_advantages"],
                whole[row["traj_id"]]["turn_advantages"],
                rtol=1e-5,
                atol=1e-6,
            )


def test_estimator_recipes_name_real_signals_and_learner_settings():
    """Each estimator's declaration is buildable: its signals exist and take the settings
    given, its columns come from a rollout or a declared signal, and its learner settings
    are fields of LearnerConfig."""
    pytest.importorskip("torch")
    from ray_credit.actors.learner import LearnerConfig
    from ray_credit.batch import ROLLOUT_COLUMNS
    from ray_credit.config import replace_path
    from ray_credit.signals import get_signal

    for name, est in ESTIMATORS.items():
        provided = set(ROLLOUT_COLUMNS)
        for signal_name, settings in est.signals.items():
            signal = dataclasses.replace(get_signal(signal_name), **settings)
            provided |= set(signal.columns)
        assert set(est.requires) <= provided, (name, set(est.requires) - provided)
        config = LearnerConfig()
        for key, value in est.learner.items():
            config = replace_path(config, key, value)
    assert get_estimator("a2tgpo").learner["loss.ratio_level"] == "turn"
