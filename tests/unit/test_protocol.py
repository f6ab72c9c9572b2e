"""Action parsing, document / observation formatting and prompt templates."""

import dataclasses
import json

import pytest

from ray_credit.protocol import (
    INVALID_ACTION_FEEDBACK,
    INVALID_TOOL_CALL_FEEDBACK,
    Action,
    ActionKind,
    PromptTemplate,
    format_documents,
    format_observation,
    load_prompt_template,
    normalize_question,
    parse_action,
)
from ray_credit.qa import extract_answer

SEARCH, ANSWER = ActionKind.SEARCH, ActionKind.ANSWER
INVALID, TRUNCATED = ActionKind.INVALID, ActionKind.TRUNCATED


def tool_call(payload) -> str:
    body = payload if isinstance(payload, str) else json.dumps(payload)
    return f"<tool_call>{body}</tool_call>"


# --- ActionKind / Action -----------------------------------------------------------------


def test_action_kind_values_are_the_stored_strings():
    assert [k.value for k in ActionKind] == ["search", "answer", "invalid", "truncated"]
    assert ActionKind("search") is SEARCH
    assert SEARCH == "search"
    assert str(TRUNCATED) == "truncated"
    assert f"{INVALID}" == "invalid"


def test_action_is_frozen_and_checked():
    action = Action(kind="search", queries=("q1", "q2"), end=5)
    assert action.kind is SEARCH
    assert action.query == "q1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        action.end = 0
    assert Action(kind=ANSWER, answer="x", end=1).query is None
    with pytest.raises(ValueError, match="needs at least one query"):
        Action(kind=SEARCH, end=0)
    with pytest.raises(ValueError, match="needs an answer"):
        Action(kind=ANSWER, end=0)


# --- parse_action: "tags" style ------------------------------------------------------------


def test_tags_search_and_answer():
    text = "<think>need facts</think>\n<search>  capital of France </search>"
    action = parse_action(text)
    assert action.kind is SEARCH
    assert action.query == "capital of France"
    assert action.queries == ("capital of France",)
    assert action.answer is None and action.reason is None
    assert action.end == len(text)

    action = parse_action("<think>ok</think><answer> Paris\n</answer>")
    assert action.kind is ANSWER
    assert action.answer == "Paris"
    assert action.queries == ()


def test_tags_first_complete_action_wins_and_end_offset():
    text = "<search>first</search> more <answer>x</answer> trailing"
    action = parse_action(text)
    assert action.kind is SEARCH and action.query == "first"
    assert action.end == text.index(" more")
    assert text[: action.end] == "<search>first</search>"

    text = "<answer>Paris</answer><search>late</search>"
    action = parse_action(text)
    assert action.kind is ANSWER
    assert text[: action.end] == "<answer>Paris</answer>"


def test_tags_content_may_span_lines():
    action = parse_action("<search>multi\nline query</search>")
    assert action.query == "multi\nline query"


def test_tags_unclosed_tag_before_a_complete_action():
    # The leftmost *complete* action wins, as with Search-R1's re.search.
    text = "<search>never closed <answer>Paris</answer>"
    action = parse_action(text)
    assert action.kind is ANSWER and action.answer == "Paris"
    assert action.end == len(text)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<search>   </search>", "empty <search></search>: the query is blank"),
        ("<answer></answer>", "empty <answer></answer>: the answer is blank"),
        ("<search>capital of", "unclosed <search> tag"),
        ("<answer>Paris", "unclosed <answer> tag"),
        ("I think it is Paris.", "no action found"),
        ("<tool_call>{}</tool_call>", "no action found"),  # not an action in "tags" style
    ],
)
def test_tags_invalid(text, reason):
    action = parse_action(text)
    assert action.kind is INVALID
    assert reason in action.reason
    assert action.end == len(text)
    assert action.queries == () and action.answer is None


def test_truncated_only_without_a_complete_action():
    text = "<think>long reasoning ... <search>capital of"
    action = parse_action(text, hit_token_limit=True)
    assert action.kind is TRUNCATED
    assert "token limit" in action.reason and "<search>" in action.reason
    assert action.end == len(text)

    action = parse_action("<think>still thinking", hit_token_limit=True)
    assert action.kind is TRUNCATED

    # A complete action is still an action, whatever stopped the generation.
    action = parse_action("<search>q</search> and then rambling", hit_token_limit=True)
    assert action.kind is SEARCH


# --- parse_action: "tool_call" style -------------------------------------------------------


def test_tool_call_search():
    text = "<think>x</think>" + tool_call({"name": "search", "arguments": {"query": " Paris "}})
    action = parse_action(text, style="tool_call")
    assert action.kind is SEARCH
    assert action.queries == ("Paris",)
    assert action.end == len(text)


