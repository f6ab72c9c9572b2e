"""GiGPO: episode-level groups plus step-level groups of turns that share an anchor
state (GiGPO, arXiv 2505.10978; docs/estimators.md). Trains a search agent end to end,
with the paper's KL loss (0.001).

    python pipelines/gigpo.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/gigpo.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.gigpo import GiGPOConfig
from ray_credit.pipeline import RunConfig, main


@dataclass(frozen=True)
class GiGPORun(RunConfig):
    name: str = "gigpo"
    """Run name: the output folder and the wandb run."""
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)
    """GiGPO's estimator (the paper's defaults)."""


if __name__ == "__main__":
    main(GiGPORun, "gigpo", __doc__)
