"""The rollout services together on a local Ray cluster, with the embedded defaults.

SmolLM2-135M rolls out against a MiniLM index over the synthetic world; the judge pool
and the info-gain scorer add their signals; every registered estimator accepts the
result. Figures (recall@k, logprob alignment) are printed for the record (pytest -s).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_credit.actors.generator import GeneratorConfig, make_generator_actor  # noqa: E402
from ray_credit.actors.judge import JudgePool  # noqa: E402
from ray_credit.actors.retriever import make_retriever_actor  # noqa: E402
from ray_credit.actors.scorer import make_scorer_actor  # noqa: E402
from ray_credit.batch import TrajectoryBatch  # noqa: E402
from ray_credit.data import WorldConfig, make_world  # noqa: E402
from ray_credit.estimators import ESTIMATORS  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from ray_credit.testing import max_logprob_gap  # noqa: E402

TOPK = 3


# the rollout-quality figures of docs/benchmarks.md (an index over 537 questions' corpus,
# SmolLM2 rollouts): the second test command's
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def world():
    return make_world(WorldConfig(seed=0, num_entities=80))


@pytest.fixture(scope="module")
def retriever(ray_cluster, world):
    return make_retriever_actor(world.corpus, num_cpus=0.5)


def test_recall_at_k_of_supporting_documents(ray_cluster, world, retriever):
    """The question text alone finds its first-hop supporting document; the second hop of a
    2-hop question needs the bridge entity, which only a search after the first one has."""
    questions = world.questions
    hits = ray_cluster.get(retriever.search.remote([q["question"] for q in questions], TOPK))
    first, every = [], []
    for q, hit in zip(questions, hits, strict=True):
        ids = {str(h["id"]) for h in hit}
        first.append(q["supporting_doc_ids"][0] in ids)
        every.append(set(q["supporting_doc_ids"]) <= ids)
    recall, recall_all = float(np.mean(first)), float(np.mean(every))
    print(
        f"\nrecall@{TOPK} over {len(questions)} questions: first supporting document "
        f"{recall:.3f}, every supporting document {recall_all:.3f}"
    )
    assert recall >= 0.95
    assert recall_all < recall  # 2-hop questions are not answered by one search


@pytest.mark.slow
def test_full_rollout_with_signals_feeds_every_estimator(ray_cluster, world, retriever):
    config = GeneratorConfig(
        group_size=2,
        max_turns=3,
        max_new_tokens=40,
        prompt_template="search_tags_fewshot",
        response_prefix="<search>",
        seed=0,
    )
    # num_cpus=2: Ray gives an actor as many torch threads as CPUs it asks for
    generator = make_generator_actor("smollm2-135m", retriever, config, num_cpus=2)
    questions = world.questions[:2]  # 2 groups of 2: SmolLM2 on CPU, a few turns each
    ref = generator.generate.remote(questions)
    assert isinstance(ref, ray_cluster.ObjectRef)  # batches move as object-store references
    batch: TrajectoryBatch = ray_cluster.get(ref, timeout=600)
    ray_cluster.kill(generator)  # frees its CPUs for the scorer and the judges
    assert len(batch) == 4 and batch.num_groups == 2
    assert batch.metrics["gen/searches"] > 0  # the retriever was used
    records = batch.to_records()
    for row in records:
        assert len(row["turns"]) == len(row["turn_doc_ids"]) == len(row["turn_contains_gold"])
        assert row["supporting_doc_ids"] and row["data_source"]

    # Token/mask/logprob alignment against a teacher-forced pass of the same weights.
    model, _ = load_model("smollm2-135m")
    worst = max_logprob_gap(model, batch)
    for row in records:
        mask = np.array(row["loss_mask"][1:]) == 1
        assert (np.array(row["behavior_logprobs"][1:])[~mask] == 0).all()
    print(
        f"\nmax |behavior - teacher-forced logprob| over {len(records)} trajectories: {worst:.2e}"
    )
    assert worst < 1e-3

    scorer = make_scorer_actor("smollm2-135m", num_cpus=0.5)
    batch = ray_cluster.get(scorer.score.remote(batch), timeout=600)
    judges = JudgePool(backend="evidence")
    for signal in ("cw_grpo_judgement", "search_p1_evaluation"):
        batch = judges.judge(signal, batch)
    for name, estimator in ESTIMATORS.items():
        out = estimator(batch)
        advantages = out.turn_values("turn_advantages")
        assert advantages.shape == (batch.num_turns,) and np.isfinite(advantages).all(), name
