"""An evaluation whose generator is lost under it (an actor restarted by Ray, back on the
base weights) is brought back to the policy's weights and redone, each time counted; a
generator lost more often than the retries allow fails the evaluation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray.exceptions

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.pipeline import evaluation
from ray_credit.pipeline.configs import EvalConfig


def _cfg():
    return SimpleNamespace(
        generator=GeneratorConfig(),
        eval=EvalConfig(),
        pipeline=SimpleNamespace(timeout_s=5.0),
        model="unused",
    )


@pytest.mark.parametrize(
    "loss",
    [
        lambda: ray.exceptions.ActorUnavailableError("The actor was restarted.", None),
        # what the call raises when Ray's memory monitor killed the generator under it
        lambda: ray.exceptions.OutOfMemoryError("Task was killed due to low memory."),
    ],
    ids=["restarted", "killed_by_the_memory_monitor"],
)
def test_a_generator_lost_mid_evaluation_is_reloaded_and_the_evaluation_redone(monkeypatch, loss):
    brought, calls = [], []
    lost = {"times": 1}

    def fake_evaluate_on(generators, questions, timeout_s, **overrides):
        calls.append(len(questions))
        if lost["times"]:
            lost["times"] -= 1
            raise loss()
        return {"em": 0.5, "correct": {}, "source": {}}

    monkeypatch.setattr(evaluation, "evaluate_on", fake_evaluate_on)
    monkeypatch.setattr(evaluation, "_bring_to", lambda gens, learner, v, t: brought.append(v))
    learner = SimpleNamespace(policy_version=7)
    questions = [{"question": "q?", "golden_answers": ["a"]}]
    result = evaluation.evaluate_policy(_cfg(), None, learner, questions, "after", ["gen"])
    assert result["em"] == 0.5 and result["redone_after_a_lost_generator"] == 1
    assert calls == [1, 1] and brought == [7, 7]  # weights checked again before the redo

    lost["times"] = evaluation.EVALUATION_RETRIES + 1  # lost every time: the run fails
    with pytest.raises(type(loss())):
        evaluation.evaluate_policy(_cfg(), None, learner, questions, "after", ["gen"])
    lost["times"], calls[:] = 0, []
    clean = evaluation.evaluate_policy(_cfg(), None, learner, questions, "after", ["gen"])
    assert "redone_after_a_lost_generator" not in clean and calls == [1]
