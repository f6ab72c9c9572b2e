"""Intervals for the numbers a run prints: held-out exact match and its change.

Exact match on n questions is a mean of 0/1 outcomes, so a single figure hides how much
it can move by chance. Two intervals, both at ``confidence`` (default 95 %):

* :func:`proportion_interval`: the Wilson score interval of one EM (one evaluation);
* :func:`paired_difference`: EM after minus EM before **on the same questions**, with a
  percentile bootstrap over questions (pairs resampled together, so what the two
  evaluations share cancels). The interval excludes zero when the change is more than
  the questions' own spread explains.

Pure NumPy, seeded, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

__all__ = ["paired_difference", "proportion_interval"]


def proportion_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n``."""
    _check_confidence(confidence)
    if n < 1:
        raise ValueError(f"a proportion needs n >= 1 observations, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(
    before: Mapping[str, float] | Sequence[float],
    after: Mapping[str, float] | Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, float]:
    """Mean of ``after - before`` over paired items, with a bootstrap interval.

    ``before`` and ``after`` are per-question scores (EM: 0 or 1), either two sequences in
    the same question order or two mappings from question id to score with the same ids.
    Returns ``diff`` (the mean difference), ``low`` / ``high`` (the percentile interval),
    ``n`` (pairs), ``better`` / ``worse`` (questions that flipped each way).
    """
    _check_confidence(confidence)
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a stable interval, got {resamples}")
    if isinstance(before, Mapping) != isinstance(after, Mapping):
        raise TypeError("before and after must both be mappings (by question id) or sequences")
    if isinstance(before, Mapping):
        if set(before) != set(after):
            only = sorted(set(before) ^ set(after))[:3]
            raise ValueError(
                f"before and after score different questions (e.g. {only}); evaluate the same "
                "held-out set twice"
            )
        keys = sorted(before)
        a = np.asarray([before[k] for k in keys], dtype=np.float64)
        b = np.asarray([after[k] for k in keys], dtype=np.float64)
    else:
        a = np.asarray(before, dtype=np.float64)
        b = np.asarray(after, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1:
            raise ValueError(
                f"before and after need one score per question each, got {a.shape} and {b.shape}"
            )
    if a.size == 0:
        raise ValueError("paired_difference needs at least one question")
    delta = b - a
    rng = np.random.default_rng(seed)
    means = delta[rng.integers(0, delta.size, size=(resamples, delta.size))].mean(axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return {
        "diff": float(delta.mean()),
        "low": float(low),
        "high": float(high),
        "n": int(delta.size),
        "better": int((delta > 0).sum()),
        "worse": int((delta < 0).sum()),
        "confidence": confidence,
    }


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
