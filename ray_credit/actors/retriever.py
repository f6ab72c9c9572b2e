"""Dense retrieval for search agents: an HF encoder + a faiss index over a FlashRAG corpus.

Pieces, each usable alone:

* :class:`Corpus` (from :mod:`ray_credit.actors.corpus`): the documents in a
  memory-mapped Arrow file, converted once from a FlashRAG / Search-R1 ``.jsonl`` (``id``,
  ``contents`` = title line + text), read by row, with a fingerprint computed once.
* :class:`Encoder` (from :mod:`ray_credit.actors.encoder`): a sentence-transformers model
  (each model's own pooling and normalization), L2-normalized, with query / passage
  prefixes (E5's ``"query: "`` / ``"passage: "``, BGE's query instruction). ``"minilm"``
  is the embedded all-MiniLM-L6-v2.
* :class:`DenseIndex` / :class:`IndexConfig` (from :mod:`ray_credit.actors.dense_index`):
  Flat, HNSW, IVF-Flat or IVF-PQ, memory-mapped on CPU, sharded over GPUs with faiss-gpu;
  an index folder's manifest pins the corpus fingerprint and the encoder, so a stale index
  is refused instead of returning wrong docs. Built once by
  :func:`~ray_credit.actors.index_build.ensure_index` (across Ray workers, resumable), or
  imported from a faiss file built elsewhere.
* :class:`Retriever`: ``search(queries, topk)`` -> hits best first, with counters.
  ``Retriever.create`` opens the index folder (a shared cache folder keyed by the corpus
  and the settings, :func:`index_cache_folder`, unless one is given), building it first
  when it is not there.
* :class:`QueryBatcher` / :class:`RetrieverActor`: request coalescing. Concurrent
  ``search`` calls are gathered into one encoder + faiss call (up to ``max_batch_queries``
  queries, waiting at most ``batch_wait_ms`` for the batch to fill) and split back per
  caller. ``RetrieverActor`` is a plain class; :func:`make_retriever_actor` wraps it with
  ``ray.remote(...).options(...)``.

The HTTP side (a Ray Serve ``/retrieve`` endpoint and a client for any Search-R1 retrieval
server) is in :mod:`ray_credit.actors.retrieval_server`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_credit.actors.corpus import Corpus, CorpusSource, corpus_fingerprint
from ray_credit.actors.dense_index import (
    MANIFEST,
    DenseIndex,
    IndexConfig,
    check_index_folder,
    check_whole_folder,
    faiss_module,
    read_manifest,
)
from ray_credit.actors.encoder import (
    ENCODER_PRESETS,
    Encoder,
    EncoderConfig,
    EncoderPreset,
    canonical_encoder_name,
    resolve_encoder_path,
)
from ray_credit.actors.index_build import ensure_index, index_identity, same_corpus
from ray_credit.config import InputError
from ray_credit.log import log
from ray_credit.process_memory import PeakMeter, memory_report

if TYPE_CHECKING:  # pragma: no cover
    from ray.actor import ActorHandle

__all__ = [
    "Corpus",
    "DenseIndex",
    "ENCODER_PRESETS",
    "Encoder",
    "EncoderConfig",
    "EncoderPreset",
    "IndexConfig",
    "QueryBatcher",
    "Retriever",
    "RetrieverActor",
    "corpus_fingerprint",
    "index_cache_folder",
    "check_index_folder",
    "make_retriever_actor",
    "resolve_encoder_path",
]

Hit = dict[str, Any]
"""One retrieved document: ``{"id", "contents", "title", "text", "score"}``."""


_SPELLED = ("name", "query_prefix", "passage_prefix")  # what EncoderConfig.identity respells


def index_cache_folder(
    corpus: CorpusSource,
    encoder: Encoder | EncoderConfig | str,
    config: IndexConfig | str,
    index_file: str | os.PathLike | None = None,
) -> Path:
    """The shared folder of the index of ``corpus`` under ``encoder`` and ``config``:
    ``$RAY_CREDIT_CACHE/indexes/<name>`` (default ``~/.cache/ray_credit/indexes``).

    The name is a hash of everything the index depends on (:func:`index_identity`: a
    corpus file's path, size and mtime, or an in-memory corpus's fingerprint; the encoder
    settings and a stamp of a local model folder; the index settings; an imported index
    file's stamp). Found with a few stats, nothing read: every run, method, seed and resume
    over the same corpus and settings finds the index built once; a changed setting gets a
    folder of its own.
    """
    from ray_credit.models import cache_dir

    if isinstance(encoder, Encoder):
        encoder = encoder.config
    encoder = EncoderConfig(name=encoder) if isinstance(encoder, str) else encoder
    config = IndexConfig(kind=config) if isinstance(config, str) else config
    identity = index_identity(corpus, encoder, config, index_file and str(index_file))
    if isinstance(corpus, (str, os.PathLike)):
        what = Path(corpus).name.split(".")[0][:30]
    else:
        what = f"{len(Corpus.coerce(corpus))}docs"
    kind = "imported" if index_file else config.kind
    root = cache_dir().parent / "indexes"

    def folder(identity: dict[str, Any]) -> Path:
        key = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=10)
        name = identity["encoder"]["name"]  # a preset by its name, however it was given
        readable = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        return root / f"{readable[-40:]}-{kind}-{what}-{key.hexdigest()}"

    found = folder(identity)
    # an index cached before a preset's spellings were one (keyed by the encoder settings
    # as given) is still found
    as_given = {**encoder.identity(), **{k: getattr(encoder, k) for k in _SPELLED}}
    if as_given != identity["encoder"] and not (found / MANIFEST).is_file():
        earlier = folder({**identity, "encoder": as_given})
        if (earlier / MANIFEST).is_file():
            return earlier
    return found


def _same_corpus(given: CorpusSource, docs: Corpus, folder: Path) -> None:
    """Refuse an index folder whose corpus is not ``given`` (:func:`same_corpus`)."""
    fingerprint = same_corpus(given, docs)
    if fingerprint is not None:
        raise InputError(
            f"the index in {folder} was built from another corpus ({len(docs)} docs, "
            f"fingerprint {docs.fingerprint}) than the one given (fingerprint {fingerprint}); "
            "point at the index of this corpus, or at a new folder to build one"
        )


# ---------------------------------------------------------------------------- retriever
def _check_search_args(queries: Any, topk: Any) -> None:
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise TypeError(
            f"queries must be a list of str, got {type(queries).__name__}; wrap one query "
            "as [query]"
        )
    bad = [i for i, q in enumerate(queries) if not isinstance(q, str)]
    if bad:
        raise TypeError(f"queries must be str; entries {bad[:5]} are not")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")


class Retriever:
    """Encoder + index + corpus: ``search(queries, topk)`` -> hits, best first. No Ray inside."""

    def __init__(self, corpus: Corpus, encoder: Encoder, index: DenseIndex) -> None:
        if index.manifest["corpus_fingerprint"] != corpus.fingerprint:
            raise InputError(
                "the index was built from another corpus than the one given (fingerprint "
                f"{index.manifest['corpus_fingerprint']}, not {corpus.fingerprint}); build "
                "the index of this corpus"
            )
        recorded, want = dict(index.manifest["encoder"]), encoder.manifest()
        for side in (recorded, want):  # a preset named by its name or by its hub id
            side["name"] = canonical_encoder_name(str(side.get("name")))
        differ = sorted(k for k in want if recorded.get(k) != want[k])
        if differ:
            raise InputError(
                f"the index was built with another encoder: "
                f"{ {k: recorded.get(k) for k in differ} } there, "
                f"{ {k: want[k] for k in differ} } now; build the index with this encoder or "
                "search it with the one it was built with"
            )
        self.corpus, self.encoder, self.index = corpus, encoder, index
        # where create() loaded the index from (None: assembled by the caller)
        self.index_folder: str | None = None
        self.index_loaded = False
        self._metrics = {
            "queries": 0,
            "batches": 0,
            "encode_seconds": 0.0,
            "search_seconds": 0.0,
            "missing_hits": 0,
        }

    @classmethod
    def create(
        cls,
        corpus: CorpusSource | None,
        *,
        encoder: EncoderConfig | str = "minilm",
        index: IndexConfig | str = "flat",
        index_folder: str | os.PathLike | None = None,
        index_file: str | os.PathLike | None = None,
        build: dict[str, Any] | None = None,
        slices: tuple[Any, float, float] | None = None,
    ) -> Retriever:
        """Open the index folder, building it first when it is not whole
        (:func:`~ray_credit.actors.index_build.ensure_index`, with ``build``'s keyword
        arguments: workers, shard_docs, ...; ``index_file``: import that faiss file).
        A folder of another corpus, encoder or index config is refused, never rebuilt
        silently. One line says whether the index was loaded or built.

        ``corpus`` None: the corpus the index folder holds. ``index_folder`` None: the
        shared cache folder of this corpus and these settings (:func:`index_cache_folder`),
        so runs, methods, seeds and resumes build it once.

        ``slices``: ``(hosts, share, cpus)``: a flat index is held in slices, one per
        (placement group, bundle) of ``hosts``, each asking ``share`` of its GPU and
        ``cpus`` (:class:`~ray_credit.actors.index_slices.SlicedIndex`; needs Ray),
        instead of whole in this process.
        """
        faiss_module()  # a missing faiss fails here, not after the encoder has loaded
        enc_config = EncoderConfig(name=encoder) if isinstance(encoder, str) else encoder
        config = IndexConfig(kind=index) if isinstance(index, str) else index
        if index_folder is None:
            if corpus is None:
                raise InputError("give a corpus, or an index folder that holds one")
            folder = index_cache_folder(corpus, enc_config, config, index_file)
        else:
            folder = Path(index_folder)
            check_index_folder(folder)
        loaded = read_manifest(folder) is not None
        start = time.perf_counter()
        if not loaded:
            if corpus is None:
                raise InputError(f"{folder} holds no whole index; give the corpus to build it from")
            ensure_index(corpus, folder, encoder=enc_config, index=config,
                         index_file=index_file, **(build or {}))  # fmt: skip
        else:  # its files and its corpus, cheaply, before faiss maps the index
            check_whole_folder(folder)
        if slices is not None:
            from ray_credit.actors.index_slices import SlicedIndex
            from ray_credit.models import device_for

            hosts, share, cpus = slices
            dense = SlicedIndex.start(folder, check_whole_folder(folder), config, hosts,
                                      share=share, cpus=cpus, device=device_for(share))  # fmt: skip
        else:
            dense = DenseIndex.load(folder, config)
        docs = Corpus.open(folder)
        if loaded and index_folder is not None and corpus is not None:
            _same_corpus(corpus, docs, folder)
        retriever = cls(docs, Encoder(enc_config), dense)
        where = f"on GPUs {dense.gpus}" if dense.on_gpu else (
            "memory-mapped" if dense.mmapped else "in memory")  # fmt: skip
        if slices is not None:
            where = f"in {len(dense.gpus)} slices: {', '.join(dense.gpus)}"
        log.info(
            f"retriever: {'loaded' if loaded else 'built'} the index of {len(docs)} docs in "
            f"{folder} ({time.perf_counter() - start:.1f}s; {where})"
        )
        retriever.index_folder = str(folder)
        retriever.index_loaded = loaded
        return retriever

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """The ``topk`` best documents per query, best first.

        ``topk`` above the corpus size raises. An approximate index (HNSW, IVF) can
        return fewer than ``topk`` hits; the shortfall is counted as ``missing_hits``.
        """
        _check_search_args(queries, topk)
        if topk > len(self.corpus):
            raise ValueError(f"topk={topk} exceeds the corpus size {len(self.corpus)}")
        if not queries:
            return []
        start = time.perf_counter()
        embeddings = self.encoder.encode_queries(queries)
        encoded = time.perf_counter()
        scores, rows = self.index.search(embeddings, topk)
        self._metrics["encode_seconds"] += encoded - start
        self._metrics["search_seconds"] += time.perf_counter() - encoded
        self._metrics["queries"] += len(queries)
        self._metrics["batches"] += 1
        found = [[(r, s) for s, r in zip(qs, qr, strict=True) if r >= 0]
                 for qs, qr in zip(scores.tolist(), rows.tolist(), strict=True)]  # fmt: skip
        flat = self.corpus.hits([r for q in found for r, _ in q], [s for q in found for _, s in q])
        results, at = [], 0
        for query in found:  # one gather over the corpus for the batch, split per query
            results.append(flat[at : at + len(query)])
            at += len(query)
            self._metrics["missing_hits"] += topk - len(query)
        return results

    def metrics(self) -> dict[str, float]:
        """Counters since creation: queries, batches (search calls), encode / search seconds,
        missing_hits (hits an approximate index could not fill)."""
        return dict(self._metrics)


# ---------------------------------------------------------------------------- coalescing
@dataclass
class _Request:
    queries: Sequence[str]
    topk: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class QueryBatcher:
    """Coalesce concurrent ``search`` calls into one call of a blocking ``search_fn``.

    A batch starts when ``max_batch_queries`` queries wait, or ``batch_wait_ms`` after its
    oldest request arrived, whichever comes first; it runs in one worker thread (so the
    event loop keeps accepting requests) with the largest ``topk`` asked for, and each
    caller gets its own queries' hits cut to its own ``topk``. While one batch runs, the
    next fills. A request larger than ``max_batch_queries`` runs as a batch of its own.
    A failed batch fails every request in it with the same exception (counted).
    ``max_topk`` (the corpus size) is checked per call, before queueing.

    Must be used from one event loop (an async Ray actor's, or a Serve replica's).
    """

    def __init__(
        self,
        search_fn: Callable[[list[str], int], list[list[Hit]]],
        *,
        max_batch_queries: int = 256,
        batch_wait_ms: float = 2.0,
        max_topk: int | None = None,
    ) -> None:
        if max_batch_queries < 1 or batch_wait_ms < 0:
            raise ValueError(
                f"max_batch_queries must be >= 1 and batch_wait_ms >= 0, got "
                f"{max_batch_queries}, {batch_wait_ms}"
            )
        self._search_fn = search_fn
        self.max_topk = max_topk
        self.max_batch_queries = max_batch_queries
        self.batch_wait_s = batch_wait_ms / 1000
        self._pending: deque[_Request] = deque()
        self._pending_queries = 0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self._metrics = {
            "requests": 0,
            "coalesced_batches": 0,
            "largest_batch_queries": 0,
            "failed_batches": 0,
            "cancelled_requests": 0,
            "queue_seconds": 0.0,
        }

    def check(self, queries: Sequence[str], topk: int) -> None:
        """Raise TypeError / ValueError for arguments that would fail a whole batch."""
        _check_search_args(queries, topk)
        if self.max_topk is not None and topk > self.max_topk:
            raise ValueError(f"topk={topk} exceeds the corpus size {self.max_topk}")

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Queue ``queries`` for the next batch and wait for their hits.

        Arguments are checked first, so a bad call fails alone instead of failing its batch.
        """
        self.check(queries, topk)
        self._metrics["requests"] += 1
        if not queries:
            return []
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._run())
        request = _Request(list(queries), topk, loop.create_future())
        self._pending.append(request)
        self._pending_queries += len(request.queries)
        self._wakeup.set()
        return await request.future

    def metrics(self) -> dict[str, float]:
        """requests, coalesced_batches, largest_batch_queries, failed_batches,
        cancelled_requests (callers gone before their batch ended), queue_seconds (summed
        time requests waited before their batch started)."""
        return dict(self._metrics)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._pending[0].arrived + self.batch_wait_s
            while self._pending_queries < self.max_batch_queries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            await self._run_batch(self._take_batch())

    def _take_batch(self) -> list[_Request]:
        batch, size = [], 0
        while self._pending and (
            not batch or size + len(self._pending[0].queries) <= self.max_batch_queries
        ):
            request = self._pending.popleft()
            batch.append(request)
            size += len(request.queries)
        self._pending_queries -= size
        return batch

    async def _run_batch(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        queries = [q for request in batch for q in request.queries]
        metrics = self._metrics
        metrics["coalesced_batches"] += 1
        metrics["largest_batch_queries"] = max(metrics["largest_batch_queries"], len(queries))
        metrics["queue_seconds"] += sum(now - request.arrived for request in batch)
        topk = max(request.topk for request in batch)
        loop = asyncio.get_running_loop()
        try:
            hits = await loop.run_in_executor(self._executor, self._search_fn, queries, topk)
        except Exception as err:  # every caller in the batch sees the error; none hangs
            metrics["failed_batches"] += 1
            for request in batch:
                self._resolve(request, error=err)
            return
        offset = 0
        for request in batch:
            mine = hits[offset : offset + len(request.queries)]
            offset += len(request.queries)
            self._resolve(request, result=[query_hits[: request.topk] for query_hits in mine])

    def _resolve(self, request: _Request, *, result: Any = None, error: Any = None) -> None:
        if request.future.done():  # the caller was cancelled while its batch ran
            self._metrics["cancelled_requests"] += 1
        elif error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)


