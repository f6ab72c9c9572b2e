"""IGPO: information-gain turn rewards (the gold answer's probability rising across turns) (IGPO, arXiv 2510.14967; docs/estimators.md). An info-gain scorer on the current
policy weights fills turn_info_gain. Trains a search agent end to end.

    python pipelines/igpo.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/igpo.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ray_credit.estimators.igpo import IGPOConfig
from ray_credit.pipeline import estimator_stage
from ray_credit.pipeline.recipe import RunConfig, main, scorer_stage


@dataclass(frozen=True)
class IGPORun(RunConfig):
    name: str = "igpo"
    """Run name: the output folder and the wandb run."""
    info_gain_mode: str = "prob_diff"
    """How the scorer turns gold-answer probabilities into turn gains: prob_diff or log_prob_diff."""
    igpo: IGPOConfig = field(default_factory=IGPOConfig)
    """IGPO's estimator (the paper's defaults)."""


def stages(ctx):
    return [
        scorer_stage(ctx, ctx.cfg.info_gain_mode),
        estimator_stage("igpo", **asdict(ctx.cfg.igpo)),
    ]


if __name__ == "__main__":
    main(IGPORun, None, __doc__, stages)
