"""What the pipeline's driver reads instead of a batch: small summaries made where the
batch is, and the step's metrics combined from them.

The driver holds object references and these dicts, never a batch. Each generated chunk
comes with a :func:`generation_summary` (made by the generator: its ``gen/*`` counters
and the oldest policy version of each trajectory, for the staleness check); each staged
chunk with a :func:`chunk_report` (made by the stage task: the stages' metrics and
seconds, and the sums behind the outcome metrics). :func:`step_metrics` combines a
step's summaries and reports exactly as if the step's batch had been one:

* the ``gen/*`` counters and every outcome count are sums, the rates are derived after;
* a stage metric is combined by its name: a name ending in ``_frac`` or ``_mean`` is a
  per-trajectory (or per-group: groups have one size) average, averaged weighted by the
  chunks' trajectories; a name containing ``max`` is a maximum; ``.../policy_version``
  is the oldest; anything else is a count, summed. Estimators and signals name their
  metrics accordingly (CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ray_credit.actors.generator import ADDITIVE_GEN, generation_summary, oldest_versions
from ray_credit.batch import TrajectoryBatch

# generation_summary and oldest_versions are the generator's (it makes the summary): kept
# importable from here, where the driver combines them
__all__ = ["chunk_report", "generation_summary", "oldest_versions", "step_metrics"]

_OUTCOME_SUMS = (
    "trajectories",
    "reward",
    "em",
    "groups",
    "groups_all_wrong",
    "groups_all_correct",
    "groups_mixed",
    "gold_retrieved",
    "near_miss",
    "first_gold_turn",
    "first_gold_n",
    "groups_zero_advantage",
    "tokens",
)


def chunk_report(batch: TrajectoryBatch, stage_seconds: Mapping[str, float]) -> dict[str, Any]:
    """A staged chunk as the driver sees it: the stages' metrics (``gen/*`` excluded: the
    generation summary has them) and seconds, and the outcome sums."""
    return {
        "trajectories": len(batch),
        "stages": {k: v for k, v in batch.metrics.items() if not k.startswith("gen/")},
        "stage_seconds": dict(stage_seconds),
        "outcome": _outcome_sums(batch),
    }


def _outcome_sums(batch: TrajectoryBatch) -> dict[str, float]:
    reward = batch.traj_values("outcome_reward")
    groups, n_groups = batch.group_index, batch.num_groups
    correct = np.bincount(groups, weights=(reward > 0).astype(float), minlength=n_groups)
    sizes = np.bincount(groups, minlength=n_groups)
    contains = batch.turn_values("turn_contains_gold", null=0.0) > 0
    never = np.iinfo(np.int64).max
    first = np.full(len(batch), never, dtype=np.int64)
    owner, position = batch.turn_traj_index, batch.turn_position
    np.minimum.at(first, owner[contains], position[contains].astype(np.int64))
    seen_gold = first != never
    out = {
        "trajectories": float(len(batch)),
        "reward": float(reward.sum()),
        "em": float((reward >= 1.0).sum()),
        "groups": float(n_groups),
        "groups_all_wrong": float((correct == 0).sum()),
        "groups_all_correct": float((correct == sizes).sum()),
        "groups_mixed": float(((correct > 0) & (correct < sizes)).sum()),
        "gold_retrieved": float(seen_gold.sum()),
        "near_miss": float((seen_gold & (reward <= 0)).sum()),
        "first_gold_turn": float(first[seen_gold].sum()),
        "first_gold_n": float(seen_gold.sum()),
        "tokens": float(batch.token_offsets[-1]) if "input_ids" in batch else 0.0,
    }
    if "turn_advantages" in batch:
        adv = np.abs(batch.turn_values("turn_advantages"))
        per_group = np.bincount(groups[owner], weights=adv, minlength=n_groups)
        out["groups_zero_advantage"] = float((per_group < 1e-6).sum())
    return out


# --------------------------------------------------------------------------- combining
def step_metrics(
    summaries: Sequence[Mapping[str, Any]],
    reports: Sequence[Mapping[str, Any]],
    *,
    version: int,
    max_staleness: int = 0,
    outcome_from: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """The step's ``gen/*``, ``staleness/*``, stage, ``time/stage_*`` and ``train/*``
    metrics from its chunks' summaries and reports (``version``: the learner's, at
    training; ``staleness/k`` is reported for every ``k`` up to ``max_staleness``).
    ``outcome_from``: the report of the step stages, which saw the whole step after the
    chunks' stages: the outcome metrics come from it alone."""
    out = _generation(summaries)
    out.update(_staleness(summaries, version, max_staleness))
    out.update(_stages(reports))
    out.update(_outcome(reports if outcome_from is None else [outcome_from]))
    return out


