"""The pipeline's per-step metrics (combined from chunk summaries and reports exactly as
from one batch) and failure bookkeeping, computed without Ray."""

from __future__ import annotations

import numpy as np
import pytest

from ray_credit.estimators import get_estimator
from ray_credit.pipeline.report import (
    chunk_report,
    generation_summary,
    oldest_versions,
    staleness_of,
    step_metrics,
)
from ray_credit.pipeline.weights import WeightPublisher
from ray_credit.signals import get_signal
from ray_credit.testing import make_batch, random_batch

SP1 = get_signal("search_p1_evaluation")
CW = get_signal("cw_grpo_judgement")


def test_search_p1_agreement_counts_only_judged_trajectories():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "sp1_outcome_accuracy": 1.0},  # agree
            {"group": "a", "reward": 0.0, "sp1_outcome_accuracy": 0.5},  # judge says right
            {"group": "b", "reward": 0.0, "sp1_outcome_accuracy": 0.0},  # agree
            {"group": "b", "reward": 1.0, "sp1_outcome_accuracy": None},  # not judged
        ]
    )
    assert SP1.agreement(batch) == (2, 3)


def test_cw_grpo_agreement_reads_the_answer_turn():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 2, "judge_correct": [0, 1]},  # agree
            {"group": "a", "reward": 1.0, "turns": 2, "judge_correct": [1, 0]},  # disagree
            {"group": "b", "reward": 0.0, "turns": 1, "judge_correct": [None]},  # skipped
        ]
    )
    assert CW.agreement(batch) == (1, 2)
    assert CW.agreement(make_batch([{"reward": 0.0, "turns": 1, "judge_correct": [None]}])) == (
        0,
        0,
    )


def _report(batch, **stage_metrics):
    return chunk_report(batch.with_metrics(stage_metrics), {"estimator": 0.5})


def test_outcome_metrics_group_make_up_and_first_gold_turn():
    batch = make_batch(
        [
            {"group": "a", "reward": 1.0, "turns": 3, "turn_contains_gold": [0, 1, 1]},
            {"group": "a", "reward": 0.0, "turns": 2, "turn_contains_gold": [1, 0]},  # near miss
            {"group": "b", "reward": 0.0, "turns": 1, "turn_contains_gold": [0]},
            {"group": "b", "reward": 0.0, "turns": 1, "turn_contains_gold": [0]},
        ]
    )
    m = step_metrics([generation_summary(batch)], [_report(batch)], version=0)
    assert m["train/em"] == 0.25 and m["train/reward_mean"] == 0.25
    assert m["train/groups_all_wrong"] == 0.5 and m["train/groups_mixed"] == 0.5
    assert m["train/groups_all_correct"] == 0.0
    assert m["train/gold_retrieved"] == 0.5 and m["train/near_miss"] == 0.25
    assert m["train/first_gold_turn"] == pytest.approx(0.5)  # turns 1 and 0
    assert m["time/stage_estimator_s"] == 0.5


def test_chunks_combine_exactly_as_one_batch():
    """Split at group boundaries, the step's metrics from the chunks' summaries and
    reports are those of the whole batch (rates derived after the sums)."""
    batch = get_estimator("grpo")(random_batch(3, num_groups=9, group_size=4, max_turns=4))
    parts = np.random.default_rng(0).integers(0, 3, batch.num_groups)[batch.group_index]
    chunks = [batch.select(np.flatnonzero(parts == k)) for k in range(3)]
    whole = step_metrics([generation_summary(batch)], [_report(batch)], version=0)
    split = step_metrics(
        [generation_summary(c) for c in chunks], [_report(c) for c in chunks], version=0
    )
    for key, value in whole.items():
        if key.startswith(("train/", "staleness/", "gen/")):
            assert split[key] == pytest.approx(value), key
    assert "train/groups_zero_advantage" in whole


