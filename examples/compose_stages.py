"""Your own training loop from the library's pieces: a retriever, two generators running
ahead of a learner, a judge, a user-written stage and an estimator.

    python examples/compose_stages.py                         # tiny-random, under a minute
    python examples/compose_stages.py --model smollm2-135m --pipeline.steps 4
    RAY_ADDRESS=auto python examples/compose_stages.py        # on a running cluster

The stage list is plain Python: any ``batch -> batch`` function goes in. Here a user
stage drops the advantage of trajectories that never searched (a made-up rule, to show
the shape) and counts what it did in the batch's metrics, which the loop reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import ray

from ray_credit import (
    GeneratorConfig,
    JudgePool,
    LearnerConfig,
    LearnerGroup,
    Pipeline,
    PipelineConfig,
    TrajectoryBatch,
    WorldConfig,
    estimator_stage,
    make_generator_actor,
    make_retriever_actor,
    make_world,
    parse_config,
)


@dataclass(frozen=True)
class PipelineFlags:
    """How long the loop runs (a pipeline's --pipeline.* of the same name)."""

    steps: int = 3
    """Learner updates, each on 4 questions x G=4 trajectories."""


@dataclass(frozen=True)
class Flags:
    """What this example trains."""

    model: str = "tiny-random"
    """Policy: an embedded name, an HF id or a folder."""
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)


def no_search_no_credit(batch: TrajectoryBatch) -> TrajectoryBatch:
    """Zero the turn advantages of trajectories without a search (and count them)."""
    actions = [[t["action"] for t in turns] for turns in batch.column("turns").to_pylist()]
    searched = np.array(["search" in a for a in actions])
    advantages = batch.turn_values("turn_advantages").copy()
    advantages[~searched[batch.turn_traj_index]] = 0.0
    return batch.with_turn_columns(
        {"turn_advantages": advantages},
        metrics={"user/no_search_trajectories": float((~searched).sum())},
    )


def main() -> None:
    args = parse_config(Flags, description=__doc__)  # --help: every flag, its default
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False)

    world = make_world(WorldConfig(seed=0, num_entities=30))
    retriever = make_retriever_actor(world.corpus, num_cpus=0.25)
    config = GeneratorConfig(
        group_size=4, max_turns=2, max_new_tokens=24, response_prefix="<search>",
        final_turn_prefix="<answer>", temperature=1.0,
    )  # fmt: skip
    generators = [
        make_generator_actor(args.model, retriever, config, num_cpus=0.5, name=f"g{i}")
        for i in range(2)
    ]
    learner = LearnerGroup(args.model, LearnerConfig(lr=1e-5), resources_per_worker={"CPU": 1})
    judges = JudgePool("evidence")  # deterministic: judges in each chunk's stage task

    stages = [  # run on every chunk as soon as it is generated
        judges.stage("cw_grpo_judgement"),  # CW-GRPO's per-turn judgements
        estimator_stage("cw_grpo"),  # -> turn_advantages
        no_search_no_credit,  # the user's rule, after the estimator
    ]
    pipeline = Pipeline(
        generators,
        learner,
        world.questions,
        stages,
        PipelineConfig(steps=args.pipeline.steps, groups_per_step=4, max_staleness=1),
        on_step=lambda m: print(
            f"step {m['pipeline/step']:.0f}: reward {m['train/reward_mean']:.3f}, "
            f"staleness<={m['staleness/max']:.0f}, judged {m.get('judge/requests', 0):.0f} turns, "
            f"no-search trajectories {m['user/no_search_trajectories']:.0f}, "
            f"loss {m['learner/loss']:+.4f}"
        ),
    )
    pipeline.run()
    print(f"trained groups {pipeline.trained_groups[0]}..{pipeline.trained_groups[-1]}, "
          f"policy version {pipeline.version}")  # fmt: skip
    learner.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
