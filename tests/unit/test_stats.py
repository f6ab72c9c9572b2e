"""Intervals of held-out EM: Wilson for one evaluation, a paired bootstrap for the change,
the evaluation summary that pairs them, and the plot that shows them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_credit.stats import (
    paired_difference,
    proportion_interval,
    seeded_mean,
    seeded_paired_difference,
    sign_test,
)


def test_wilson_interval_matches_known_values():
    # 7 of 24 at 95 %: scipy's binomtest(7, 24).proportion_ci(method="wilson")
    low, high = proportion_interval(7, 24)
    assert low == pytest.approx(0.149146, abs=1e-6) and high == pytest.approx(0.491677, abs=1e-6)
    # none of n: the upper end is z^2 / (n + z^2) in closed form
    assert proportion_interval(0, 10) == pytest.approx((0.0, 1.959964**2 / (10 + 1.959964**2)))
    assert proportion_interval(10, 10)[1] == pytest.approx(1.0)
    assert proportion_interval(0, 10)[0] == 0.0 and proportion_interval(10, 10)[1] == 1.0  # exact
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


def test_few_questions_that_moved_get_the_exact_sign_test_beside_the_interval():
    """Two questions, both better: every resample's mean is 1 and the percentile interval
    [+1, +1] excludes 0, while a fair coin gives a split that uneven half the time."""
    before, after = np.zeros(2), np.ones(2)
    change = paired_difference(before, after)
    assert (change["low"], change["high"]) == (1.0, 1.0) and change["p_sign"] == 0.5
    assert sign_test(7, 1) == pytest.approx(18 / 256)  # 2 * (1 + 8) / 2^8
    assert sign_test(1, 7) == sign_test(7, 1) and sign_test(0, 0) == 1.0
    assert sign_test(30, 0) == pytest.approx(2 / 2**30)
    assert paired_difference(before, before)["p_sign"] == 1.0  # nothing moved
    for bad in ((-1, 3), (2.5, 1)):
        with pytest.raises(ValueError, match="count|whole number"):
            sign_test(*bad)


def _seed_runs(changes, n=120, seed=0):
    """Per seed, 0/1 scores before and after whose paired change is ``changes[seed]``."""
    rng = np.random.default_rng(seed)
    runs = {}
    for s, change in enumerate(changes):
        before = (rng.random(n) < 0.4).astype(float)
        after = before.copy()
        moved = rng.permutation(np.flatnonzero(before == 0 if change > 0 else before == 1))
        after[moved[: round(abs(change) * n)]] = 1.0 if change > 0 else 0.0
        ids = [f"q{i}" for i in range(n)]
        runs[s] = (dict(zip(ids, before, strict=True)), dict(zip(ids, after, strict=True)))
    return runs


def test_an_interval_over_seeds_resamples_the_seeds_not_only_their_questions():
    """Three runs whose changes disagree (+0.10, -0.05, +0.10): pooling their questions into
    one bootstrap reads the seeds as one run and excludes 0; resampling the seeds, then
    each one's questions, does not."""
    runs = _seed_runs([0.10, -0.05, 0.10])
    first = {f"{s}:{q}": v for s, (b, _) in runs.items() for q, v in b.items()}
    second = {f"{s}:{q}": v for s, (_, a) in runs.items() for q, v in a.items()}
    assert paired_difference(first, second)["low"] > 0
    seeded = seeded_paired_difference(runs)
    assert seeded["diff"] == pytest.approx(0.05) and seeded["low"] < 0 < seeded["high"]
    assert (seeded["n"], seeded["seeds"], seeded["better"], seeded["worse"]) == (360, 3, 24, 6)
    assert seeded["p_sign"] is None  # three runs' questions are not one sample to test
    assert seeded == seeded_paired_difference(runs)  # seeded
    # runs that agree keep an interval that excludes 0
    assert seeded_paired_difference(_seed_runs([0.10, 0.08, 0.10]))["low"] > 0
    # one seed: the questions' bootstrap, paired_difference's to the digit
    alone = seeded_paired_difference({0: runs[0]})
    plain = paired_difference(*runs[0])
    assert (alone["diff"], alone["low"], alone["high"], alone["p_sign"]) == (
        plain["diff"],
        plain["low"],
        plain["high"],
        plain["p_sign"],
    )
    with pytest.raises(ValueError, match="seed 1: before and after score different questions"):
        seeded_paired_difference({0: runs[0], 1: (runs[1][0], {"q0": 1.0})})


