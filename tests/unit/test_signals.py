"""The signal registry and contract, and a user-defined judged signal that the judge pool
runs without any change to the library."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pytest

from ray_credit.actors.judge import JudgePool
from ray_credit.batch import COLUMNS, ColumnSpec, TrajectoryBatch
from ray_credit.signals import (
    SIGNALS,
    Choice,
    JudgedSignal,
    Request,
    get_signal,
    register_signal,
)
from ray_credit.signals._reply import Count, Strings, json_schema
from tests.unit.test_judge import OBS, SEARCH3, batch_of, traj

BUILTIN = {"cw_grpo_judgement", "search_p1_evaluation", "reference_plan", "info_gain"}


def test_builtins_registered_with_their_columns():
    assert set(SIGNALS) >= BUILTIN
    for signal in SIGNALS.values():
        assert dataclasses.is_dataclass(signal) and type(signal).__dataclass_params__.frozen
        assert signal.service in ("judge", "scorer") and signal.columns
        for name, spec in signal.columns.items():
            assert COLUMNS[name] == spec and spec.align in ("traj", "turn") and spec.producer
        if isinstance(signal, JudgedSignal):
            assert signal.level in ("turn", "trajectory", "question")
            assert signal.requires("hf") == signal.llm_requires


def test_signals_import_neither_torch_nor_ray():
    code = "import sys, ray_credit.signals; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_missing_signal_column_names_its_producer():
    batch = batch_of(traj(0, ["answer"], reward=1, answer="x"))
    with pytest.raises(ValueError, match="cw_grpo_judgement signal fills it"):
        batch.require(["judge_utility"])


def test_reply_schema_as_json_schema():
    schema = (("a", Choice((0, 1))), ("n", Count(max=3)), ("s", Strings(max_items=2)))
    out = json_schema(schema)
    assert out["required"] == ["a", "n", "s"] and out["additionalProperties"] is False
    assert out["properties"]["a"] == {"enum": [0, 1]}
    assert out["properties"]["n"]["maximum"] == 3 and out["properties"]["s"]["maxItems"] == 2
    with pytest.raises(ValueError):
        Strings(min_items=3, max_items=2)


# ------------------------------------------------------------------- a user's own signal
@dataclass(frozen=True)
class Concise(JudgedSignal):
    """A made-up judged signal: is each trajectory's final answer concise? Judged per
    trajectory, answered trajectories only."""

    name: ClassVar[str] = "test_concise"
    level: ClassVar[str] = "trajectory"
    columns: ClassVar[Mapping[str, ColumnSpec]] = {
        "concise": ColumnSpec(pa.int8(), "traj", "1: the answer is concise", producer="Concise")
    }
    llm_requires: ClassVar[tuple[str, ...]] = ("question", "answer")

    max_words: int = 3
    """What counts as concise."""

    def request(self, row: Mapping[str, Any], turn: int | None) -> Request | None:
        if row["answer"] is None:
            return None  # nothing to judge: null, counted as no_evidence
        prompt = f"Is '{row['answer']}' at most {self.max_words} words? Reply in JSON."
        return Request(prompt, (("concise", Choice((0, 1))),))

    def parse(self, reply: str, context: Any) -> dict[str, int] | None:
        value = json.loads(reply).get("concise")
        return {"concise": value} if value in (0, 1) else None


class WordCounter:
    """A judge backend that counts words: the 'model' of the test."""

    def complete(self, prompts, counts):
        answers = [p.split("'")[1] for p in prompts]
        return [json.dumps({"concise": int(len(a.split()) <= 3)}) for a in answers]


def test_user_signal_plugs_into_the_pool():
    register_signal(Concise())
    try:
        assert get_signal("test_concise") == Concise() and "concise" in COLUMNS
        with pytest.raises(ValueError, match="already registered"):
            register_signal(Concise())
        batch = batch_of(
            traj(0, ["answer"], answer="Velmora Hall"),
            traj(1, ["answer"], answer="the great hall of the old city"),
            traj(2, SEARCH3, obs=OBS),
        )
        out = JudgePool(WordCounter()).judge("test_concise", batch)
        assert out.column("concise").to_pylist() == [1, 0, None]
        assert out.metrics["judge/requests"] == 3 and out.metrics["judge/no_evidence"] == 1
        with pytest.raises(ValueError, match="no evidence rule"):
            JudgePool().judge("test_concise", batch)
    finally:
        SIGNALS.pop("test_concise")
        COLUMNS.pop("concise")


def test_a_signal_cannot_redeclare_a_column():
    @dataclass(frozen=True)
    class Clash(Concise):
        name: ClassVar[str] = "test_clash"
        columns: ClassVar[Mapping[str, ColumnSpec]] = {
            "judge_utility": ColumnSpec(pa.float32(), "turn", "not an int8")
        }

    with pytest.raises(ValueError, match="judge_utility.*already declared"):
        register_signal(Clash())
    assert "test_clash" not in SIGNALS


def test_agreement_with_exact_match_is_counted():
    batch = batch_of(
        traj(0, ["search", "answer"], reward=1, answer="Velmora Hall", docs=[["d1", "d2"], None],
             obs=["Velmora Hall", None]),
        traj(1, ["search", "answer"], reward=0, answer="Velmora", docs=[["d1"], None]),
    )  # fmt: skip
    cw = JudgePool().judge(
        dataclasses.replace(get_signal("cw_grpo_judgement"), skip_failed=False), batch
    )
    # answer turns: row 0 grounded (v=1) and right; row 1 ungrounded (v=0) and wrong
    assert cw.metrics["judge/agreement_n"] == 2 and cw.metrics["judge/agreement_hits"] == 2
    sp1 = JudgePool().judge("search_p1_evaluation", batch)
    assert sp1.metrics["judge/agreement_n"] == 2
    # row 1: "Velmora" is not contained... accuracy 0 < 0.5 agrees with EM 0
    assert sp1.metrics["judge/agreement_hits"] == 2
    assert np.isfinite(list(sp1.metrics.values())).all()
    assert isinstance(batch, TrajectoryBatch)
