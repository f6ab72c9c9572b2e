"""IGPO: information-gain turn rewards, the gold answer's probability rising across turns
(IGPO, arXiv 2510.14967; docs/estimators.md). An info-gain scorer, on the weights that
sampled each chunk, fills turn_info_gain on it as it is generated. Trains end to end, with
the paper's KL loss (0.001).

    python pipelines/igpo.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/igpo.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.igpo import IGPOConfig
from ray_credit.pipeline import RunConfig, main
from ray_credit.signals.info_gain import InfoGain


@dataclass(frozen=True)
class IGPORun(RunConfig):
    name: str = "igpo"
    """Run name: the output folder and the wandb run."""
    info_gain: InfoGain = field(default_factory=InfoGain)
    """How the scorer turns gold-answer probabilities into turn gains."""
    igpo: IGPOConfig = field(default_factory=IGPOConfig)
    """IGPO's estimator (the paper's defaults)."""


if __name__ == "__main__":
    main(IGPORun, "igpo", __doc__)
