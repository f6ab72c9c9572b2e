"""The text protocol between a search agent and its environment (Search-R1 style).

The policy writes free text that contains one action per turn:

* ``"tags"`` style (Search-R1): ``<search> query </search>`` or ``<answer> answer </answer>``.
* ``"tool_call"`` style (verl / Qwen): ``<tool_call>{"name": "search", "arguments":
  {"query": "..."}}</tool_call>``, or ``<answer> answer </answer>`` for the final answer.

:func:`parse_action` turns one generation into an :class:`Action`; :func:`format_observation`
turns retrieved documents into the text fed back to the policy; :class:`PromptTemplate`
renders the first user prompt.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ray_credit.config import InputError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "INVALID_ACTION_FEEDBACK",
    "INVALID_TOOL_CALL_FEEDBACK",
    "Action",
    "ActionKind",
    "PromptTemplate",
    "format_documents",
    "format_observation",
    "load_prompt_template",
    "normalize_question",
    "parse_action",
]


class ActionKind(str, Enum):
    """What one turn did. The values are the strings stored in the batch's ``turns.action``."""

    SEARCH = "search"
    ANSWER = "answer"
    INVALID = "invalid"
    TRUNCATED = "truncated"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class Action:
    """One parsed action.

    Attributes:
        kind: search, answer, invalid (no usable action) or truncated (the generation hit
            the token limit before it completed an action).
        end: character offset just after the action's closing tag, so a generator can cut
            the text with ``text[:action.end]``; ``len(text)`` for invalid and truncated
            actions (nothing is cut).
        queries: the search queries, stripped; one for ``<search>`` and for a tool call
            with ``"query"``, several for a tool call with ``"query_list"``. Empty unless
            ``kind`` is search.
        answer: the final answer, stripped; ``None`` unless ``kind`` is answer.
        reason: why the action is invalid or truncated, for logs; ``None`` otherwise.
    """

    kind: ActionKind
    end: int
    queries: tuple[str, ...] = ()
    answer: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.kind is ActionKind.SEARCH and not self.queries:
            raise ValueError("a search Action needs at least one query")
        if self.kind is ActionKind.ANSWER and self.answer is None:
            raise ValueError("an answer Action needs an answer")

    @property
    def query(self) -> str | None:
        """The first search query, or ``None`` when this is not a search."""
        return self.queries[0] if self.queries else None


# Tags that form a complete action in each parsing style.
_STYLE_TAGS: dict[str, tuple[str, ...]] = {
    "tags": ("search", "answer"),
    "tool_call": ("tool_call", "answer"),
    "auto": ("search", "tool_call", "answer"),
}
_ACTION_RE = {
    style: re.compile(rf"<({'|'.join(tags)})>(.*?)</\1>", re.DOTALL)
    for style, tags in _STYLE_TAGS.items()
}
_OPEN_TAG_RE = {style: re.compile(rf"<({'|'.join(tags)})>") for style, tags in _STYLE_TAGS.items()}
_TOOL_CALL_EXAMPLE = '{"name": "search", "arguments": {"query": "..."}}'


