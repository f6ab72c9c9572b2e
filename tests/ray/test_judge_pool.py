"""JudgePool on Ray actors: the same judgements as in process, bounded concurrency,
ObjectRef input, a judge actor dying mid-call (its chunk goes again), and the pipeline
stage running in a Ray task."""

from __future__ import annotations

import json
import os

import pytest

from ray_credit.actors.judge import JudgePool
from tests.unit.test_judge import CW, GOOD, _server_reply, batch_of, fake_openai_server, traj

ray = pytest.importorskip("ray")


class LengthGrades:
    """A deterministic judge backend: grades from the prompt's length."""

    def complete(self, prompts, counts):
        return [
            json.dumps({"retrieval_reward": len(p) % 2, "thinking_reward": len(p) // 2 % 2})
            for p in prompts
        ]


class DiesOnce(LengthGrades):
    """Kills its process on the first call (Ray restarts the actor), then grades."""

    def __init__(self, marker: str):
        self.marker = marker

    def complete(self, prompts, counts):
        if not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return super().complete(prompts, counts)


def mixed_batch():
    """Twelve trajectories of one to four searches and an answer."""
    records = []
    for i in range(12):
        found = [["d1"], ["x"], ["d2", "d1"], ["d1"]][: 1 + i % 4]
        records.append(
            traj(
                i,
                ["search"] * len(found) + ["answer"],
                reward=float(i % 3 != 0),
                answer="Velmora Hall",
                docs=[*found, None],
                obs=["seal in Velmora Hall"] * len(found) + [None],
                group=f"g{i // 4}",
            )
        )
    return batch_of(*records)


def columns(batch, names=("judge_utility", "judge_correct")):
    return {name: batch.table.column(name).to_pylist() for name in names}


def test_actors_match_in_process_and_take_refs(ray_cluster):
    batch = mixed_batch()
    local = JudgePool(LengthGrades(), batch_size=5).judge(CW, batch)
    pool = JudgePool(LengthGrades(), num_actors=2, batch_size=5, max_concurrency=3, num_cpus=0)
    got = pool.judge(CW, batch)
    assert columns(got) == columns(local)
    assert got.metrics["judge/calls"] > 2  # several chunks across the actors
    assert got.metrics["judge/requests"] == local.metrics["judge/requests"]
    assert columns(pool.judge(CW, ray_cluster.put(batch))) == columns(local)


def test_a_judge_actor_dying_mid_call_is_retried(ray_cluster, tmp_path):
    batch = mixed_batch()
    pool = JudgePool(
        DiesOnce(str(tmp_path / "died")), num_actors=1, batch_size=100, num_cpus=0, max_retries=2
    )
    out = pool.judge(CW, batch)
    assert columns(out) == columns(JudgePool(LengthGrades()).judge(CW, batch))
    assert out.metrics["judge/actor_failures"] == 1 and out.metrics["judge/retries"] == 1
    assert "judge/failed" not in out.metrics


def test_stage_runs_in_a_task(ray_cluster):
    """What a pipeline does with a judge: the stage travels to a Ray task with the pool's
    actor handles and fills the signal there."""
    batch = mixed_batch()
    stage = JudgePool(LengthGrades(), num_actors=1, num_cpus=0).stage(CW)

    @ray_cluster.remote(num_cpus=0)
    def run(stage, batch):
        return stage(batch)

    assert columns(ray_cluster.get(run.remote(stage, batch))) == columns(
        JudgePool(LengthGrades()).judge(CW, batch)
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
            num_cpus=0,
        )
        out = pool.judge(CW, batch)
    assert out.table.column("judge_utility").to_pylist() == [[1]] * 12
    assert state["n"] == 12
    assert 2 <= state["peak"] <= 3
    assert out.metrics["judge/max_in_flight"] == 3


def test_a_judge_actor_gone_for_good_is_worked_around(ray_cluster):
    """One of two judge actors is killed for good: its chunks go to the other, every
    judgement is made, and the failures are counted."""
    batch = mixed_batch()
    pool = JudgePool(LengthGrades(), num_actors=2, batch_size=2, num_cpus=0, max_retries=3)
    ray_cluster.kill(pool._actors[0], no_restart=True)
    out = pool.judge(CW, batch)
    assert columns(out) == columns(JudgePool(LengthGrades()).judge(CW, batch))
    assert "judge/failed" not in out.metrics and out.metrics["judge/actor_failures"] >= 1
