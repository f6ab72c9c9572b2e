"""A demonstrations file for pipelines/sft.py: every chat format people have (OpenAI and
Hugging Face messages, ShareGPT, TRL's prompt/completion) teaches exactly the assistant's
replies; what cannot be taught is refused with its line."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from ray_credit.config import InputError  # noqa: E402
from ray_credit.models import load_tokenizer  # noqa: E402
from ray_credit.sft import tokenize_demonstrations  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
USER = {"role": "user", "content": "Who founded Velmora?"}
REPLY = {"role": "assistant", "content": "<answer> Ada Quill </answer>"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")


def _file(tmp_path, rows, name="demos.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _one(tmp_path, tokenizer, row, **kw):
    (demo,) = tokenize_demonstrations(_file(tmp_path, [row]), tokenizer, max_tokens=512, **kw)
    return demo


def _taught(tokenizer, demo) -> list[str]:
    """The taught runs of tokens, as text: one per taught reply."""
    assert len(demo["input_ids"]) == len(demo["loss_mask"])
    runs, run = [], []
    for token, taught in zip(demo["input_ids"], demo["loss_mask"], strict=True):
        if taught:
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    return [tokenizer.decode(r) for r in runs]


def _rendered(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_teaches_the_assistants_words_and_a_completion_its_text(tmp_path, tokenizer):
    chat = {"messages": [USER, REPLY]}
    plain = {"prompt": "Q: Who founded Velmora?\nA:", "completion": " Ada Quill"}
    (c, p) = tokenize_demonstrations(_file(tmp_path, [chat, plain]), tokenizer, max_tokens=512)
    # the reply and its end of turn, not the header nor ChatML's newline after it
    assert _taught(tokenizer, c) == ["<answer> Ada Quill </answer><|im_end|>"]
    assert c["input_ids"] == _rendered(tokenizer, chat["messages"])
    taught = [t for t, m in zip(p["input_ids"], p["loss_mask"], strict=True) if m]
    assert tokenizer.decode(taught[:-1]) == " Ada Quill" and taught[-1] == tokenizer.eos_token_id


def test_a_multi_turn_chat_teaches_every_assistant_reply_and_nothing_else(tmp_path, tokenizer):
    """As TRL's SFTTrainer with assistant_only_loss: each reply, none of the context."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        USER,
        {"role": "assistant", "content": '<search> "Velmora" </search>'},
        {"role": "tool", "content": "Velmora was founded by Ada Quill."},
        REPLY,
        {"role": "user", "content": "And when?"},
        {"role": "assistant", "content": "<answer> 1802 </answer>"},
    ]
    demo = _one(tmp_path, tokenizer, {"messages": messages})
    assert demo["input_ids"] == _rendered(tokenizer, messages)
    assert _taught(tokenizer, demo) == [
        '<search> "Velmora" </search><|im_end|>',
        "<answer> Ada Quill </answer><|im_end|>",
        "<answer> 1802 </answer><|im_end|>",
    ]


def test_sharegpt_chats_teach_the_gpt_replies(tmp_path, tokenizer):
    """ShareGPT's shape and role names: the "gpt" reply was rendered as context (taught
    nothing); it is the assistant's now."""
    sharegpt = {"conversations": [
        {"from": "system", "value": "Answer briefly."},
        {"from": "human", "value": USER["content"]},
        {"from": "gpt", "value": REPLY["content"]},
    ]}  # fmt: skip
    as_openai = [{"role": "system", "content": "Answer briefly."}, USER, REPLY]
    demo = _one(tmp_path, tokenizer, sharegpt)
    assert demo["input_ids"] == _rendered(tokenizer, as_openai)
    assert _taught(tokenizer, demo) == ["<answer> Ada Quill </answer><|im_end|>"]
    # ShareGPT's role names inside OpenAI's shape
    named = {"messages": [{"role": "human", "content": USER["content"]},
                          {"role": "gpt", "content": REPLY["content"]}]}  # fmt: skip
    assert _one(tmp_path, tokenizer, named) == _one(
        tmp_path, tokenizer, {"messages": [USER, REPLY]}
    )