def test_stage_metrics_are_combined_by_their_names():
    gold = {"turn_contains_gold": [0]}
    a = make_batch([{"group": "a", "reward": 1.0, **gold}, {"group": "a", "reward": 0.0, **gold}])
    b = make_batch(
        [{"group": "b", "reward": 1.0, **gold}] * 2 + [{"group": "c", "reward": 1.0, **gold}] * 2
    )
    reports = [
        _report(
            a, **{"x/count": 2, "x/share_frac": 1.0, "x/max_in_flight": 3, "s/policy_version": 4}
        ),
        _report(
            b, **{"x/count": 3, "x/share_frac": 0.25, "x/max_in_flight": 2, "s/policy_version": 5}
        ),
        _report(b, **{"judge/agreement_hits": 1, "judge/agreement_n": 4}),
    ]
    summaries = [generation_summary(x) for x in (a, b, b)]
    m = step_metrics(summaries, reports, version=0)
    assert m["x/count"] == 5 and m["x/max_in_flight"] == 3 and m["s/policy_version"] == 4
    assert m["x/share_frac"] == pytest.approx((2 * 1.0 + 4 * 0.25) / 6)  # by trajectories
    assert m["judge/agreement_em"] == 0.25 and m["time/stage_estimator_s"] == 1.5


def test_staleness_from_the_oldest_turn_of_each_trajectory():
    batch = make_batch(
        [
            {"reward": 0.0, "turns": 3, "turn_contains_gold": [0, 0, 0]},
            {"reward": 1.0, "turns": 1, "turn_contains_gold": [1]},
        ]
    )
    turns = batch.column("turns").to_pylist()
    for t, v in zip(turns[0], (2, 3, 3), strict=True):
        t["policy_version"] = v
    turns[1][0]["policy_version"] = 3
    records = batch.to_records()
    for r, t in zip(records, turns, strict=True):
        r["turns"] = t
    from ray_credit.batch import TrajectoryBatch

    batch = TrajectoryBatch.from_records(records)
    assert oldest_versions(batch).tolist() == [2, 3]
    summary = generation_summary(batch)
    assert summary["oldest_versions"] == {2: 1, 3: 1}
    assert staleness_of([summary], version=4) == 2
    m = step_metrics([summary], [_report(batch)], version=4)
    assert m["staleness/1"] == 1 and m["staleness/2"] == 1 and m["staleness/max"] == 2
    assert m["staleness/mean"] == 1.5
    records[0]["turns"][0]["policy_version"] = None
    with pytest.raises(ValueError, match="no policy_version"):
        oldest_versions(TrajectoryBatch.from_records(records))


class _FailingPublisher:
    def __init__(self, error):
        self.error = error

    def pending_refs(self):
        return []  # nothing to wait on in slices: wait() settles it

    def wait(self):
        raise self.error


def _bare_pipeline(publisher):
    from ray_credit.pipeline.runner import Pipeline

    pipeline = object.__new__(Pipeline)  # the failure bookkeeping only, no Ray
    pipeline.publisher, pipeline.generators, pipeline._chunks = publisher, [0, 1], {}
    pipeline._lost, pipeline._queued, pipeline._epoch = set(), [0, 1], [0, 0]
    pipeline._epoch_published = [0, 0]  # no death handled since the weights were sent
    pipeline._progress = [0.0, 0.0]
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
    died = WeightSyncError("generators died", failed=[(0, "died"), (1, "died")], died=[0, 1])
    pipeline, recovered = _bare_pipeline(_FailingPublisher(died))
    pipeline._wait_publication()  # an idle generator that died is recovered here; a busy
    assert recovered == [0] and pipeline._epoch == [1, 0]  # one hears it from its call
    # generator 0's death was handled (its failed call) after the weights were sent: the
    # update that went to the killed process is not news of a second death
    pipeline, recovered = _bare_pipeline(_FailingPublisher(died))
    pipeline._queued, pipeline._epoch = [0, 0], [1, 0]
    pipeline._wait_publication()
    assert recovered == [1] and pipeline._epoch == [1, 1]