class RetrieverActor:
    """A :class:`Retriever` behind a :class:`QueryBatcher`, meant to run as an async Ray actor.

    Create it with :func:`make_retriever_actor`, or ``ray.remote(RetrieverActor).options(...)``.
    The retriever (model, index) is built in the actor, from a corpus path or the documents.
    """

    def __init__(
        self,
        corpus: CorpusSource,
        *,
        encoder: EncoderConfig | str = "minilm",
        index: IndexConfig | str = "flat",
        index_folder: str | os.PathLike | None = None,
        index_file: str | os.PathLike | None = None,
        build: dict[str, Any] | None = None,
        max_batch_queries: int = 256,
        batch_wait_ms: float = 2.0,
        slices: tuple[Any, float, float] | None = None,
    ) -> None:
        self.retriever = Retriever.create(
            corpus, encoder=encoder, index=index, index_folder=index_folder,
            index_file=index_file, build=build, slices=slices,
        )  # fmt: skip
        self.batcher = QueryBatcher(
            self.retriever.search,
            max_batch_queries=max_batch_queries,
            batch_wait_ms=batch_wait_ms,
            max_topk=len(self.retriever.corpus),
        )
        self._memory = PeakMeter()

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Hits for ``queries``, best first, coalesced with other callers' concurrent calls."""
        return await self.batcher.search(queries, topk)

    async def metrics(self) -> dict[str, float]:
        """:meth:`Retriever.metrics` and :meth:`QueryBatcher.metrics` in one dict."""
        return {**self.retriever.metrics(), **self.batcher.metrics()}

    async def memory(self) -> dict[str, float] | None:
        """This process's resident memory and its peak since the last call (GiB); a
        memory-mapped index and corpus count only for the pages read."""
        return memory_report(self._memory)

    async def info(self) -> dict[str, Any]:
        """The index manifest plus where it runs (``encoder_device``, ``index_on_gpu``) and
        where it came from (``index_folder``, ``index_loaded``)."""
        return {
            **self.retriever.index.manifest,
            "index_folder": self.retriever.index_folder,
            "index_loaded": self.retriever.index_loaded,
            "encoder_device": self.retriever.encoder.device,
            "index_on_gpu": self.retriever.index.on_gpu,
            "index_gpus": self.retriever.index.gpus,
            "index_mmapped": self.retriever.index.mmapped,
        }


