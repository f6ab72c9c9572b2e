"""CW-GRPO: a judge scores each turn's contribution and reweights the group advantage
(CW-GRPO, arXiv 2604.14267; docs/estimators.md). Trains a search agent end to end.

    python pipelines/cw_grpo.py [--help] [--config my.yaml]
    python pipelines/cw_grpo.py --judge.backend openai --judge.base_url http://host:8000/v1 --judge.model M
    ray job submit --working-dir . -- python pipelines/cw_grpo.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ray_credit.estimators.cw_grpo import CWGRPOConfig
from ray_credit.pipeline import estimator_stage
from ray_credit.pipeline.recipe import JudgeConfig, RunConfig, main, make_judge_pool


@dataclass(frozen=True)
class CWGRPORun(RunConfig):
    name: str = "cw_grpo"
    """Run name: the output folder and the wandb run."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge of each turn's utility and correctness."""
    cw_grpo: CWGRPOConfig = field(default_factory=CWGRPOConfig)
    """CW-GRPO's estimator (the paper's defaults)."""


def stages(ctx):
    judges = make_judge_pool(ctx.cfg.judge, ctx.corpus, ctx.cfg.resources)

    def judge(batch):
        return judges.annotate_cw_grpo(batch)

    return [judge, estimator_stage("cw_grpo", **asdict(ctx.cfg.cw_grpo))]


if __name__ == "__main__":
    main(CWGRPORun, None, __doc__, stages)
