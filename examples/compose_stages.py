"""Your own training loop from the library's pieces: a retriever, two generators running
ahead of a learner, an info-gain scorer, an estimator and a user-written stage.

    python examples/compose_stages.py                          # SmolLM2-135M, a few minutes
    python examples/compose_stages.py --model tiny-random      # the plumbing, under a minute
    RAY_ADDRESS=auto python examples/compose_stages.py         # on a running cluster

The credit is IGPO's: the scorer reads, under the current weights, how much likelier each
search made the gold answer, so a search earns credit even in a group whose answers are
all wrong (an untrained policy's usual group). The stage list is plain Python: any
``batch -> batch`` function goes in. Here a user stage after the estimator clips each
turn's advantage to [-3, 3] and counts the turns that carry credit, in the batch's
metrics, which the loop reports per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import ray

from ray_credit import (
    GeneratorConfig,
    LearnerConfig,
    LearnerGroup,
    Pipeline,
    PipelineConfig,
    TrajectoryBatch,
    WorldConfig,
    actor_stage,
    estimator_stage,
    make_generator_actor,
    make_retriever_actor,
    make_scorer_actor,
    make_world,
    parse_config,
)

CLIP = 3.0


@dataclass(frozen=True)
class PipelineFlags:
    """How long the loop runs (a pipeline's --pipeline.* of the same name)."""

    steps: int = 3
    """Learner updates, each on 4 questions x G=4 trajectories."""


@dataclass(frozen=True)
class Flags:
    """What this example trains."""

    model: str = "smollm2-135m"
    """Policy (and the scorer's weights): an embedded name, an HF id or a folder."""
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)


def clip_and_count(batch: TrajectoryBatch) -> TrajectoryBatch:
    """Clip each turn's advantage to [-CLIP, CLIP]; count the clipped turns and the turns
    with any credit at all (the loop sums a count over the step's chunks)."""
    advantages = batch.turn_values("turn_advantages").astype(np.float64)
    clipped = np.abs(advantages) > CLIP
    return batch.with_turn_columns(
        {"turn_advantages": np.clip(advantages, -CLIP, CLIP)},
        metrics={
            "user/clipped_turns": float(clipped.sum()),
            "user/credited_turns": float((np.abs(advantages) > 1e-6).sum()),
            "user/turns": float(len(advantages)),
        },
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
        group_size=4, max_turns=2, max_new_tokens=24, prompt_template="search_tags_fewshot",
        response_prefix="<search>", final_turn_prefix="<answer>", temperature=1.0,
    )  # fmt: skip
    generators = [
        make_generator_actor(args.model, retriever, config, num_cpus=0.5, name=f"g{i}")
        for i in range(2)
    ]
    learner = LearnerGroup(args.model, LearnerConfig(lr=1e-5), resources_per_worker={"CPU": 1})
    # IGPO's signal: gold-answer probabilities under the policy's weights, so the scorer
    # is a weight target of the loop, as the generators are
    scorer = make_scorer_actor(args.model, mode="prob_diff", num_cpus=0.5)

    stages = [  # run on every chunk as soon as it is generated
        actor_stage(scorer.score, name="info_gain"),  # -> turn_info_gain
        estimator_stage("igpo"),  # -> turn_advantages
        clip_and_count,  # the user's rule, after the estimator
    ]
    pipeline = Pipeline(
        generators,
        learner,
        world.questions,
        stages,
        PipelineConfig(steps=args.pipeline.steps, groups_per_step=4, max_staleness=1),
        weight_targets=[scorer],
        on_step=lambda m: print(
            f"step {m['pipeline/step']:.0f}: reward {m['train/reward_mean']:.3f}, "
            f"staleness<={m['staleness/max']:.0f}, turns with credit "
            f"{m['user/credited_turns']:.0f} of {m['user/turns']:.0f} "
            f"({m['user/clipped_turns']:.0f} clipped), loss {m['learner/loss']:+.4f}, "
            f"grad norm {m['learner/grad_norm']:.3f}"
        ),
    )
    pipeline.run()
    print(f"trained groups {pipeline.trained_groups[0]}..{pipeline.trained_groups[-1]}, "
          f"policy version {pipeline.version}")  # fmt: skip
    learner.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
