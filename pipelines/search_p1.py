"""Search-P1: path-centric reward from a judge's evaluation of the search plan against a
reference plan (Search-P1, arXiv 2602.22576; docs/estimators.md). Trains end to end.

    python pipelines/search_p1.py [--help] [--config my.yaml]
    ray job submit --working-dir . -- python pipelines/search_p1.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ray_credit.estimators.search_p1 import SearchP1Config
from ray_credit.pipeline import estimator_stage
from ray_credit.pipeline.recipe import JudgeConfig, RunConfig, main, make_judge_pool


@dataclass(frozen=True)
class SearchP1Run(RunConfig):
    name: str = "search_p1"
    """Run name: the output folder and the wandb run."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The evaluator of plans and outcomes."""
    search_p1: SearchP1Config = field(default_factory=SearchP1Config)
    """Search-P1's estimator (the paper's defaults)."""


def stages(ctx):
    judges = make_judge_pool(ctx.cfg.judge, ctx.corpus, ctx.cfg.resources)

    def judge(batch):
        return judges.annotate_search_p1(batch)

    return [judge, estimator_stage("search_p1", **asdict(ctx.cfg.search_p1))]


if __name__ == "__main__":
    main(SearchP1Run, None, __doc__, stages)
