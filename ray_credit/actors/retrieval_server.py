"""The retriever over HTTP, in the Search-R1 retrieval-server JSON.

* :class:`RetrievalDeployment` / :func:`serve_retriever`: a Ray Serve deployment answering
  ``POST /retrieve``; concurrent requests are coalesced into one encoder + faiss call
  (:class:`~ray_credit.actors.retriever.QueryBatcher`).
* :class:`RemoteRetriever`: a client for any server speaking that JSON (ours, or
  Search-R1's ``retrieval_server.py``), with the same ``search(queries, topk)`` as
  :class:`~ray_credit.actors.retriever.Retriever`, plus timeouts and counted retries.

The wire format::

    request:  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
    response: {"result": [[{"document": {"id": "7", "contents": "Title\\ntext"},
                            "score": 0.83}, ...], ...]}

With ``"return_scores": false`` each hit is the document dict alone.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_credit.actors.retriever import (
    CorpusSource,
    EncoderConfig,
    Hit,
    IndexConfig,
    QueryBatcher,
    Retriever,
    _check_search_args,
)
from ray_credit.config import InputError, check_fields

if TYPE_CHECKING:  # pragma: no cover
    from ray_credit.actors.index_build import BuildConfig

__all__ = [
    "LimitExceeded",
    "RequestLimits",
    "RemoteRetriever",
    "RetrievalDeployment",
    "RetrievalServiceError",
    "parse_retrieve_request",
    "retrieve_response",
    "serve_retriever",
]


class RetrievalServiceError(RuntimeError):
    """A retrieval server could not answer (after every retry), or answered malformed JSON."""


class LimitExceeded(ValueError):
    """A request over one of the server's :class:`RequestLimits`; ``status`` is its HTTP
    status (413 for sizes, 400 for topk) and the message names the limit."""

    def __init__(self, message: str, status: int = 413):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RequestLimits:
    """What one ``/retrieve`` request may ask for; over a limit it gets a 4xx naming it
    (and the setting that raises it), before any search work."""

    max_queries: int = 1024
    """Queries in one request."""
    max_query_chars: int = 4096
    """Characters in one query."""
    max_topk: int = 100
    """Documents per query (also never more than the corpus holds)."""
    max_body_bytes: int = 16 * 2**20
    """Bytes of one request body."""

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        for name in ("max_queries", "max_query_chars", "max_topk", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check_body(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise LimitExceeded(
                f"the body has {size} bytes, over the limit of {self.max_body_bytes} "
                "(max_body_bytes); split the queries over several requests"
            )

    def check_request(self, queries: Sequence[str], topk: int) -> None:
        """Raise :class:`LimitExceeded` for a request over a limit. (Not ``check``: config
        sections' ``check()`` is their cross-field rule, called with no arguments.)"""
        if len(queries) > self.max_queries:
            raise LimitExceeded(
                f"{len(queries)} queries in one request, over the limit of {self.max_queries} "
                "(max_queries); split them over several requests"
            )
        over = next((i for i, q in enumerate(queries) if len(q) > self.max_query_chars), None)
        if over is not None:
            raise LimitExceeded(
                f"query {over} has {len(queries[over])} characters, over the limit of "
                f"{self.max_query_chars} (max_query_chars)"
            )
        if topk > self.max_topk:
            raise LimitExceeded(
                f"topk={topk} is over the limit of {self.max_topk} (max_topk)", status=400
            )


def parse_retrieve_request(body: Any) -> tuple[list[str], int, bool]:
    """``(queries, topk, return_scores)`` from a request body; ValueError says what is wrong.

    ``topk`` defaults to 3 and ``return_scores`` to false, as in Search-R1's server.
    """
    if not isinstance(body, Mapping):
        raise ValueError('the body must be a JSON object like {"queries": ["..."], "topk": 3}')
    unknown = sorted(set(body) - {"queries", "topk", "return_scores"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; expected queries, topk, return_scores")
    if "queries" not in body:
        raise ValueError("missing 'queries': a list of query strings")
    queries, topk = body["queries"], body.get("topk", 3)
    return_scores = body.get("return_scores", False)
    if not isinstance(queries, list):
        raise ValueError(f"'queries' must be a list of str, got {type(queries).__name__}")
    try:
        _check_search_args(queries, topk)
    except TypeError as err:
        raise ValueError(str(err)) from None
    if not isinstance(return_scores, bool):
        raise ValueError(f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


def retrieve_response(results: list[list[Hit]], *, return_scores: bool) -> dict[str, Any]:
    """The Search-R1 response body for :meth:`Retriever.search` results."""
    out = []
    for hits in results:
        docs = [{"id": hit["id"], "contents": hit["contents"]} for hit in hits]
        if return_scores:
            out.append(
                [{"document": d, "score": h["score"]} for d, h in zip(docs, hits, strict=True)]
            )
        else:
            out.append(docs)
    return {"result": out}


class RetrievalDeployment:
    """A Serve replica: one :class:`Retriever` behind a :class:`QueryBatcher`.

    Wrapped at wiring time by :func:`serve_retriever` (``serve.deployment(...)``); the
    class itself needs no Serve. Bad requests get 400 with the reason; a failed search
    gets 500 with the error, and both are counted in :meth:`metrics`.
    """

    def __init__(
        self,
        corpus: CorpusSource,
        *,
        encoder: EncoderConfig | str = "minilm",
        index: IndexConfig | str = "flat",
        index_folder: str | os.PathLike | None = None,
        max_batch_queries: int = 256,
        batch_wait_ms: float = 2.0,
        limits: RequestLimits | None = None,
    ) -> None:
        self.limits = limits or RequestLimits()
        self.retriever = Retriever.create(
            corpus, encoder=encoder, index=index, index_folder=index_folder
        )
        self.batcher = QueryBatcher(
            self.retriever.search,
            max_batch_queries=max_batch_queries,
            batch_wait_ms=batch_wait_ms,
            max_topk=len(self.retriever.corpus),
        )
        self._errors = {"bad_requests": 0, "server_errors": 0, "requests_over_limits": 0}

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if request.method != "POST":
            self._errors["bad_requests"] += 1
            return JSONResponse({"error": "use POST with a JSON body"}, status_code=405)
        try:  # a body over the limit is not read past it (declared size first)
            declared = request.headers.get("content-length")
            self.limits.check_body(int(declared) if declared else 0)
            raw = await _read_body(request, self.limits)
        except LimitExceeded as err:
            self._errors["requests_over_limits"] += 1
            return JSONResponse({"error": str(err)}, status_code=err.status)
        except ValueError:
            self._errors["bad_requests"] += 1
            return JSONResponse(
                {"error": f"Content-Length {declared!r} is not a number of bytes"}, status_code=400
            )
        try:
            body = json.loads(raw)
        except ValueError as err:
            self._errors["bad_requests"] += 1
            return JSONResponse({"error": f"the body is not JSON: {err}"}, status_code=400)
        try:
            queries, topk, return_scores = parse_retrieve_request(body)
            self.limits.check_request(queries, topk)
            self.batcher.check(queries, topk)
        except LimitExceeded as err:
            self._errors["requests_over_limits"] += 1
            return JSONResponse({"error": str(err)}, status_code=err.status)
        except (TypeError, ValueError) as err:
            self._errors["bad_requests"] += 1
            return JSONResponse({"error": str(err)}, status_code=400)
        try:
            results = await self.batcher.search(queries, topk)
        except Exception as err:
            self._errors["server_errors"] += 1
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=500)
        return JSONResponse(retrieve_response(results, return_scores=return_scores))

    async def metrics(self) -> dict[str, float]:
        """Retriever and batcher counters, plus bad_requests, requests_over_limits and
        server_errors."""
        return {**self.retriever.metrics(), **self.batcher.metrics(), **self._errors}

    async def info(self) -> dict[str, Any]:
        """The index manifest, the folder it was opened from (``index_folder``,
        ``index_loaded``) and where it runs (``index_on_gpu``, ``index_gpus``,
        ``index_mmapped``): what ``python -m ray_credit.serve`` reports."""
        index = self.retriever.index
        return {
            **index.manifest,
            "index_folder": self.retriever.index_folder,
            "index_loaded": self.retriever.index_loaded,
            "index_on_gpu": index.on_gpu,
            "index_gpus": index.gpus,
            "index_mmapped": index.mmapped,
        }


async def _read_body(request: Any, limits: RequestLimits) -> bytes:
    """The body, read chunk by chunk and refused as soon as it passes the limit (a chunked
    upload declares no length)."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        limits.check_body(size)
        parts.append(part)
    return b"".join(parts)


def serve_retriever(
    corpus: CorpusSource,
    *,
    encoder: EncoderConfig | str = "minilm",
    index: IndexConfig | str = "flat",
    index_folder: str | os.PathLike | None = None,
    index_file: str | os.PathLike | None = None,
    build: BuildConfig | None = None,
    name: str = "retriever",
    route_prefix: str = "/retrieve",
    host: str = "127.0.0.1",
    port: int = 8000,
    num_replicas: int = 1,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_ongoing_requests: int = 256,
    max_batch_queries: int = 256,
    batch_wait_ms: float = 2.0,
    limits: RequestLimits | None = None,
) -> str:
    """Deploy :class:`RetrievalDeployment` with Ray Serve; return the ``/retrieve`` URL.

    Serve's HTTP host and port are cluster-wide and set when Serve first starts: when it
    already runs elsewhere, ``host`` / ``port`` are not applied (Serve logs a warning) and
    the returned URL is the one it listens on. ``limits``: what one request may ask for
    (:class:`RequestLimits`). ``max_ongoing_requests`` per replica must
    be large for requests to coalesce (Serve's default, 5, would cap a batch at 5).
    The index is built (or imported from ``index_file``) once, here, before any replica
    starts (``build``: its workers and shards, see
    :class:`~ray_credit.actors.index_build.BuildConfig`), in ``index_folder`` (None: the
    shared index cache of this machine); the replicas only open it, memory-mapped, and
    read the corpus from it. Replicas on other nodes need the folder on storage they see.
    ``corpus`` None: the index folder's own. Remove the app with ``serve.delete(name)``;
    ``python -m ray_credit.serve`` does all of this from the command line.
    """
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    if not ray.is_initialized():
        raise RuntimeError("serve_retriever needs a connected Ray cluster; call ray.init() first")
    folder = _built_once(corpus, encoder, index, index_folder, index_file, build)
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(RetrievalDeployment, name=name).options(
        num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    )
    app = deployment.bind(
        None,  # the corpus is the index folder's
        encoder=encoder,
        index=index,
        index_folder=str(folder),
        max_batch_queries=max_batch_queries,
        batch_wait_ms=batch_wait_ms,
        limits=limits,
    )
    serve.run(app, name=name, route_prefix=route_prefix)
    # Serve keeps the HTTP options it first started with; report where it really listens.
    http = _get_global_client().http_config
    listen = "127.0.0.1" if http.host in ("0.0.0.0", "::") else http.host
    return f"http://{listen}:{http.port}{route_prefix}"


def _built_once(
    corpus: CorpusSource | None,
    encoder: EncoderConfig | str,
    index: IndexConfig | str,
    index_folder: str | os.PathLike | None,
    index_file: str | os.PathLike | None,
    build: BuildConfig | None,
) -> Path:
    """The whole index folder the replicas open: built or imported here when it is not."""
    from ray_credit.actors.corpus import Corpus
    from ray_credit.actors.dense_index import read_manifest
    from ray_credit.actors.index_build import BuildConfig, ensure_index
    from ray_credit.actors.retriever import _same_corpus, index_cache_folder

    if corpus is None and index_folder is None:
        raise InputError("give a corpus, or an index folder that holds one")
    if isinstance(corpus, (str, os.PathLike)):
        corpus = os.path.abspath(corpus)  # replicas' working directory may differ
    if index_folder is None:
        folder = index_cache_folder(corpus, encoder, index, index_file)
    else:
        folder = Path(index_folder).absolute()
    if read_manifest(folder) is None:
        if corpus is None:
            raise InputError(f"{folder} holds no whole index; give the corpus to build it from")
        ensure_index(corpus, folder, encoder=encoder, index=index, index_file=index_file,
                     **(build or BuildConfig()).kwargs())  # fmt: skip
    elif corpus is not None and index_folder is not None:
        _same_corpus(corpus, Corpus.open(folder), folder)
    return folder


_RETRY_STATUS = {429, 500, 502, 503, 504}


class RemoteRetriever:
    """A client of a Search-R1 ``/retrieve`` server with :class:`Retriever`'s ``search``.

    Each request has ``timeout_s`` (connect, read, write). A timeout, a connection error
    or a 429 / 5xx answer is retried up to ``retries`` times, sleeping ``backoff_s * 2**i``
    before retry ``i``; every retry, timeout and error is counted in :meth:`metrics`.
    After the last attempt, :class:`RetrievalServiceError` names the URL and the last
    error. Any other 4xx, or a malformed response, raises at once (retrying cannot fix it).
    A query longer than ``max_query_chars`` (the server's default limit) is cut to it
    before it is sent, and counted in ``queries_clipped``: a policy's runaway search must
    not stop a run.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_query_chars: int = RequestLimits.max_query_chars,
    ) -> None:
        import httpx

        if not (
            isinstance(retries, int) and retries >= 0 and 0 < timeout_s < math.inf
            and 0 <= backoff_s < math.inf
        ):  # fmt: skip
            raise ValueError(
                f"need retries >= 0, timeout_s > 0, backoff_s >= 0; got {retries}, "
                f"{timeout_s}, {backoff_s}"
            )
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self.timeout_s, self.max_query_chars = timeout_s, max_query_chars
        self._httpx = httpx
        self._client = httpx.Client(timeout=timeout_s)
        self._metrics = {
            "requests": 0,
            "queries": 0,
            "attempts": 0,
            "retries": 0,
            "timeouts": 0,
            "connection_errors": 0,
            "server_errors": 0,
            "failures": 0,
            "queries_clipped": 0,
            "seconds": 0.0,
        }

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Hits per query, best first: ``{"id", "contents", "title", "text", "score"}``."""
        _check_search_args(queries, topk)
        if not queries:
            return []
        self._metrics["requests"] += 1
        self._metrics["queries"] += len(queries)
        cap = self.max_query_chars
        self._metrics["queries_clipped"] += sum(len(q) > cap for q in queries)
        body = {"queries": [q[:cap] for q in queries], "topk": topk, "return_scores": True}
        start = time.perf_counter()
        try:
            payload = self._post(body)
        finally:
            self._metrics["seconds"] += time.perf_counter() - start
        return self._parse(payload, len(queries))

    def metrics(self) -> dict[str, float]:
        """requests, queries, attempts, retries, timeouts, connection_errors, server_errors
        (retryable status codes), failures (requests that raised), queries_clipped,
        seconds."""
        return dict(self._metrics)

    def close(self) -> None:
        self._client.close()

    def __reduce__(self):
        # Pickles as its settings (into generator actors): the copy opens its own
        # connections and starts its own counters.
        return (
            _remote_retriever,
            (self.url, self.timeout_s, self.retries, self.backoff_s, self.max_query_chars),
        )

    def __enter__(self) -> RemoteRetriever:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, body: dict[str, Any]) -> Any:
        httpx, metrics = self._httpx, self._metrics
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                metrics["retries"] += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            metrics["attempts"] += 1
            try:
                response = self._client.post(self.url, json=body)
            except httpx.TimeoutException as err:
                metrics["timeouts"] += 1
                last_error = f"timed out ({type(err).__name__})"
                continue
            except httpx.TransportError as err:
                metrics["connection_errors"] += 1
                last_error = f"{type(err).__name__}: {err}"
                continue
            if response.status_code in _RETRY_STATUS:
                metrics["server_errors"] += 1
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:
                metrics["failures"] += 1
                raise RetrievalServiceError(
                    f"{self.url} rejected the request with HTTP {response.status_code}: "
                    f"{response.text[:500]}"
                )
            try:
                return response.json()
            except ValueError:
                metrics["failures"] += 1
                raise RetrievalServiceError(
                    f"{self.url} answered with a body that is not JSON: {response.text[:200]!r}"
                ) from None
        metrics["failures"] += 1
        raise RetrievalServiceError(
            f"{self.url} failed after {self.retries + 1} attempt(s); last error: {last_error}"
        )

    def _parse(self, payload: Any, num_queries: int) -> list[list[Hit]]:
        result = payload.get("result") if isinstance(payload, Mapping) else None
        if not isinstance(result, list) or len(result) != num_queries:
            self._metrics["failures"] += 1
            raise RetrievalServiceError(
                f"{self.url} answered {str(payload)[:200]!r}; expected {{'result': [...]}} with "
                f"one list of hits per query ({num_queries})"
            )
        try:
            return [[_hit(entry) for entry in hits] for hits in result]
        except (KeyError, TypeError, AttributeError) as err:
            self._metrics["failures"] += 1
            raise RetrievalServiceError(
                f"{self.url} answered hits without the Search-R1 shape "
                f'{{"document": {{"id", "contents"}}, "score"}} ({err!r})'
            ) from None


def _remote_retriever(
    url: str, timeout_s: float, retries: int, backoff_s: float, max_query_chars: int
):
    return RemoteRetriever(
        url,
        timeout_s=timeout_s,
        retries=retries,
        backoff_s=backoff_s,
        max_query_chars=max_query_chars,
    )


def _hit(entry: Mapping[str, Any]) -> Hit:
    doc = entry["document"]
    title, _, text = doc["contents"].partition("\n")
    return {
        "id": str(doc["id"]),
        "contents": doc["contents"],
        "title": title,
        "text": text,
        "score": float(entry["score"]),
    }
