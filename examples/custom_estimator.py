"""A user-defined credit estimator, used exactly like the built-in ones.

Nothing in ray_credit is edited: the estimator is a frozen config dataclass plus a pure
function, wrapped in an `Estimator` and registered at run time. Run it with

    python examples/custom_estimator.py

The example estimator, "discounted_grpo", gives each turn the GRPO advantage of its
trajectory scaled by gamma ** (turns remaining), so early turns of a long trajectory get
less credit than the answer turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_credit import Estimator, TrajectoryBatch, get_estimator, register_estimator
from ray_credit.testing import random_batch


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


def main() -> None:
    batch = random_batch(0, num_groups=4, group_size=4, max_turns=4)
    out = get_estimator("discounted_grpo")(batch, gamma=0.5)  # by name, like any built-in
    for row in out.select(range(4)).to_records():
        print(
            row["traj_id"],
            f"reward={row['outcome_reward']:.0f}",
            "turn advantages:",
            [round(a, 3) for a in row["turn_advantages"]],
        )
    print({k: round(v, 4) for k, v in out.metrics.items()})


if __name__ == "__main__":
    main()
