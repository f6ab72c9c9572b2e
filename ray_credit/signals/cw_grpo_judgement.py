"""CW-GRPO's per-turn judgement: retrieval utility ``u`` and reasoning correctness ``v``.

CW-GRPO (arXiv 2604.14267) asks an LLM judge, for every turn of
a trajectory, whether the turn's search brought relevant new material (``u``) and whether
its reasoning and action were sound (``v``); the estimator weights each search round by
``p = u * v``. Columns: ``judge_utility`` and ``judge_correct``, int8 per turn, null
where not judged.

**LLM judge**: one request per turn, with the question and the trace up to and including
that turn (our prompt, ``prompts/cw_grpo_judgement.txt``); the reply is
``{"retrieval_reward": 0|1, "thinking_reward": 0|1}`` (other fields, such as the
``analysis`` the prompt invites, are ignored; a bool or any other number is unparseable).

**Evidence rule** (needs ``supporting_doc_ids``, the documents ``S`` that support the
gold answer, and ``turn_doc_ids``). For turn ``t``, with ``seen`` the supporting documents
returned before ``t``:

* a ``search`` turn: ``u = 1`` iff it returned a supporting document not in ``seen``
  (relevant and new); ``v = 1`` iff ``S`` was not yet all seen (it asks for something
  still missing). So ``p = 1`` exactly when the turn advanced the evidence chain;
* an ``answer`` turn: ``u = 1`` iff the answer exact-matches a gold answer; ``v = 1`` iff
  the normalized answer is non-empty and contained in an earlier observation (grounded in
  what was retrieved, right or not);
* an ``invalid`` / ``truncated`` turn: ``u = v = 0``.

A trajectory without supporting documents is not judged (null, ``judge/no_evidence``).

``skip_failed`` (default True, as the official code): trajectories with
``outcome_reward <= 0`` are not judged (null, ``judge/skipped``); the paper's estimator
gives them uniform weights and reads no judgement, so skipping changes no advantage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from ray_credit.batch import ColumnSpec, TrajectoryBatch
from ray_credit.qa import contains_gold, em_check, extract_answer, normalize_answer
from ray_credit.signals._base import JudgedSignal, Request, add, parse_json_object, render_trace
from ray_credit.signals._reply import Choice

_GRADE = Choice((0, 1))
_SCHEMA = (("retrieval_reward", _GRADE), ("thinking_reward", _GRADE))


@cache
def _template() -> str:
    return (resources.files(__package__) / "prompts" / "cw_grpo_judgement.txt").read_text()


@dataclass(frozen=True)
class CWGRPOJudgement(JudgedSignal):
    """CW-GRPO's per-turn utility and correctness (module docstring)."""

    name: ClassVar[str] = "cw_grpo_judgement"
    level: ClassVar[str] = "turn"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {
        "judge_utility": ColumnSpec(
            pa.list_(pa.int8()),
            "turn",
            "CW-GRPO retrieval utility u in {0,1}; null = not judged",
            producer="The cw_grpo_judgement signal fills it (a JudgePool stage).",
        ),
        "judge_correct": ColumnSpec(
            pa.list_(pa.int8()),
            "turn",
            "CW-GRPO reasoning correctness v in {0,1}; null = not judged",
            producer="The cw_grpo_judgement signal fills it (a JudgePool stage).",
        ),
    }
    llm_requires: ClassVar[tuple[str, ...]] = ("question", "turns")
    evidence_requires: ClassVar[tuple[str, ...]] = (
        "turns",
        "gold_answers",
        "answer",
        "supporting_doc_ids",
        "turn_doc_ids",
    )

    skip_failed: bool = True
    """Leave trajectories with outcome_reward <= 0 unjudged (the official code; their
    weights are uniform in the paper's estimator, so no advantage changes)."""

    def units(self, batch: TrajectoryBatch, counts: dict[str, float]) -> np.ndarray:
        if not self.skip_failed:
            return np.arange(batch.num_turns)
        failed = batch.traj_values("outcome_reward") <= 0
        add(counts, "judge/skipped", float(batch.turn_counts[failed].sum()))
        return np.flatnonzero(~failed[batch.turn_traj_index])

    def request(self, row: Mapping[str, Any], turn: int | None) -> Request:
        trace = render_trace(row["turns"][: turn + 1])  # the trace up to and including it
        return Request(_template().format(question=row["question"], trace=trace), _SCHEMA)

    def parse(self, reply: str, context: Any) -> dict[str, int] | None:
        obj = parse_json_object(reply)
        if obj is None:
            return None
        u, v = obj.get("retrieval_reward"), obj.get("thinking_reward")
        if not all(type(g) is int and g in (0, 1) for g in (u, v)):
            return None
        return {"judge_utility": u, "judge_correct": v}

    def evidence(self, rows: Sequence[Mapping[str, Any]], documents=None) -> list[list]:
        return [_evidence_row(row) for row in rows]

    def agreement(self, batch: TrajectoryBatch) -> tuple[int, int]:
        """The answer turn's correctness label against exact match."""
        em = batch.traj_values("outcome_reward") >= 1.0
        judged = batch.turn_valid("judge_correct") & batch.is_last_turn
        says = batch.turn_values("judge_correct", null=0.0) > 0
        agree = (says == em[batch.turn_traj_index])[judged]
        return int(agree.sum()), int(len(agree))


def _evidence_row(row: Mapping[str, Any]) -> list[dict[str, int] | None]:
    turns = row["turns"]
    support = set(row["supporting_doc_ids"] or ())
    if not support:
        return [None] * len(turns)
    out: list[dict[str, int] | None] = []
    seen: set[str] = set()
    observations: list[str] = []
    doc_ids = row["turn_doc_ids"] or [None] * len(turns)
    for t, turn in enumerate(turns):
        returned = set(doc_ids[t] or ())
        if turn["action"] == "search":
            missing = support - seen
            u, v = bool(missing & returned), bool(missing)
        elif turn["action"] == "answer":
            final = t == len(turns) - 1 and row["answer"] is not None
            answer = row["answer"] if final else extract_answer(turn["text"] or "")
            u, v = em_check(answer, row["gold_answers"]) == 1.0, _grounded(answer, observations)
        else:  # invalid / truncated: neither useful retrieval nor a useful action
            u = v = False
        out.append({"judge_utility": int(u), "judge_correct": int(v)})
        seen |= returned & support
        if turn["observation"]:
            observations.append(turn["observation"])
    return out


def _grounded(answer: str | None, observations: list[str]) -> bool:
    if answer is None or not normalize_answer(answer):
        return False
    return any(contains_gold(obs, [answer]) for obs in observations)


SIGNALS = (CWGRPOJudgement(),)
