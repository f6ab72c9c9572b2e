"""JudgePool on Ray actors: same judgements as in process, bounded concurrency, ObjectRef input."""

from __future__ import annotations

import pytest

from ray_credit.actors.judge import JudgePool
from tests.unit.test_judge import GOOD, _server_reply, batch_of, fake_openai_server, traj

ray = pytest.importorskip("ray")


def mixed_batch():
    """Twelve trajectories: searches that find new, repeated or no supporting documents,
    right and wrong answers, failed trajectories and one without supporting documents."""
    records = []
    for i in range(12):
        found = [["d1"], ["x"], ["d2", "d1"], ["d1"]][: 1 + i % 4]
        actions = ["search"] * len(found) + ["answer"]
        right = i % 3 != 0
        records.append(
            traj(
                i,
                actions,
                reward=float(right),
                answer="Velmora Hall" if right else "nowhere",
                docs=[*found, None],
                obs=["seal in Velmora Hall"] * len(found) + [None],
                support=None if i == 7 else ("d1", "d2"),
                group=f"g{i // 4}",
            )
        )
    return batch_of(*records)


def columns(batch, names):
    return {name: batch.table.column(name).to_pylist() for name in names}


def test_actors_match_in_process(ray_cluster):
    batch = mixed_batch()
    local = JudgePool("evidence", num_actors=0, skip_failed=False)
    pool = JudgePool("evidence", num_actors=2, batch_size=5, max_concurrency=3, skip_failed=False)
    names = ["judge_utility", "judge_correct"]
    want, got = local.annotate_cw_grpo(batch), pool.annotate_cw_grpo(batch)
    assert columns(got, names) == columns(want, names)
    assert got.metrics["judge/calls"] > 2  # split into several chunks across the actors
    sp1 = [
        "sp1_planner_score",
        "sp1_effective_steps_self",
        "sp1_effective_steps_ref",
        "sp1_outcome_accuracy",
    ]
    assert columns(pool.annotate_search_p1(batch), sp1) == columns(
        local.annotate_search_p1(batch), sp1
    )
    for name in ("judge/requests", "judge/no_evidence"):
        assert pool.metrics()[name] == local.metrics()[name]


def test_object_ref_input(ray_cluster):
    batch = mixed_batch()
    pool = JudgePool("evidence", num_actors=1)
    from_ref = pool.annotate_cw_grpo(ray.put(batch))
    assert columns(from_ref, ["judge_utility"]) == columns(
        JudgePool().annotate_cw_grpo(batch), ["judge_utility"]
    )


def test_bounded_concurrency(ray_cluster):
    """Twelve one-prompt chunks against a slow server: never more than max_concurrency
    requests at once, and the pool does use that much."""
    batch = batch_of(
        *[traj(i, ["answer"], reward=1, answer="x", question=f"question {i}?") for i in range(12)]
    )
    with fake_openai_server(lambda n, _: (200, _server_reply(GOOD), 0.25)) as (url, state):
        pool = JudgePool(
            "openai",
            num_actors=2,
            max_concurrency=3,
            batch_size=1,
            base_url=url,
            model="judge",
            timeout_s=10,
        )
        out = pool.annotate_cw_grpo(batch)
    assert out.table.column("judge_utility").to_pylist() == [[1]] * 12
    assert state["n"] == 12
    assert 2 <= state["peak"] <= 3
    assert out.metrics["judge/max_in_flight"] == 3
