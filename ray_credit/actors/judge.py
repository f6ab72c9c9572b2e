"""JudgePool: any judged signal (:mod:`ray_credit.signals`) from a pool of judge workers.

``pool.judge(signal, batch)`` returns the batch with the signal's columns (null where not
judged) and this call's ``judge/*`` counters in its metrics; for a question-level signal
(reference plans) ``pool.judge(signal, questions)`` returns one ``{column: value}`` (or
None) per question. The pool knows nothing of any method: the signal says what to judge,
how to ask and how to read the reply (see :mod:`ray_credit.signals._base`); the pool
schedules the work:

* **Backends.** ``"evidence"`` runs the signal's deterministic rule in this process (no
  model, no actors). ``"hf"`` (a local model) and ``"openai"`` (any OpenAI-compatible
  endpoint) answer our prompts (:mod:`ray_credit.actors.judge_backends`); an object with
  ``complete(prompts, counts)`` is accepted too. ``guided`` constrains replies to the
  signal's reply schema (``hf``: guided decoding, on by default, so even a small judge
  answers in form; ``openai``: a ``json_schema`` response format, off by default).
* **Chunks and concurrency.** Requests go out in chunks of ``batch_size``; each call of
  :meth:`JudgePool.judge` keeps at most ``max_concurrency`` chunks in flight, on the least
  loaded of the ``num_actors`` Ray actors (a random one among equals, so that the stage
  tasks of concurrent chunks spread over the pool; each actor runs at most
  ``ceil(max_concurrency / num_actors)`` calls at once), or on a thread pool in this
  process when ``num_actors=0``.
* **Timeouts and retries.** Each backend call has ``timeout_s`` (per HTTP request or per
  generate) and the ``openai`` backend retries ``max_retries`` times itself. A judge
  actor that dies is restarted by Ray (``max_restarts``) and its chunk is sent again, up
  to ``max_retries`` times (``judge/actor_failures``, ``judge/retries``); then its
  judgements are null (``judge/failed``). A call that outlives every timeout its backend
  could honour is cancelled and its judgements are null (``judge/timeouts``).
* **Nulls, counted.** A judgement is never a silent 0: every null is counted once under
  its cause: ``judge/skipped`` (the signal left the unit out), ``judge/no_evidence`` (the
  unit could not be asked: no supporting documents, no reference plan),
  ``judge/unparseable``, ``judge/failed``, ``judge/timeouts``. ``judge/requests`` counts
  the units judged or attempted, ``judge/calls`` the backend calls, ``judge/seconds`` the
  wall time; signals that give a verdict on the final answer add ``judge/agreement_hits``
  and ``judge/agreement_n`` (that verdict against exact match).

In a pipeline, :meth:`JudgePool.stage` is the stage that fills a signal on each chunk as
it is generated; it runs in a Ray task, which calls the pool's actors.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

from ray_credit.actors import actor_lost_errors
from ray_credit.actors.judge_backends import HFBackend, OpenAIBackend, check_openai_args
from ray_credit.batch import TrajectoryBatch
from ray_credit.signals import JudgedSignal, get_signal
from ray_credit.signals._base import Request, add

__all__ = ["BACKENDS", "JudgePool", "JudgeWorker"]

Backend = Literal["evidence", "hf", "openai"]
BACKENDS = get_args(Backend)
NULL_CAUSES = ("skipped", "no_evidence", "unparseable", "failed", "timeouts")


class JudgeWorker:
    """One judge: a completion backend behind ``complete`` (the class a pool actor runs;
    plain, usable without Ray). Returns the replies (None: the call failed) and the
    ``judge/*`` counters of the call."""

    def __init__(
        self,
        backend: Any = "hf",
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        guided: bool = False,
        **backend_kwargs: Any,
    ) -> None:
        if backend == "hf":
            self.backend = HFBackend(timeout_s=timeout_s, **backend_kwargs)
        elif backend == "openai":
            self.backend = OpenAIBackend(
                timeout_s=timeout_s, max_retries=max_retries, **backend_kwargs
            )
        else:
            if not callable(getattr(backend, "complete", None)):
                raise TypeError(
                    f"a judge backend is 'evidence', 'hf', 'openai' or an object with a "
                    f"complete(prompts, counts) method; got {backend!r}"
                )
            self.backend = backend
        self.guided = guided

    def complete(
        self, prompts: list[str], schemas: list[Any]
    ) -> tuple[list[str | None], dict[str, float]]:
        counts: dict[str, float] = {}
        if self.guided:
            replies = self.backend.complete(prompts, counts, schemas)
        else:
            replies = self.backend.complete(prompts, counts)
        if len(replies) != len(prompts):
            raise RuntimeError(
                f"judge backend returned {len(replies)} replies for {len(prompts)} prompts"
            )
        return list(replies), counts


class JudgePool:
    """Judge workers behind one object (see the module docstring).

    Args:
        backend: ``"evidence"``, ``"hf"``, ``"openai"``, or an object with
            ``complete(prompts, counts)`` (and ``schemas`` as third argument if guided).
        num_actors: Ray actors to start for an LLM backend (0: judge in this process).
            The evidence judge needs none.
        max_concurrency: chunks in flight at once across the pool.
        batch_size: requests per chunk (one backend call).
        timeout_s: per backend call: one HTTP request (openai), one generate (hf).
        max_retries: retries of a failed HTTP request (openai) and of a chunk whose actor
            died.
        guided: constrain replies to the signal's reply schema (None: on for ``hf``, off
            otherwise).
        corpus: documents ``{"id", "contents"}`` (or a mapping id -> contents) for the
            evidence rule of question-level signals (reference plans name documents).
        num_cpus: of each actor.
        num_gpus: of each actor.
        resources: custom resources of each actor, e.g. ``{"service": 1}`` to land on a
            cluster's service nodes.
        max_restarts: of each actor.
        **backend_kwargs: ``model``, ``device``, ``dtype``, ``max_new_tokens`` (hf);
            ``base_url``, ``model``, ``api_key_env``, ``backoff_s``, ``max_tokens``,
            ``extra_body`` (openai).
    """

    def __init__(
        self,
        backend: Any = "evidence",
        *,
        num_actors: int = 0,
        max_concurrency: int = 8,
        batch_size: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        guided: bool | None = None,
        corpus: Iterable[Mapping[str, Any]] | Mapping[str, str] | None = None,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        max_restarts: int = 3,
        **backend_kwargs: Any,
    ) -> None:
        if isinstance(backend, str) and backend not in BACKENDS:
            raise ValueError(
                f"unknown judge backend {backend!r}; valid backends are {list(BACKENDS)} "
                "(or an object with a complete(prompts, counts) method)"
            )
        if num_actors < 0 or max_concurrency < 1 or batch_size < 1 or max_retries < 0:
            raise ValueError(
                f"need num_actors >= 0, max_concurrency >= 1, batch_size >= 1 and "
                f"max_retries >= 0; got {num_actors}, {max_concurrency}, {batch_size}, "
                f"{max_retries}"
            )
        self.evidence = backend == "evidence"
        self.backend_name = backend if isinstance(backend, str) else type(backend).__name__
        if self.evidence and (num_actors or backend_kwargs):
            raise ValueError(
                "the evidence judge runs in process from the batch's own columns: it takes "
                f"no actors and no backend settings (got num_actors={num_actors}, "
                f"{sorted(backend_kwargs)})"
            )
        if backend == "openai":
            check_openai_args(**{"base_url": None, "model": None, **backend_kwargs})
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.documents = _titles(corpus)
        self._actors: list[Any] = []
        self._worker: JudgeWorker | None = None
        if self.evidence:
            return
        guided = backend == "hf" if guided is None else guided
        args = dict(timeout_s=timeout_s, max_retries=max_retries, guided=guided)
        if num_actors == 0:
            self._worker = JudgeWorker(backend, **args, **backend_kwargs)
            return
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "JudgePool(num_actors > 0) needs a connected Ray cluster; call ray.init() first"
            )
        remote = ray.remote(JudgeWorker).options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=resources,
            max_concurrency=math.ceil(max_concurrency / num_actors),
            max_restarts=max_restarts,
        )
        self._actors = [remote.remote(backend, **args, **backend_kwargs) for _ in range(num_actors)]

    # ------------------------------------------------------------------ public API
    def judge(self, signal: JudgedSignal | str, data: Any) -> Any:
        """Fill ``signal`` on ``data``: a :class:`TrajectoryBatch` (or an ObjectRef to one),
        giving a new batch; or, for a question-level signal, question mappings, giving one
        ``{column: value}`` or None per question."""
        signal = get_signal(signal) if isinstance(signal, str) else signal
        if not isinstance(signal, JudgedSignal):
            raise TypeError(f"a JudgePool judges JudgedSignal objects, got {signal!r}")
        counts: dict[str, float] = {}
        start = time.perf_counter()
        if signal.level == "question":
            rows = [dict(q) for q in data]
            values = self._judgements(signal, rows, None, np.arange(len(rows)), counts)
            self._finish(counts, start)
            return values
        batch = _resolve(data)
        needed = signal.requires("evidence" if self.evidence else "llm")
        missing = [c for c in needed if c not in batch]
        if missing:
            raise ValueError(
                f"the {signal.name} signal with the {self.backend_name} judge needs column(s) "
                f"{missing}, missing from the batch. {_missing_hint(signal, self.evidence)}"
            )
        units = signal.units(batch, counts)
        rows = batch.table.select(list(needed)).to_pylist()
        values = self._judgements(signal, rows, batch, units, counts)
        self._finish(counts, start)
        return self._write(signal, batch, units, values, counts)

    def stage(self, signal: JudgedSignal | str) -> _SignalStage:
        """A pipeline stage filling ``signal`` on each chunk (it runs in a Ray task and
        calls this pool's actors)."""
        signal = get_signal(signal) if isinstance(signal, str) else signal
        if self._worker is not None:
            raise ValueError(
                "a pipeline stage runs in a Ray task, away from this process: give the "
                f"{self.backend_name} judge its actors (num_actors >= 1)"
            )
        return _SignalStage(self, signal)

    # ------------------------------------------------------------------ internals
    def _judgements(
        self,
        signal: JudgedSignal,
        rows: list[dict[str, Any]],
        batch: TrajectoryBatch | None,
        units: np.ndarray,
        counts: dict[str, float],
    ) -> list[dict[str, Any] | None]:
        """One ``{column: value}`` or None per unit, every None counted under its cause."""
        add(counts, "judge/requests", float(len(units)))
        if signal.level == "turn":
            owner, turn = batch.turn_traj_index[units], batch.turn_position[units]
        else:
            owner, turn = np.asarray(units), np.full(len(units), -1)
        if self.evidence:
            keep = np.unique(owner).tolist()
            judged = signal.evidence([rows[r] for r in keep], self.documents)
            per_row = dict(zip(keep, judged, strict=True))
            values = [
                per_row[r][t] if signal.level == "turn" else per_row[r]
                for r, t in zip(owner.tolist(), turn.tolist(), strict=True)
            ]
            add(counts, "judge/no_evidence", float(sum(v is None for v in values)))
            return values
        requests = [
            signal.request(rows[r], None if t < 0 else t)
            for r, t in zip(owner.tolist(), turn.tolist(), strict=True)
        ]
        asked = [i for i, r in enumerate(requests) if r is not None]
        add(counts, "judge/no_evidence", float(len(requests) - len(asked)))
        replies = self._complete([requests[i] for i in asked], counts)
        values: list[dict[str, Any] | None] = [None] * len(requests)
        for i, reply in zip(asked, replies, strict=True):
            if reply is None:
                continue  # counted by the backend (failed / timeouts)
            values[i] = signal.parse(reply, requests[i].context)
            if values[i] is None:
                add(counts, "judge/unparseable")
        return values

    def _complete(self, requests: list[Request], counts: dict[str, float]) -> list[str | None]:
        """Replies to ``requests`` in order, chunked and spread over the workers."""
        chunks = [
            requests[i : i + self.batch_size] for i in range(0, len(requests), self.batch_size)
        ]
        add(counts, "judge/calls", float(len(chunks)))
        if self._worker is not None:
            with ThreadPoolExecutor(max_workers=self.max_concurrency) as threads:
                results = list(
                    threads.map(
                        lambda c: self._worker.complete(
                            [r.prompt for r in c], [r.schema for r in c]
                        ),
                        chunks,
                    )
                )
        else:
            results = self._map_actors(chunks, counts)
        replies: list[str | None] = []
        for chunk_replies, chunk_counts in results:
            replies.extend(chunk_replies)
            for name, value in chunk_counts.items():
                add(counts, name, value)
        return replies

    def _map_actors(self, chunks: list[list[Request]], counts: dict[str, float]) -> list:
        """Every chunk on the actor with the fewest failures in this call, least loaded
        among those (a random one among equals, so that concurrent callers spread over the
        pool), at most
        ``max_concurrency`` in flight; a chunk whose actor died goes again, preferably
        elsewhere (up to ``max_retries``), one that outlives its deadline is cancelled;
        either way what cannot be had is null and counted."""
        import ray

        results: list[Any] = [None] * len(chunks)
        queue = deque((i, 0) for i in range(len(chunks)))
        pending: dict[Any, tuple[int, int, int, float]] = {}  # ref: chunk, try, actor, deadline
        load = np.zeros(len(self._actors))
        failures = np.zeros(len(self._actors))
        rng = np.random.default_rng()
        peak = 0
        while queue or pending:
            while queue and len(pending) < self.max_concurrency:
                i, attempt = queue.popleft()
                # fewest failures first (a dead actor fails at once, and would look idle),
                # then least loaded, then a random one among equals
                key = failures * 1e6 + load + rng.random(len(load)) * 0.5
                a = int(np.argmin(key))
                prompts = [r.prompt for r in chunks[i]]
                ref = self._actors[a].complete.remote(prompts, [r.schema for r in chunks[i]])
                pending[ref] = (i, attempt, a, time.monotonic() + self._call_deadline(len(prompts)))
                load[a] += 1
                peak = max(peak, len(pending))
            wait_s = max(0.0, min(d for *_, d in pending.values()) - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            now = time.monotonic()
            for ref in [r for r in pending if r in ready or pending[r][3] <= now]:
                i, attempt, a, deadline = pending.pop(ref)
                load[a] -= 1
                n = len(chunks[i])
                if ref not in ready:  # past its deadline
                    ray.cancel(ref)
                    results[i] = ([None] * n, {"judge/timeouts": float(n)})
                    continue
                try:
                    results[i] = ray.get(ref)
                except (*actor_lost_errors(), ray.exceptions.ActorUnavailableError):
                    add(counts, "judge/actor_failures")
                    failures[a] += 1
                    if attempt < self.max_retries:
                        add(counts, "judge/retries")
                        _await_restart(self._actors[a], min(0.5 * 2**attempt, 10.0))
                        queue.append((i, attempt + 1))
                    else:
                        results[i] = ([None] * n, {"judge/failed": float(n)})
        counts["judge/max_in_flight"] = float(peak)
        return results

    def _call_deadline(self, prompts: int) -> float:
        """Longest a call of ``prompts`` requests may take: every timeout and retry its
        backend could honour, request after request, plus a minute."""
        return self.timeout_s * (self.max_retries + 1) * prompts + 60.0

    @staticmethod
    def _finish(counts: dict[str, float], start: float) -> None:
        add(counts, "judge/seconds", time.perf_counter() - start)

    def _write(
        self,
        signal: JudgedSignal,
        batch: TrajectoryBatch,
        units: np.ndarray,
        values: list[dict[str, Any] | None],
        counts: dict[str, float],
    ) -> TrajectoryBatch:
        turn_level = signal.level == "turn"
        size = batch.num_turns if turn_level else len(batch)
        offsets = pa.array(batch.turn_offsets.astype(np.int32)) if turn_level else None
        columns = {}
        for name, spec in signal.columns.items():
            flat: list[Any] = [None] * size
            for unit, value in zip(units.tolist(), values, strict=True):
                if value is not None:
                    flat[unit] = value[name]
            if turn_level:
                columns[name] = pa.ListArray.from_arrays(
                    offsets, pa.array(flat, type=spec.type.value_type)
                )
            else:
                columns[name] = pa.array(flat, type=spec.type)
        out = batch.with_traj_columns(columns)
        agreement = signal.agreement(out)
        if agreement is not None:
            add(counts, "judge/agreement_hits", float(agreement[0]))
            add(counts, "judge/agreement_n", float(agreement[1]))
        return out.with_metrics(counts)


class _SignalStage:
    """``batch -> batch`` with one signal filled (what :meth:`JudgePool.stage` returns)."""

    def __init__(self, pool: JudgePool, signal: JudgedSignal) -> None:
        self.pool, self.signal = pool, signal
        self.__name__ = signal.name

    def __call__(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        return self.pool.judge(self.signal, batch)


def _resolve(data: Any) -> TrajectoryBatch:
    if isinstance(data, TrajectoryBatch):
        return data
    import ray

    if not isinstance(data, ray.ObjectRef):
        raise TypeError(
            f"expected a TrajectoryBatch or an ObjectRef to one, got {type(data).__name__}"
        )
    return ray.get(data)


def _titles(corpus: Any) -> dict[str, str] | None:
    """Corpus id -> title (the first line of its contents)."""
    if corpus is None:
        return None
    if isinstance(corpus, Mapping):
        return {str(k): v.split("\n", 1)[0].strip() for k, v in corpus.items()}
    return {str(d["id"]): d["contents"].split("\n", 1)[0].strip() for d in corpus}


def _missing_hint(signal: JudgedSignal, evidence: bool) -> str:
    if evidence:
        return (
            "The evidence judge works from gold answers and supporting documents; for data "
            "without them use an LLM judge: JudgePool(backend='hf', ...) or "
            "JudgePool(backend='openai', ...)."
        )
    if "reference_plan" in signal.requires("llm"):
        return (
            "Make reference plans first (pool.judge('reference_plan', questions); the "
            "pipelines do it for you) or bring them in the question file, and add them as "
            "the reference_plan column."
        )
    return ""


def _await_restart(actor: Any, backoff_s: float, limit_s: float = 60.0) -> None:
    """After a judge actor's call failed: sleep ``backoff_s``, then wait (at most
    ``limit_s``) until Ray has restarted the actor, so that the retry is not spent on an
    actor still starting (a loaded machine takes seconds). An actor gone for good is left
    to the retry, which fails and is counted."""
    import ray

    time.sleep(backoff_s)
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(actor.__ray_ready__.remote(), timeout=limit_s)