class _Loads(WeightPublisher):
    """A weight publisher for one target (the scorer) that records what it is sent; a load
    stays in flight until ``wait``."""

    def __init__(self):
        super().__init__(["scorer"], names=["target0"])
        self.loads: list[tuple[int, str]] = []

    def _send(self, version, weights):
        self.loads.append((version, weights))
        self._pending = [(0, f"load of version {version}")]

    def wait(self):
        self._pending = []
        return 0.0


def _gated_pipeline(targets):
    """A Pipeline's stage bookkeeping with weight targets, no Ray: each chunk's stages are
    recorded with the weights version the targets hold when they start."""
    from ray_credit.pipeline.runner import Pipeline

    pipeline = object.__new__(Pipeline)
    pipeline.target_publisher, pipeline.version, pipeline._chunks = targets, 0, {}
    pipeline._unloaded, pipeline._waiting, pipeline._redo = {}, [], []
    pipeline.failures, pipeline._stages = {"pipeline/chunks_redone": 0.0}, "stages"
    staged = []

    class StageTask:
        @staticmethod
        def remote(stages, batches):
            staged.append((batches[0], targets.version or 0))
            return f"{batches[0]} staged", f"{batches[0]} report"

    pipeline._stage_task = StageTask
    return pipeline, staged


def _generated(pipeline, start, version):
    from ray_credit.pipeline.runner import _Chunk

    chunk = _Chunk(start, 1, generator=0, min_version=version, batch=f"chunk{start}")
    chunk.summary = {"oldest_versions": {version: 4}}
    pipeline._chunks[start] = chunk
    return chunk


def _published(pipeline, version):
    """What Pipeline._publish does for the weight targets."""
    pipeline.version = version
    pipeline._unloaded[version] = f"w{version}"
    pipeline._advance_targets()


def test_each_chunk_is_scored_with_the_weights_that_sampled_it():
    """The weight targets (the info-gain scorer) load a version only once every chunk
    sampled with older weights is staged, and a chunk's stages wait until they hold its
    version: never scored by a newer policy than the one that acted, whatever the order in
    which generation, staging and training finish."""
    targets = _Loads()
    pipeline, staged = _gated_pipeline(targets)
    a, b = _generated(pipeline, 0, 0), _generated(pipeline, 1, 0)
    pipeline._start_stages(a)
    pipeline._start_stages(b)
    assert staged == [("chunk0", 0), ("chunk1", 0)]
    _published(pipeline, 1)  # the learner trained: version 1 to the generators
    c = _generated(pipeline, 2, 1)
    pipeline._start_stages(c)  # sampled with version 1, the scorer still on 0: it waits
    assert targets.loads == [] and pipeline._waiting == [c]
    a.report = {}
    pipeline._advance_targets()  # b, sampled with version 0, is still in its stages
    assert targets.loads == []
    b.report = {}
    pipeline._advance_targets()
    assert targets.loads == [(1, "w1")] and pipeline._waiting == [c]  # loading
    assert pipeline._targets_pending() == {
        "load of version 1": "the weight targets loading weights version 1"
    }
    pipeline._wait_targets()  # loaded: c's stages start on the weights that sampled it
    assert staged[-1] == ("chunk2", 1) and pipeline._waiting == []
    # Two versions published while a chunk sampled with the older one generates; one
    # made again (its generator died) holds nothing back: it samples anew.
    _published(pipeline, 2)
    d = _generated(pipeline, 3, 2)
    d.summary = None  # still generating
    _published(pipeline, 3)
    e = _generated(pipeline, 4, 3)
    pipeline._start_stages(e)
    c.report = {}
    pipeline._advance_targets()
    assert targets.loads[-1] == (2, "w2")  # d's weights, not the newest
    pipeline._wait_targets()
    assert pipeline._waiting == [e]
    pipeline._redo_chunk(d, "pipeline/chunks_redone")
    assert targets.loads[-1] == (3, "w3") and list(pipeline._unloaded) == []
    pipeline._wait_targets()
    assert staged[-1] == ("chunk4", 3) and pipeline._waiting == []
    # A chunk sampled with weights no longer held (restored from an older checkpoint
    # format) is staged at once, on the newer weights: the scorer counts its turns.
    old = _generated(pipeline, 5, 1)
    pipeline._start_stages(old)
    assert staged[-1] == ("chunk5", 3)


