"""The training stream's order with ``pipeline.stratify_by``: every window of a step's
length holds each value in its data share, give or take one; without it, one shuffle."""

from __future__ import annotations

import numpy as np
import pytest

from ray_credit.pipeline.runner import PipelineConfig, _strata, stratified_order


def _keys(n_one: int, n_two: int) -> list[int]:
    return [1] * n_one + [2] * n_two


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("window", [2, 3, 8])
def test_every_window_holds_each_value_in_its_share(seed, window):
    keys = _keys(176, 106)  # the embedded world's training split: 62 % 1-hop
    order = stratified_order(keys, np.random.default_rng(seed))
    assert sorted(order.tolist()) == list(range(len(keys)))  # a permutation
    two = np.array([keys[i] == 2 for i in order], dtype=float)
    share = 106 / 282
    counts = np.convolve(two, np.ones(window), mode="valid")
    assert np.all(np.abs(counts - window * share) < 1 + 1e-9), counts
    # steps tile the epoch: each of them in share too
    steps = two[: len(two) // window * window].reshape(-1, window).sum(axis=1)
    assert set(steps.tolist()) <= {np.floor(window * share), np.ceil(window * share)}


def test_a_plain_shuffle_does_not_hold_the_share():
    """What stratification buys: a plain permutation's 2-question steps are often 0 or 2
    two-hop questions."""
    keys = np.array(_keys(176, 106))
    two = keys[np.random.default_rng(0).permutation(len(keys))] == 2
    steps = two.reshape(-1, 2).sum(axis=1)
    assert (steps != 1).sum() > 40


def test_order_is_seeded_and_shuffles_within_a_value():
    keys = _keys(30, 20)
    a = stratified_order(keys, np.random.default_rng(3))
    assert np.array_equal(a, stratified_order(keys, np.random.default_rng(3)))
    b = stratified_order(keys, np.random.default_rng(4))
    assert not np.array_equal(a, b)
    ones = [i for i in a if keys[i] == 1]
    assert ones != sorted(ones)  # the 1-hop questions are shuffled among themselves


def test_one_value_is_a_plain_permutation_and_strings_work():
    order = stratified_order(["x"] * 7, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(7))
    mixed = stratified_order(["nq", "hotpot", "nq", "nq"], np.random.default_rng(1))
    assert sorted(mixed.tolist()) == [0, 1, 2, 3]


def test_a_question_without_the_field_is_named():
    questions = [{"hops": 1}, {"hops": 2}, {"question": "no hops"}]
    with pytest.raises(
        ValueError, match=r"1 of 3 training questions have no 'hops' \(the first: question 2\)"
    ):
        _strata(questions, "hops")
    assert _strata(questions[:2], "hops") == [1, 2]
    assert _strata(questions, None) is None
    with pytest.raises(ValueError, match="stratify_by must name a question field"):
        PipelineConfig(stratify_by="")
