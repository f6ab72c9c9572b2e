"""CW-GRPO: a judge scores each turn's contribution and reweights the group advantage
(CW-GRPO, arXiv 2604.14267; docs/estimators.md). Trains a search agent end to end, with
the paper's KL loss (0.001). Each chunk is judged as soon as it is generated.

    python pipelines/cw_grpo.py [--help] [--config my.yaml]
    python pipelines/cw_grpo.py --judge.backend openai --judge.base_url http://host:8000/v1 --judge.model M
    python pipelines/cw_grpo.py --judge.backend hf --judge.model smollm2-135m
    ray job submit --working-dir . -- python pipelines/cw_grpo.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.cw_grpo import CWGRPOConfig
from ray_credit.pipeline import JudgeConfig, RunConfig, main
from ray_credit.signals.cw_grpo_judgement import CWGRPOJudgement


@dataclass(frozen=True)
class CWGRPORun(RunConfig):
    name: str = "cw_grpo"
    """Run name: the output folder and the wandb run."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge of each turn's utility and correctness."""
    cw_grpo_judgement: CWGRPOJudgement = field(default_factory=CWGRPOJudgement)
    """What the judge is asked (the cw_grpo_judgement signal)."""
    cw_grpo: CWGRPOConfig = field(default_factory=CWGRPOConfig)
    """CW-GRPO's estimator (the paper's defaults)."""


if __name__ == "__main__":
    main(CWGRPORun, "cw_grpo", __doc__)