def test_without_weight_targets_a_chunk_is_staged_at_once():
    from ray_credit.pipeline.weights import WeightPublisher

    pipeline, staged = _gated_pipeline(WeightPublisher([]))
    _published(pipeline, 4)
    pipeline._start_stages(_generated(pipeline, 0, 2))
    pipeline._start_stages(_generated(pipeline, 1, 4))
    assert staged == [("chunk0", 0), ("chunk1", 0)] and pipeline._unloaded == {4: "w4"}


def _stream_pipeline(**config):
    """A Pipeline's dispatch bookkeeping, no Ray: submissions are recorded."""
    from ray_credit.pipeline.runner import Pipeline, PipelineConfig

    pipeline = object.__new__(Pipeline)
    pipeline.config = PipelineConfig(**config)
    pipeline.generators = [0, 1, 2]
    pipeline._queued, pipeline._epoch, pipeline._lost, pipeline._redo = (
        [0, 0, 0],
        [0, 0, 0],
        set(),
        [],
    )
    pipeline._chunks, pipeline.step, pipeline.version, pipeline._next = {}, 0, 0, 0
    pipeline._progress = [0.0, 0.0, 0.0]
    pipeline._incarnation = [None, None, None]
    pipeline.chunk = pipeline.config.chunk_groups or pipeline.config.groups_per_step
    pipeline.failures = {"pipeline/chunks_redone": 0.0, "pipeline/stale_chunks_redone": 0.0}
    pipeline.target_publisher = WeightPublisher([])  # no weight targets
    pipeline._unloaded, pipeline._waiting = {}, []
    submitted = []

    def submit(chunk, g):
        pipeline._queued[g] += 1
        chunk.generator, chunk.epoch, chunk.min_version = g, pipeline._epoch[g], pipeline.version
        submitted.append((chunk.start, chunk.size))

    pipeline._submit = submit
    return pipeline, submitted


def test_a_resumed_run_never_overlaps_a_restored_chunk():
    """Resumed with larger chunks than the checkpoint's: the chunk before a restored one is
    cut short, and each step is tiled exactly once."""
    from ray_credit.pipeline.runner import _Chunk

    pipeline, submitted = _stream_pipeline(steps=4, groups_per_step=8, max_staleness=1)
    pipeline.step, pipeline.version, pipeline._next = 1, 1, 8
    pipeline._chunks = {10: _Chunk(10, 2)}  # restored: generated before the checkpoint
    pipeline._dispatch()
    assert submitted == [(8, 2), (12, 4), (16, 8)]  # [8,10), then past [10,12)
    assert sum(c.size for s, c in pipeline._chunks.items() if 8 <= s < 16) == 8


def test_admission_follows_the_step_and_stops_at_the_run_end():
    pipeline, submitted = _stream_pipeline(steps=2, groups_per_step=4, max_staleness=1)
    pipeline.version = 7  # a learner resumed from elsewhere: admission follows the step
    pipeline._dispatch()
    assert submitted == [(0, 4), (4, 4)] and pipeline._admissible_end() == 8
    pipeline.step = 1
    assert pipeline._admissible_end() == 8  # no step 2 to generate for