def test_tool_call_query_list_keeps_every_query():
    call = {"name": "search", "arguments": {"query_list": ["a", " b "], "topk": 3}}
    action = parse_action(tool_call(call) + "rest", style="tool_call")
    assert action.kind is SEARCH
    assert action.queries == ("a", "b")
    assert action.query == "a"
    assert action.end == len(tool_call(call))


def test_tool_call_style_answer_and_first_action_wins():
    text = "<answer> Paris </answer>" + tool_call({"name": "search", "arguments": {"query": "q"}})
    action = parse_action(text, style="tool_call")
    assert action.kind is ANSWER and action.answer == "Paris"
    assert action.end == text.index("<tool_call>")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "search", "arguments": {"query": "x"}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"arguments": {"query": "x"}}, "has no 'name'"),
        ({"name": "browse", "arguments": {"query": "x"}}, "unknown tool 'browse'"),
        ({"name": "search"}, "'arguments' must be a JSON object"),
        ({"name": "search", "arguments": "x"}, "'arguments' must be a JSON object"),
        ({"name": "search", "arguments": {}}, "no 'query' argument"),
        ({"name": "search", "arguments": {"query": "  "}}, "empty search query"),
        ({"name": "search", "arguments": {"query": 3}}, "must be strings"),
        ({"name": "search", "arguments": {"query_list": []}}, "non-empty list"),
        ({"name": "search", "arguments": {"query_list": ["a", ""]}}, "empty search query"),
        ({"name": "search", "arguments": {"query": "a", "query_list": ["b"]}}, "both"),
    ],
)
def test_tool_call_invalid(body, reason):
    text = tool_call(body) + " trailing"
    action = parse_action(text, style="tool_call")
    assert action.kind is INVALID
    assert reason in action.reason
    assert action.end == len(text)


def test_tool_call_style_ignores_search_tags():
    action = parse_action("<search>q</search>", style="tool_call")
    assert action.kind is INVALID and "no action found" in action.reason
    action = parse_action("<tool_call>{", style="tool_call")
    assert action.kind is INVALID and "unclosed <tool_call> tag" in action.reason
    action = parse_action("<tool_call>{", style="tool_call", hit_token_limit=True)
    assert action.kind is TRUNCATED


# --- parse_action: "auto" style ------------------------------------------------------------


def test_auto_takes_whichever_complete_action_comes_first():
    call = tool_call({"name": "search", "arguments": {"query": "from json"}})
    action = parse_action(call + "<search>from tags</search>", style="auto")
    assert action.query == "from json" and action.end == len(call)
    action = parse_action("<search>from tags</search>" + call, style="auto")
    assert action.query == "from tags"
    action = parse_action("<answer>A</answer>" + call, style="auto")
    assert action.kind is ANSWER
    action = parse_action("nothing", style="auto")
    assert action.kind is INVALID


def test_parse_action_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown action style 'xml'"):
        parse_action("<search>q</search>", style="xml")
    with pytest.raises(TypeError, match="expects a str"):
        parse_action(None)


def test_invalid_action_feedback_teaches_a_parsable_action():
    # Following the feedback's own instructions yields actions that parse.
    assert "<search>" in INVALID_ACTION_FEEDBACK and "<answer>" in INVALID_ACTION_FEEDBACK
    assert parse_action(INVALID_ACTION_FEEDBACK).kind is SEARCH
    assert parse_action(INVALID_TOOL_CALL_FEEDBACK, style="tool_call").kind is SEARCH
    assert not INVALID_ACTION_FEEDBACK.startswith("\n")


# --- documents and observations ------------------------------------------------------------

DOCS = [
    {"contents": "Paris\nParis is the capital of France.\nIt is large."},
    {"title": "Lyon", "text": "Lyon is a city."},
]


def test_format_documents_search_r1_byte_exact():
    expected = (
        "Doc 1(Title: Paris) Paris is the capital of France.\nIt is large.\n"
        "Doc 2(Title: Lyon) Lyon is a city.\n"
    )
    assert format_documents(DOCS) == expected
    assert format_documents([{"contents": "Only a title"}]) == "Doc 1(Title: Only a title) \n"
    assert format_documents([]) == ""


def test_format_documents_verl_byte_exact():
    expected = (
        "Doc 1 (Title: Paris)\nParis is the capital of France.\nIt is large.\n\n"
        "Doc 2 (Title: Lyon)\nLyon is a city."
    )
    assert format_documents(DOCS, style="verl") == expected


def test_format_documents_prefers_contents():
    doc = {"contents": "T\nbody", "title": "other", "text": "other"}
    assert format_documents([doc]) == "Doc 1(Title: T) body\n"


