"""JudgePool: the judged signals of CW-GRPO and Search-P1, from a pool of judge workers.

:class:`JudgePool` fills

* ``judge_utility`` / ``judge_correct`` (CW-GRPO's ``u`` and ``v``, int8 per turn, null =
  not judged) with :meth:`JudgePool.annotate_cw_grpo`;
* the Search-P1 evaluator fields ``sp1_*`` (per trajectory, null = not judged) with
  :meth:`JudgePool.annotate_search_p1`;
* Search-P1's offline reference plans with :meth:`JudgePool.make_reference_plans`.

Backends: ``"evidence"`` (deterministic, below), ``"hf"`` (a local model) and
``"openai"`` (any OpenAI-compatible endpoint); the two LLM backends use our prompts in
``ray_credit/prompts/judge/`` and strict JSON replies (see
:mod:`ray_credit.actors.judge_backends`). An object with a ``complete(prompts, counts)``
method is accepted as a backend too.

**The evidence judge** needs ``supporting_doc_ids`` (the documents that support the gold
answer, ``S``) and ``turn_doc_ids`` (what each search returned). For turn ``t``, with
``seen`` the supporting documents returned before ``t``:

* a ``search`` turn: ``u = 1`` iff it returned a supporting document not in ``seen``
  (relevant and new); ``v = 1`` iff ``S`` was not yet all seen (it asks for something
  still missing). So ``p = u * v = 1`` exactly when the turn advanced the evidence chain;
* an ``answer`` turn: ``u = 1`` iff the answer exact-matches a gold answer; ``v = 1`` iff
  the normalized answer is non-empty and contained in an earlier observation (the answer
  is grounded in what was retrieved, whether or not it is right);
* an ``invalid`` / ``truncated`` turn: ``u = v = 0``.

Search-P1, per trajectory: the reference plan is one step per supporting document, and
the evidence judge takes it as the agent's plan too (it cannot read a plan), so
``sp1_plan_steps = sp1_ref_plan_steps = |S|`` and ``sp1_effective_steps_self =
sp1_effective_steps_ref`` = the supporting documents returned by any search (at most
``|S|``). ``sp1_planner_score``: 1.2 if all of ``S`` was found with exactly ``|S|``
searches, 1.0 if all was found, 0.6 if some, 0.2 if none. ``sp1_outcome_accuracy``: 1
for an exact match, 0.5 if the answer contains a gold answer, else 0.
``sp1_outcome_reasoning``: 1.0 for an exact match on the full evidence chain, 0.8 for the
full chain, 0.5 for part of it, 0 for none. Reference plans: the title (first line) of each
supporting document, in hop order (needs ``corpus=``).

A trajectory without supporting documents (null or empty) is not judged: null, counted
in ``judge/no_evidence``. With ``skip_failed=True`` (default, as the official CW-GRPO code)
trajectories with ``outcome_reward <= 0`` are not sent to the CW-GRPO judge: null, counted
in ``judge/skipped`` (the paper's estimator gives them uniform weights and reads no
judgement). Every null is counted once under its cause (``judge/skipped``,
``judge/no_evidence``, ``judge/unparseable``, ``judge/failed``, ``judge/timeouts``);
``judge/requests`` counts judgements asked for and ``judge/retries`` repeated calls.

Work goes out in chunks of about ``batch_size`` judgements; at most ``max_concurrency``
chunks are in flight across the pool (``ray.wait``; in process, a thread pool of that
size). ``num_actors=0`` runs in this process; otherwise :class:`JudgeWorker` (a plain
class) is wrapped with ``ray.remote`` here. A crashed actor raises Ray's error.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from ray_credit.actors.judge_backends import (
    HFBackend,
    LLMJudge,
    OpenAIBackend,
    add,
    check_openai_args,
)
from ray_credit.batch import COLUMNS, TrajectoryBatch
from ray_credit.qa import contains_gold, em_check, extract_answer, normalize_answer, subem_check

__all__ = ["BACKENDS", "EvidenceJudge", "JudgePool", "JudgeWorker"]

BACKENDS = ("evidence", "hf", "openai")
SP1_COLUMNS = (
    "sp1_planner_score",
    "sp1_plan_steps",
    "sp1_effective_steps_self",
    "sp1_effective_steps_ref",
    "sp1_ref_plan_steps",
    "sp1_outcome_accuracy",
    "sp1_outcome_reasoning",
)


class EvidenceJudge:
    """Deterministic judgements from gold answers and supporting documents (module docstring).

    Args:
        corpus: documents ``{"id", "contents"}`` (or a mapping id -> contents), needed only
            by :meth:`reference_plans`, which names each supporting document by its title.
    """

    required_columns = {
        "cw_grpo": ("supporting_doc_ids", "turn_doc_ids"),
        "search_p1": ("supporting_doc_ids", "turn_doc_ids"),
    }
    missing_hint = (
        "the evidence judge works from supporting documents; this dataset has none, so use "
        "an LLM judge instead: JudgePool(backend='hf', ...) or JudgePool(backend='openai', ...)"
    )

    def __init__(self, *, corpus: Iterable[Mapping[str, Any]] | Mapping[str, str] | None = None):
        if corpus is None:
            self.titles = None
        elif isinstance(corpus, Mapping):
            self.titles = {str(k): _title(v) for k, v in corpus.items()}
        else:
            self.titles = {str(d["id"]): _title(d["contents"]) for d in corpus}

    def cw_grpo(self, batch: TrajectoryBatch, counts: dict[str, float]):
        u = np.full(batch.num_turns, -1, dtype=np.int8)
        v = np.full(batch.num_turns, -1, dtype=np.int8)
        add(counts, "judge/requests", batch.num_turns)
        for i, row in enumerate(_rows(batch)):
            support = set(row["supporting_doc_ids"] or ())
            at = int(batch.turn_offsets[i])
            if not support:
                add(counts, "judge/no_evidence", len(row["turns"]))
                continue
            seen: set[str] = set()
            observations: list[str] = []
            doc_ids = row["turn_doc_ids"] or [None] * len(row["turns"])
            for t, turn in enumerate(row["turns"]):
                returned = set(doc_ids[t] or ())
                if turn["action"] == "search":
                    missing = support - seen
                    u[at + t], v[at + t] = bool(missing & returned), bool(missing)
                elif turn["action"] == "answer":
                    final = t == len(row["turns"]) - 1 and row["answer"] is not None
                    answer = row["answer"] if final else extract_answer(turn["text"] or "")
                    u[at + t] = em_check(answer, row["gold_answers"]) == 1.0
                    v[at + t] = _grounded(answer, observations)
                else:  # invalid / truncated: neither useful retrieval nor a useful action
                    u[at + t] = v[at + t] = 0
                seen |= returned & support
                if turn["observation"]:
                    observations.append(turn["observation"])
        return u, v

    def search_p1(self, batch: TrajectoryBatch, counts: dict[str, float]):
        out: list[dict[str, float | int] | None] = []
        add(counts, "judge/requests", len(batch))
        for row in _rows(batch):
            support = list(dict.fromkeys(row["supporting_doc_ids"] or ()))
            if not support:
                add(counts, "judge/no_evidence")
                out.append(None)
                continue
            returned = {d for ids in row["turn_doc_ids"] or () for d in ids or ()}
            found = len(set(support) & returned)
            searches = sum(turn["action"] == "search" for turn in row["turns"])
            complete = found == len(support)
            exact = em_check(row["answer"], row["gold_answers"]) == 1.0
            partial = subem_check(row["answer"], row["gold_answers"]) == 1.0
            out.append(
                {
                    "sp1_planner_score": (1.2 if searches == found else 1.0)
                    if complete
                    else (0.6 if found else 0.2),
                    "sp1_plan_steps": len(support),
                    "sp1_effective_steps_self": found,
                    "sp1_effective_steps_ref": found,
                    "sp1_ref_plan_steps": len(support),
                    "sp1_outcome_accuracy": 1.0 if exact else (0.5 if partial else 0.0),
                    "sp1_outcome_reasoning": (1.0 if exact else 0.8)
                    if complete
                    else (0.5 if found else 0.0),
                }
            )
        return out

    def reference_plans(
        self, questions: Sequence[Mapping[str, Any]], counts: dict[str, float]
    ) -> list[list[str] | None]:
        if self.titles is None:
            raise ValueError(
                "evidence reference plans name the supporting documents by title; pass the "
                "corpus: JudgePool(backend='evidence', corpus=world.corpus)"
            )
        add(counts, "judge/requests", len(questions))
        plans: list[list[str] | None] = []
        for q in questions:
            ids = q.get("supporting_doc_ids")
            if not ids:
                add(counts, "judge/no_evidence")
                plans.append(None)
                continue
            unknown = [d for d in ids if str(d) not in self.titles]
            if unknown:
                raise ValueError(
                    f"question {q.get('question', '')[:60]!r}: supporting_doc_ids {unknown} are "
                    "not in the corpus given to the judge"
                )
            plans.append([self.titles[str(d)] for d in dict.fromkeys(ids)])
        return plans


def _title(contents: str) -> str:
    return contents.split("\n", 1)[0].strip()


def _rows(batch: TrajectoryBatch) -> list[dict[str, Any]]:
    names = ["gold_answers", "turns", "supporting_doc_ids", "turn_doc_ids"]
    rows = batch.table.select(names).to_pylist()
    answers = batch.column("answer").to_pylist() if "answer" in batch else [None] * len(batch)
    for row, answer in zip(rows, answers, strict=True):
        row["answer"] = answer
    return rows


def _grounded(answer: str | None, observations: list[str]) -> bool:
    if answer is None or not normalize_answer(answer):
        return False
    return any(contains_gold(obs, [answer]) for obs in observations)


# ---------------------------------------------------------------------------- the worker
_JUDGES = {"evidence": EvidenceJudge, "hf": LLMJudge, "openai": LLMJudge}


def _judge_class(backend: Any) -> type:
    if isinstance(backend, str):
        if backend not in _JUDGES:
            raise ValueError(
                f"unknown judge backend {backend!r}; valid backends are {list(BACKENDS)} "
                "(or an object with a complete(prompts, counts) method)"
            )
        return _JUDGES[backend]
    return LLMJudge


class JudgeWorker:
    """One judge: the class a pool actor runs (plain, usable without Ray).

    Each method returns its judgements and the ``judge/*`` counters of that call.
    """

    def __init__(
        self,
        backend: Any = "evidence",
        *,
        batch_size: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        **backend_kwargs: Any,
    ) -> None:
        cls = _judge_class(backend)
        if cls is EvidenceJudge:
            self.judge = EvidenceJudge(**backend_kwargs)
        elif backend == "hf":
            self.judge = LLMJudge(
                HFBackend(timeout_s=timeout_s, **backend_kwargs), batch_size=batch_size
            )
        elif backend == "openai":
            completer = OpenAIBackend(
                timeout_s=timeout_s, max_retries=max_retries, **backend_kwargs
            )
            self.judge = LLMJudge(completer, batch_size=batch_size)
        else:
            self.judge = LLMJudge(backend, batch_size=batch_size)

    def cw_grpo(self, batch: TrajectoryBatch) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        counts: dict[str, float] = {}
        u, v = self.judge.cw_grpo(batch, counts)
        return u, v, counts

    def search_p1(self, batch: TrajectoryBatch) -> tuple[list, dict[str, float]]:
        counts: dict[str, float] = {}
        return self.judge.search_p1(batch, counts), counts

    def reference_plans(self, questions: Sequence[Mapping[str, Any]]) -> tuple[list, dict]:
        counts: dict[str, float] = {}
        return self.judge.reference_plans(questions, counts), counts


# ---------------------------------------------------------------------------- the pool
class JudgePool:
    """Judge workers behind one object (see the module docstring).

    Args:
        backend: ``"evidence"``, ``"hf"``, ``"openai"``, or an object with
            ``complete(prompts, counts) -> list[str | None]``.
        num_actors: Ray actors to start (0: judge in this process).
        max_concurrency: chunks in flight at once across the pool.
        batch_size: judgements per chunk (and per backend call).
        timeout_s: per call: one HTTP request (openai), one generate (hf).
        max_retries: retries of a failed call (openai).
        skip_failed: do not judge CW-GRPO turns of trajectories with ``outcome_reward <= 0``.
        num_cpus, num_gpus, resources: resources of each actor (``resources``: custom
            ones, e.g. ``{"service": 1}`` to land on a cluster's service nodes).
        **backend_kwargs: for the backend: ``corpus`` (evidence); ``model``, ``device``,
            ``dtype``, ``max_new_tokens`` (hf); ``base_url``, ``model``, ``api_key_env``,
            ``backoff_s``, ``max_tokens``, ``extra_body`` (openai).
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
        skip_failed: bool = True,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: dict[str, float] | None = None,
        **backend_kwargs: Any,
    ) -> None:
        self.judge_class = _judge_class(backend)
        if num_actors < 0 or max_concurrency < 1 or batch_size < 1:
            raise ValueError(
                f"need num_actors >= 0, max_concurrency >= 1 and batch_size >= 1; got "
                f"{num_actors}, {max_concurrency}, {batch_size}"
            )
        if backend == "openai":
            check_openai_args(**{"base_url": None, "model": None, **backend_kwargs})
        self.batch_size, self.max_concurrency, self.skip_failed = (
            batch_size,
            max_concurrency,
            skip_failed,
        )
        self._counts: dict[str, float] = {}
        self._lock = threading.Lock()
        args = dict(batch_size=batch_size, timeout_s=timeout_s, max_retries=max_retries)
        self._actors: list[Any] = []
        if num_actors == 0:
            self._worker = JudgeWorker(backend, **args, **backend_kwargs)
            return
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                "JudgePool(num_actors > 0) needs a connected Ray cluster; call ray.init() first"
            )
        per_actor = math.ceil(max_concurrency / num_actors)
        remote = ray.remote(JudgeWorker).options(
            num_cpus=num_cpus, num_gpus=num_gpus, resources=resources, max_concurrency=per_actor
        )
        self._actors = [remote.remote(backend, **args, **backend_kwargs) for _ in range(num_actors)]

    # ------------------------------------------------------------------ public API
    def annotate_cw_grpo(self, batch_or_ref: Any) -> TrajectoryBatch:
        """The batch with ``judge_utility`` and ``judge_correct`` (int8 per turn, null where
        not judged) and this call's ``judge/*`` counters in its metrics."""
        batch = self._batch(batch_or_ref, "cw_grpo")
        rows = np.arange(len(batch))
        counts: dict[str, float] = {}
        if self.skip_failed:
            judged = batch.traj_values("outcome_reward") > 0
            add(counts, "judge/skipped", float(batch.turn_counts[~judged].sum()))
            rows = rows[judged]
        chunks = _chunks(rows, batch.turn_counts, self.batch_size)
        results = self._map("cw_grpo", [batch.select(c) for c in chunks], counts)
        u = np.full(batch.num_turns, -1, dtype=np.int8)
        v = np.full(batch.num_turns, -1, dtype=np.int8)
        offsets = batch.turn_offsets
        for chunk, (cu, cv, _) in zip(chunks, results, strict=True):
            at = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in chunk])
            u[at], v[at] = cu, cv
        list_offsets = pa.array(offsets.astype(np.int32))
        columns = {
            name: pa.ListArray.from_arrays(list_offsets, pa.array(x, type=pa.int8(), mask=x < 0))
            for name, x in (("judge_utility", u), ("judge_correct", v))
        }
        return batch.with_traj_columns(columns, metrics=self._record(counts))

    def annotate_search_p1(self, batch_or_ref: Any) -> TrajectoryBatch:
        """The batch with the Search-P1 evaluator fields ``sp1_*`` (null where not judged)."""
        batch = self._batch(batch_or_ref, "search_p1")
        counts: dict[str, float] = {}
        chunks = _chunks(np.arange(len(batch)), np.ones(len(batch), np.int64), self.batch_size)
        results = self._map("search_p1", [batch.select(c) for c in chunks], counts)
        fields: list[dict | None] = [None] * len(batch)
        for chunk, (values, _) in zip(chunks, results, strict=True):
            for r, value in zip(chunk, values, strict=True):
                fields[int(r)] = value
        columns = {
            name: pa.array([None if f is None else f[name] for f in fields], COLUMNS[name].type)
            for name in SP1_COLUMNS
        }
        return batch.with_traj_columns(columns, metrics=self._record(counts))

    def make_reference_plans(
        self, questions: Sequence[Mapping[str, Any]]
    ) -> list[list[str] | None]:
        """Search-P1 reference plans, one list of steps per question (None: not made).

        Questions are dicts with ``question`` and ``golden_answers`` (LLM backends) or
        ``supporting_doc_ids`` (evidence). Add the result as the ``reference_plan`` column
        (or to the questions, which the generator copies into its batches)."""
        questions = list(questions)
        counts: dict[str, float] = {}
        chunks = [
            questions[i : i + self.batch_size] for i in range(0, len(questions), self.batch_size)
        ]
        results = self._map("reference_plans", chunks, counts)
        self._record(counts)
        return [plan for plans, _ in results for plan in plans]

    def metrics(self) -> dict[str, float]:
        """Counters summed over every call since creation (``judge/*``)."""
        with self._lock:
            return dict(self._counts)

    # ------------------------------------------------------------------ internals
    def _batch(self, batch_or_ref: Any, task: str) -> TrajectoryBatch:
        if not isinstance(batch_or_ref, TrajectoryBatch):
            import ray

            if not isinstance(batch_or_ref, ray.ObjectRef):
                raise TypeError(
                    f"expected a TrajectoryBatch or an ObjectRef to one, got {type(batch_or_ref).__name__}"
                )
            batch_or_ref = ray.get(batch_or_ref)
        missing = [c for c in self.judge_class.required_columns[task] if c not in batch_or_ref]
        if missing:
            raise ValueError(
                f"the {task} judge needs column(s) {missing}, missing from the batch; "
                f"{self.judge_class.missing_hint}"
            )
        return batch_or_ref

    def _map(self, method: str, chunks: list[Any], counts: dict[str, float]) -> list[Any]:
        """``worker.method(chunk)`` for every chunk, at most ``max_concurrency`` at once."""
        start = time.perf_counter()
        in_flight = peak = 0
        if not self._actors:
            guard = threading.Lock()

            def call(chunk):
                nonlocal in_flight, peak
                with guard:
                    in_flight += 1
                    peak = max(peak, in_flight)
                try:
                    return getattr(self._worker, method)(chunk)
                finally:
                    with guard:
                        in_flight -= 1

            with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
                results = list(pool.map(call, chunks))
        else:
            import ray

            results = [None] * len(chunks)
            pending: dict[Any, tuple[int, int]] = {}  # ref -> (chunk, actor)
            load = [0] * len(self._actors)
            for i, chunk in enumerate(chunks):
                while len(pending) >= self.max_concurrency:
                    self._collect(ray, pending, load, results)
                a = int(np.argmin(load))
                pending[getattr(self._actors[a], method).remote(chunk)] = (i, a)
                load[a] += 1
                peak = max(peak, len(pending))
            while pending:
                self._collect(ray, pending, load, results)
        for result in results:
            for name, value in result[-1].items():
                add(counts, name, value)
        add(counts, "judge/calls", len(chunks))
        add(counts, "judge/seconds", time.perf_counter() - start)
        counts["judge/max_in_flight"] = float(peak)
        return results

    @staticmethod
    def _collect(ray: Any, pending: dict, load: list[int], results: list) -> None:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i, a = pending.pop(ref)
            load[a] -= 1
            results[i] = ray.get(ref)

    def _record(self, counts: dict[str, float]) -> dict[str, float]:
        with self._lock:
            for name, value in counts.items():
                if name == "judge/max_in_flight":
                    self._counts[name] = max(self._counts.get(name, 0.0), value)
                else:
                    add(self._counts, name, value)
        return counts


def _chunks(rows: np.ndarray, sizes: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive runs of ``rows`` holding about ``budget`` units (``sizes[row]`` each; a
    row bigger than the budget goes alone)."""
    chunks, start, total = [], 0, 0
    for k, r in enumerate(rows):
        if k > start and total + sizes[r] > budget:
            chunks.append(rows[start:k])
            start, total = k, 0
        total += int(sizes[r])
    if len(rows) > start:
        chunks.append(rows[start:])
    return chunks