def test_a_mean_over_seeds_has_the_two_level_interval():
    same = {s: [0.0, 1.0] * 50 for s in range(3)}
    result = seeded_mean(same)
    assert result["mean"] == 0.5 and result["seeds"] == 3 and result["n"] == 300
    assert result["low"] < 0.5 < result["high"]  # the questions' spread is still there
    constant = seeded_mean({0: [1.0] * 10, 1: {"a": 1.0, "b": 1.0}})
    assert (constant["low"], constant["high"]) == (1.0, 1.0)  # equal weight per seed
    apart = seeded_mean({0: [0.0] * 100, 1: [1.0] * 100})  # two seeds that disagree fully
    assert apart["mean"] == 0.5 and apart["low"] == 0.0 and apart["high"] == 1.0
    for empty in ({}, []):
        with pytest.raises(ValueError, match="seed 1 needs one score per question"):
            seeded_mean({0: [1.0], 1: empty})


def test_a_large_evaluation_is_resampled_in_chunks_with_the_same_interval():
    """51k questions (Search-R1's test sets) x 10,000 resamples would hold 4 GB of indices
    at once; resampled in chunks, the interval is the one the normal approximation gives."""
    rng = np.random.default_rng(1)
    before = (rng.random(51_000) < 0.4).astype(float)
    after = np.where(rng.random(51_000) < 0.05, 1.0 - before, before)
    change = paired_difference(before, after, resamples=400)
    delta = after - before
    half = 1.96 * delta.std() / np.sqrt(delta.size)
    assert change["low"] == pytest.approx(delta.mean() - half, abs=half * 0.2)
    assert change["high"] == pytest.approx(delta.mean() + half, abs=half * 0.2)


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


def _answered(batch, right):
    """``batch`` with a final answer per trajectory: the gold where ``right`` says 1, else
    a wrong one; outcome rewards of 1 everywhere (as a lenient reward might give)."""
    answers = ["Ada Quill" if r else "Ada Quill of Tarsk" for r in right]
    return batch.with_traj_columns(
        {
            "answer": answers,
            "gold_answers": [["Ada Quill"]] * len(right),
            "outcome_reward": [1.0] * len(right),
        }  # fmt: skip
    )


def test_the_evaluation_scores_exact_match_whatever_the_training_reward():
    """Under generator.reward subem a longer answer holding the gold gets outcome 1; the
    held-out EM still counts it wrong, and a trajectory with no answer is wrong."""
    from ray_credit.pipeline.evaluation import eval_summary
    from ray_credit.testing import random_batch

    batch = _answered(random_batch(0, num_groups=3, group_size=1), [1, 0, 1])
    batch = batch.with_traj_columns({"data_source": ["synthetic_1hop"] * 3})
    summary = eval_summary(batch)
    assert list(summary["correct"].values()) == [1, 0, 1] and summary["em"] == pytest.approx(2 / 3)
    unanswered = batch.with_traj_columns({"answer": ["Ada Quill", None, None]})
    assert list(eval_summary(unanswered)["correct"].values()) == [1, 0, 0]


def test_eval_summary_change_and_plot(tmp_path):
    from ray_credit.pipeline.evaluation import describe_change, eval_change, eval_summary
    from ray_credit.pipeline.outputs import plot, smooth
    from ray_credit.testing import random_batch

    batch = _answered(random_batch(0, num_groups=6, group_size=1), [1, 0, 0, 1, 1, 0])
    batch = batch.with_traj_columns({"data_source": ["synthetic_1hop", "synthetic_2hop"] * 3})
    summary = eval_summary(batch)
    assert list(summary["correct"].values()) == [1, 0, 0, 1, 1, 0]
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
    batch = _answered(batch, [1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0])
    batch = batch.with_traj_columns({"data_source": sources})
    summary = eval_summary(batch)
    assert summary["samples"] == 3 and summary["questions"] == 4
    assert list(summary["correct"].values()) == pytest.approx([1 / 3, 1.0, 0.0, 2 / 3])
    assert summary["em"] == pytest.approx(0.5) and summary["em_interval"] is None
    assert summary["em_by_source"] == pytest.approx({"synthetic_1hop": 1 / 6,
                                                     "synthetic_2hop": 5 / 6})  # fmt: skip
    greedy = eval_summary(_answered(random_batch(0, num_groups=4, group_size=1),
                                    [1, 0, 0, 1]).with_traj_columns(
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
