"""Answer normalization, exact match, F1, answer extraction and "contains gold" checks.

The semantics follow the reference implementations so that scores are comparable with
published numbers:

* :func:`normalize_answer`, :func:`em_check`, :func:`subem_check` and :func:`contains_gold`
  reproduce Search-R1's ``qa_em.py`` / ``qa_em_format.py``.
* :func:`f1_score` reproduces IGPO's ``compute_f1`` (no article removal, F1 over word sets).
* :func:`extract_answer` reproduces both Search-R1 (``min_matches=2``, which scores
  prompt + response) and verl (``min_matches=1``, which scores only the response).

Everything here is pure Python on strings; it is called once per trajectory or per turn.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "ANSWER_SPLIT",
    "check_gold_answers",
    "contains_gold",
    "em_check",
    "extract_answer",
    "f1_score",
    "normalize_answer",
    "subem_check",
    "turn_contains_gold",
]

ANSWER_SPLIT = "<|answer_split|>"
"""Separator IGPO uses to pack several accepted answers into one string."""

_DELETE_PUNCTUATION = str.maketrans("", "", string.punctuation)
_PUNCTUATION_TO_SPACE = str.maketrans(string.punctuation, " " * len(string.punctuation))
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(s: str) -> str:
    """Normalize an answer the way Search-R1 (and the SQuAD script) does.

    Steps, in this order: ``lower()``; delete every ASCII ``string.punctuation``
    character; replace each whole word ``a``, ``an`` or ``the`` with a space; collapse
    runs of whitespace to one space and strip the ends.

    Only ASCII punctuation is deleted: ``"—"`` or ``"“"`` survive. Because punctuation is
    deleted (not replaced by a space), ``"U.S.A."`` becomes ``"usa"``. A string made only
    of articles, punctuation and whitespace (``"The"``, ``"!!!"``) normalizes to ``""``.
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects a str, got {type(s).__name__}: {s!r}")
    s = s.lower().translate(_DELETE_PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _gold_list(golds: str | Iterable[str], *, what: str = "golds") -> list[str]:
    """Return ``golds`` as a non-empty list of str; a single str is wrapped into a list."""
    if isinstance(golds, str):
        return [golds]
    if isinstance(golds, (bytes, bytearray)):
        raise TypeError(
            f"{what} must be a str or a sequence of str (the accepted answers), got the "
            f"bytes {golds!r}: decode them first, e.g. golds.decode('utf-8')"
        )
    if isinstance(golds, Mapping) or not isinstance(golds, Iterable):
        raise TypeError(
            f"{what} must be a str or a sequence of str (the accepted answers), "
            f"got {type(golds).__name__}"
        )
    out = list(golds)
    if not out:
        raise ValueError(f"{what} is empty: pass at least one accepted answer")
    for g in out:
        if not isinstance(g, str):
            number = isinstance(g, (int, float)) and not isinstance(g, bool)
            raise TypeError(
                f"every gold answer must be a str, got {type(g).__name__} ({g!r}) in {what}"
                + (f'; write it as text ("{g}", not {g})' if number else "")
            )
    return out


def _check_prediction(prediction: str | None, func: str) -> None:
    if prediction is not None and not isinstance(prediction, str):
        raise TypeError(
            f"{func}: prediction must be a str or None, got {type(prediction).__name__}"
        )


def em_check(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Exact match: 1.0 if ``normalize_answer(prediction)`` equals any normalized gold.

    ``golds`` is one accepted answer or a sequence of them (OR over the list). A
    ``None`` prediction (no answer was extracted) scores 0.0. A gold that normalizes to
    ``""`` (e.g. ``"The"``) matches every prediction that also normalizes to ``""``; use
    :func:`check_gold_answers` to reject such golds when loading data.

    Raises:
        ValueError: ``golds`` is empty.
        TypeError: ``golds`` or ``prediction`` has the wrong type.
    """
    _check_prediction(prediction, "em_check")
    gold_list = _gold_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return 1.0 if any(normalize_answer(g) == pred for g in gold_list) else 0.0


def subem_check(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Substring EM: 1.0 if any normalized gold is a substring of the normalized prediction.

    The test is on characters, not on words: ``"category"`` contains ``"cat"``. A gold
    that normalizes to ``""`` (e.g. ``"The"``) is a substring of everything, so it scores
    1.0 for every non-``None`` prediction (the reference behaviour; reject such golds with
    :func:`check_gold_answers`). A ``None`` prediction scores 0.0.

    Raises:
        ValueError: ``golds`` is empty.
        TypeError: ``golds`` or ``prediction`` has the wrong type.
    """
    _check_prediction(prediction, "subem_check")
    gold_list = _gold_list(golds)
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return 1.0 if any(normalize_answer(g) in pred for g in gold_list) else 0.0


def _f1_words(s: str) -> set[str]:
    # IGPO's preprocessing: lower-case, every ASCII punctuation char -> space, split.
    return set(s.lower().translate(_PUNCTUATION_TO_SPACE).split())


def f1_score(prediction: str | None, golds: str | Sequence[str]) -> float:
    """Word-set F1 between a prediction and the best-matching gold (IGPO's metric).

    Both sides are lower-cased, every ASCII punctuation character is replaced by a space
    and the text is split on whitespace. Articles are NOT removed, and the words form a
    *set*, so repeated words count once: ``"the the cat"`` vs ``"cat"`` has precision
    1/2 and recall 1, so F1 = 2/3.

    ``golds`` is a sequence of accepted answers or one string; any string that contains
    :data:`ANSWER_SPLIT` is split on it first. The result is the maximum F1 over golds.

    Edge cases: a ``None`` prediction scores 0.0. A prediction or a gold with no words
    scores 0.0 against that gold, also when both are empty (IGPO skips such golds).

    Raises:
        ValueError: ``golds`` is empty.
        TypeError: ``golds`` or ``prediction`` has the wrong type.
    """
    _check_prediction(prediction, "f1_score")
    gold_list = [part for g in _gold_list(golds) for part in g.split(ANSWER_SPLIT)]
    if prediction is None:
        return 0.0
    pred_words = _f1_words(prediction)
    if not pred_words:
        return 0.0
    best = 0.0
    for gold in gold_list:
        gold_words = _f1_words(gold)
        common = len(pred_words & gold_words)
        if not gold_words or common == 0:
            continue
        precision = common / len(pred_words)
        recall = common / len(gold_words)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def extract_answer(text: str, *, min_matches: int = 1) -> str | None:
    """Return the content of the LAST ``<answer>…</answer>`` in ``text``, stripped.

    Matches are found with ``re.finditer(r"<answer>(.*?)</answer>", text, re.DOTALL)``.
    If there are fewer than ``min_matches`` matches, the result is ``None``.

    * ``min_matches=1`` (default) reproduces verl / CW-GRPO, which score only the response.
    * ``min_matches=2`` reproduces Search-R1, which scores prompt + response: the prompt's
      example answer is one match, so the response must add at least one more. In
      general, use one more than the number of ``<answer>…</answer>`` pairs in the prompt.

    An empty pair ``<answer></answer>`` counts as a match and yields ``""``.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a str, got {type(text).__name__}")
    if isinstance(min_matches, bool) or not isinstance(min_matches, int) or min_matches < 1:
        raise ValueError(f"min_matches must be an int >= 1, got {min_matches!r}")
    matches = list(_ANSWER_TAG.finditer(text))
    if len(matches) < min_matches:
        return None
    return matches[-1].group(1).strip()


def contains_gold(text: str | None, golds: str | Sequence[str]) -> bool:
    """True if any normalized gold is a substring of ``normalize_answer(text)``.

    This is Search-R1's ``is_retrieval_correct`` applied to one observation (one
    ``<information>`` block or tool response); pass the block's content. The test is on
    characters, as in :func:`subem_check`. ``None`` or ``""`` text (no retrieval this
    turn) is ``False``. A gold that normalizes to ``""`` is contained in every non-empty
    text; reject such golds with :func:`check_gold_answers`.
    """
    if text is not None and not isinstance(text, str):
        raise TypeError(f"contains_gold: text must be a str or None, got {type(text).__name__}")
    gold_list = _gold_list(golds)
    if not text:
        return False
    normalized = normalize_answer(text)
    return any(normalize_answer(g) in normalized for g in gold_list)


def turn_contains_gold(
    observations: Sequence[str | None], golds: str | Sequence[str]
) -> list[bool]:
    """:func:`contains_gold` for each turn's observation (``None`` where a turn had none)."""
    if isinstance(observations, (str, bytes, Mapping)) or not isinstance(observations, Iterable):
        raise TypeError(
            "observations must be a sequence with one entry per turn (a str, or None where "
            f"the turn had no observation), got {observations!r} ({type(observations).__name__})"
        )
    gold_list = [normalize_answer(g) for g in _gold_list(golds)]
    out = []
    for i, obs in enumerate(observations):
        if obs is not None and not isinstance(obs, str):
            raise TypeError(
                f"observation of turn {i} must be a str or None, got {type(obs).__name__}"
            )
        normalized = normalize_answer(obs) if obs else None
        out.append(normalized is not None and any(g in normalized for g in gold_list))
    return out


def check_gold_answers(golds: str | Sequence[str], *, where: str = "") -> list[str]:
    """Validate accepted answers and return them as a list (a single str is wrapped).

    Args:
        golds: the accepted answers of one question.
        where: where the golds come from, put at the start of error messages, e.g.
            ``"row 3 (traj_id='t3')"``.

    Raises:
        ValueError: the list is empty, or a gold normalizes to ``""`` (``"The"``, ``"a"``,
            ``"!!!"``). Such a gold is a substring of every prediction, so substring EM and
            "contains gold" would be 1 for everything.
        TypeError: a gold is not a str.
    """
    prefix = f"{where}: " if where else ""
    try:
        gold_list = _gold_list(golds, what="gold_answers")
    except (TypeError, ValueError) as err:
        raise type(err)(f"{prefix}{err}") from None
    for g in gold_list:
        if not normalize_answer(g):
            raise ValueError(
                f"{prefix}gold answer {g!r} normalizes to an empty string (articles, "
                "ASCII punctuation and whitespace are removed), so under substring EM it "
                "would match every prediction. Remove it from gold_answers or replace it "
                "with a real answer."
            )
    return gold_list
