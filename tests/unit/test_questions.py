"""A run's questions: a question file's own prompts, or the template, as data.prompts says."""

from __future__ import annotations

import json

from ray_credit.pipeline.configs import DataConfig
from ray_credit.pipeline.questions import load_data


def _files(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "1", "contents": "Oslo\nthe capital"}) + "\n")
    own = [{"role": "user", "content": "Answer the given question. Question: where?\n"}]
    rows = [
        {"id": "train_0", "question": "where?", "golden_answers": ["Oslo"], "prompt": own},
        {"id": "train_1", "question": "which?", "golden_answers": ["Bergen"]},
    ]
    questions = tmp_path / "train.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps(rows[0]) + "\n")
    return str(corpus), str(questions), str(test), own


def test_a_file_s_own_prompts_are_used_and_said(tmp_path, caplog):
    corpus, questions, test, own = _files(tmp_path)
    data = DataConfig(questions=questions, corpus=corpus, eval_file=test)
    with caplog.at_level("INFO", logger="ray_credit"):
        _, train_q, eval_q = load_data(data, seed=0)
    assert [q["prompt"] for q in train_q] == [own, None] and eval_q[0]["prompt"] == own
    notes = [r.message for r in caplog.records if "own prompt" in r.message]
    assert len(notes) == 2  # the training file's and the evaluation file's, once each
    assert "train.jsonl: 1 of 2 questions bring their own prompt" in notes[0]
    assert "generator.prompt_template renders the other 1" in notes[0]
    assert "--data.prompts template" in notes[0]


def test_data_prompts_template_renders_every_question(tmp_path, caplog):
    corpus, questions, test, _ = _files(tmp_path)
    data = DataConfig(questions=questions, corpus=corpus, eval_file=test, prompts="template")
    with caplog.at_level("INFO", logger="ray_credit"):
        _, train_q, eval_q = load_data(data, seed=0)
    assert all(q["prompt"] is None for q in train_q + eval_q)
    assert any("'prompt' column is not used (data.prompts=template)" in r.message
               for r in caplog.records)  # fmt: skip
