"""GRPO: one outcome-normalized advantage for every turn of a trajectory (the baseline
the turn-level methods improve on; DeepSeekMath). Trains a search agent end to end.

    python pipelines/grpo.py [--help] [--config my.yaml] [--pipeline.steps 50]
    ray job submit --working-dir . -- python pipelines/grpo.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.grpo import GRPOConfig
from ray_credit.pipeline import RunConfig, main


@dataclass(frozen=True)
class GRPORun(RunConfig):
    name: str = "grpo"
    """Run name: the output folder and the wandb run."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO's estimator."""


if __name__ == "__main__":
    main(GRPORun, "grpo", __doc__)
