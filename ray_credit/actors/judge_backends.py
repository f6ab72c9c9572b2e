"""LLM judges for the JudgePool: our prompts, strict JSON parsing and two completion backends.

A completion backend turns prompts into raw replies, ``complete(prompts, counts) ->
list[str | None]`` (None: the call failed), and adds to the ``judge/*`` counters in
``counts``. :class:`LLMJudge` renders the prompts in ``ray_credit/prompts/judge/``, asks a
backend in batches of ``batch_size`` and parses each reply strictly:

* a reply is one JSON object, with surrounding whitespace and at most one enclosing
  fenced code block (optionally tagged json) tolerated; anything else is unparseable;
* every field must be present with an allowed value (CW-GRPO grades are the integers 0
  or 1; Search-P1 scores come from ``EVALUATOR_FIELDS``, counts are integers >= 0 and
  effective steps never exceed the plan they count);
* a reply that fails either check becomes null and counts in ``judge/unparseable``.

Each null judgement is counted once, under its cause: ``judge/unparseable``,
``judge/failed`` (the backend gave up after its retries) or ``judge/timeouts`` (its last
attempt timed out).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any, Protocol

import numpy as np

from ray_credit.batch import TrajectoryBatch
from ray_credit.estimators.search_p1 import EVALUATOR_FIELDS

__all__ = [
    "CompletionBackend",
    "HFBackend",
    "LLMJudge",
    "OpenAIBackend",
    "load_judge_prompt",
    "parse_cw_grpo",
    "parse_json_object",
    "parse_reference_plan",
    "parse_search_p1",
]

PROMPTS = ("cw_grpo_turn", "search_p1_evaluate", "search_p1_reference_plan")
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL)
# Status codes that say the request itself is wrong everywhere: raise, do not null.
_CONFIG_ERRORS = {401: "the API key", 403: "the API key", 404: "base_url or the model name"}


def add(counts: dict[str, float], name: str, value: float = 1.0) -> None:
    counts[name] = counts.get(name, 0.0) + value


class CompletionBackend(Protocol):
    """What an LLM judge needs: one reply (or None on failure) per prompt, in order."""

    def complete(self, prompts: list[str], counts: dict[str, float]) -> list[str | None]: ...


# ---------------------------------------------------------------------------- prompts
@cache
def load_judge_prompt(name: str) -> str:
    """A judge prompt shipped in ``ray_credit/prompts/judge/`` (``str.format`` fields)."""
    if name not in PROMPTS:
        raise ValueError(f"unknown judge prompt {name!r}; judge prompts are {PROMPTS}")
    return (resources.files("ray_credit") / "prompts" / "judge" / f"{name}.txt").read_text(
        encoding="utf-8"
    )


def render_trace(turns: Sequence[Mapping[str, Any]]) -> str:
    """``Agent:`` / ``Information:`` blocks for the given turns, in order."""
    blocks = []
    for turn in turns:
        text = turn.get("text")
        if text is None:  # hand-built batches may record only the action and query
            text = f"[{turn.get('action')}] {turn.get('query') or ''}".strip()
        blocks.append(f"Agent: {text.strip()}")
        if turn.get("observation") is not None:
            blocks.append(f"Information: {turn['observation'].strip()}")
    return "\n\n".join(blocks)


def _golds(golds: Sequence[str]) -> str:
    return "; ".join(golds)


# ---------------------------------------------------------------------------- parsing
def parse_json_object(reply: str | None) -> dict[str, Any] | None:
    """The JSON object in ``reply``, or None when the reply is anything but one object."""
    if reply is None:
        return None
    text = reply.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> int | None:
    """An integer >= 0 (``2`` or ``2.0``), else None."""
    if _is_number(x) and x >= 0 and float(x).is_integer():
        return int(x)
    return None


def _one_of(x: Any, allowed: Sequence[float]) -> float | None:
    if _is_number(x):
        for a in allowed:
            if abs(x - a) <= 1e-6:
                return a
    return None


def parse_cw_grpo(reply: str | None) -> tuple[int, int] | None:
    """``(utility, correct)`` from ``{"retrieval_reward": 0|1, "thinking_reward": 0|1}``."""
    obj = parse_json_object(reply)
    if obj is None:
        return None
    grades = [obj.get("retrieval_reward"), obj.get("thinking_reward")]
    if not all(type(g) is int and g in (0, 1) for g in grades):
        return None
    return grades[0], grades[1]


_SP1_REPLY = {  # reply field -> (column, allowed values or None for a count)
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


def parse_search_p1(reply: str | None, ref_steps: int) -> dict[str, float | int] | None:
    """The ``sp1_*`` columns from an evaluator reply, or None unless every field is valid
    (``sp1_ref_plan_steps`` is ``ref_steps``, the length of the reference plan)."""
    obj = parse_json_object(reply)
    if obj is None:
        return None
    out: dict[str, float | int] = {"sp1_ref_plan_steps": ref_steps}
    for field, (column, allowed) in _SP1_REPLY.items():
        value = _count(obj.get(field)) if allowed is None else _one_of(obj.get(field), allowed)
        if value is None:
            return None
        out[column] = value
    if out["sp1_effective_steps_self"] > out["sp1_plan_steps"] or (
        out["sp1_effective_steps_ref"] > ref_steps
    ):
        return None  # effective steps cannot exceed the plan they count
    return out


def parse_reference_plan(reply: str | None) -> list[str] | None:
    """The steps of ``{"steps": ["query", ...]}`` (non-empty strings, at least one)."""
    obj = parse_json_object(reply)
    steps = None if obj is None else obj.get("steps")
    if not isinstance(steps, list) or not steps:
        return None
    if not all(isinstance(s, str) and s.strip() for s in steps):
        return None
    return [s.strip() for s in steps]


# ---------------------------------------------------------------------------- the judge
class LLMJudge:
    """Judgements from a completion backend with our prompts (see the module docstring)."""

    required_columns = {"cw_grpo": (), "search_p1": ("reference_plan",)}
    missing_hint = (
        "make reference plans with JudgePool.make_reference_plans (or bring your own) and "
        "add them as the reference_plan column"
    )

    def __init__(self, backend: CompletionBackend, *, batch_size: int = 16) -> None:
        if not callable(getattr(backend, "complete", None)):
            raise TypeError(
                f"a judge backend needs a complete(prompts, counts) method; got {backend!r}"
            )
        self.backend = backend
        self.batch_size = batch_size

    def _ask(self, prompts: list[str], counts: dict[str, float]) -> list[str | None]:
        replies: list[str | None] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            add(counts, "judge/requests", len(chunk))
            got = self.backend.complete(chunk, counts)
            if len(got) != len(chunk):
                raise RuntimeError(
                    f"judge backend returned {len(got)} replies for {len(chunk)} prompts"
                )
            replies.extend(got)
        return replies

    def _parsed(self, replies: list[str | None], parse, counts: dict[str, float]) -> list:
        out = [None if r is None else parse(r) for r in replies]
        bad = sum(r is not None and o is None for r, o in zip(replies, out, strict=True))
        add(counts, "judge/unparseable", bad)
        return out

    def cw_grpo(self, batch: TrajectoryBatch, counts: dict[str, float]):
        """Per flat turn ``(utility, correct)`` as int8 arrays, -1 where null."""
        template = load_judge_prompt("cw_grpo_turn")
        prompts = []
        for row in batch.table.select(["question", "turns"]).to_pylist():
            for t in range(len(row["turns"])):  # the trace up to and including turn t
                trace = render_trace(row["turns"][: t + 1])
                prompts.append(template.format(question=row["question"], trace=trace))
        grades = self._parsed(self._ask(prompts, counts), parse_cw_grpo, counts)
        u = np.array([-1 if g is None else g[0] for g in grades], dtype=np.int8)
        v = np.array([-1 if g is None else g[1] for g in grades], dtype=np.int8)
        return u, v

    def search_p1(self, batch: TrajectoryBatch, counts: dict[str, float]):
        """Per trajectory: the ``sp1_*`` fields (a dict, or None where null)."""
        template = load_judge_prompt("search_p1_evaluate")
        columns = ["question", "gold_answers", "turns", "reference_plan"]
        rows = batch.table.select(columns).to_pylist()
        asked = [i for i, row in enumerate(rows) if row["reference_plan"]]
        add(counts, "judge/no_evidence", len(rows) - len(asked))
        prompts = []
        for i in asked:
            row = rows[i]
            plan = row["reference_plan"]
            prompts.append(
                template.format(
                    question=row["question"],
                    gold_answers=_golds(row["gold_answers"]),
                    ref_steps=len(plan),
                    reference_plan="\n".join(f"{k + 1}. {s}" for k, s in enumerate(plan)),
                    trace=render_trace(row["turns"]),
                )
            )
        replies = self._ask(prompts, counts)
        out: list[dict | None] = [None] * len(rows)
        bad = 0
        for i, reply in zip(asked, replies, strict=True):
            if reply is None:
                continue
            out[i] = parse_search_p1(reply, len(rows[i]["reference_plan"]))
            bad += out[i] is None
        add(counts, "judge/unparseable", bad)
        return out

    def reference_plans(
        self, questions: Sequence[Mapping[str, Any]], counts: dict[str, float]
    ) -> list[list[str] | None]:
        template = load_judge_prompt("search_p1_reference_plan")
        prompts = [
            template.format(question=q["question"], gold_answers=_golds(_question_golds(q)))
            for q in questions
        ]
        return self._parsed(self._ask(prompts, counts), parse_reference_plan, counts)


def _question_golds(q: Mapping[str, Any]) -> list[str]:
    golds = q.get("golden_answers", q.get("gold_answers"))
    if isinstance(golds, str):
        return [golds]
    if not golds:
        raise ValueError(
            f"question {q.get('question', '')[:60]!r} has no 'golden_answers' (or 'gold_answers')"
        )
    return list(golds)


# ---------------------------------------------------------------------------- backends
class HFBackend:
    """A local Hugging Face causal LM, greedy and batched (left padding, chat template).

    ``timeout_s`` caps each batch's generation time (transformers' ``max_time``); a reply
    cut short that way is usually unparseable, and counted so. A model error raises: it is
    a bug or a resource problem, not a bad judgement.
    """

    def __init__(
        self,
        *,
        model: str | tuple[Any, Any] = "smollm2-135m",
        device: str = "cpu",
        dtype: str = "float32",
        max_new_tokens: int = 256,
        timeout_s: float | None = None,
        seed: int = 0,
    ) -> None:
        from ray_credit.models import load_model

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.tokenizer = (
            model
            if isinstance(model, tuple)
            else load_model(model, dtype=dtype, device=device, seed=seed)
        )
        self.max_new_tokens = max_new_tokens
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one generate at a time per model

    def complete(self, prompts: list[str], counts: dict[str, float]) -> list[str | None]:
        import torch

        if not prompts:
            return []
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        self.tokenizer.padding_side = "left"
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(self.model.parameters()).device
        start = time.perf_counter()
        with self._lock, torch.inference_mode():
            output = self.model.generate(
                **{k: v.to(device) for k, v in encoded.items()},
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                max_time=self.timeout_s,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        add(counts, "judge/latency_s", time.perf_counter() - start)
        new = output[:, encoded["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(new, skip_special_tokens=True)


class OpenAIBackend:
    """Any OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang, hosted APIs).

    One request per prompt, temperature 0. Each request has ``timeout_s``; a timeout, a
    connection error, HTTP 429 or 5xx is retried up to ``max_retries`` times with
    exponential backoff (``backoff_s``, doubled each time, at most 30 s). Another 4xx is
    not retried: 401/403/404 raise (a wrong key, URL or model fails every call), others
    (e.g. a prompt longer than the context) give a null judgement in ``judge/failed``.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_tokens: int = 1024,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        check_openai_args(base_url=base_url, model=model)
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError(
                f"need max_retries >= 0, timeout_s > 0 and backoff_s >= 0; got {max_retries}, "
                f"{timeout_s}, {backoff_s}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self._body = {"model": model, "temperature": 0.0, "max_tokens": max_tokens}
        self._body.update(extra_body or {})
        self._client = None

    def complete(self, prompts: list[str], counts: dict[str, float]) -> list[str | None]:
        return [self._one(prompt, counts) for prompt in prompts]

    def _one(self, prompt: str, counts: dict[str, float]) -> str | None:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, headers=self._headers)
        body = {**self._body, "messages": [{"role": "user", "content": prompt}]}
        cause = "judge/failed"
        for attempt in range(self.max_retries + 1):
            if attempt:
                add(counts, "judge/retries")
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
            start = time.perf_counter()
            try:
                response = self._client.post(self.url, json=body)
            except httpx.TimeoutException:
                cause = "judge/timeouts"
                continue
            except httpx.TransportError:
                cause = "judge/failed"
                continue
            finally:
                add(counts, "judge/latency_s", time.perf_counter() - start)
            status = response.status_code
            cause = "judge/failed"
            if status == 429 or status >= 500:
                continue
            if status in _CONFIG_ERRORS:
                raise RuntimeError(
                    f"judge endpoint {self.url} answered {status}: {response.text[:200]!r}; "
                    f"check {_CONFIG_ERRORS[status]}"
                )
            if status >= 400:
                break
            try:
                return response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                break  # not an OpenAI-shaped reply: the server failed, not the judge
        add(counts, cause)
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # a client does not cross processes


def check_openai_args(*, base_url: str | None, model: str | None, **_: Any) -> None:
    if not base_url:
        raise ValueError(
            "the openai judge backend needs base_url, e.g. base_url='http://localhost:8000/v1' "
            "for a vLLM server"
        )
    if not model:
        raise ValueError("the openai judge backend needs model=<the served model's name>")