def test_format_documents_errors():
    with pytest.raises(ValueError, match=r"document 1 has keys \['body', 'title'\]"):
        format_documents([DOCS[0], {"title": "x", "body": "y"}])
    with pytest.raises(TypeError, match="document 0 must be a mapping"):
        format_documents(["just a string"])
    with pytest.raises(TypeError, match="'contents' must be a str"):
        format_documents([{"contents": None}])
    with pytest.raises(ValueError, match="unknown document style"):
        format_documents(DOCS, style="flashrag")


def test_format_observation():
    expected = (
        "\n\n<information>Doc 1(Title: Paris) Paris is the capital of France.\nIt is large.\n"
        "Doc 2(Title: Lyon) Lyon is a city.</information>\n\n"
    )
    assert format_observation(DOCS) == expected
    assert format_observation(DOCS, style="verl") == format_documents(DOCS, style="verl")
    assert format_observation([]) == "\n\n<information></information>\n\n"


# --- questions and prompt templates --------------------------------------------------------


def test_normalize_question():
    assert normalize_question("  who wrote Hamlet ") == "who wrote Hamlet?"
    assert normalize_question("who wrote Hamlet?\n") == "who wrote Hamlet?"
    with pytest.raises(ValueError, match="question is empty"):
        normalize_question("   ")
    with pytest.raises(TypeError):
        normalize_question(None)


@pytest.mark.parametrize("name", ["search_tags", "search_tool_call"])
def test_builtin_templates(name):
    template = load_prompt_template(name)
    assert template.name == name
    prompt = template.render("who wrote Hamlet?")
    assert prompt.endswith("Question: who wrote Hamlet?\n")
    assert "<think>" in prompt and "<answer>" in prompt
    # Exactly one complete answer pair (the example), so min_matches=2 on prompt+response
    # ignores the example and finds the response's answer.
    assert extract_answer(prompt) is not None
    assert extract_answer(prompt, min_matches=2) is None
    assert extract_answer(prompt + "<answer> Shakespeare </answer>", min_matches=2) == (
        "Shakespeare"
    )


def test_builtin_tags_template_mentions_its_protocol():
    prompt = load_prompt_template("search_tags").render("q?")
    assert "<search>" in prompt and "<information>" in prompt


def test_builtin_tool_call_template_shows_a_parsable_call():
    prompt = load_prompt_template("search_tool_call").render("q?")
    assert "<tool_response>" in prompt
    action = parse_action(prompt, style="tool_call")
    assert action.kind is SEARCH and action.query == "your query"


def test_template_from_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text('Use JSON like {{"a": 1}}.\nQ: {question}\n', encoding="utf-8")
    template = load_prompt_template(path)
    assert template == PromptTemplate(name="mine", text=path.read_text(encoding="utf-8"))
    assert template.render("why?") == 'Use JSON like {"a": 1}.\nQ: why?\n'
    assert load_prompt_template(str(path)).render("x") == template.render("x")


def test_template_without_question_fails_at_load(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("No placeholder here.\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'bad' has no \{question\} placeholder"):
        load_prompt_template(path)


def test_template_other_placeholders_and_stray_braces():
    with pytest.raises(ValueError, match=r"\['context'\]"):
        PromptTemplate(name="t", text="{context} {question}")
    with pytest.raises(ValueError, match=r"write literal braces as \{\{ and \}\}"):
        PromptTemplate(name="t", text='{"a": 1} {question}')
    with pytest.raises(ValueError, match="literal braces"):
        PromptTemplate(name="t", text="{question} }")


def test_unknown_template_name_lists_builtins():
    with pytest.raises(ValueError, match="unknown prompt template 'nope'") as info:
        load_prompt_template("nope")
    message = str(info.value)
    assert "search_tags" in message and "search_tool_call" in message
    assert "path" in message


def test_missing_template_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_template(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_template("prompts/missing.txt")


def test_template_file_that_is_not_utf8_names_line_and_byte(tmp_path):
    """Not a bare UnicodeDecodeError: the file, line, column, byte and how to convert it."""
    from ray_credit.config import InputError

    path = tmp_path / "latin.txt"
    path.write_bytes("Answer this.\nCaf\u00e9 question: {question}\n".encode("latin-1"))
    with pytest.raises(
        InputError,
        match=r"latin\.txt:2: not UTF-8 \(byte 0xe9 at column 4\); save the file "
        r"as UTF-8, e.g. `iconv -f latin1 -t utf-8 latin\.txt`",
    ):
        load_prompt_template(path)
    path.write_bytes(b"Line one\r\nQ: {question}\r\n")  # newlines as read_text gives them
    assert load_prompt_template(path).text == "Line one\nQ: {question}\n"
