"""A2TGPO: turn-group normalized information gain and adaptive turn clipping (A²TGPO,
arXiv 2605.06200; docs/estimators.md). An info-gain scorer, on the weights that sampled
each chunk, fills turn_info_gain (log-probability gains, as A²TGPO's code) on it as it
is generated; the learner trains with A²TGPO's turn-level ratio, its clip range (3e-3 /
4e-3, scaled per turn by turn_clip_scale) and no KL.

    python pipelines/a2tgpo.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/a2tgpo.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.a2tgpo import A2TGPOConfig
from ray_credit.pipeline import RunConfig, main
from ray_credit.signals.info_gain import InfoGain


@dataclass(frozen=True)
class A2TGPORun(RunConfig):
    name: str = "a2tgpo"
    """Run name: the output folder and the wandb run."""
    info_gain: InfoGain = field(default_factory=InfoGain)
    """How the scorer turns gold-answer probabilities into turn gains."""
    a2tgpo: A2TGPOConfig = field(default_factory=A2TGPOConfig)
    """A2TGPO's estimator (the paper's defaults)."""


if __name__ == "__main__":
    main(A2TGPORun, "a2tgpo", __doc__)
