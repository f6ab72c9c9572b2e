"""Search-P1's evaluator: the ``sp1_*`` fields of each trajectory.

Search-P1 (arXiv 2602.22576) asks an evaluator LLM to compare a
trajectory with the question's reference plan: the quality of the agent's own plan, how
many of its steps it carried out, how many reference steps it covered, and a soft grade
of the outcome. The estimator (``estimators/search_p1.py``) turns them into the path
reward. One value per trajectory in each column below, null where not judged.

**LLM judge**: one request per trajectory with a reference plan (our prompt,
``prompts/search_p1_evaluation.txt``, with the question, the accepted answers, the numbered
reference plan and the whole trace). A row without a reference plan cannot be asked
(null, ``judge/no_evidence``): build the plans first (the ``reference_plan`` signal, which
the pipeline runs over the training questions) or bring them in the question file. The
reply must hold every field with an allowed value; the effective step counts may not
exceed the plans they count (else unparseable).

**Evidence rule** (needs ``supporting_doc_ids`` and ``turn_doc_ids``): the reference plan
is one step per supporting document, and it stands for the agent's plan too (the rule
cannot read a plan): ``sp1_plan_steps = sp1_ref_plan_steps = |S|``, and both effective
step counts are the supporting documents any search returned. ``sp1_planner_score``: 1.2
if all of ``S`` was found with exactly ``|S|`` searches, 1.0 if all was found, 0.6 if
some, 0.2 if none. ``sp1_outcome_accuracy``: 1 for an exact match, 0.5 if the answer
contains a gold answer, else 0. ``sp1_outcome_reasoning``: 1.0 for an exact match on the
full evidence chain, 0.8 for the full chain, 0.5 for part of it, 0 for none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, ClassVar

import pyarrow as pa

from ray_credit.batch import ColumnSpec, TrajectoryBatch
from ray_credit.estimators.search_p1 import EVALUATOR_FIELDS
from ray_credit.qa import em_check, subem_check
from ray_credit.signals._base import (
    JudgedSignal,
    Request,
    as_count,
    golds_text,
    one_of,
    parse_json_object,
    render_trace,
)
from ray_credit.signals._reply import Choice, Count

_PRODUCER = "The search_p1_evaluation signal fills it (a JudgePool stage)."


def _column(type_: pa.DataType, doc: str) -> ColumnSpec:
    return ColumnSpec(type_, "traj", doc, producer=_PRODUCER)


# reply field -> (column, allowed values; None: a count)
_REPLY = {
    "planner_score": ("sp1_planner_score", EVALUATOR_FIELDS["sp1_planner_score"]),
    "model_plan_steps": ("sp1_plan_steps", None),
    "effective_steps_self": ("sp1_effective_steps_self", None),
    "effective_steps_ref": ("sp1_effective_steps_ref", None),
    "outcome_accuracy_score": ("sp1_outcome_accuracy", EVALUATOR_FIELDS["sp1_outcome_accuracy"]),
    "outcome_reasoning_score": (
        "sp1_outcome_reasoning",
        EVALUATOR_FIELDS["sp1_outcome_reasoning"],
    ),
}
_MAX_STEPS = 12  # the largest plan a guided judge may count


@cache
def _template() -> str:
    return (resources.files(__package__) / "prompts" / "search_p1_evaluation.txt").read_text()


def _schema(ref_steps: int):
    return (
        ("planner_score", Choice(EVALUATOR_FIELDS["sp1_planner_score"])),
        ("model_plan_steps", Count(max=_MAX_STEPS)),
        ("effective_steps_self", Count(max=_MAX_STEPS, at_most="model_plan_steps")),
        ("effective_steps_ref", Count(max=ref_steps)),
        ("outcome_accuracy_score", Choice(EVALUATOR_FIELDS["sp1_outcome_accuracy"])),
        ("outcome_reasoning_score", Choice(EVALUATOR_FIELDS["sp1_outcome_reasoning"])),
    )


@dataclass(frozen=True)
class SearchP1Evaluation(JudgedSignal):
    """Search-P1's evaluator fields (module docstring)."""

    name: ClassVar[str] = "search_p1_evaluation"
    level: ClassVar[str] = "trajectory"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {
        "sp1_planner_score": _column(
            pa.float32(), "Search-P1 planner score in {0.2,0.6,1.0,1.2}; null = not judged"
        ),
        "sp1_plan_steps": _column(pa.int32(), "Search-P1 n_plan: steps in the agent's own plan"),
        "sp1_effective_steps_self": _column(
            pa.int32(), "Search-P1 n_exec_self: plan steps the agent executed"
        ),
        "sp1_effective_steps_ref": _column(
            pa.int32(), "Search-P1 n_covered: reference-plan steps covered"
        ),
        "sp1_ref_plan_steps": _column(pa.int32(), "Search-P1 |R_ref|: steps in the reference plan"),
        "sp1_outcome_accuracy": _column(pa.float32(), "Search-P1 r_acc in {0,0.5,1}"),
        "sp1_outcome_reasoning": _column(pa.float32(), "Search-P1 r_reason in {0,0.5,0.8,1}"),
    }
    llm_requires: ClassVar[tuple[str, ...]] = (
        "question",
        "gold_answers",
        "turns",
        "reference_plan",
    )
    evidence_requires: ClassVar[tuple[str, ...]] = (
        "turns",
        "gold_answers",
        "answer",
        "supporting_doc_ids",
        "turn_doc_ids",
    )

    def request(self, row: Mapping[str, Any], turn: int | None) -> Request | None:
        plan = row["reference_plan"]
        if not plan:
            return None
        prompt = _template().format(
            question=row["question"],
            gold_answers=golds_text(row["gold_answers"]),
            ref_steps=len(plan),
            reference_plan="\n".join(f"{k + 1}. {step}" for k, step in enumerate(plan)),
            trace=render_trace(row["turns"]),
        )
        return Request(prompt, _schema(len(plan)), context=len(plan))

    def parse(self, reply: str, context: Any) -> dict[str, float | int] | None:
        """Every field valid, and effective steps within the plans they count
        (``context``: the reference plan's length)."""
        obj = parse_json_object(reply)
        if obj is None:
            return None
        out: dict[str, float | int] = {"sp1_ref_plan_steps": context}
        for field, (column, allowed) in _REPLY.items():
            value = as_count(obj.get(field)) if allowed is None else one_of(obj.get(field), allowed)
            if value is None:
                return None
            out[column] = value
        if out["sp1_effective_steps_self"] > out["sp1_plan_steps"] or (
            out["sp1_effective_steps_ref"] > context
        ):
            return None
        return out

    def evidence(self, rows: Sequence[Mapping[str, Any]], documents=None) -> list:
        return [_evidence_row(row) for row in rows]

    def agreement(self, batch: TrajectoryBatch) -> tuple[int, int]:
        """Outcome accuracy >= 0.5 read as "correct", against exact match."""
        em = batch.traj_values("outcome_reward") >= 1.0
        judged = batch.traj_valid("sp1_outcome_accuracy")
        says = batch.traj_values("sp1_outcome_accuracy", null=0.0) >= 0.5
        agree = (says == em)[judged]
        return int(agree.sum()), int(len(agree))


def _evidence_row(row: Mapping[str, Any]) -> dict[str, float | int] | None:
    support = list(dict.fromkeys(row["supporting_doc_ids"] or ()))
    if not support:
        return None
    returned = {d for ids in row["turn_doc_ids"] or () for d in ids or ()}
    found = len(set(support) & returned)
    searches = sum(turn["action"] == "search" for turn in row["turns"])
    complete = found == len(support)
    exact = em_check(row["answer"], row["gold_answers"]) == 1.0
    partial = subem_check(row["answer"], row["gold_answers"]) == 1.0
    if complete:
        planner, reasoning = (1.2 if searches == found else 1.0), (1.0 if exact else 0.8)
    else:
        planner, reasoning = (0.6 if found else 0.2), (0.5 if found else 0.0)
    return {
        "sp1_planner_score": planner,
        "sp1_plan_steps": len(support),
        "sp1_effective_steps_self": found,
        "sp1_effective_steps_ref": found,
        "sp1_ref_plan_steps": len(support),
        "sp1_outcome_accuracy": 1.0 if exact else (0.5 if partial else 0.0),
        "sp1_outcome_reasoning": reasoning,
    }


SIGNALS = (SearchP1Evaluation(),)
