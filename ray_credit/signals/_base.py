"""The signal contract: a named producer of batch columns, and the judged kind.

A **signal** adds columns to a trajectory batch that an estimator reads: a judge's grade
of each turn, an evaluator's scores of each trajectory, the information gain of each turn.
Each module of this package declares one, together with the columns it owns (their types
and meaning, registered into :data:`ray_credit.batch.COLUMNS`), its prompt and its parser.
An estimator names the signals it needs (``Estimator.signals``) and the pipeline builds
the stages that make them; see ``CONTRIBUTING.md``, "Adding a signal".

A :class:`JudgedSignal` is asked of a judge: the :class:`~ray_credit.actors.judge.JudgePool`
runs every judged signal the same way (chunks, concurrency, timeouts, retries, and a null
for every judgement that fails, counted by cause). The signal supplies only what is its
own:

* :meth:`~JudgedSignal.units`: what gets one judgement (every turn, every trajectory, or
  a subset; the rest is null and counted);
* :meth:`~JudgedSignal.request`: the prompt for one unit (our template, the unit's
  context) and the shape of the reply (:mod:`ray_credit.signals._reply`), or ``None``
  when the unit cannot be asked (null, counted as ``judge/no_evidence``);
* :meth:`~JudgedSignal.parse`: a reply to ``{column: value}``, or ``None`` when the reply
  is not what was asked for (null, counted as ``judge/unparseable``);
* optionally :meth:`~JudgedSignal.evidence`: the deterministic ``evidence`` backend's
  judgements of whole rows, from gold answers and supporting documents instead of a
  model (None where it cannot judge: null, counted as ``judge/no_evidence``);
* optionally :meth:`~JudgedSignal.agreement`: how the judge's verdict on the final answer
  compares with exact match (a check on the judge, reported by the pipeline).

Levels: ``"turn"`` signals write turn-aligned list columns (one value per turn),
``"trajectory"`` signals one value per row, ``"question"`` signals work on question
mappings before any rollout (reference plans) and return one value per question.
"""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ray_credit.batch import ColumnSpec, TrajectoryBatch
from ray_credit.signals._reply import ReplySchema

__all__ = ["JudgedSignal", "Request", "Signal", "add", "parse_json_object", "render_trace"]

LEVELS = ("turn", "trajectory", "question")
SERVICES = ("judge", "scorer")


def add(counts: dict[str, float], name: str, value: float = 1.0) -> None:
    """Add to a counter of ``counts`` (the ``judge/*`` and signal counters of one call)."""
    counts[name] = counts.get(name, 0.0) + value


@dataclass(frozen=True)
class Request:
    """One judgement to ask for: the prompt, the shape of its reply, and what
    :meth:`JudgedSignal.parse` needs besides the reply (e.g. the reference plan's length)."""

    prompt: str
    schema: ReplySchema
    context: Any = None


@dataclass(frozen=True)
class Signal(ABC):
    """Base of every signal. Subclasses are frozen dataclasses: their fields are the
    signal's settings (documented like any config), so an instance is also the config
    section a pipeline exposes for it.

    Class attributes:
        name: the registry name (``get_signal(name)``), which estimators declare.
        columns: the columns it writes, ``name -> ColumnSpec`` (types and meaning).
        service: what computes it: ``"judge"`` (a :class:`JudgedSignal`, run by the judge
            pool) or ``"scorer"`` (the policy's own forward passes: information gain).
    """

    name: ClassVar[str]
    columns: ClassVar[Mapping[str, ColumnSpec]]
    service: ClassVar[str]

    @abstractmethod
    def requires(self, backend: str) -> tuple[str, ...]:
        """The batch columns (or question fields) computing it reads with ``backend``."""


