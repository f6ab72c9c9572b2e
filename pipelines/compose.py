"""Credit of your own: an estimator written as a composition of parts (reward terms, a
normalizer, transforms, weightings; docs/estimators.md), trained end to end. The signals
its parts read run as stages, and the learner settings they need are the defaults.

    python pipelines/compose.py --estimator "outcome + 0.5*folr | turn_position"
    python pipelines/compose.py --estimator "folr | turn_position | contribution"
    python pipelines/compose.py --estimator tspo          # a paper's method, as its parts
    python pipelines/compose.py --config my.yaml          # estimator: "..." in the file
    ray job submit --working-dir . -- python pipelines/compose.py --estimator "..."

The default adds A²TGPO's information-gain term to TSPO's latent reward, a composition
no paper ran. A composition that cannot work (a per-turn reward under a per-trajectory
normalizer, a weighting reading a term that is not there) is refused before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_credit.pipeline import JudgeConfig, RunConfig, main
from ray_credit.signals.cw_grpo_judgement import CWGRPOJudgement
from ray_credit.signals.info_gain import InfoGain

DEFAULT = (
    "(folr | turn_position) + 0.3*(info_gain(mode='log_prob_diff') | "
    "turn_position(padding='none') | rescaled_sum)"
)


@dataclass(frozen=True)
class ComposeRun(RunConfig):
    name: str = "compose"
    """Run name: the output folder and the wandb run."""
    estimator: str = DEFAULT
    """The composition of parts that assigns credit (docs/estimators.md), or a paper's
    estimator by name (its composition, with its recipe)."""
    info_gain: InfoGain = field(default_factory=InfoGain)
    """The info-gain signal's settings (when a part reads it)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge (when a part reads a judged signal: contribution, path)."""
    cw_grpo_judgement: CWGRPOJudgement = field(default_factory=CWGRPOJudgement)
    """What the judge is asked for the contribution weighting."""


if __name__ == "__main__":
    main(ComposeRun, None, __doc__)
