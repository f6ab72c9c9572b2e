"""The rollout services from a user script: each one alone, then all of them feeding every
registered estimator.

    python examples/rollout_services.py                       # SmolLM2-135M, a few minutes on 2 cores
    python examples/rollout_services.py --model tiny-random   # seconds: the plumbing (a random
                                                              # policy never closes a search tag,
                                                              # so only information gain credits it)
    RAY_ADDRESS=auto python examples/rollout_services.py      # on a running cluster

1. a retriever actor (MiniLM + faiss over the synthetic corpus) answers a search;
2. a generator actor rolls out G trajectories per question against it and hands back an
   ObjectRef to a TrajectoryBatch;
3. the info-gain scorer and the evidence judge pool add their per-turn signals;
4. every estimator of the registry turns the batch into turn advantages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import ray

from ray_credit import (
    ESTIMATORS,
    GeneratorConfig,
    JudgePool,
    WorldConfig,
    make_generator_actor,
    make_retriever_actor,
    make_scorer_actor,
    make_world,
    parse_config,
)


@dataclass(frozen=True)
class GeneratorFlags:
    """The generator's settings (a pipeline's --generator.* of the same names)."""

    group_size: int = 4
    """G: trajectories sampled per question."""
    max_new_tokens: int = 48
    """Sampled tokens per turn."""


@dataclass(frozen=True)
class Flags:
    """What this example rolls out."""

    model: str = "smollm2-135m"
    """Policy (and the info-gain scorer's model): an embedded name, an HF id or a folder."""
    questions: int = 2
    """Questions of the synthetic world rolled out (G trajectories each)."""
    generator: GeneratorFlags = field(default_factory=GeneratorFlags)


def main() -> None:
    args = parse_config(Flags, description=__doc__)  # --help: every flag, its default
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False)

    world = make_world(WorldConfig(seed=0, num_entities=40))
    question = world.questions[0]

    # 1. The retriever alone.
    retriever = make_retriever_actor(world.corpus, num_cpus=0.5)
    [hits] = ray.get(retriever.search.remote([question["question"]], 3))
    print(f"Q: {question['question']}  (gold: {question['golden_answers'][0]})")
    for hit in hits:
        print(f"  {hit['score']:.3f}  {hit['id']}  {hit['contents'].splitlines()[0]}")

    # 2. The generator, against the retriever actor; the batch stays in the object store.
    config = GeneratorConfig(
        group_size=args.generator.group_size,
        max_turns=3,
        max_new_tokens=args.generator.max_new_tokens,
        prompt_template="search_tags_fewshot",
        response_prefix="<search>",
    )
    generator = make_generator_actor(args.model, retriever, config, num_cpus=2)
    batch_ref = generator.generate.remote(world.questions[: args.questions])

    # 3. Signals: info gain under the same weights, then the evidence judge.
    scorer = make_scorer_actor(args.model, num_cpus=1)
    batch = ray.get(scorer.score.remote(batch_ref))  # Ray resolves the ref in the actor
    judges = JudgePool("evidence")  # a deterministic rule: no model, no actors
    for signal in ("cw_grpo_judgement", "search_p1_evaluation"):
        batch = judges.judge(signal, batch)
    counters = {k: v for k, v in batch.metrics.items() if k.startswith(("gen/", "judge/"))}
    print(f"\n{len(batch)} trajectories, {batch.num_turns} turns; counters:")
    for key in sorted(counters):
        print(f"  {key} = {counters[key]:g}")

    # 4. Every estimator accepts the batch.
    # Advantages are centred within a group, so their mean says nothing: the table shows
    # their size and how many turns carry any credit at all. Where every answer of a group
    # is wrong, only turn-level signals (the retrieved gold, information gain, a judged
    # path) tell its turns apart: outcome-only estimators give them 0.
    right = int((batch.traj_values("outcome_reward") > 0).sum())
    print(f"\n{right} of {len(batch)} answers right")
    print(f"{'estimator':<10} {'mean |A|':>9} {'max |A|':>9}  turns with credit")
    for name, estimator in ESTIMATORS.items():
        advantages = np.abs(estimator(batch).turn_values("turn_advantages"))
        nonzero = np.count_nonzero(advantages > 1e-6)
        print(f"{name:<10} {advantages.mean():>9.3g} {advantages.max():>9.3g}  "
              f"{nonzero} of {len(advantages)}")  # fmt: skip
    ray.shutdown()


if __name__ == "__main__":
    main()