def test_a_chunk_generated_on_older_weights_than_sent_is_redone(monkeypatch):
    """A generator Ray restarted before the driver heard of it runs its queued chunks on
    base weights: they are redone, and the restart is handled once."""
    import ray

    from ray_credit.pipeline.runner import _Chunk

    pipeline, submitted = _stream_pipeline(steps=4, groups_per_step=4, max_staleness=1)
    pipeline.version = 2
    recovered = []
    pipeline._recover = recovered.append
    chunks = [_Chunk(0, 2), _Chunk(2, 2)]
    for chunk in chunks:
        pipeline._submit(chunk, 1)  # min_version 2
        chunk.summary_ref = object()
    monkeypatch.setattr(ray, "get", lambda ref: {"oldest_versions": {0: 4}, "gen": {}})
    for chunk in chunks:
        pipeline._on_generated(chunk)
    assert recovered == [1] and pipeline._epoch[1] == 1
    assert pipeline.failures["pipeline/stale_chunks_redone"] == 2
    assert pipeline._redo == chunks and all(c.summary is None for c in chunks)


def test_a_generator_restarted_between_calls_is_counted(monkeypatch, capsys):
    """A generator whose process died while it waited (no call failed: Ray restarted it,
    and the next publication made it current) is seen in its next chunk, which comes
    from another process: counted once and said, and the chunk is used, not redone."""
    import ray

    from ray_credit.pipeline.runner import _Chunk

    pipeline, _ = _stream_pipeline(steps=4, groups_per_step=4, max_staleness=1)
    pipeline.failures["pipeline/generator_restarts"] = 0.0
    staged = []
    pipeline._start_stages = staged.append
    pipeline.version = 2
    chunks = [_Chunk(0, 2), _Chunk(2, 2), _Chunk(4, 2), _Chunk(6, 2)]
    for chunk, process in zip(chunks, ["p1", "p1", "p2", "p2"], strict=True):
        pipeline._submit(chunk, 1)
        chunk.summary_ref = {"oldest_versions": {2: 4}, "gen": {}, "incarnation": process}
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    for chunk in chunks:
        pipeline._on_generated(chunk)
    assert staged == chunks and not pipeline._redo  # sound chunks: none redone
    assert pipeline.failures["pipeline/generator_restarts"] == 1
    out = capsys.readouterr().out
    assert out.count("generator1 was restarted by Ray: its process died between calls") == 1
    assert "groups [4, 6)" in out
    # after a death the driver handled (a call failed), the new process is counted, unsaid
    pipeline._epoch[1] += 1
    later = _Chunk(8, 2)
    pipeline._submit(later, 1)
    later.summary_ref = {"oldest_versions": {2: 4}, "gen": {}, "incarnation": "p3"}
    pipeline._on_generated(later)
    assert pipeline.failures["pipeline/generator_restarts"] == 2
    assert "restarted by Ray" not in capsys.readouterr().out


def test_step_stage_outcome_is_not_counted_twice():
    batch = get_estimator("grpo")(random_batch(4, num_groups=4, group_size=2, max_turns=3))
    parts = [
        batch.select(np.flatnonzero(batch.group_index < 2)),
        batch.select(np.flatnonzero(batch.group_index >= 2)),
    ]
    raw = [_report(p.select(range(len(p)))) for p in parts]
    step = _report(batch)
    m = step_metrics(
        [generation_summary(p) for p in parts], [*raw, step], version=0, outcome_from=step
    )
    whole = step_metrics([generation_summary(batch)], [step], version=0)
    assert m["train/tokens"] == whole["train/tokens"] and m["train/em"] == whole["train/em"]
    assert m["train/groups_zero_advantage"] == whole["train/groups_zero_advantage"]


def test_overlap_of_a_stage_with_training():
    from ray_credit.pipeline.runner import _overlap

    assert _overlap((0.0, 10.0), [(2.0, 4.0), (8.0, 12.0)]) == 4.0
    assert _overlap((5.0, 6.0), [(2.0, 4.0)]) == 0.0
