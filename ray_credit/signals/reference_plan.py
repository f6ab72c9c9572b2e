"""Search-P1's reference plans: the searches that are enough to answer each question.

Search-P1 (arXiv 2602.22576) makes a reference plan for every training question offline,
with a strong LLM, before training; its evaluator then measures how much of the plan a
trajectory covered. This signal works on questions, not rollouts: the pipeline runs it
once over the training questions (unless the question file brings a ``reference_plan``
field), keeps the plans next to the run's outputs, and the generator copies each
question's plan into its trajectories' ``reference_plan`` column.

**LLM judge**: our prompt (``prompts/reference_plan.txt``) with the question and its
accepted answers; the reply is ``{"steps": ["query", ...]}`` with at least one non-empty
step (else unparseable).

**Evidence rule** (needs the question's ``supporting_doc_ids`` and the corpus): one step
per supporting document, in hop order, named by the document's title (its first line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, ClassVar

from ray_credit.batch import COLUMNS, ColumnSpec
from ray_credit.signals._base import (
    JudgedSignal,
    Request,
    golds_text,
    parse_json_object,
    question_golds,
)
from ray_credit.signals._reply import Strings

_SCHEMA = (("steps", Strings(min_items=1, max_items=6, max_tokens=24)),)


@cache
def _template() -> str:
    return (resources.files(__package__) / "prompts" / "reference_plan.txt").read_text()


@dataclass(frozen=True)
class ReferencePlan(JudgedSignal):
    """A reference plan per question (module docstring)."""

    name: ClassVar[str] = "reference_plan"
    level: ClassVar[str] = "question"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {"reference_plan": COLUMNS["reference_plan"]}
    llm_requires: ClassVar[tuple[str, ...]] = ("question", "golden_answers")
    evidence_requires: ClassVar[tuple[str, ...]] = ("supporting_doc_ids",)

    def request(self, row: Mapping[str, Any], turn: int | None) -> Request:
        prompt = _template().format(
            question=row["question"], gold_answers=golds_text(question_golds(row))
        )
        return Request(prompt, _SCHEMA)

    def parse(self, reply: str, context: Any) -> dict[str, list[str]] | None:
        obj = parse_json_object(reply)
        steps = None if obj is None else obj.get("steps")
        if not isinstance(steps, list) or not steps:
            return None
        if not all(isinstance(s, str) and s.strip() for s in steps):
            return None
        return {"reference_plan": [s.strip() for s in steps]}

    def evidence(
        self, rows: Sequence[Mapping[str, Any]], documents: Mapping[str, str] | None
    ) -> list[dict[str, list[str]] | None]:
        if documents is None:
            raise ValueError(
                "evidence reference plans name the supporting documents by title; pass the "
                "corpus: JudgePool(backend='evidence', corpus=world.corpus)"
            )
        plans: list[dict[str, list[str]] | None] = []
        for q in rows:
            ids = q.get("supporting_doc_ids")
            if not ids:
                plans.append(None)
                continue
            unknown = [d for d in ids if str(d) not in documents]
            if unknown:
                raise ValueError(
                    f"question {q.get('question', '')[:60]!r}: supporting_doc_ids {unknown} are "
                    "not in the corpus given to the judge"
                )
            plans.append({"reference_plan": [documents[str(d)] for d in dict.fromkeys(ids)]})
        return plans


SIGNALS = (ReferencePlan(),)
