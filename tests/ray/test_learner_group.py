"""LearnerGroup on the local Ray cluster: one worker, and two gloo workers under DDP and
under FSDP2, make the same update on the same data; chunked input trains as the whole
batch; a failed or dead rank is named; a group the cluster cannot hold fails at once."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_credit.actors.generator import Generator, GeneratorConfig  # noqa: E402
from ray_credit.actors.learner import LearnerConfig  # noqa: E402
from ray_credit.actors.learner_group import LearnerGroup, LearnerWorkerError  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from tests.unit.test_generator import QUESTIONS, WordRetriever  # noqa: E402

CONFIG = LearnerConfig(lr=1e-3, mini_batches=2, kl_coef=0.1)
WORKER = {"CPU": 0.5}  # the test cluster has 4 logical CPUs
THIRD = {"id": "q3", "question": "What grows in Tarsk?", "golden_answers": ["barley"]}


@pytest.fixture(scope="module")
def batch():
    """Three groups of four rollouts of tiny-random, with fixed random turn advantages."""
    config = GeneratorConfig(group_size=4, max_turns=2, max_new_tokens=10, seed=2)
    generator = Generator(load_model("tiny-random"), WordRetriever(), config)
    rollouts = generator.generate([*QUESTIONS, THIRD])
    advantages = np.random.default_rng(1).normal(size=rollouts.num_turns).astype(np.float32)
    return rollouts.with_turn_columns({"turn_advantages": advantages})


@pytest.fixture(scope="module")
def single(ray_cluster, batch):
    """One worker's update on the whole batch: (metrics, weights after it)."""
    group = LearnerGroup("tiny-random", CONFIG, timeout_s=300, resources_per_worker=WORKER)
    try:
        metrics = group.train(ray_cluster.put(batch))
        return metrics, ray_cluster.get(group.weights())
    finally:
        group.shutdown()


def _max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# FSDP over two ranks is the second test command's
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.e2e)])
def test_two_workers_make_the_same_update_as_one(ray_cluster, batch, single, tmp_path, strategy):
    one, one_weights = single
    ref = ray_cluster.put(batch)
    kwargs = dict(num_workers=2, timeout_s=300, strategy=strategy, resources_per_worker=WORKER)
    group = LearnerGroup("tiny-random", CONFIG, **kwargs)
    try:
        two = group.train(ref)
        two_weights = ray_cluster.get(group.weights())
        assert group.policy_version == 1
        saved = group.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "learner_state.pt").is_file() and saved.endswith("ckpt")
        if strategy == "fsdp":  # the gathered checkpoint reloads into a sharded group
            group.shutdown()
            group = LearnerGroup("tiny-random", CONFIG, resume_from=saved, **kwargs)
            assert group.policy_version == 1
            reloaded = ray_cluster.get(group.weights())
            assert all(torch.equal(reloaded[k], two_weights[k]) for k in two_weights)
            group.train(ref)  # the restored optimizer state steps on
            assert group.policy_version == 2
        with pytest.raises(
            LearnerWorkerError,
            match=r"learner rank \d failed during 'train':(.|\n)*cannot give each of 2 rank",
        ):
            group.train(ray_cluster.put(batch.select([0])))  # fewer rows than ranks x mini-batches
    finally:
        group.shutdown()

    print(
        f"\nloss 1 worker {one['learner/loss']:.6g}, 2 workers {two['learner/loss']:.6g}; "
        f"grad norm {one['learner/grad_norm']:.6g} vs {two['learner/grad_norm']:.6g}"
    )
    assert two["learner/loss"] == pytest.approx(one["learner/loss"], rel=1e-5)
    assert two["learner/grad_norm"] == pytest.approx(one["learner/grad_norm"], rel=1e-5)
    assert two["learner/tokens"] == one["learner/tokens"]
    assert two["learner/trajectories"] == one["learner/trajectories"] == len(batch)
    # Adam divides by |g|, so float rounding in near-zero gradients moves a weight by a
    # fraction of lr; a wrong sharding or normalization moves weights by O(lr).
    worst = _max_diff(one_weights, two_weights)
    assert worst < 0.05 * CONFIG.lr, worst


def test_chunk_refs_train_as_the_whole_batch(ray_cluster, batch, single):
    """submit_train on a ref per group (the pipeline's staged chunks) is the same update as
    on the whole batch: the worker concatenates them in order."""
    one, one_weights = single
    starts = batch.group_starts
    assert batch.group_order is None and len(starts) == 3  # contiguous groups
    chunks = [batch.select(rows) for rows in np.split(np.arange(len(batch)), starts[1:])]
    group = LearnerGroup("tiny-random", CONFIG, timeout_s=300, resources_per_worker=WORKER)
    try:
        with pytest.raises(TypeError, match="ObjectRefs"):
            group.submit_train(chunks)  # batches themselves would be copied to every rank
        call = group.submit_train([ray_cluster.put(chunk) for chunk in chunks])
        assert call.what == "train" and len(call.refs) == 1
        ray_cluster.wait(list(call.refs), timeout=300)
        assert call.ready()
        chunked = call.result(timeout=0)
        assert _max_diff(one_weights, ray_cluster.get(group.weights())) == 0.0
    finally:
        group.shutdown()
    # the same update, but for its time and the process's memory (docs/metrics.md)
    timing = ("learner/seconds", "learner/tokens_per_s")
    assert {
        k: v for k, v in chunked.items() if k not in timing and not k.startswith("memory/")
    } == {k: v for k, v in one.items() if k not in timing and not k.startswith("memory/")}


@pytest.mark.e2e  # a rank killed: the second test command
def test_failed_and_dead_ranks_are_named(ray_cluster, batch):
    group = LearnerGroup(
        "tiny-random", CONFIG, num_workers=2, timeout_s=300, resources_per_worker=WORKER
    )
    try:
        sent = group.broadcast_weights()  # one ref for both ranks, read by check()
        with pytest.raises(
            LearnerWorkerError,
            match=r"learner rank 0 failed during 'broadcast_weights':(.|\n)*open_weight_group",
        ):
            group.check(ray_cluster.get(sent, timeout=300))
        ray_cluster.kill(group._workers[1])  # idle: it dies between commands
        with pytest.raises(LearnerWorkerError, match=r"learner rank 1 died during 'train'"):
            group.train(batch)
    finally:
        group.shutdown()


def test_a_group_the_cluster_cannot_hold_fails_naming_what_it_asked_for(ray_cluster):
    with pytest.raises(RuntimeError, match=r"could not place 2 worker\(s\) of \{'CPU': 3"):
        LearnerGroup("tiny-random", num_workers=2, resources_per_worker={"CPU": 3}, timeout_s=2)