def parse_action(text: str, *, style: str = "tags", hit_token_limit: bool = False) -> Action:
    """Classify one generation as a search, an answer, an invalid or a truncated action.

    The FIRST complete action wins, as in Search-R1: the leftmost opening tag whose
    matching closing tag follows (``re.search(r"<(search|answer)>(.*?)</\\1>")`` for the
    ``"tags"`` style). Its content is stripped. ``"auto"`` accepts ``<search>``,
    ``<tool_call>`` and ``<answer>`` and takes whichever complete action comes first.

    Classification, never guessed:

    * a complete action with non-empty content: search or answer;
    * an empty query or answer: invalid;
    * a ``<tool_call>`` whose content is not a JSON object, names a tool other than
      ``"search"``, or lacks a ``"query"`` string / ``"query_list"`` of strings in its
      ``"arguments"`` object: invalid (other argument keys are ignored);
    * no complete action and ``hit_token_limit``: truncated;
    * no complete action otherwise: invalid (e.g. an unclosed ``<search>`` tag).

    Args:
        text: what the policy generated this turn (the response only, not the prompt).
        style: ``"tags"``, ``"tool_call"`` or ``"auto"``.
        hit_token_limit: whether generation stopped at the length limit rather than at a
            stop string or end-of-sequence.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_action expects a str, got {type(text).__name__}")
    if style not in _STYLE_TAGS:
        raise ValueError(f"unknown action style {style!r}; choose one of {sorted(_STYLE_TAGS)}")

    match = _ACTION_RE[style].search(text)
    if match is None:
        return _no_complete_action(text, style, hit_token_limit)

    tag, content = match.group(1), match.group(2).strip()
    if tag == "tool_call":
        return _parse_tool_call(content, end=match.end(), text_len=len(text))
    if not content:
        what = "query" if tag == "search" else "answer"
        return _invalid(f"empty <{tag}></{tag}>: the {what} is blank", len(text))
    if tag == "search":
        return Action(kind=ActionKind.SEARCH, queries=(content,), end=match.end())
    return Action(kind=ActionKind.ANSWER, answer=content, end=match.end())


def _invalid(reason: str, text_len: int) -> Action:
    return Action(kind=ActionKind.INVALID, reason=reason, end=text_len)


def _no_complete_action(text: str, style: str, hit_token_limit: bool) -> Action:
    opened = _OPEN_TAG_RE[style].search(text)
    if hit_token_limit:
        detail = f" (<{opened.group(1)}> was still open)" if opened else ""
        return Action(
            kind=ActionKind.TRUNCATED,
            reason=f"hit the token limit before completing an action{detail}",
            end=len(text),
        )
    if opened:
        tag = opened.group(1)
        return _invalid(f"unclosed <{tag}> tag: no matching </{tag}> follows it", len(text))
    expected = " or ".join(f"<{t}>…</{t}>" for t in _STYLE_TAGS[style])
    return _invalid(f"no action found: expected {expected}", len(text))


def _parse_tool_call(content: str, *, end: int, text_len: int) -> Action:
    """Parse the JSON inside ``<tool_call>…</tool_call>`` into a search Action."""
    try:
        call = json.loads(content)
    except json.JSONDecodeError as err:
        return _invalid(
            f"<tool_call> content is not valid JSON ({err.msg} at char {err.pos}); "
            f"expected {_TOOL_CALL_EXAMPLE}",
            text_len,
        )
    if not isinstance(call, dict):
        return _invalid(
            f"<tool_call> content must be a JSON object like {_TOOL_CALL_EXAMPLE}, "
            f"got a JSON {type(call).__name__}",
            text_len,
        )
    name = call.get("name")
    if name != "search":
        problem = "has no 'name'" if name is None else f"names unknown tool {name!r}"
        return _invalid(f"tool call {problem}; the only tool is 'search'", text_len)
    args = call.get("arguments")
    if not isinstance(args, dict):
        return _invalid("tool call 'arguments' must be a JSON object with a 'query'", text_len)
    if "query" in args and "query_list" in args:
        return _invalid("tool call gives both 'query' and 'query_list'; give one", text_len)
    if "query" in args:
        raw = [args["query"]]
    elif "query_list" in args:
        raw = args["query_list"]
        if not isinstance(raw, list) or not raw:
            return _invalid("tool call 'query_list' must be a non-empty list of str", text_len)
    else:
        return _invalid("search tool call has no 'query' argument", text_len)
    if not all(isinstance(q, str) for q in raw):
        return _invalid("tool call queries must be strings", text_len)
    queries = tuple(q.strip() for q in raw)
    if not all(queries):
        return _invalid("tool call has an empty search query", text_len)
    return Action(kind=ActionKind.SEARCH, queries=queries, end=end)


INVALID_ACTION_FEEDBACK = (
    "The last step did not contain an action that could be carried out, so nothing was run. "
    "To run a search, write <search> your query </search>. "
    "To finish, write <answer> your final answer </answer>."
)
"""Observation text after an invalid action in the ``"tags"`` style. The caller wraps it
like any other observation (e.g. inside ``<information>…</information>``)."""

INVALID_TOOL_CALL_FEEDBACK = (
    "The last step did not contain an action that could be carried out, so nothing was run. "
    'To run a search, write <tool_call>{"name": "search", "arguments": {"query": "your '
    'query"}}</tool_call>. To finish, write <answer> your final answer </answer>.'
)
"""Observation text after an invalid action in the ``"tool_call"`` style."""


_DOC_STYLES = ("search_r1", "verl")


def _title_and_text(doc: Mapping[str, str], index: int) -> tuple[str, str]:
    """Return (title, text) of a FlashRAG ``contents`` doc or a ``title``/``text`` doc."""
    if not isinstance(doc, Mapping):
        raise TypeError(f"document {index} must be a mapping, got {type(doc).__name__}")
    if "contents" in doc:
        contents = doc["contents"]
        if not isinstance(contents, str):
            raise TypeError(f"document {index}: 'contents' must be a str")
        title, _, text = contents.partition("\n")
        return title, text
    if "title" in doc and "text" in doc:
        title, text = doc["title"], doc["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise TypeError(f"document {index}: 'title' and 'text' must be str")
        return title, text
    raise ValueError(
        f"document {index} has keys {sorted(doc)}; it needs 'contents' (title on the first "
        "line, text on the rest, as in FlashRAG corpora) or both 'title' and 'text'"
    )


def _check_doc_style(style: str) -> None:
    if style not in _DOC_STYLES:
        raise ValueError(f"unknown document style {style!r}; choose one of {list(_DOC_STYLES)}")


def format_documents(docs: Sequence[Mapping[str, str]], *, style: str = "search_r1") -> str:
    """Render retrieved documents as text, numbered from 1.

    A document is a mapping with ``contents`` (FlashRAG: the title is the first line, the
    text is the rest; preferred when present) or with ``title`` and ``text``.

    * ``"search_r1"``: ``f"Doc {i}(Title: {title}) {text}\\n"`` per document, concatenated.
      There is no space before ``(``: that is the reference format.
    * ``"verl"``: ``f"Doc {i} (Title: {title})\\n{text}\\n\\n"`` per document, concatenated,
      then stripped.

    An empty ``docs`` gives ``""``.
    """
    _check_doc_style(style)
    parts = []
    for i, doc in enumerate(docs, start=1):
        title, text = _title_and_text(doc, i - 1)
        if style == "search_r1":
            parts.append(f"Doc {i}(Title: {title}) {text}\n")
        else:
            parts.append(f"Doc {i} (Title: {title})\n{text}\n\n")
    joined = "".join(parts)
    return joined if style == "search_r1" else joined.strip()


def format_observation(docs: Sequence[Mapping[str, str]], *, style: str = "search_r1") -> str:
    """The observation text appended after a search.

    * ``"search_r1"``: ``"\\n\\n<information>" + documents.strip() + "</information>\\n\\n"``,
      appended to the policy's text directly.
    * ``"verl"``: the stripped document text alone; it becomes a tool message's content.
    """
    _check_doc_style(style)
    documents = format_documents(docs, style=style)
    if style == "search_r1":
        return "\n\n<information>" + documents.strip() + "</information>\n\n"
    return documents


def normalize_question(q: str) -> str:
    """Strip the question and append ``"?"`` when it does not end with one (Search-R1).

    Raises:
        ValueError: the question is empty or only whitespace.
    """
    if not isinstance(q, str):
        raise TypeError(f"question must be a str, got {type(q).__name__}")
    q = q.strip()
    if not q:
        raise ValueError("question is empty; every example needs a non-blank question")
    return q if q.endswith("?") else q + "?"


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt with one ``{question}`` placeholder, rendered with ``str.format``.

    Literal braces (e.g. JSON in a tool-call example) are written ``{{`` and ``}}``.
    Construction fails if the text has no ``{question}``, another placeholder, or a
    single unmatched brace.
    """

    name: str
    text: str

    def __post_init__(self) -> None:
        hint = "write literal braces as {{ and }}"
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.text) if f is not None]
        except ValueError as err:
            raise ValueError(f"prompt template {self.name!r}: {err}; {hint}") from None
        others = sorted({f for f in fields if f != "question"})
        if others:
            raise ValueError(
                f"prompt template {self.name!r} has placeholder(s) {others}; only "
                f"{{question}} is allowed ({hint})"
            )
        if not fields:
            raise ValueError(
                f"prompt template {self.name!r} has no {{question}} placeholder; "
                "add {question} where the question goes"
            )

    def render(self, question: str) -> str:
        """Return the prompt for ``question`` (used as given: see :func:`normalize_question`)."""
        if not isinstance(question, str):
            raise TypeError(f"question must be a str, got {type(question).__name__}")
        return self.text.format(question=question)


