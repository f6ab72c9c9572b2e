"""Intervals for the numbers a run prints: held-out exact match and its change.

Exact match on n questions is a mean of 0/1 outcomes, so a single figure hides how much
it can move by chance. Two intervals, both at ``confidence`` (default 95 %):

* :func:`proportion_interval`: the Wilson score interval of one EM (one evaluation);
* :func:`paired_difference`: EM after minus EM before **on the same questions**, with a
  percentile bootstrap over questions (pairs resampled together, so what the two
  evaluations share cancels). The interval excludes zero when the change is more than
  the questions' own spread explains. With few questions that changed, a bootstrap
  interval is too narrow: the exact sign test on them (``p_sign``) says how likely that
  split is by chance (4 better and 0 worse of 120 questions: the interval excludes zero,
  as a resample misses all four only 1.8 % of the time, but p = 0.125);
* :func:`seeded_paired_difference` and :func:`seeded_mean`: the same over several
  training runs (seeds), each with its own questions' outcomes. A seed is one draw of
  the training's randomness, so the interval resamples seeds, then questions within
  each drawn seed: pooling every seed's questions into one bootstrap would count only the
  questions' spread, as if the seeds' runs were one. It errs both ways with three
  seeds: each seed's mean already holds its questions' noise, which resampling them
  again counts twice (where the seeds agree, the interval is about 1.3 times too wide),
  while a bootstrap over three draws shrinks the seeds' own spread by sqrt(2/3) (where
  they differ, it is too narrow). Read it as an order of magnitude, not an exact level.
  The sign test is given for one seed only: pooling the seeds' questions into one test
  would count them as one run.

Pure NumPy, seeded, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

__all__ = [
    "paired_difference",
    "proportion_interval",
    "seeded_mean",
    "seeded_paired_difference",
    "sign_test",
]

# resampled indices held at once (160 MB of int64, as much again for the values they
# gather): resamples go in chunks
_CELLS = 20_000_000


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
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, not
    high = 1.0 if successes == n else min(1.0, centre + half)  # 1e-17 off them
    return low, high


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
    ``n`` (pairs), ``better`` / ``worse`` (questions that moved each way) and ``p_sign``
    (the exact two-sided sign test of ``better`` against ``worse``; 1 when none moved).
    """
    _check_confidence(confidence)
    resamples, seed = _check_resampling(resamples, seed)
    delta = _paired_deltas(before, after)
    rng = np.random.default_rng(seed)
    low, high = _percentiles(_bootstrap_means(delta, resamples, rng), confidence)
    return {"diff": float(delta.mean()), "low": low, "high": high, "n": int(delta.size),
            **_moved(delta), "confidence": confidence}  # fmt: skip


def seeded_paired_difference(
    pairs: Mapping[object, tuple[Mapping[str, float], Mapping[str, float]]],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, float]:
    """:func:`paired_difference` over several runs: ``pairs`` maps each run (a seed) to its
    ``(before, after)`` scores by question id (each seed may hold other questions). The
    change is the mean over seeds of each seed's mean difference (every seed weighs the
    same); the interval is a two-level percentile bootstrap, seeds drawn with replacement,
    then each drawn seed's questions (see the module docstring). One seed: exactly
    :func:`paired_difference`'s interval.

    Returns ``diff``, ``low``, ``high``, ``n`` (pairs, all seeds), ``seeds``, ``better``
    and ``worse`` (over all pairs), ``p_sign`` (the sign test of one seed's pairs; None
    for several, whose pairs are not one sample), ``confidence``."""
    _check_confidence(confidence)
    resamples, seed = _check_resampling(resamples, seed)
    if not isinstance(pairs, Mapping) or not pairs:
        raise ValueError("seeded_paired_difference needs a mapping from seed to (before, after)")
    deltas = {}
    for run, pair in pairs.items():
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"pairs[{run!r}] must be a (before, after) tuple, got {pair!r}")
        try:
            deltas[run] = _paired_deltas(*pair)
        except (TypeError, ValueError) as err:
            raise type(err)(f"seed {run!r}: {err}") from err
    everything = np.concatenate(list(deltas.values()))
    diff, low, high = _two_level(list(deltas.values()), confidence, resamples, seed)
    moved = _moved(everything)
    if len(deltas) > 1:
        moved["p_sign"] = None
    return {"diff": diff, "low": low, "high": high, "n": int(everything.size),
            "seeds": len(deltas), **moved, "confidence": confidence}  # fmt: skip


