"""Guided decoding: every reply has its schema's form, whatever the model."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ray_credit.actors.guided import guided_replies  # noqa: E402
from ray_credit.models import load_model  # noqa: E402
from ray_credit.signals._reply import Choice, Count, Strings  # noqa: E402

GRADES = (("retrieval_reward", Choice((0, 1))), ("thinking_reward", Choice((0, 1))))
EVAL = (
    ("planner_score", Choice((0.2, 0.6, 1.0, 1.2))),
    ("model_plan_steps", Count(max=3)),
    ("effective_steps_self", Count(max=5, at_most="model_plan_steps")),
)
PLAN = (("steps", Strings(min_items=1, max_items=3, max_tokens=8)),)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def contexts(tokenizer, n):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Grade answer number {i}. Reply with JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(n)
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def check(reply, schema):
    obj = json.loads(reply)
    assert list(obj) == [name for name, _ in schema]
    for name, kind in schema:
        value = obj[name]
        if isinstance(kind, Choice):
            assert value in kind.values and type(value) is type(kind.values[0])
        elif isinstance(kind, Count):
            bound = kind.max if kind.at_most is None else min(kind.max, obj[kind.at_most])
            assert type(value) is int and 0 <= value <= bound
        else:
            assert kind.min_items <= len(value) <= kind.max_items
            assert all(isinstance(s, str) and s.strip() for s in value)


def test_every_reply_has_its_schemas_form(tiny):
    model, tokenizer = tiny
    schemas = [GRADES, EVAL, PLAN] * 3
    replies = guided_replies(model, tokenizer, contexts(tokenizer, 9), schemas)
    for reply, schema in zip(replies, schemas, strict=True):
        check(reply, schema)
    assert replies == guided_replies(model, tokenizer, contexts(tokenizer, 9), schemas)
    one_by_one = guided_replies(model, tokenizer, contexts(tokenizer, 9), schemas, max_batch_rows=1)
    assert one_by_one == replies  # batching (padding) changes nothing


def logprob_of(model, tokenizer, context, text):
    """Total log-probability of ``text``'s tokens after ``context``, one forward pass."""
    base = tokenizer(text[: text.rindex(": ") + 2], add_special_tokens=False)["input_ids"]
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    k = next((i for i, (a, b) in enumerate(zip(base, full, strict=False)) if a != b), len(base))
    ids = torch.tensor([context + full])
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids).logits.float()[0], -1)
    start = len(context) + k
    return float(sum(logp[t - 1, ids[0, t]] for t in range(start, ids.shape[1])))


def test_a_choice_is_the_most_likely_value(tiny):
    model, tokenizer = tiny
    schema = (("score", Choice((0.2, 0.6, 1.0, 1.2))),)
    for context in contexts(tokenizer, 4):
        (reply,) = guided_replies(model, tokenizer, [context], [schema])
        scores = [
            logprob_of(model, tokenizer, context, f'{{"score": {v}') for v in (0.2, 0.6, 1.0, 1.2)
        ]
        assert json.loads(reply)["score"] == (0.2, 0.6, 1.0, 1.2)[int(np.argmax(scores))]


def test_bad_input(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="one schema per context"):
        guided_replies(model, tokenizer, contexts(tokenizer, 2), [GRADES])
    with pytest.raises(ValueError, match="at least one field"):
        guided_replies(model, tokenizer, contexts(tokenizer, 1), [()])
    with pytest.raises(TypeError, match="not a Choice, Count or Strings"):
        guided_replies(model, tokenizer, contexts(tokenizer, 1), [(("x", int),)])


@pytest.mark.slow
def test_smollm2_replies_in_form():
    try:
        model, tokenizer = load_model("smollm2-135m")
    except (ImportError, FileNotFoundError) as err:
        pytest.skip(f"SmolLM2 is not installed here: {err}")
    schemas = [GRADES, PLAN]
    for reply, schema in zip(
        guided_replies(model, tokenizer, contexts(tokenizer, 2), schemas), schemas, strict=True
    ):
        check(reply, schema)