def test_trls_conversational_prompt_completion_teaches_the_completion(tmp_path, tokenizer):
    """Lists of messages: the repr of the lists was what got taught; now the prompt is
    context (its assistant turns too) and the completion's reply is taught."""
    earlier = {"role": "assistant", "content": "<search> Velmora </search>"}
    row = {"prompt": [USER, earlier, {"role": "tool", "content": "Ada Quill"}],
           "completion": [REPLY]}  # fmt: skip
    demo = _one(tmp_path, tokenizer, row)
    assert demo["input_ids"] == _rendered(tokenizer, [*row["prompt"], REPLY])
    assert _taught(tokenizer, demo) == ["<answer> Ada Quill </answer><|im_end|>"]
    assert "[{" not in tokenizer.decode(demo["input_ids"])


def test_files_as_people_have_them(tmp_path, tokenizer):
    """Blank lines, a JSON array (gzipped too), gzipped JSON lines, parquet of chats."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": [USER, REPLY]}, {"prompt": "Q:", "completion": " A"}]
    want = tokenize_demonstrations(_file(tmp_path, rows), tokenizer, max_tokens=512)
    blank = _file(tmp_path, [rows[0], "", "  ", rows[1], ""], "blank.jsonl")
    array = tmp_path / "demos.json"
    array.write_text(json.dumps(rows, indent=2))
    zipped = tmp_path / "demos.json.gz"
    zipped.write_bytes(gzip.compress(json.dumps(rows).encode()))
    lines = tmp_path / "demos.jsonl.gz"
    lines.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    table = tmp_path / "demos.parquet"  # a column per key, null where a row lacks it
    columns = [{"messages": None, "prompt": None, "completion": None, **r} for r in rows]
    pq.write_table(pa.Table.from_pylist(columns), table)
    for path in (blank, array, zipped, lines, table):
        assert tokenize_demonstrations(path, tokenizer, max_tokens=512) == want, path.name
    sharegpt = tmp_path / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist([{"conversations": [
        {"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]}]), sharegpt)  # fmt: skip
    (demo,) = tokenize_demonstrations(sharegpt, tokenizer, max_tokens=512)
    assert _taught(tokenizer, demo) == ["A.<|im_end|>"]
    # a row's other keys are not read: ultrachat's rows carry their first question as text
    ultrachat = {"prompt": USER["content"], "prompt_id": "x1", "messages": [USER, REPLY]}
    assert _one(tmp_path, tokenizer, ultrachat) == want[0]


def test_a_tool_call_is_taught_where_the_template_renders_it(tmp_path, tokenizer):
    """An assistant message that calls tools (null content beside tool_calls, OpenAI's
    shape): taught with a template that writes the calls, refused with one that drops them
    (only its end of turn would be taught)."""
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "search",
                                                              "arguments": '{"q": "Velmora"}'}}]}  # fmt: skip
    row = {"messages": [USER, call, {"role": "tool", "content": "Ada Quill"}, REPLY]}
    with pytest.raises(InputError, match=r"demos.jsonl:1: the chat template renders message 1 "
                       r"\(assistant\) as nothing but its end of turn \(it leaves out tool_calls\)"):  # fmt: skip
        _one(tmp_path, tokenizer, row)
    writes_calls = copy.deepcopy(tokenizer)
    writes_calls.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
        "{{ c.function.arguments }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    demo = _one(tmp_path, writes_calls, row)
    assert _taught(writes_calls, demo) == [
        '<tool_call>search {"q": "Velmora"}</tool_call><|im_end|>',
        "<answer> Ada Quill </answer><|im_end|>",
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            "{not json",
            "demos.jsonl:1: invalid JSON (Expecting property name enclosed in "
            "double quotes at column 2); each line must be one JSON object",
        ),
        (
            {"text": "hi"},
            'demos.jsonl:1: give {"messages": [{"role": ..., "content": ...}, '
            '...]}, ShareGPT\'s {"conversations"',
        ),
        (
            {"messages": [USER]},
            "demos.jsonl:1: no assistant message to teach (it has user); add "
            "the reply the model should give (role assistant, ShareGPT's gpt)",
        ),
        (
            {"messages": [{"role": "system", "content": "Be brief."}]},
            "demos.jsonl:1: no assistant message to teach (it has system)",
        ),
        (
            {"messages": [{"role": "user"}, REPLY]},
            "demos.jsonl:1: message 0 needs a role and a content",
        ),
        # a null content: jinja's "can only concatenate str (not NoneType)" before
        (
            {"messages": [{"role": "user", "content": None}, REPLY]},
            "demos.jsonl:1: message 0 (user) has a null content; give its text as a string",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": ["Ada"]}]},
            "demos.jsonl:1: message 1 (assistant) has the content ['Ada'] (list); give its text "
            "as a string",
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": "  "}]},
            "demos.jsonl:1: message 1 is an assistant reply that is only whitespace: nothing to "
            "teach",
        ),
        (
            {"messages": [{"role": "bot", "content": "hi"}, REPLY]},
            "demos.jsonl:1: message 0 has the role 'bot'; a role is system, user, assistant or "
            "tool (ShareGPT's human and gpt)",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "hi"},
                    {"from": "chatgpt", "value": "x"},
                ]
            },
            "demos.jsonl:1: message 1 has the role 'chatgpt'",
        ),
        (
            {"messages": [USER, REPLY], "conversations": [USER, REPLY]},
            "demos.jsonl:1: has both 'messages' and 'conversations', two demonstrations in one "
            "row; keep one of them",
        ),
        (
            {"messages": [USER, REPLY], "completion": "Ada"},
            "demos.jsonl:1: has both 'messages' and 'completion'",
        ),
        # a null completion: the model was taught to say "None"
        (
            {"prompt": "Q:", "completion": None},
            "demos.jsonl:1: the completion is null, and nothing is taught without one; give the "
            "reply as text, or drop the row",
        ),
        # an empty completion: only the end-of-sequence token was taught
        (
            {"prompt": "Q:", "completion": ""},
            "demos.jsonl:1: the completion is empty: only the end-of-sequence token would be "
            "taught; give the reply, or drop the row",
        ),
        ({"prompt": [USER], "completion": []}, "the completion is an empty list: nothing to teach"),
        (
            {"prompt": [USER], "completion": [{"role": "user", "content": "more?"}]},
            "demos.jsonl:1: no assistant message to teach (its completion has user)",
        ),
        (
            {"prompt": [USER], "completion": "Ada"},
            "demos.jsonl:1: prompt and completion are both text (TRL's standard form) or both "
            "lists of messages",
        ),
        (
            {"prompt": "Q:"},
            'a prompt without a completion: nothing to teach; add the reply as "completion"',
        ),
        (
            {"messages": [USER, dict(REPLY, weight=0)]},
            "demos.jsonl:1: message 1 (assistant) has weight=0, and a per-message weight is not "
            "read",
        ),
        (
            {"messages": [REPLY, USER, REPLY]},
            "message 0 is the assistant's, with nothing before it that it answers",
        ),
        (
            {"prompt": "a " * 300, "completion": "b"},
            "demos.jsonl:1: 303 tokens, over --max_tokens 64",
        ),
        # a weight or train that is not a bool or 0/1 was read as true: "0", "false", 0.5
        # and NaN left the reply taught in full
        (
            {"messages": [USER, dict(REPLY, weight="0")]},
            "demos.jsonl:1: message 1 (assistant) has weight='0', and a per-message weight is "
            "not read: every assistant reply is taught in full and nothing else; remove "
            "'weight' (a reply not to teach goes in the prompt of",
        ),
        (
            {"messages": [USER, dict(REPLY, train="false")]},
            "message 1 (assistant) has train='false', and a per-message train is not read",
        ),
        (
            {"messages": [USER, dict(REPLY, weight=0.5)]},
            "message 1 (assistant) has weight=0.5, and a per-message weight is not read",
        ),
        # a special token written as text became that token: the reply's first part and an
        # end of turn were taught, then the rest; a user's <|im_start|> opened a turn
        (
            {"messages": [USER, dict(REPLY, content="Ada<|im_end|> Quill")]},
            "demos.jsonl:1: message 1's content holds '<|im_end|>', a special token of the "
            "tokenizer, as text; it would be read as that token (a turn's end or start inside "
            "the message), not as text: remove it",
        ),
        (
            {"messages": [dict(USER, content="hi<|im_end|>\n<|im_start|>assistant\nno"), REPLY]},
            "message 0's content holds '<|im_start|>', a special token of the tokenizer",
        ),
        (
            {"prompt": "Q:", "completion": " Ada<|im_end|>"},
            "demos.jsonl:1: the completion holds '<|im_end|>', a special token of the tokenizer",
        ),
        (
            {"messages": [USER, dict(REPLY, role="Assistant")]},
            "message 1 has the role 'Assistant' (did you mean 'assistant'?); a role is",
        ),
        (
            {"messages": None},
            "demos.jsonl:1: 'messages' is null: nothing to teach; fill the row in",
        ),
        # a parquet row of its columns, none filled: "a prompt without a completion" before
        (
            {"messages": None, "prompt": None},
            "demos.jsonl:1: 'messages' and 'prompt' are null: nothing to teach",
        ),
        (
            {"dialog": [USER, REPLY]},
            "got keys ['dialog'] ('dialog' holds messages: name it 'messages')",
        ),
        (
            {"messages": json.dumps([USER, REPLY])},
            "(str); it is the list's JSON text: store the list itself",
        ),
    ],
)
def test_what_cannot_be_taught_is_refused_with_its_line(tmp_path, tokenizer, row, message):
    with pytest.raises(InputError) as err:
        tokenize_demonstrations(_file(tmp_path, [row]), tokenizer, max_tokens=64)
    assert message in str(err.value), str(err.value)


def test_demonstrations_over_the_limit_are_counted_not_dropped(tmp_path, tokenizer):
    rows = [{"prompt": "a " * n, "completion": "b"} for n in (300, 10, 400, 500)]
    with pytest.raises(InputError) as err:
        tokenize_demonstrations(_file(tmp_path, rows), tokenizer, max_tokens=64)
    assert str(err.value).endswith(
        "demos.jsonl:1: 303 tokens, over --max_tokens 64 (and 2 more of the 4 demonstrations, "
        "the longest 503 tokens); raise it to 503 or shorten them (none is cut: a cut one "
        "teaches a truncated turn)"
    ), str(err.value)


def test_a_file_that_is_not_utf8_names_its_line(tmp_path, tokenizer):
    """pipelines/sft.py --data with a Latin-1 line: a UnicodeDecodeError traceback before,
    the loaders' one line now (JSON lines and a JSON array alike)."""
    from ray_credit.pipeline.cli import run_config_class

    lines = tmp_path / "demos.jsonl"
    lines.write_bytes(
        b'{"prompt": "Q:", "completion": " A"}\n{"prompt": "caf\xe9", "completion": "x"}\n'
    )
    array = tmp_path / "demos.json"
    array.write_bytes(
        b'[{"prompt": "Q:", "completion": " A"},\n {"prompt": "caf\xe9", "completion": "x"}]'
    )
    for path in (lines, array):
        with pytest.raises(InputError) as err:
            tokenize_demonstrations(path, tokenizer, max_tokens=64)
        assert f"{path.name}:2: not UTF-8 (byte 0xe9 at column" in str(err.value)
    main = run_config_class(ROOT / "pipelines" / "sft.py", "main")
    argv = ["--model", "tiny-random", "--data", str(lines), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert str(exit_.value.code) == (
        f"sft.py: error: {lines}:2: not UTF-8 (byte 0xe9 at column 16); save the file as "
        "UTF-8, e.g. `iconv -f latin1 -t utf-8 demos.jsonl` if it is Latin-1"
    )


def test_a_key_given_twice_is_refused_not_read_as_its_last(tmp_path, tokenizer):
    """JSON keeps the last of two equal keys without a word: the first completion, or the
    first role of a message, was dropped and the other taught."""
    row = '{"prompt": "Q:", "completion": " first", "completion": " second"}'
    reply = (
        '{"messages": [{"role": "user", "content": "Q"}, '
        '{"role": "assistant", "role": "user", "content": "A"}]}'
    )
    (tmp_path / "demos.jsonl").write_text(f'{{"prompt": "Q:", "completion": " A"}}\n{row}\n')
    (tmp_path / "demos.json").write_text(f"[{reply}]")
    for name, says in (("demos.jsonl", "demos.jsonl:2: the key 'completion' appears twice"),
                       ("demos.json", "demos.json: the key 'role' appears twice")):  # fmt: skip
        with pytest.raises(InputError) as err:
            tokenize_demonstrations(tmp_path / name, tokenizer, max_tokens=64)
        said = f"{tmp_path / says} in one object, and JSON keeps only the last; keep the one"
        assert str(err.value).startswith(said), str(err.value)


def test_a_file_of_no_rows_or_one_object_says_what_a_file_holds(tmp_path, tokenizer):
    """A .json file that is one object (its rows under a key) was read as JSON lines: "line
    1: invalid JSON"; an empty file was "holds no demonstration", without what to give."""
    path = tmp_path / "demos.json"
    path.write_text(json.dumps({"data": [{"messages": [USER, REPLY]}] * 2}, indent=2))
    with pytest.raises(InputError) as err:
        tokenize_demonstrations(path, tokenizer, max_tokens=64)
    assert str(err.value) == (
        f"{path}: one JSON object over several lines (keys ['data']), not rows ('data' holds 2 "
        "rows: write them one per line, or as a JSON array); a demonstrations file is JSON "
        "lines (one row per line) or one JSON array of rows"
    )
    path.write_text(json.dumps({"data": [{"messages": [USER, REPLY]}]}))  # on one line
    with pytest.raises(InputError, match=r"got keys \['data'\] \('data' holds 1 row: write"):
        tokenize_demonstrations(path, tokenizer, max_tokens=64)
    for text in ("", "\n  \n"):
        path.write_text(text)
        with pytest.raises(
            InputError, match=r'holds no demonstration \(no row\); give \{"messages"'
        ):
            tokenize_demonstrations(path, tokenizer, max_tokens=64)


def test_arguments_and_a_tokenizer_without_a_chat_template_are_named(tmp_path, tokenizer):
    """A missing file or a folder: FileNotFoundError and IsADirectoryError tracebacks; a
    max_tokens of 0, True or None: every row refused as too long, or a TypeError; a chat
    for a tokenizer without a template: transformers' paragraph."""
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(InputError, match="demonstrations file .* does not exist"):
            tokenize_demonstrations(path, tokenizer, max_tokens=64)
    path = _file(tmp_path, [{"messages": [USER, REPLY]}])
    with pytest.raises(ValueError, match="max_tokens must be >= 2, got 0"):
        tokenize_demonstrations(path, tokenizer, max_tokens=0)
    for bad in (True, None, 2.5):
        with pytest.raises(TypeError, match="max_tokens is a whole number of tokens"):
            tokenize_demonstrations(path, tokenizer, max_tokens=bad)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(InputError) as err:
        tokenize_demonstrations(path, bare, max_tokens=64)
    assert str(err.value) == (
        f"{path}:1: the model's tokenizer has no chat template to render a chat with; give the "
        'rows as text ({"prompt": "...", "completion": "..."}), or a model that has one (an '
        "instruct model)"
    )


def test_a_json_array_names_the_item_and_the_line(tmp_path, tokenizer):
    path = tmp_path / "demos.json"
    path.write_text('[{"messages": [{"role": "user", "content": "hi"}]},\n {"x": }]')
    with pytest.raises(InputError, match=r"demos.json:2: invalid JSON \(Expecting value at "
                       r"column 8\); a file that begins with '\[' is read as one JSON array"):  # fmt: skip
        tokenize_demonstrations(path, tokenizer, max_tokens=64)
    path.write_text(json.dumps([{"messages": [USER, REPLY]}, {"messages": [USER]}]))
    with pytest.raises(InputError, match=r"demos.json: item 1: no assistant message to teach"):
        tokenize_demonstrations(path, tokenizer, max_tokens=64)
    path.write_text("[]")
    with pytest.raises(InputError, match="holds no demonstration"):
        tokenize_demonstrations(path, tokenizer, max_tokens=64)
