"""A user-defined credit estimator, used exactly like the built-in ones.

Nothing in ray_credit is edited: the estimator is a frozen config dataclass plus a pure
function, wrapped in an `Estimator` and registered at run time. Run it with

    python examples/custom_estimator.py                     # on a batch of one question
    python examples/custom_estimator.py --pipeline.steps 2  # and in a 2-step training run

The example estimator, "discounted_grpo", gives each turn the GRPO advantage of its
trajectory scaled by gamma ** (turns remaining), so early turns of a long trajectory get
less credit than the answer turn.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field

import numpy as np

from ray_credit import (
    Estimator,
    TrajectoryBatch,
    get_estimator,
    parse_config,
    register_estimator,
)
from ray_credit.testing import make_batch


@dataclass(frozen=True)
class DiscountedGRPOConfig:
    """Knobs of the example estimator."""

    gamma: float = 0.9
    """Per-turn discount applied backwards from the final turn."""

    def __post_init__(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")


def discounted_grpo(batch: TrajectoryBatch, config: DiscountedGRPOConfig) -> TrajectoryBatch:
    # Reuse a built-in estimator for the group-normalized outcome, then reshape per turn.
    grpo = get_estimator("grpo")(batch).turn_values("turn_advantages")
    remaining = np.repeat(batch.turn_counts, batch.turn_counts) - 1 - batch.turn_position
    return batch.with_turn_columns(
        {"turn_advantages": grpo * config.gamma**remaining},
        metrics={"discounted_grpo/mean_discount": float(np.mean(config.gamma**remaining))},
    )


ESTIMATOR = register_estimator(
    Estimator(
        name="discounted_grpo",
        fn=discounted_grpo,
        config_cls=DiscountedGRPOConfig,
        requires=("group_id", "outcome_reward", "turns"),
        description="GRPO advantage discounted by the number of turns left",
    )
)


def train_with_it(steps: int, model: str) -> None:
    """The estimator as the credit stage of a training run (the recipe behind every
    pipeline): generators, learner and the loop are the library's, the credit is ours.
    The run config has a section named after the estimator, as every pipeline's does.
    SmolLM2 is first warm-started on 24 scripted demonstrations, so that some answers of a
    group are right and GRPO-style credit has something to compare; a random policy
    (tiny-random) never answers right, and its run shows the plumbing only."""
    from ray_credit import RunConfig, load_config, train

    @dataclass(frozen=True)
    class DiscountedRun(RunConfig):
        discounted_grpo: DiscountedGRPOConfig = field(default_factory=DiscountedGRPOConfig)

    out = tempfile.TemporaryDirectory(prefix="custom_estimator_")  # removed at the end
    random = model == "tiny-random"
    argv = [
        "--name", "discounted-grpo", "--model", model, "--wandb", "disabled",
        "--output_dir", out.name, "--eval.enabled", "false",
        "--pipeline.steps", str(steps), "--pipeline.groups_per_step", "4",
        "--resources.learner_cpus", "1", "--discounted_grpo.gamma", "0.8",
        "--warm_start.enabled", str(not random), "--warm_start.questions", "24",
        # the transformers sampler starts in a second where a vLLM engine takes half a
        # minute: what a tiny model wants
        *(["--generator.backend", "transformers"] if random else []),
    ]  # fmt: skip
    cfg = load_config(DiscountedRun, "discounted_grpo", argv)  # on the embedded settings
    with out:
        summary = train(cfg, "discounted_grpo")
    last = summary["final_step_metrics"]
    credited = 1.0 - last["train/groups_zero_advantage"]
    print(
        f"trained {summary['steps']} steps with discounted_grpo: mean discount "
        f"{last['discounted_grpo/mean_discount']:.3f}, reward {last['train/reward_mean']:.3f}, "
        f"groups with credit in the last step {credited:.0%}, learner steps without a "
        f"gradient {last['learner/zero_gradient_batches']:.0f} of {summary['steps']}"
    )


@dataclass(frozen=True)
class PipelineFlags:
    """The training run (a pipeline's --pipeline.* of the same name)."""

    steps: int = 0
    """Learner updates of a training run with the estimator (0: no run, the batch only)."""


@dataclass(frozen=True)
class Flags:
    model: str = "smollm2-135m"
    """The training run's policy: SmolLM2, warm-started first (a few minutes), or
    tiny-random (a random policy: the plumbing in a minute, no credit to show)."""
    pipeline: PipelineFlags = field(default_factory=PipelineFlags)


def main() -> None:
    args = parse_config(Flags, description=__doc__)  # --help: every flag, its default
    # One question answered by four trajectories of 1-4 turns, two of them right: their
    # GRPO advantages differ, and the discount shrinks the early turns' share.
    batch = make_batch(
        [
            {"group": "q1", "reward": 1.0, "turns": 3},
            {"group": "q1", "reward": 0.0, "turns": 2},
            {"group": "q1", "reward": 1.0, "turns": 1},
            {"group": "q1", "reward": 0.0, "turns": 4},
        ]
    )
    out = get_estimator("discounted_grpo")(batch, gamma=0.5)  # by name, like any built-in
    for row in out.to_records():
        print(
            row["traj_id"],
            f"reward={row['outcome_reward']:.0f}",
            "turn advantages:",
            [round(a, 3) for a in row["turn_advantages"]],
        )
    print({k: round(v, 4) for k, v in out.metrics.items()})
    if args.pipeline.steps:
        train_with_it(args.pipeline.steps, args.model)


if __name__ == "__main__":
    main()
