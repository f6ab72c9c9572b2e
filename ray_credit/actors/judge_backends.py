"""Completion backends of the judge pool: a local HF model and any OpenAI-compatible API.

A completion backend turns prompts into raw replies, ``complete(prompts, counts,
schemas=None) -> list[str | None]`` (None: the call failed), and adds to the ``judge/*``
counters in ``counts``. With ``schemas`` (one :data:`~ray_credit.signals._reply.ReplySchema`
per prompt) the reply is constrained to that shape: :class:`HFBackend` decodes under it
(:mod:`ray_credit.actors.guided`), :class:`OpenAIBackend` asks the server for a
``json_schema`` response format. Prompts, reply shapes and parsing belong to the signals
(:mod:`ray_credit.signals`); the backends only complete text.

A failed reply is counted once, under its cause: ``judge/failed`` (the backend gave up
after its retries) or ``judge/timeouts`` (its last attempt timed out).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ray_credit.signals._base import add
from ray_credit.signals._reply import ReplySchema, json_schema

__all__ = ["CompletionBackend", "HFBackend", "OpenAIBackend", "check_openai_args"]

# Status codes that say the request itself is wrong everywhere: raise, do not null.
_CONFIG_ERRORS = {401: "the API key", 403: "the API key", 404: "base_url or the model name"}


class CompletionBackend(Protocol):
    """What an LLM judge needs: one reply (or None on failure) per prompt, in order."""

    def complete(
        self,
        prompts: list[str],
        counts: dict[str, float],
        schemas: Sequence[ReplySchema] | None = None,
    ) -> list[str | None]: ...


# ---------------------------------------------------------------------------- backends
class HFBackend:
    """A local Hugging Face causal LM, greedy and batched (chat template).

    With ``schemas`` the replies are decoded under them (guided decoding: always in form,
    whatever the model's size). Without, free greedy generation with left padding;
    ``timeout_s`` caps each batch's generation time (transformers' ``max_time``), and a
    reply cut short that way is usually unparseable, and counted so. A model error raises:
    it is a bug or a resource problem, not a bad judgement.
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

    def complete(
        self,
        prompts: list[str],
        counts: dict[str, float],
        schemas: Sequence[ReplySchema] | None = None,
    ) -> list[str | None]:
        import torch

        if not prompts:
            return []
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        start = time.perf_counter()
        if schemas is not None:
            from ray_credit.actors.guided import guided_replies

            contexts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            with self._lock:
                replies = guided_replies(self.model, self.tokenizer, contexts, list(schemas))
            add(counts, "judge/latency_s", time.perf_counter() - start)
            return replies
        self.tokenizer.padding_side = "left"
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(self.model.parameters()).device
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

    One request per prompt, temperature 0 (with a schema: a ``json_schema`` response
    format, which vLLM's server and OpenAI's API honour). Each request has ``timeout_s``; a timeout, a
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

    def complete(
        self,
        prompts: list[str],
        counts: dict[str, float],
        schemas: Sequence[ReplySchema] | None = None,
    ) -> list[str | None]:
        if schemas is None:
            return [self._one(prompt, None, counts) for prompt in prompts]
        return [self._one(p, s, counts) for p, s in zip(prompts, schemas, strict=True)]

    def _one(self, prompt: str, schema: ReplySchema | None, counts: dict[str, float]) -> str | None:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s, headers=self._headers)
        body = {**self._body, "messages": [{"role": "user", "content": prompt}]}
        if schema is not None:  # vLLM's and OpenAI's structured outputs
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "judgement", "schema": json_schema(schema)},
            }
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
                content = response.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError, TypeError):
                break  # not an OpenAI-shaped reply: the server failed, not the judge
            if isinstance(content, str):
                return content
            break  # no content (a refusal, or out of tokens before any): failed
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