@dataclass(frozen=True)
class JudgedSignal(Signal):
    """A signal a judge gives (module docstring). Subclasses set ``name``, ``columns``,
    ``level``, ``llm_requires`` and ``evidence_requires`` (None: no evidence rule) and
    implement :meth:`request` and :meth:`parse`."""

    service: ClassVar[str] = "judge"
    level: ClassVar[str]
    llm_requires: ClassVar[tuple[str, ...]]
    evidence_requires: ClassVar[tuple[str, ...] | None] = None

    def requires(self, backend: str) -> tuple[str, ...]:
        if backend != "evidence":
            return self.llm_requires
        if self.evidence_requires is None:
            raise ValueError(
                f"the {self.name} signal has no evidence rule; use an LLM judge "
                "(backend 'hf' or 'openai')"
            )
        return self.evidence_requires

    # ------------------------------------------------------------------ what to judge
    def units(self, batch: TrajectoryBatch, counts: dict[str, float]) -> np.ndarray:
        """Indices of the units to judge: flat turns (``level="turn"``) or rows. Units
        left out are null; count them here under their cause (default: every unit)."""
        return np.arange(batch.num_turns if self.level == "turn" else len(batch))

    @abstractmethod
    def request(self, row: Mapping[str, Any], turn: int | None) -> Request | None:
        """The request for one unit: ``row`` is its trajectory (the columns of
        :meth:`requires`) or question mapping, ``turn`` the turn's position in the row
        (``level="turn"``; else None). None: the unit cannot be asked."""

    @abstractmethod
    def parse(self, reply: str, context: Any) -> dict[str, Any] | None:
        """``{column: value}`` from a reply, or None when it is not what was asked."""

    def evidence(
        self, rows: Sequence[Mapping[str, Any]], documents: Mapping[str, str] | None
    ) -> list[Any]:
        """The evidence backend's judgements, one per row (``level="turn"``: a list with
        one per turn of the row); each ``{column: value}`` or None where it cannot judge.
        ``documents``: corpus id -> title (what a question-level rule may name). Only
        signals with ``evidence_requires`` have one."""
        raise ValueError(
            f"the {self.name} signal has no evidence rule; use an LLM judge (hf or openai)"
        )

    def agreement(self, batch: TrajectoryBatch) -> tuple[int, int] | None:
        """(judged trajectories whose verdict on the final answer matches exact match,
        judged trajectories); None when the signal gives no verdict on the answer."""
        return None


# ------------------------------------------------------------------------------ helpers
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL)


def parse_json_object(reply: str | None) -> dict[str, Any] | None:
    """The JSON object in ``reply``, or None when the reply is anything but one object
    (surrounding whitespace and one enclosing fenced code block are tolerated)."""
    if reply is None:
        return None
    text = reply.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def is_number(x: Any) -> bool:
    """A finite JSON number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def as_count(x: Any) -> int | None:
    """An integer >= 0 (``2`` or ``2.0``), else None."""
    if is_number(x) and x >= 0 and float(x).is_integer():
        return int(x)
    return None


def one_of(x: Any, allowed: Sequence[float]) -> float | None:
    """The allowed value ``x`` equals (within 1e-6), else None."""
    if is_number(x):
        for a in allowed:
            if abs(x - a) <= 1e-6:
                return a
    return None


def render_trace(turns: Sequence[Mapping[str, Any]]) -> str:
    """``Agent:`` / ``Information:`` blocks for the given turns, in order."""
    blocks = []
    for turn in turns:
        text = turn.get("text")
        if text is None:  # hand-built batches may record only the action and query
            text = f"[{turn.get('action')}] {turn.get('query') or ''}".strip()
        blocks.append(f"Agent: {text.strip()}")
        if turn.get("observation") is not None:
            blocks.append(f"Information: {turn['observation'].strip()}")
    return "\n\n".join(blocks)


def golds_text(golds: Sequence[str]) -> str:
    return "; ".join(golds)


def question_golds(q: Mapping[str, Any]) -> list[str]:
    """The accepted answers of a question mapping (``golden_answers`` or ``gold_answers``)."""
    golds = q.get("golden_answers", q.get("gold_answers"))
    if isinstance(golds, str):
        return [golds]
    if not golds:
        raise ValueError(
            f"question {q.get('question', '')[:60]!r} has no 'golden_answers' (or 'gold_answers')"
        )
    return list(golds)
