"""Intervals of held-out EM: Wilson for one evaluation, a paired bootstrap for the change,
the evaluation summary that pairs them, and the plot that shows them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_credit.stats import paired_difference, proportion_interval


def test_wilson_interval_matches_known_values():
    # 7 of 24 at 95 %: scipy's binomtest(7, 24).proportion_ci(method="wilson")
    low, high = proportion_interval(7, 24)
    assert low == pytest.approx(0.149146, abs=1e-6) and high == pytest.approx(0.491677, abs=1e-6)
    # none of n: the upper end is z^2 / (n + z^2) in closed form
    assert proportion_interval(0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)))
    assert proportion_interval(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        proportion_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        proportion_interval(5, 4)


def test_paired_difference_excludes_zero_only_for_a_real_change():
    rng = np.random.default_rng(0)
    before = rng.random(200) < 0.2
    gained = before | (rng.random(200) < 0.2)  # ~16 % of questions newly right
    change = paired_difference(before.astype(float), gained.astype(float))
    assert change["diff"] == pytest.approx(gained.mean() - before.mean())
    assert change["low"] > 0 and change["worse"] == 0 and change["n"] == 200
    noise = rng.permutation(before).astype(float)  # same EM, questions shuffled
    flat = paired_difference(before.astype(float), noise)
    assert flat["diff"] == 0 and flat["low"] < 0 < flat["high"]
    again = paired_difference(before.astype(float), noise)
    assert again == flat  # seeded


def test_paired_difference_pairs_by_question_id_and_refuses_mismatches():
    before = {"q1#0": 1, "q2#1": 0, "q3#2": 0}
    after = {"q3#2": 1, "q1#0": 1, "q2#1": 0}
    change = paired_difference(before, after)
    assert change["diff"] == pytest.approx(1 / 3) and change["better"] == 1
    with pytest.raises(ValueError, match="different questions"):
        paired_difference(before, {"q1#0": 1, "q2#1": 0, "q9#2": 1})
    with pytest.raises(ValueError, match="one score per question"):
        paired_difference([1, 0], [1, 0, 1])
    with pytest.raises(TypeError):
        paired_difference(before, [1, 0, 0])


@pytest.mark.parametrize(
    "before, error, match",
    [
        ([1, None, 0], TypeError, r"before\[1\] is None"),
        ([1, "0", 0], TypeError, r"before\[1\] is '0'"),
        ([1, float("nan"), 0], ValueError, r"before\[1\] is nan"),
        ({"a": 1, "b": None, "c": 0}, TypeError, r"before\['b'\] is None"),
        ("101", TypeError, "one score per question"),
    ],
)
def test_a_score_that_is_no_number_is_named_not_turned_into_nan(before, error, match):
    after = {"a": 1, "b": 1, "c": 0} if isinstance(before, dict) else [1, 1, 0]
    with pytest.raises(error, match=match):
        paired_difference(before, after)


def test_counts_and_settings_are_checked():
    with pytest.raises(ValueError, match="whole number"):
        proportion_interval(2.5, 10)
    with pytest.raises(TypeError, match="successes must be an integer"):
        proportion_interval(True, 10)
    assert proportion_interval(np.int64(2), 10.0) == proportion_interval(2, 10)
    with pytest.raises(TypeError, match="confidence must be a number"):
        proportion_interval(2, 10, confidence="95%")
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        paired_difference([1, 0], [1, 1], seed=-1)


def test_eval_summary_change_and_plot(tmp_path):
    from ray_credit.pipeline.evaluation import describe_change, eval_change, eval_summary
    from ray_credit.pipeline.outputs import plot, smooth
    from ray_credit.testing import random_batch

    batch = random_batch(0, num_groups=6, group_size=1)
    batch = batch.with_traj_columns({"data_source": ["synthetic_1hop", "synthetic_2hop"] * 3})
    summary = eval_summary(batch)
    assert len(summary["correct"]) == 6 and set(summary["correct"].values()) <= {0, 1}
    assert summary["em"] == pytest.approx(np.mean(list(summary["correct"].values())))
    low, high = summary["em_interval"]
    assert low <= summary["em"] <= high
    searches: dict[str, list[int]] = {}  # per source, counted from the records
    for record in batch.to_records():
        n = sum(turn["action"] == "search" for turn in record["turns"])
        searches.setdefault(record["data_source"], []).append(n)
    assert summary["searches_by_source"] == pytest.approx(
        {source: np.mean(counts) for source, counts in searches.items()}
    )
    after = {**summary, "correct": dict.fromkeys(summary["correct"], 1), "em": 1.0}
    after["em_interval"] = list(proportion_interval(6, 6))
    after["em_by_source"] = dict.fromkeys(summary["em_by_source"], 1.0)
    change = eval_change(summary, after)
    assert set(change) == {"all", *summary["em_by_source"]}
    assert change["all"]["diff"] == pytest.approx(1 - summary["em"])
    text = describe_change(summary, after, change)
    assert "paired on the same questions" in text and "95% CI" in text
    source = sorted(searches)[0]
    per_source = summary["searches_by_source"][source]
    assert f"{source:<16}" in text and f"searches per question {per_source:.2f}" in text
    older = {k: v for k, v in summary.items() if k != "searches_by_source"}  # an older summary
    assert "searches per question" not in describe_change(older, after, change).split("\n")[2]

    rows = [{"pipeline/step": s, "train/reward_mean": r} for s, r in enumerate([0, 1, 0, 1], 1)]
    full = {"config": {"name": "t"}, "steps": 4, "eval_before": summary, "eval_after": after,
            "eval_change": change}  # fmt: skip
    plot(rows, json.loads(json.dumps(full)), tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # debiased from the start
    assert smooth([0.0, 1.0])[1] == pytest.approx(1 / 1.6)


def test_a_sampled_evaluation_scores_each_question_by_its_share_of_right_samples(tmp_path):
    """eval.samples: G rollouts per question; a question scores the share of its rollouts
    that are right, the keys pair it with the greedy evaluation's, and no Wilson interval
    is claimed (a question's samples are not independent of each other)."""
    from ray_credit.pipeline.evaluation import describe_change, eval_change, eval_summary
    from ray_credit.pipeline.outputs import plot
    from ray_credit.testing import random_batch

    batch = random_batch(0, num_groups=4, group_size=3, singleton_frac=0.0)
    sources = [s for s in ("synthetic_1hop", "synthetic_2hop") * 2 for _ in range(3)]
    rewards = [1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    batch = batch.with_traj_columns({"data_source": sources, "outcome_reward": rewards})
    summary = eval_summary(batch)
    assert summary["samples"] == 3 and summary["questions"] == 4
    assert list(summary["correct"].values()) == pytest.approx([1 / 3, 1.0, 0.0, 2 / 3])
    assert summary["em"] == pytest.approx(0.5) and summary["em_interval"] is None
    assert summary["em_by_source"] == pytest.approx({"synthetic_1hop": 1 / 6,
                                                     "synthetic_2hop": 5 / 6})  # fmt: skip
    greedy = eval_summary(random_batch(0, num_groups=4, group_size=1).with_traj_columns(
        {"data_source": sources[::3]}))  # fmt: skip
    assert list(greedy["correct"]) == list(summary["correct"])  # the same keys, in order
    assert greedy["samples"] == 1
    after = {**summary, "correct": dict.fromkeys(summary["correct"], 1.0), "em": 1.0,
             "em_by_source": dict.fromkeys(summary["em_by_source"], 1.0)}  # fmt: skip
    change = eval_change(summary, after)
    assert change["all"]["diff"] == pytest.approx(0.5)
    assert (change["all"]["better"], change["all"]["worse"]) == (3, 0)
    text = describe_change(summary, after, change, "held-out sampled EM (3 samples)")
    assert text.startswith("held-out sampled EM (3 samples):\n")
    full = {"config": {"name": "t"}, "steps": 2,
            "eval_before": {**greedy, "sampled": summary},
            "eval_after": {**greedy, "sampled": after}}  # fmt: skip
    plot([{"pipeline/step": 1, "train/reward_mean": 0.5}], full, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