def staleness_of(summaries: Sequence[Mapping[str, Any]], version: int) -> int:
    """The largest staleness among the trajectories the summaries describe."""
    oldest = min(v for s in summaries for v in s["oldest_versions"])
    return version - oldest


def _generation(summaries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    out = {f"gen/{k}": float(sum(s["gen"][k] for s in summaries)) for k in ADDITIVE_GEN}
    seconds, turns = out["gen/seconds"], max(out["gen/turns"], 1.0)
    out["gen/tokens_per_s"] = out["gen/generated_tokens"] / seconds if seconds else 0.0
    n = max(out["gen/trajectories"], 1.0)
    out["gen/turns_per_traj"] = out["gen/turns"] / n
    out["gen/searches_per_traj"] = out["gen/searches"] / n
    out["gen/invalid_rate"] = out["gen/invalid_actions"] / turns
    out["gen/truncation_rate"] = out["gen/truncated_turns"] / turns
    memory = [s["memory"] for s in summaries if s.get("memory")]
    if memory:  # the largest generator process of the step (GiB), after and at its peak
        out["memory/generator_rss_gb"] = max(m["rss_gb"] for m in memory)
        out["memory/generator_peak_gb"] = max(m["peak_gb"] for m in memory)
    return out


def _staleness(
    summaries: Sequence[Mapping[str, Any]], version: int, max_staleness: int
) -> dict[str, float]:
    counts: dict[int, float] = dict.fromkeys(range(max_staleness + 1), 0.0)
    for s in summaries:
        for oldest, n in s["oldest_versions"].items():
            counts[version - oldest] = counts.get(version - oldest, 0.0) + n
    total = sum(counts.values())
    out = {f"staleness/{k}": v for k, v in sorted(counts.items())}
    out["staleness/max"] = float(max(k for k, v in counts.items() if v))
    out["staleness/mean"] = sum(k * v for k, v in counts.items()) / total
    return out


def _stages(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    weights = np.array([r["trajectories"] for r in reports], dtype=np.float64)
    names = dict.fromkeys(k for r in reports for k in r["stages"])
    for name in names:
        present = [
            (r["stages"][name], w)
            for r, w in zip(reports, weights, strict=True)
            if name in r["stages"]
        ]
        values = np.array([v for v, _ in present])
        if name.endswith(("_frac", "_mean")):
            w = np.array([w for _, w in present])
            out[name] = float((values * w).sum() / w.sum())
        elif "max" in name.rsplit("/", 1)[-1]:
            out[name] = float(values.max())
        elif name.endswith("policy_version"):
            out[name] = float(values.min())
        else:
            out[name] = float(values.sum())
    if out.get("judge/agreement_n"):
        out["judge/agreement_em"] = out["judge/agreement_hits"] / out["judge/agreement_n"]
    for r in reports:
        for stage, seconds in r["stage_seconds"].items():
            key = f"time/stage_{stage}_s"
            out[key] = out.get(key, 0.0) + seconds
    return out


def _outcome(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    sums = {k: sum(r["outcome"].get(k, 0.0) for r in reports) for k in _OUTCOME_SUMS}
    n, groups = max(sums["trajectories"], 1.0), max(sums["groups"], 1.0)
    out = {
        "train/reward_mean": sums["reward"] / n,
        "train/em": sums["em"] / n,
        "train/groups_all_wrong": sums["groups_all_wrong"] / groups,
        "train/groups_all_correct": sums["groups_all_correct"] / groups,
        "train/groups_mixed": sums["groups_mixed"] / groups,
        "train/gold_retrieved": sums["gold_retrieved"] / n,
        "train/near_miss": sums["near_miss"] / n,
        "train/first_gold_turn": (
            sums["first_gold_turn"] / sums["first_gold_n"] if sums["first_gold_n"] else -1.0
        ),
        "train/tokens": sums["tokens"],
    }
    if all("groups_zero_advantage" in r["outcome"] for r in reports):
        out["train/groups_zero_advantage"] = sums["groups_zero_advantage"] / groups
    return out
