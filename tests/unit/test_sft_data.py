"""A demonstrations file for pipelines/sft.py: chats teach the assistant's messages only,
plain text its completion; what cannot be taught is refused with its line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from ray_credit.config import InputError  # noqa: E402
from ray_credit.models import load_tokenizer  # noqa: E402
from ray_credit.sft import tokenize_demonstrations  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


def _file(tmp_path, rows):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_chat_teaches_the_assistants_words_and_a_completion_its_text(tmp_path, tokenizer):
    chat = {"messages": [{"role": "user", "content": "Who founded Velmora?"},
                         {"role": "assistant", "content": "<answer> Ada Quill </answer>"}]}  # fmt: skip
    plain = {"prompt": "Q: Who founded Velmora?\nA:", "completion": " Ada Quill"}
    (c, p) = tokenize_demonstrations(_file(tmp_path, [chat, plain]), tokenizer, max_tokens=512)
    taught = [t for t, m in zip(c["input_ids"], c["loss_mask"], strict=True) if m]
    text = tokenizer.decode(taught)
    assert text.startswith("<answer> Ada Quill </answer>") and "Who founded" not in text
    assert (
        c["input_ids"]
        == tokenizer(
            tokenizer.apply_chat_template(chat["messages"], tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )
    taught = [t for t, m in zip(p["input_ids"], p["loss_mask"], strict=True) if m]
    assert tokenizer.decode(taught[:-1]) == " Ada Quill" and taught[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "demos.jsonl:1: not a JSON object"),
        ({"text": "hi"}, 'demos.jsonl:1: give {"messages"'),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message or completion"),
        ({"messages": [{"role": "user"}]}, "message 0 needs a role and a content"),
        ({"prompt": "a " * 300, "completion": "b"}, "over --max_tokens 64"),
    ],
)
def test_what_cannot_be_taught_is_refused_with_its_line(tmp_path, tokenizer, row, message):
    with pytest.raises(InputError, match=message.replace("{", "\\{").replace("[", "\\[")):
        tokenize_demonstrations(_file(tmp_path, [row]), tokenizer, max_tokens=64)
