"""The pipeline's per-step metrics and failure bookkeeping, computed without Ray."""

from __future__ import annotations

import pytest

from ray_credit.pipeline.runner import _judge_agreement, _outcome_metrics
from ray_credit.testing import make_batch


def test_judge_agreement_search_p1_counts_only_judged_trajectories():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "sp1_outcome_accuracy": 1.0},  # agree
            {"group": "a", "reward": 0.0, "sp1_outcome_accuracy": 0.5},  # judge says right
            {"group": "b", "reward": 0.0, "sp1_outcome_accuracy": 0.0},  # agree
            {"group": "b", "reward": 1.0, "sp1_outcome_accuracy": None},  # not judged
        ]
    )
    assert _judge_agreement(batch) == {"judge/agreement_n": 3.0, "judge/agreement_em": 2 / 3}


def test_judge_agreement_cw_grpo_reads_the_answer_turn():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 2, "judge_correct": [0, 1]},  # agree
            {"group": "a", "reward": 1.0, "turns": 2, "judge_correct": [1, 0]},  # disagree
            {"group": "b", "reward": 0.0, "turns": 1, "judge_correct": [None]},  # skipped
        ]
    )
    assert _judge_agreement(batch) == {"judge/agreement_n": 2.0, "judge/agreement_em": 0.5}
    nothing_judged = make_batch([{"reward": 0.0, "turns": 1, "judge_correct": [None]}])
    assert _judge_agreement(nothing_judged) == {"judge/agreement_n": 0.0}
    assert _judge_agreement(make_batch([{"reward": 1.0}])) == {}


def test_outcome_metrics_group_make_up_and_first_gold_turn():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 3, "turn_contains_gold": [0, 1, 1]},
            {"group": "a", "reward": 0.0, "turns": 2, "turn_contains_gold": [1, 0]},  # near miss
            {"group": "b", "reward": 0.0, "turns": 1, "turn_contains_gold": [0]},
            {"group": "b", "reward": 0.0, "turns": 1, "turn_contains_gold": [0]},
        ]
    )
    m = _outcome_metrics(batch)
    assert m["train/em"] == 0.25 and m["train/reward_mean"] == 0.25
    assert m["train/groups_all_wrong"] == 0.5 and m["train/groups_mixed"] == 0.5
    assert m["train/groups_all_correct"] == 0.0
    assert m["train/gold_retrieved"] == 0.5 and m["train/near_miss"] == 0.25
    assert m["train/first_gold_turn"] == pytest.approx(0.5)  # turns 1 and 0


class _FailingPublisher:
    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error


def _bare_pipeline(publisher):
    from ray_credit.pipeline.runner import Pipeline

    pipeline = object.__new__(Pipeline)  # the failure bookkeeping only, no Ray
    pipeline.publisher, pipeline.generators, pipeline._chunks = publisher, [0, 1], {}
    pipeline._lost, pipeline._idle = set(), [0, 1]
    recovered = []
    pipeline._recover = recovered.append
    return pipeline, recovered


def test_a_failed_publication_on_the_learner_side_is_never_swallowed():
    from ray_credit.pipeline.weights import WeightSyncError

    learner_side = WeightSyncError("broadcasting failed on the learner")  # no target named
    pipeline, recovered = _bare_pipeline(_FailingPublisher(learner_side))
    with pytest.raises(WeightSyncError, match="on the learner"):
        pipeline._wait_publication()
    refused = WeightSyncError("bad weights", failed=[(1, "ValueError: shape")])  # not a death
    pipeline, recovered = _bare_pipeline(_FailingPublisher(refused))
    with pytest.raises(WeightSyncError, match="bad weights"):
        pipeline._wait_publication()
    died = WeightSyncError("generator1 died", failed=[(1, "died")], died=[1])
    pipeline, recovered = _bare_pipeline(_FailingPublisher(died))
    pipeline._wait_publication()  # an idle generator that died is recovered here
    assert recovered == [1] and pipeline._idle == [0]
