"""Search-P1: path-centric reward from a judge's evaluation of the search path against a
reference plan (Search-P1, arXiv 2602.22576; docs/estimators.md). Trains end to end with
the paper's clip range (0.2 / 0.28) and KL loss (0.001).

With an LLM judge (hf, openai) the reference plans come from the question file's
reference_plan field, or are made by the judge before training (the paper makes them
offline) and kept in runs/<name>/reference_plans.jsonl, so a resumed run reuses them.
The evidence judge needs none: it reads the supporting documents.

    python pipelines/search_p1.py [--help] [--config my.yaml]
    python pipelines/search_p1.py --judge.backend hf --judge.model smollm2-135m
    ray job submit --working-dir . -- python pipelines/search_p1.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.search_p1 import SearchP1Config
from ray_credit.pipeline import JudgeConfig, RunConfig, main


@dataclass(frozen=True)
class SearchP1Run(RunConfig):
    name: str = "search_p1"
    """Run name: the output folder and the wandb run."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The evaluator of plans and outcomes, and the author of reference plans."""
    search_p1: SearchP1Config = field(default_factory=SearchP1Config)
    """Search-P1's estimator (the paper's defaults)."""


if __name__ == "__main__":
    main(SearchP1Run, "search_p1", __doc__)
