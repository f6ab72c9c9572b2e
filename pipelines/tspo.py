"""TSPO: turn-level credit from the first turn whose observation holds the gold answer
(TSPO, arXiv 2601.22776; docs/estimators.md). Trains a search agent end to end.

    python pipelines/tspo.py                               # embedded defaults, this machine
    python pipelines/tspo.py --help                        # every setting
    python pipelines/tspo.py --config my.yaml --pipeline.steps 50
    ray job submit --working-dir . -- python pipelines/tspo.py   # on a running cluster
    python pipelines/tspo.py --resume runs/tspo/checkpoint # continue a killed run

Defaults (configs/embedded.yaml): SmolLM2-135M-Instruct, MiniLM over the synthetic world,
a warm-start on 96 questions, then 12 steps of 16 questions x G=8, one step of staleness.
Writes runs/tspo/{summary.json,plot.png,metrics.jsonl}, the checkpoint and an offline
wandb run. The run itself, in order, is ray_credit.pipeline.recipe.train.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.estimators.tspo import TSPOConfig
from ray_credit.pipeline import RunConfig, main


@dataclass(frozen=True)
class TSPORun(RunConfig):
    name: str = "tspo"
    """Run name: the output folder and the wandb run."""
    tspo: TSPOConfig = field(default_factory=TSPOConfig)
    """TSPO's estimator (the paper's defaults); the generator fills turn_contains_gold."""


if __name__ == "__main__":
    main(TSPORun, "tspo", __doc__)
