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
    """Wilson score interval of a proportion ``successes / n`` (two counts: integers)."""
    _check_confidence(confidence)
    successes, n = _count(successes, "successes"), _count(n, "n")
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
    resamples, seed = _count(resamples, "resamples"), _count(seed, "seed")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a stable interval, got {resamples}")
    if seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (numpy's seeds are), got {seed}")
    for name, scores in (("before", before), ("after", after)):
        if isinstance(scores, (str, bytes)) or not isinstance(
            scores, (Mapping, Sequence, np.ndarray)
        ):
            raise TypeError(
                f"{name} holds one score per question: a sequence (in question order) or a "
                f"mapping from question id to score, got {scores!r} ({type(scores).__name__})"
            )
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
        a = _scores([before[k] for k in keys], "before", keys)
        b = _scores([after[k] for k in keys], "after", keys)
    else:
        a, b = _scores(before, "before"), _scores(after, "after")
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


def _count(value: object, name: str) -> int:
    """``value`` as an int: an integer (numpy's too) or a float with no fraction; not a
    bool, a fraction or text."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if not float(value).is_integer():
        raise ValueError(f"{name} must be a whole number (a count), got {value!r}")
    return int(value)


def _scores(values: Sequence[object] | np.ndarray, name: str, keys: Sequence[object] = ()):
    """Per-question scores as float64: real, finite numbers (bools count as 0/1). A None,
    a text or a NaN raises, naming the question, instead of turning the interval to NaN."""
    array = np.asarray(values)

    def where(i: int) -> str:
        return f"{name}[{keys[i]!r}]" if keys else f"{name}[{i}]"

    if array.dtype.kind not in "biuf":  # find the item that is no number
        items = list(values) if array.ndim == 1 else array.reshape(-1)
        for i, v in enumerate(items):
            if isinstance(v, (str, bytes)) or not isinstance(v, (int, float, np.number, np.bool_)):
                raise TypeError(
                    f"{where(i)} is {v!r} ({type(v).__name__}); a score is a number (EM: 0 "
                    "or 1): score a question with no answer as 0"
                )
    array = array.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(array.reshape(-1)))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"{where(i)} is {array.reshape(-1)[i]}; a score is a finite number (EM: 0 or 1): "
            "score a question with no answer as 0"
        )
    return array


def _check_confidence(confidence: float) -> None:
    if isinstance(confidence, (bool, np.bool_)) or not isinstance(
        confidence, (int, float, np.number)
    ):
        raise TypeError(
            f"confidence must be a number in (0, 1), e.g. 0.95, got {confidence!r} "
            f"({type(confidence).__name__})"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
