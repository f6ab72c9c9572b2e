"""The learner as one Ray actor and as a two-worker Ray Train group (gloo DDP, and FSDP2
sharding): the same update on the same data."""

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


@pytest.fixture(scope="module")
def batch():
    config = GeneratorConfig(group_size=4, max_turns=2, max_new_tokens=10, seed=2)
    rollouts = Generator(load_model("tiny-random"), WordRetriever(), config).generate(QUESTIONS)
    advantages = np.random.default_rng(1).normal(size=rollouts.num_turns).astype(np.float32)
    return rollouts.with_turn_columns({"turn_advantages": advantages})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_workers_make_the_same_update_as_one(ray_cluster, batch, tmp_path, strategy):
    ref = ray_cluster.put(batch)
    single = LearnerGroup("tiny-random", CONFIG, timeout_s=300)
    one = single.train(ref)
    one_weights = ray_cluster.get(single.weights())
    single.shutdown()

    group = LearnerGroup("tiny-random", CONFIG, num_workers=2, timeout_s=300, strategy=strategy)
    try:
        two = group.train(ref)
        two_weights = ray_cluster.get(group.weights())
        assert group.policy_version == 1
        saved = group.save(str(tmp_path / "ckpt"))
        assert (tmp_path / "ckpt" / "learner_state.pt").is_file() and saved.endswith("ckpt")
        if strategy == "fsdp":  # the gathered checkpoint reloads into a sharded group
            group.shutdown()
            group = LearnerGroup(
                "tiny-random", CONFIG, num_workers=2, timeout_s=300, strategy=strategy,
                resume_from=saved,
            )  # fmt: skip
            assert group.policy_version == 1
            reloaded = ray_cluster.get(group.weights())
            assert all(torch.equal(reloaded[k], two_weights[k]) for k in two_weights)
            group.train(ref)  # the restored optimizer state steps on
            assert group.policy_version == 2
        with pytest.raises(
            LearnerWorkerError,
            match=r"rank \d failed during 'train'(.|\n)*cannot give each of 2 rank",
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
    worst = max(float((one_weights[k] - two_weights[k]).abs().max()) for k in one_weights)
    assert worst < 0.05 * CONFIG.lr, worst