def make_retriever_actor(
    corpus: CorpusSource,
    *,
    encoder: EncoderConfig | str = "minilm",
    index: IndexConfig | str = "flat",
    index_folder: str | os.PathLike | None = None,
    index_file: str | os.PathLike | None = None,
    build: dict[str, Any] | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict[str, float] | None = None,
    max_batch_queries: int = 256,
    batch_wait_ms: float = 2.0,
    max_concurrency: int = 1000,
    max_restarts: int = 3,
    name: str | None = None,
    slices: tuple[Any, float, float] | None = None,
) -> ActorHandle:
    """Start a :class:`RetrieverActor` on the connected Ray cluster and return its handle.

    Pass a ``.jsonl`` path rather than a large list of documents: the path travels to the
    actor, the documents would go through the object store. With ``num_gpus`` > 0 and the
    default ``device="auto"`` / ``use_gpu=None``, the encoder and (with faiss-gpu) the
    index run on the actor's GPU. ``index_folder`` None: the shared index cache of the
    actor's node (:func:`index_cache_folder`). ``max_restarts``: the actor holds no state but counters,
    so Ray may restart it after a crash; calls in flight then fail with Ray's actor error
    and the caller retries (no hidden task retries). ``resources``: custom resources
    (``{"service": 1}`` places it on a cluster's service nodes). Call
    ``handle.search.remote(queries, topk)``; ``handle.metrics.remote()`` for counters.
    ``slices``: ``(hosts, share, cpus)`` of :meth:`Retriever.create`: the actor holds a
    flat index in slices on a share of those bundles' GPUs.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "make_retriever_actor needs a connected Ray cluster; call ray.init() first"
        )
    if isinstance(corpus, (str, os.PathLike)):
        corpus = os.path.abspath(corpus)  # the actor's working directory may differ
    if index_folder is not None:
        index_folder = os.path.abspath(index_folder)
    if index_file is not None:
        index_file = os.path.abspath(index_file)
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": resources,
        "max_concurrency": max_concurrency,
        "max_restarts": max_restarts,
    }
    if name is not None:
        options["name"] = name
    return (
        ray.remote(RetrieverActor)
        .options(**options)
        .remote(
            corpus,
            encoder=encoder,
            index=index,
            index_folder=index_folder,
            index_file=index_file,
            build=build,
            max_batch_queries=max_batch_queries,
            batch_wait_ms=batch_wait_ms,
            slices=slices,
        )
    )