def _builtin_templates() -> dict[str, Traversable]:
    folder = resources.files("ray_credit") / "prompts"
    return {
        entry.name.removesuffix(".txt"): entry
        for entry in folder.iterdir()
        if entry.is_file() and entry.name.endswith(".txt")
    }


def _read_utf8(path: Path) -> str:
    """A text file's contents; a file that is not UTF-8 raises an error naming the line,
    the column and the byte, and how to convert it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise InputError(
            f"{path}:{line}: not UTF-8 (byte {data[err.start]:#04x} at column {column}); save "
            f"the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name}` if it is Latin-1"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as read_text's universal newlines


def load_prompt_template(name_or_path: str | os.PathLike[str]) -> PromptTemplate:
    """Load a built-in template by name (a file stem in ``ray_credit/prompts/``) or a file.

    A str that is a built-in name wins; otherwise it is read as a path to a UTF-8 text file
    (the template's name is then the file stem).

    Raises:
        ValueError: neither a built-in name nor an existing file; or the template is
            invalid (see :class:`PromptTemplate`); or the file is not UTF-8 (an
            :class:`~ray_credit.config.InputError` naming the line and the byte).
        FileNotFoundError: the argument looks like a path (has a folder or a suffix) but
            no such file exists.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load_prompt_template expects a name or a path, got {type(name_or_path).__name__}"
        )
    builtins = _builtin_templates()
    if isinstance(name_or_path, str) and name_or_path in builtins:
        text = builtins[name_or_path].read_text(encoding="utf-8")
        return PromptTemplate(name=name_or_path, text=text)
    path = Path(name_or_path)
    if path.is_file():
        return PromptTemplate(name=path.stem, text=_read_utf8(path))
    if isinstance(name_or_path, os.PathLike) or path.suffix or len(path.parts) > 1:
        raise FileNotFoundError(f"prompt template file {str(path)!r} does not exist")
    raise ValueError(
        f"unknown prompt template {name_or_path!r}; built-in templates are "
        f"{sorted(builtins)}, and a path to a .txt file with a {{question}} placeholder "
        "is accepted too"
    )