def seeded_mean(
    scores: Mapping[object, Mapping[str, float] | Sequence[float]],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> dict[str, float]:
    """The mean over seeds of each seed's mean score (e.g. held-out EM after training,
    ``scores``: seed -> per-question scores) with the two-level bootstrap interval of
    :func:`seeded_paired_difference`. Returns ``mean``, ``low``, ``high``, ``n`` (scores,
    all seeds), ``seeds``, ``confidence``."""
    _check_confidence(confidence)
    resamples, seed = _check_resampling(resamples, seed)
    if not isinstance(scores, Mapping) or not scores:
        raise ValueError("seeded_mean needs a mapping from seed to per-question scores")
    values = []
    for run, per_question in scores.items():
        if isinstance(per_question, Mapping):
            keys = sorted(per_question)
            items = [per_question[k] for k in keys]
        else:
            keys, items = (), per_question
        array = _scores(items, f"seed {run!r}", keys)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"seed {run!r} needs one score per question, got {array.shape}")
        values.append(array)
    mean_, low, high = _two_level(values, confidence, resamples, seed)
    return {"mean": mean_, "low": low, "high": high, "n": int(sum(v.size for v in values)),
            "seeds": len(values), "confidence": confidence}  # fmt: skip


def _two_level(values: list[np.ndarray], confidence: float, resamples: int, seed: int):
    """Mean of the groups' means, and the percentile interval of a bootstrap that draws
    groups with replacement, then, for each drawn group, one of its own question-level
    bootstrap means (a fresh pick per draw, so a group drawn twice is resampled twice)."""
    rng = np.random.default_rng(seed)
    within = np.stack([_bootstrap_means(v, resamples, rng) for v in values])  # (S, R)
    count = len(values)
    if count == 1:  # one group: its questions' bootstrap itself (paired_difference's)
        low, high = _percentiles(within[0], confidence)
        return float(values[0].mean()), low, high
    groups = rng.integers(0, count, size=(resamples, count))
    picks = rng.integers(0, resamples, size=(resamples, count))
    low, high = _percentiles(within[groups, picks].mean(axis=1), confidence)
    return float(np.mean([v.mean() for v in values])), low, high


def _bootstrap_means(values: np.ndarray, resamples: int, rng) -> np.ndarray:
    """``resamples`` means of ``values`` resampled with replacement, drawn in chunks so
    that a large evaluation (tens of thousands of questions) stays within memory."""
    n = values.size
    chunk = max(1, _CELLS // n)
    out = np.empty(resamples)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        out[start:stop] = values[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return out


def _percentiles(means: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def _moved(delta: np.ndarray) -> dict[str, float]:
    better, worse = int((delta > 0).sum()), int((delta < 0).sum())
    return {"better": better, "worse": worse, "p_sign": sign_test(better, worse)}


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign test: the probability, if moving up or down were a fair coin,
    of a split of ``better + worse`` moves at least as uneven as this one (1 when none)."""
    better, worse = _count(better, "better"), _count(worse, "worse")
    if better < 0 or worse < 0:
        raise ValueError(f"better and worse are counts of questions, got {better} and {worse}")
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _check_resampling(resamples: object, seed: object) -> tuple[int, int]:
    resamples, seed = _count(resamples, "resamples"), _count(seed, "seed")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100 for a stable interval, got {resamples}")
    if seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (numpy's seeds are), got {seed}")
    return resamples, seed


def _paired_deltas(before, after) -> np.ndarray:
    """``after - before`` per question: two mappings by question id (the same ids) or two
    sequences in the same question order."""
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
        raise ValueError("a paired difference needs at least one question")
    return b - a


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
