"""A2TGPO: turn-group normalized information gain and adaptive turn clipping (A²TGPO, arXiv 2605.06200; docs/estimators.md). An info-gain scorer on the current
policy weights fills turn_info_gain. Trains a search agent end to end.

    python pipelines/a2tgpo.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/a2tgpo.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ray_credit.estimators.a2tgpo import A2TGPOConfig
from ray_credit.pipeline import estimator_stage
from ray_credit.pipeline.recipe import RunConfig, main, scorer_stage


@dataclass(frozen=True)
class A2TGPORun(RunConfig):
    name: str = "a2tgpo"
    """Run name: the output folder and the wandb run."""
    info_gain_mode: str = "prob_diff"
    """How the scorer turns gold-answer probabilities into turn gains: prob_diff or log_prob_diff."""
    a2tgpo: A2TGPOConfig = field(default_factory=A2TGPOConfig)
    """A2TGPO's estimator (the paper's defaults)."""


def stages(ctx):
    return [
        scorer_stage(ctx, ctx.cfg.info_gain_mode),
        estimator_stage("a2tgpo", **asdict(ctx.cfg.a2tgpo)),
    ]


if __name__ == "__main__":
    main(A2TGPORun, None, __doc__, stages)
