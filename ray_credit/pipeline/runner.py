"""The asynchronous training loop: generators run ahead of the learner within a hard
staleness bound, every chunk goes through its stages as soon as it is generated, and the
driver holds object references and small summaries, never a batch.

Data. The training questions form an endless stream: epoch ``e`` is a seeded permutation
of the question list, and group ``i`` of the stream is one question rolled out ``G``
times. Step ``k`` trains exactly groups ``[k*B, (k+1)*B)`` (``B`` = ``groups_per_step``),
in stream order whatever order generations finish in, so a run is a pure function of its
seed and a checkpoint's data cursor is one integer. A chunk samples with the generators'
seed plus its place in the run's calls, which follows from its position
(:meth:`Pipeline._call_of`), so the generator that rolls it out, a redo or a resume leave
its sampling as it was.

The flow of one chunk (``chunk_groups`` groups, never straddling a step)::

    generator.generate_chunk  ->  (batch ref, summary)           driver reads the summary
    stage task: every stage   ->  (staged batch ref, report)     driver reads the report
    learner.submit_train(the step's staged refs)                 every rank fetches them

Stages (judges, the info-gain scorer, the estimator, any ``batch -> batch`` function) run
in one Ray task per chunk, started the moment the chunk is generated, so they overlap the
learner's current step the way generation does; a chunk holds whole groups, so a
group-local estimator gives the same advantages per chunk as per step. ``step_stages``
(for an estimator that is not group-local) run once per step, on the step's chunks
together, in a task. The driver submits work and reacts to what finishes; it never waits
on the learner while there is something to dispatch or stage. Weight targets (the
info-gain scorer, which reads the policy's beliefs) score each chunk with the weights
that sampled it: they are sent a version once every chunk sampled with older weights is
staged, and a chunk's stages start once they hold its version.

Admission control (docs/architecture.md, the asynchronous loop). A chunk whose last group is ``j`` starts only
while ``j < (max_staleness + version + 1) * B``, ``version`` being the learner's. Group
``j`` is trained at step ``j // B`` and was generated with weights of version ``>=
version at dispatch``, so its staleness at training is at most ``max_staleness``: a hard
bound that the loop also checks on the data (the oldest turn version of every
trajectory, in each chunk's summary) before every update, and raises on, rather than
trusting arithmetic. ``max_staleness = 0`` is synchronous on-policy training. Nothing is
discarded: admission delays a group instead.

Failures. A generator whose process dies loses its call, not the run: the chunk goes
back to the front of the queue for the next idle generator (a call killed by Ray's memory
monitor raises ``OutOfMemoryError``, not ``RayActorError``: the same death). Ray
restarts the actor when it was made with ``max_restarts`` (it comes back on the base
weights, so the current ones are re-sent before it gets work); one that is gone for good
leaves the pool, and the run goes on with the others. A chunk that comes back generated
with older weights than were sent before it (its generator restarted before the driver
heard of the death) is redone too, and so is one whose batch was lost with its node. A
generator that hangs (has chunks in flight and finishes none for
``generation_timeout_s``) is killed, and then handled as one that died. A generator
whose process died between calls (killed by Ray's memory monitor while it waited) fails
no call: Ray restarts it, the next publication brings it to the current weights, and its
next chunk, from another process than its last, counts it.
Every such event is counted (``pipeline/generator_failures``,
``pipeline/generators_lost``, ``pipeline/generators_hung``,
``pipeline/generator_restarts``, ``pipeline/chunks_redone``,
``pipeline/stale_chunks_redone``, ``pipeline/chunks_lost``, ``sync/resyncs``). A stage
that fails stops the run with an error naming the stage and the chunk's groups (the judge
pool retries its own actors; the retriever is retried by the generators), except when a
weight target (the info-gain scorer) died under it: the loop waits for Ray to restart it,
re-sends the current weights and runs the chunk's stages again
(``pipeline/weight_target_failures``, ``pipeline/stages_redone``); a scorer gone for good
stops the run, since every later chunk would lack its signal. While the loop
waits for a restarted generator, or writes a checkpoint, it dispatches nothing: the
learner may sit idle for that long.

Backpressure. At most ``(max_staleness + 1) * B`` groups exist beyond the trained ones
(in flight, staging or ready), each generator has at most two chunks in flight (one
running, the next queued behind it), the learner one step, the weight publisher one
publication. Every wait has a timeout.

Metrics (per step, see :mod:`ray_credit.pipeline.report`): generation, staleness, every
stage's metrics and seconds (``time/stage_<name>_s``, summed over the step's chunks),
outcomes, the learner's, and where the learner's time went: ``time/train_s``,
``time/wait_generation_s`` (idle, the step's chunks still generating),
``time/wait_stages_s`` (idle, generated but still in their stages), ``time/stages_s``
(the stage tasks' wall time, summed over the step's chunks) and ``time/stages_hidden_s``
(the part of it that overlapped the learner's training: the tasks' and the training
calls' wall-clock intervals intersected).

Checkpoints. :meth:`Pipeline.save` writes the learner (model, optimizer, scheduler, RNG,
version) and ``pipeline.json`` (step, seed, data cursor) with every generated chunk not
trained yet (Arrow IPC, written by a task on the driver's node, with its summary; staged
once its stages have run), each by absolute path or URI into ``checkpoint_dir``
(:mod:`ray_credit.pipeline.checkpointing`). It first waits for the chunks sampled with
older weights than the learner's to be generated and staged: a resumed run could not
make them again as they were. :meth:`Pipeline.run` resumed from it stages the kept chunks
not staged yet and regenerates only the chunks that were in flight (sampled with the
checkpoint's weights, and each with its seed from its place, they come out the same), so
no group is lost or trained twice, and those sampled with older weights are trained as
they were sampled and scored.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from ray_credit.actors import actor_lost_errors
from ray_credit.batch import TrajectoryBatch
from ray_credit.pipeline.checkpointing import (
    LEARNER_DIR,
    STATE_FILE,
    begin_save,
    checkpoint_state,
    checkpoints,
    end_save,
    resolve_checkpoint,
)
from ray_credit.pipeline.report import chunk_report, staleness_of, step_metrics
from ray_credit.process_memory import PeakMeter, memory_report, node_memory, ray_processes_gb
from ray_credit.storage import StoragePath

__all__ = [
    "Pipeline",
    "PipelineConfig",
    "StageError",
    "actor_stage",
    "checkpoint_state",
    "checkpoints",
    "estimator_stage",
    "resolve_checkpoint",
]

_BUFFER_DIR = "buffer"
_QUEUE_DEPTH = 2
_UNASKED = object()  # a setting not asked of the actors yet
"""Chunks in flight per generator: the next is queued behind the one running, so a
generator never idles while the driver hands out its next chunk."""
# chunks off the run's layout (:meth:`Pipeline._call_of`) take their place past this: no
# run makes that many calls
_OFF_LAYOUT = 2**32


@dataclass(frozen=True)
class PipelineConfig:
    """How the loop runs (not what it trains: see the learner and generator configs)."""

    steps: int = 10
    """Learner updates of the run (a resumed run counts the steps already done)."""
    groups_per_step: int = 8
    """Questions (groups of G trajectories) per learner update."""
    max_staleness: int = 1
    """How many policy versions a trained turn may lag the learner (0: synchronous)."""
    chunk_groups: int | None = None
    """Groups per generate call, the unit that streams through the stages (default:
    groups_per_step split evenly over the generators, at least 1). Smaller chunks start
    their stages sooner, so less of the stages' time is left when the step's last chunk
    arrives."""
    seed: int = 0
    """Seed of the question order."""
    stratify_by: str | None = None
    """A question field (``"hops"``, ``"data_source"``) whose values every step draws in
    their data proportions: each epoch shuffles each value's questions apart and spreads
    them evenly through the epoch, so a step of B groups holds ``B * share`` of each value,
    give or take one (with two values). None: one shuffle of all questions, so a step's mix varies with the
    draw."""
    timeout_s: float = 1800.0
    """Longest wait for one generate call, chunk's stages, learner update or weight
    publication."""
    generation_timeout_s: float | None = None
    """Longest a generator may go without finishing a chunk while it has one: past it the
    generator is taken for hung, killed (Ray restarts it when it was made with
    ``max_restarts``, else it leaves the pool) and its chunks go to the others. None:
    ``timeout_s``. Set it above a chunk's slowest legitimate generation, including what a
    generator may wait on: its own restart and model load, a retriever that restarts and
    rebuilds its index. Each kill spends one of the generator's restarts."""
    checkpoint_every: int = 0
    """Save every this many steps into ``checkpoint_dir`` (0: only at the end)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go: a path (made absolute on the driver; on
    a cluster, one every node sees) or a URI such as ``s3://bucket/runs/NAME/checkpoint``.
    One folder per saved step, ``step_000012``, a checkpoint once its ``pipeline.json``
    is written, last. Resuming from this folder takes the newest. None: a pipeline script
    puts them in ``storage_path/NAME/checkpoint`` (else ``output_dir/NAME/checkpoint``);
    a ``Pipeline`` built directly with None saves none."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints ``checkpoint_dir`` keeps; an older one is deleted
    only once a newer one is whole."""
    weight_sync: Literal["object_store", "nccl", "gloo"] = "object_store"
    """How weights reach the generators: 'object_store' (everywhere; survives generator
    restarts), 'nccl' (a broadcast between GPUs) or 'gloo' (the same broadcast on CPUs)."""
    stage_cpus: float = 0.0
    """CPUs each chunk's stage task asks Ray for (it mostly waits on judge and scorer
    actors; the estimator takes milliseconds)."""

    def __post_init__(self) -> None:
        from ray_credit.config import check_fields

        check_fields(self)  # types first: the checks below compare numbers
        for name in ("steps", "groups_per_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0 (0: synchronous), got {self.max_staleness}"
            )
        if self.chunk_groups is not None and not 1 <= self.chunk_groups <= self.groups_per_step:
            raise ValueError(
                f"chunk_groups must be in [1, groups_per_step={self.groups_per_step}], "
                f"got {self.chunk_groups}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints must be >= 1 (the newest is what a resume needs), got "
                f"{self.keep_checkpoints}"
            )
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s}"
            )
        if self.generation_timeout_s is not None and not 0 < self.generation_timeout_s < math.inf:
            raise ValueError(
                f"generation_timeout_s must be > 0 (None: timeout_s), got "
                f"{self.generation_timeout_s}"
            )
        if not 0 <= self.stage_cpus < math.inf:
            raise ValueError(f"stage_cpus must be finite and >= 0, got {self.stage_cpus}")
        if self.stratify_by is not None and not self.stratify_by:
            raise ValueError("stratify_by must name a question field, or be None")


def _strata(questions: Sequence[Mapping[str, Any]], field: str | None) -> list[Any] | None:
    """Each question's value of ``field`` (None: no stratification), checked present."""
    if field is None:
        return None
    missing = [i for i, q in enumerate(questions) if q.get(field) is None]
    if missing:
        raise ValueError(
            f"pipeline.stratify_by={field!r}, but {len(missing)} of {len(questions)} training "
            f"questions have no {field!r} (the first: question {missing[0]}); give every "
            "question that field, or stratify by another"
        )
    return [q[field] for q in questions]


def stratified_order(keys: Sequence[Any], rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(len(keys))`` in which every value of ``keys`` is spread
    evenly: value ``v``'s ``n_v`` questions, shuffled, sit at positions ``(j + u_v) / n_v``
    (``u_v`` uniform, one per value) of the unit interval, and the order is that of the
    positions. Any window of ``w`` consecutive entries then holds ``w * n_v / n`` of
    value ``v``, give or take one (two values) or a little more (more values)."""
    by_value: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        by_value.setdefault(key, []).append(i)
    positions = np.empty(len(keys))
    for members in by_value.values():
        shuffled = rng.permutation(np.asarray(members))
        positions[shuffled] = (np.arange(len(members)) + rng.random()) / len(members)
    return np.argsort(positions, kind="stable")


class StageError(RuntimeError):
    """A stage failed on a chunk; the message names the stage and the chunk's groups.
    ``actor_id``: the actor whose death failed it (hex), when one did."""

    def __init__(self, message: str, actor_id: str | None = None):
        super().__init__(message)
        self.actor_id = actor_id

    def __reduce__(self):  # crosses the stage task's boundary with its actor id
        return (StageError, (str(self), self.actor_id))


def actor_stage(method: Any, *, name: str | None = None, timeout_s: float = 1800.0) -> Callable:
    """A stage that calls an actor method (``actor.score``) on the batch and waits for it
    (from the stage task, so the batch goes worker to actor through the object store)."""

    def stage(batch: TrajectoryBatch) -> TrajectoryBatch:
        import ray

        try:
            return ray.get(method.remote(batch), timeout=timeout_s)
        except ray.exceptions.OutOfMemoryError as err:
            # A death names its actor (``actor_id``) and the driver brings that actor back
            # (the scorer: on the weights it held) and redoes the stage; a kill by Ray's
            # memory monitor does not, so the stage names it.
            actor = getattr(getattr(method, "_actor", None), "_actor_id", None)
            raise StageError(
                f"its actor was killed by Ray's memory monitor during the call "
                f"({str(err).strip().splitlines()[0][:200]})",
                actor_id=None if actor is None else actor.hex(),
            ) from err

    stage.__name__ = name or getattr(method, "_method_name", "actor_stage")
    return stage


def estimator_stage(estimator: str | Callable, **params: Any) -> Callable:
    """A stage that runs a registered estimator (by name) or an ``Estimator`` object.
    Its ``group_local`` says whether it may run per chunk (see :class:`Pipeline`)."""
    from ray_credit.estimators import get_estimator

    est = get_estimator(estimator) if isinstance(estimator, str) else estimator

    def stage(batch: TrajectoryBatch) -> TrajectoryBatch:
        return est(batch, **params)

    stage.__name__ = f"estimator_{getattr(est, 'name', 'custom')}"
    stage.group_local = getattr(est, "group_local", True)
    return stage


def _run_stages(stages: Sequence[Callable], batches: Sequence[Any]) -> tuple[Any, dict]:
    """The stage task: fetch the chunk(s), run every stage, report (see the module)."""
    import ray

    started_at = time.time()  # wall clock: compared with the driver's training intervals
    fetched = ray.get(list(batches))
    batch = fetched[0] if len(fetched) == 1 else TrajectoryBatch.concat(fetched)
    seconds: dict[str, float] = {}
    for stage in stages:
        name = getattr(stage, "__name__", type(stage).__name__)
        start = time.perf_counter()
        try:
            batch = stage(batch)
        except Exception as err:
            # the actor whose death (or stale weights: the scorer's WeightsBehind) failed it
            died = getattr(err, "actor_id", None)
            raise StageError(
                f"stage {name!r} failed: {type(err).__name__}: {err}", actor_id=died
            ) from err
        if not isinstance(batch, TrajectoryBatch):
            raise StageError(f"stage {name!r} returned {type(batch).__name__}, not a batch")
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
    return batch, {**chunk_report(batch, seconds), "interval": (started_at, time.time())}


def _write_chunk(location: StoragePath, batches: Sequence[Any]) -> int:
    import ray

    data = ray.get(batches[0]).to_ipc()
    location.write_bytes(data)
    return data.size


def _read_chunk(location: StoragePath) -> TrajectoryBatch:
    return TrajectoryBatch.from_ipc(location.read_bytes())


CHECKPOINT_FORMAT = 3
"""What :meth:`Pipeline.save` writes: 3 keeps a chunk staged when its stages have run (2,
still read, kept every chunk as generated)."""
_STAGED_REPORT = "staged_report"  # in a kept chunk's summary: its stages' report


def _kept_batch(chunk: _Chunk) -> Any:
    """What a checkpoint keeps of a generated chunk: the staged batch once its stages have
    run (their signals came from the weights of their time), else the generated one."""
    return chunk.staged if chunk.report is not None else chunk.batch


def _buffered(checkpoint: StoragePath, chunk: _Chunk, suffix: str) -> StoragePath:
    """A buffered chunk's file in a checkpoint: its batch (``.arrow``, Arrow IPC) or its
    summary (``.json``)."""
    return checkpoint / _BUFFER_DIR / f"{chunk.start:09d}_{chunk.size}{suffix}"


@dataclass
class _Chunk:
    """One chunk's refs and the small things the driver knows of it."""

    start: int  # stream index of its first group
    size: int
    generator: int = -1
    epoch: int = 0  # of the generator when submitted (restarts it lived through)
    min_version: int = 0  # the weights published before it was submitted
    batch: Any = None  # ref to the generated batch (kept until trained: checkpoints)
    summary_ref: Any = None
    summary: dict | None = None
    staged: Any = None  # ref to the staged batch
    report_ref: Any = None
    report: dict | None = None
    generated_at: float = 0.0  # when the driver saw its summary (perf_counter)

    @property
    def groups(self) -> str:
        return f"[{self.start}, {self.start + self.size})"


@dataclass
class _Training:
    """The step the learner is training."""

    call: Any
    chunks: list[_Chunk]
    started: float
    waited_generation: float
    waited_stages: float
    step_report: dict | None = None
    step_refs: list = field(default_factory=list)
    interval: tuple[float, float] = (0.0, 0.0)  # of the learner call (wall clock)


class Pipeline:
    """Generators ahead of a learner, stages per chunk, weights published back.

    Args:
        generators: generator actor handles (``generate_chunk(questions, *,
            progress=None, call=None)`` -> ``(batch, summary)`` with ``num_returns=2``,
            ``progress`` the title of a progress bar, which may be ignored, ``call`` the
            chunk's place in the run's calls, from its position: its sampling seed's offset;
            ``update_weights(version, weights)``,
            ``get_policy_version()``; :class:`~ray_credit.actors.generator.Generator`):
            fresh ones, or those of an earlier run on the same learner, which this one
            goes on with (ones ahead of the learner are refused).
        learner: a :class:`~ray_credit.actors.learner_group.LearnerGroup` (or anything
            with ``submit_train(refs)`` returning a call with ``refs`` and ``result()``,
            ``weights()``, ``save(folder)`` and ``policy_version``).
        questions: the training questions (mappings as ``Generator.generate`` takes).
        stages: callables ``batch -> batch`` run in order on every chunk (in a Ray task;
            they must pickle); the last stage (or the last of ``step_stages``) must leave
            ``turn_advantages`` on the batch.
        config: :class:`PipelineConfig`.
        step_stages: callables run once per step on the step's chunks together, after
            ``stages`` (an estimator whose statistics span groups).
        weight_targets: actors that stages call with the policy's weights (an info-gain
            scorer; ``update_weights``, ``get_policy_version``): each chunk's stages run
            while they hold the weights that sampled it.
        resume_from: a checkpoint folder written by :meth:`save`, a path or a URI (the
            learner must have been built from the same folder: ``LearnerGroup(resume_from=...)``).
        on_step: called with each step's metrics dict (progress display, loggers).
        metadata: a JSON-able dict saved with every checkpoint (``pipeline.json``'s
            ``metadata``; :func:`checkpoint_state` reads it back): what a caller needs
            to resume its run, e.g. the run's whole config.
        services: other actors of the run whose memory each step reports, by role
            (``{"retriever": [handle]}``: ``memory/retriever_rss_gb``), each answering
            ``memory()`` with ``{"rss_gb", "peak_gb"}`` or None. They are asked once a
            step and never waited for: a busy one's figure comes with a later step.
    """

    def __init__(
        self,
        generators: Sequence[Any],
        learner: Any,
        questions: Sequence[Mapping[str, Any]],
        stages: Sequence[Callable[[TrajectoryBatch], TrajectoryBatch]],
        config: PipelineConfig | None = None,
        *,
        step_stages: Sequence[Callable[[TrajectoryBatch], TrajectoryBatch]] = (),
        weight_targets: Sequence[Any] = (),
        resume_from: str | os.PathLike | None = None,
        on_step: Callable[[dict[str, float]], None] | None = None,
        metadata: Mapping[str, Any] | None = None,
        services: Mapping[str, Sequence[Any]] | None = None,
    ):
        import ray

        from ray_credit.pipeline.weights import CollectivePublisher, WeightPublisher

        if not generators:
            raise ValueError("Pipeline needs at least one generator actor")
        if not questions:
            raise ValueError("Pipeline needs at least one training question")
        for stage in stages:
            if getattr(stage, "group_local", True) is False:
                raise ValueError(
                    f"stage {stage.__name__!r} is not group-local: its statistics span "
                    "groups, so it cannot run per chunk; pass it in step_stages"
                )
        self.config = cfg = config or PipelineConfig()
        self.generators = list(generators)
        self.learner = learner
        self.questions = list(questions)
        self._strata = _strata(self.questions, cfg.stratify_by)
        self.on_step = on_step
        self.metadata = dict(metadata or {})
        self.services = {role: list(actors) for role, actors in (services or {}).items()}
        self._memory_asked: dict[str, list] = {}  # role -> memory() refs not read yet
        self._memory = PeakMeter()  # the driver's own
        self._checkpoint_s = 0.0  # the last save's seconds, not reported yet
        self._session_dir = _session_dir()
        try:  # refused now, not at the first checkpoint an hour in
            json.dumps(self.metadata)
        except (TypeError, ValueError) as err:
            raise TypeError(f"Pipeline metadata must be JSON-able: {err}") from None
        self._stages = ray.put(list(stages))  # pickled once, fetched by every stage task
        self._step_stages = ray.put(list(step_stages)) if step_stages else None
        # Ray retries a stage task whose worker died (judge calls are idempotent); an
        # exception a stage raises is not retried.
        self._stage_task = ray.remote(_run_stages).options(num_returns=2, num_cpus=cfg.stage_cpus)
        self.chunk = cfg.chunk_groups or max(1, math.ceil(cfg.groups_per_step / len(generators)))
        names = [f"generator{i}" for i in range(len(self.generators))]
        if cfg.weight_sync != "object_store" and weight_targets:
            raise ValueError(
                f"weight_sync={cfg.weight_sync!r} broadcasts to generators only; the weight "
                "targets (an info-gain scorer) load through the object store: use "
                "weight_sync='object_store' with them"
            )
        if cfg.weight_sync == "object_store":
            self.publisher = WeightPublisher(self.generators, timeout_s=cfg.timeout_s, names=names)
        else:
            self.publisher = CollectivePublisher(
                self.generators, learner, backend=cfg.weight_sync, timeout_s=cfg.timeout_s,
                names=names,
            )  # fmt: skip
        # The weight targets (an info-gain scorer) score each chunk with the weights that
        # sampled it: they load a version once every chunk sampled with older weights is
        # staged, and a chunk's stages start once they hold its version (_advance_targets).
        self.target_publisher = WeightPublisher(
            weight_targets,
            timeout_s=cfg.timeout_s,
            names=[f"target{i}" for i in range(len(weight_targets))],
        )
        # a weight target that dies fails the stage calling it: its index, by the actor id
        # the error names
        self._target_index = {t._actor_id.hex(): i for i, t in enumerate(weight_targets)}
        self._unloaded: dict[int, Any] = {}  # versions published, not yet for the targets
        self._weights_dtype: Any = _UNASKED  # the publications' dtype, once asked
        self._waiting: list[_Chunk] = []  # generated, waiting for the targets' version
        self.step = 0
        self.version = int(learner.policy_version)
        self._next = 0  # stream index of the next group to dispatch
        self._chunks: dict[int, _Chunk] = {}  # by start index: not trained yet
        self._queued = [0] * len(self.generators)  # chunks in flight per generator
        # when each generator last began or finished a chunk (monotonic): one with chunks in
        # flight and no progress for generation_timeout_s is hung
        self._progress = [0.0] * len(self.generators)
        self._epoch = [0] * len(self.generators)  # deaths handled per generator
        self._epoch_published = list(self._epoch)  # ... when the last publication was sent
        # the process each generator's last chunk came from (and the deaths handled then):
        # another one means Ray restarted it
        self._incarnation: list[tuple[str, int] | None] = [None] * len(self.generators)
        self._redo: list[_Chunk] = []  # lost with their generator, to dispatch first
        self._lost: set[int] = set()
        self._training: _Training | None = None
        self._trained_intervals: list[tuple[float, float]] = []  # recent learner calls
        self._orders: dict[int, np.ndarray] = {}
        self.failures = {
            "pipeline/generator_failures": 0.0,
            "pipeline/generators_lost": 0.0,
            "pipeline/chunks_redone": 0.0,
            "pipeline/stale_chunks_redone": 0.0,
            "pipeline/chunks_lost": 0.0,
            "pipeline/generators_hung": 0.0,
            "pipeline/generator_restarts": 0.0,
            "pipeline/stages_redone": 0.0,
            "pipeline/weight_target_failures": 0.0,
        }
        self.history: list[dict[str, float]] = []
        self.trained_groups: list[int] = []  # stream indices trained, in order (for checks)
        if resume_from is not None:
            self._restore(resume_from)
        self._start_on_the_learners_weights()

    # ----------------------------------------------------------------- data stream
    def question_at(self, index: int) -> Mapping[str, Any]:
        n = len(self.questions)
        epoch, pos = divmod(index, n)
        if epoch not in self._orders:
            rng = np.random.default_rng([self.config.seed, epoch])
            self._orders[epoch] = (
                rng.permutation(n) if self._strata is None else stratified_order(self._strata, rng)
            )
        return self.questions[int(self._orders[epoch][pos])]

    # ----------------------------------------------------------------- the loop
    @property
    def live_generators(self) -> list[Any]:
        """The generators still in the pool (one that died for good has left it)."""
        return [g for i, g in enumerate(self.generators) if i not in self._lost]

    def run(self) -> list[dict[str, float]]:
        """Train until ``config.steps`` steps are done; return every step's metrics."""
        self._free_since = self._step_ended = time.perf_counter()
        for chunk in self._chunks.values():  # restored from a checkpoint unstaged: stage them
            if chunk.report is None:
                self._start_stages(chunk)
        while self.step < self.config.steps:
            self._dispatch()
            self._start_training()
            self._handle(self._wait())
        self._wait_publication()
        self._wait_targets()
        return self.history

    def _admissible_end(self) -> int:
        """Stream index below which groups may be dispatched now: ``max_staleness`` steps
        ahead of the one training, never past the run's last step."""
        cfg = self.config
        ahead = min(cfg.max_staleness + self.step + 1, cfg.steps)
        return ahead * cfg.groups_per_step

    def _free_generator(self) -> int | None:
        """The live generator with the fewest chunks in flight, if one has room."""
        live = [g for g in range(len(self.generators)) if g not in self._lost]
        g = min(live, key=self._queued.__getitem__, default=None)
        return g if g is not None and self._queued[g] < _QUEUE_DEPTH else None

    def _submit(self, chunk: _Chunk, g: int) -> None:
        questions = [self.question_at(i) for i in range(chunk.start, chunk.start + chunk.size)]
        chunk.generator, chunk.epoch, chunk.min_version = g, self._epoch[g], self.version
        if not self._queued[g]:  # an idle generator starts on it now
            self._progress[g] = time.monotonic()
        self._queued[g] += 1
        call = self.generators[g].generate_chunk.options(num_returns=2)
        step = chunk.start // self.config.groups_per_step + 1
        title = f"step {step}/{self.config.steps}: groups {chunk.groups} on generator{g}"
        chunk.batch, chunk.summary_ref = call.remote(
            questions, progress=title, call=self._call_of(chunk.start)
        )

    def _call_of(self, start: int) -> int:
        """The place in the run's sequence of generate calls of the chunk starting at group
        ``start``, from its position alone: steps split into chunks of ``self.chunk``
        groups, so with one generator never restarted it is the call's number, and
        otherwise the chunk samples as it would there. A chunk that starts off that layout
        (next to one restored from a checkpoint written with other chunks) gets a place
        past every chunk's of it."""
        per_step = -(-self.config.groups_per_step // self.chunk)
        step, offset = divmod(start, self.config.groups_per_step)
        if offset % self.chunk:
            return _OFF_LAYOUT + start
        return step * per_step + offset // self.chunk

    def _dispatch(self) -> None:
        while self._redo and (g := self._free_generator()) is not None:
            self._submit(self._redo.pop(0), g)  # admitted already: versions only move forward
        limit = self._admissible_end()
        while (g := self._free_generator()) is not None:
            while self._next in self._chunks:  # restored from a checkpoint: already generated
                self._next += self._chunks[self._next].size
            if self._next >= limit:
                return
            step_end = (self._next // self.config.groups_per_step + 1) * self.config.groups_per_step
            restored = min((s for s in self._chunks if s > self._next), default=step_end)
            # never straddles a step, nor runs into a chunk restored from a checkpoint
            size = min(self.chunk, limit - self._next, step_end - self._next, restored - self._next)
            chunk = _Chunk(self._next, size)
            self._submit(chunk, g)
            self._chunks[chunk.start] = chunk
            self._next += size

    def _step_chunks(self) -> list[_Chunk]:
        first = self.step * self.config.groups_per_step
        end = first + self.config.groups_per_step
        return [self._chunks[s] for s in sorted(self._chunks) if first <= s < end]

    def _start_training(self) -> None:
        """Start the learner on the current step once its chunks are all staged (and its
        step stages done, when there are any)."""
        if self._training is not None and self._training.call is not None:
            return
        chunks = self._step_chunks()
        if sum(c.size for c in chunks) < self.config.groups_per_step or any(
            c.report is None for c in chunks
        ):
            return
        if sum(c.size for c in chunks) > self.config.groups_per_step:
            raise RuntimeError(
                f"step {self.step}'s chunks {[c.groups for c in chunks]} overlap: a bug in "
                "dispatch; nothing was trained twice"
            )
        now = time.perf_counter()
        if self._training is None:  # every chunk staged: the learner waited until now
            generated = max(c.generated_at for c in chunks)
            waited_gen = max(0.0, min(generated, now) - self._free_since)
            self._training = _Training(None, chunks, now, waited_gen, 0.0)
            if self._step_stages is not None:
                staged = [c.staged for c in chunks]
                batch, report = self._stage_task.remote(self._step_stages, staged)
                self._training.step_refs, self._training.step_report = [batch, report], None
                return
        training = self._training
        if training.step_refs and training.step_report is None:
            return  # the step stages are running
        self._check_staleness(chunks)
        refs = [training.step_refs[0]] if training.step_refs else [c.staged for c in chunks]
        training.waited_stages = now - self._free_since - training.waited_generation
        training.started = now
        training.interval = (time.time(), 0.0)
        training.call = self.learner.submit_train(refs)

    def _check_staleness(self, chunks: list[_Chunk]) -> None:
        worst = staleness_of([c.summary for c in chunks], self.version)
        if worst > self.config.max_staleness:
            raise RuntimeError(
                f"a trajectory is {worst} versions stale at step {self.step}, over "
                f"max_staleness={self.config.max_staleness}: a bug in admission control"
            )

    # ----------------------------------------------------------------- events
    def _wait(self, pending: dict[Any, str] | None = None) -> list:
        """The refs that finished (at least one) of ``pending`` (ref -> what it is; by
        default everything in flight), within ``timeout_s``."""

        pending = self._pending() if pending is None else pending
        if not pending:
            raise RuntimeError(
                f"step {self.step} cannot proceed: nothing is generating, staging or "
                f"training (next group {self._next}, admissible below "
                f"{self._admissible_end()})"
            )
        ready, _ = self._wait_killing_hung(list(pending), num_returns=1)
        if not ready:
            waiting = sorted({what for what in pending.values()})
            raise TimeoutError(
                f"nothing finished within {self.config.timeout_s:.0f}s while waiting on "
                f"{', '.join(waiting)} (a hung actor? raise pipeline.timeout_s if legitimate)"
            )
        return ready

    def _wait_killing_hung(self, refs: list, num_returns: int) -> tuple[list, list]:
        """``ray.wait`` for ``num_returns`` of ``refs`` within ``timeout_s``, waking at each
        generator's hang deadline to kill it (its calls then fail: they count as ready)."""
        import ray

        started = time.monotonic()
        while True:
            left = self.config.timeout_s - (time.monotonic() - started)
            wait = max(0.0, min(left, self._generation_deadline() - time.monotonic()))
            ready, rest = ray.wait(refs, num_returns=num_returns, timeout=wait)
            if len(ready) >= num_returns or left <= wait:
                return ready, rest
            self._kill_hung()

    def _generation_timeout(self) -> float:
        return self.config.generation_timeout_s or self.config.timeout_s

    def _generation_deadline(self) -> float:
        """When the first generator with chunks in flight is due to finish one (monotonic)."""
        busy = [
            self._progress[g]
            for g in range(len(self.generators))
            if self._queued[g] and g not in self._lost
        ]
        return min(busy, default=math.inf) + self._generation_timeout()

    def _kill_hung(self) -> None:
        """Kill each generator that has had chunks in flight and finished none for
        generation_timeout_s; its calls then fail and their chunks are redone as a dead
        generator's are (Ray restarts it when it has max_restarts)."""
        import ray

        now = time.monotonic()
        for g in range(len(self.generators)):
            if not self._queued[g] or g in self._lost:
                continue
            if now - self._progress[g] < self._generation_timeout():
                continue
            print(
                f"generator{g} finished no chunk in {self._generation_timeout():.0f}s with "
                f"{self._queued[g]} in flight: taken for hung, killed (Ray restarts it when it "
                "has max_restarts) and its chunks redone (pipeline.generation_timeout_s)",
                flush=True,
            )
            self.failures["pipeline/generators_hung"] += 1
            ray.kill(self.generators[g], no_restart=False)
            self._progress[g] = now  # not killed again while its calls fail

    def _pending(self) -> dict[Any, str]:
        pending = self._chunks_pending(self._chunks.values())
        pending.update(self._targets_pending())
        training = self._training
        if training is not None:
            if training.call is not None:
                pending.update(dict.fromkeys(training.call.refs, f"the learner (step {self.step})"))
            elif training.step_refs and training.step_report is None:
                pending[training.step_refs[1]] = f"the step stages of step {self.step}"
        return pending

    def _chunks_pending(self, chunks: Iterable[_Chunk]) -> dict[Any, str]:
        """The refs of ``chunks`` still generating or staging (or waiting for the weight
        targets to load their version), each with what it is."""
        pending: dict[Any, str] = {}
        for chunk in chunks:
            if chunk.summary is None and chunk.summary_ref is not None:
                pending[chunk.summary_ref] = f"generation of groups {chunk.groups}"
            elif chunk.report_ref is not None and chunk.report is None:
                pending[chunk.report_ref] = f"the stages of groups {chunk.groups}"
            elif chunk in self._waiting:
                pending.update(self._targets_pending())
        return pending

    def _targets_pending(self) -> dict[Any, str]:
        version = self.target_publisher.version
        return dict.fromkeys(
            self.target_publisher.pending_refs(),
            f"the weight targets loading weights version {version}",
        )

    def _handle(self, ready: list) -> None:
        done = set(ready)
        for chunk in list(self._chunks.values()):
            if chunk.summary is None and chunk.summary_ref in done:
                self._on_generated(chunk)
            elif chunk.report is None and chunk.report_ref in done:
                self._on_staged(chunk)
        if done.intersection(self.target_publisher.pending_refs()):
            self._wait_targets()
        training = self._training
        if training is None:
            return
        if training.step_refs and training.step_report is None and training.step_refs[1] in done:
            training.step_report = self._report(training.step_refs[1], f"step {self.step}")
        if training.call is not None and done & set(training.call.refs):
            self._on_trained(training)  # waits for every rank; raises early on a failed one

    def _on_generated(self, chunk: _Chunk) -> None:
        import ray

        g = chunk.generator
        self._queued[g] -= 1
        self._progress[g] = time.monotonic()
        try:
            chunk.summary = ray.get(chunk.summary_ref)
        except actor_lost_errors():  # died, or killed by Ray's memory monitor, mid-call
            self._redo_chunk(chunk, "pipeline/chunks_redone")
            if chunk.epoch == self._epoch[g] and g not in self._lost:  # news of this death
                self._epoch[g] += 1
                self._recover(g)
            return
        if min(chunk.summary["oldest_versions"]) < chunk.min_version:
            # Ray restarted the generator after it was sent the weights, before the driver
            # heard of the death: the chunk ran on base weights. Redo it on current ones.
            self._redo_chunk(chunk, "pipeline/stale_chunks_redone")
            if chunk.epoch == self._epoch[g] and g not in self._lost:
                self._epoch[g] += 1
                self._recover(g)
            return
        self._note_incarnation(chunk)
        chunk.generated_at = time.perf_counter()
        self._start_stages(chunk)

    def _note_incarnation(self, chunk: _Chunk) -> None:
        """Count a generator whose chunk comes from another process than its last one: Ray
        restarted it. Also when its process died between calls (killed by Ray's memory
        monitor while it waited, say), which no call of the driver's saw fail; the chunk
        itself is sound (it passed the version check: its weights were current)."""
        g, incarnation = chunk.generator, chunk.summary.get("incarnation")
        if incarnation is None:  # a generator of another kind: it does not say
            return
        last, self._incarnation[g] = self._incarnation[g], (incarnation, chunk.epoch)
        if last is None or incarnation == last[0]:
            return
        self.failures["pipeline/generator_restarts"] += 1
        if chunk.epoch == last[1]:  # no death handled in between: one nobody saw
            print(
                f"generator{g} was restarted by Ray: its process died between calls (killed "
                "by Ray's memory monitor? see the raylet's log); it had the current weights "
                f"(version >= {chunk.min_version}) when it generated groups {chunk.groups} "
                "(pipeline/generator_restarts)",
                flush=True,
            )

    def _redo_chunk(self, chunk: _Chunk, counter: str) -> None:
        self.failures[counter] += 1
        chunk.generator, chunk.batch, chunk.summary_ref, chunk.summary = -1, None, None, None
        chunk.staged = chunk.report_ref = chunk.report = None
        self._redo.append(chunk)
        self._advance_targets()  # it samples anew: it holds the weight targets back no more

    def _start_stages(self, chunk: _Chunk) -> None:
        """Start the chunk's stages, once the weight targets hold the weights that sampled
        it (or newer ones, for a chunk that was sampled before they could: counted by the
        scorer, ``scorer/turns_on_newer_weights``)."""
        targets = self.target_publisher
        if targets.targets and (
            targets.pending_refs() or chunk.min_version > (targets.version or 0)
        ):
            self._waiting.append(chunk)
            self._advance_targets()
            return
        chunk.staged, chunk.report_ref = self._stage_task.remote(self._stages, [chunk.batch])

    def _advance_targets(self) -> None:
        """Have the weight targets load the oldest weights that sampled a chunk not staged
        yet (the newest published when there is none), unless a load is in flight: never
        newer than any chunk still to stage needs. Chunks made again (``_redo``) sample
        with the weights current when they are sent, so they do not hold the targets back.
        A chunk sampled with weights no longer held (restored from an older checkpoint
        format) gets the oldest newer ones."""
        targets = self.target_publisher
        if not targets.targets or targets.pending_refs():
            return
        held = targets.version or 0
        needed = min(
            (
                c.min_version
                for c in self._chunks.values()
                if c.report is None and c not in self._redo and c.min_version >= held
            ),
            default=self.version,
        )
        if needed > held and (newer := [v for v in self._unloaded if v >= needed]):
            version = min(newer)
            targets.publish(version, self._unloaded[version])
            self._unloaded = {v: w for v, w in self._unloaded.items() if v > version}

    def _wait_targets(self) -> None:
        """Wait for the weight targets' load in flight (a target that died is brought back
        on these weights), then start the stages of the chunks that waited for it."""
        from ray_credit.pipeline.weights import WeightSyncError

        if self.target_publisher.pending_refs():
            try:
                self.target_publisher.wait()
            except WeightSyncError as err:
                if not err.only_deaths:
                    raise  # a version refused, or no answer
                for i in err.died:
                    self._recover_target(i)
        waiting, self._waiting = self._waiting, []
        for chunk in waiting:
            self._start_stages(chunk)
        self._advance_targets()

    def _on_staged(self, chunk: _Chunk) -> None:
        import ray

        try:
            chunk.report = ray.get(chunk.report_ref)
        except ray.exceptions.RayTaskError as err:
            # the task's other return holds the same error, handled here: read, so that
            # Ray does not log it as never handled
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(chunk.staged)
            if isinstance(err.cause, ray.exceptions.ObjectLostError):
                # the batch went with its node (the generator's): generate it again
                self._redo_chunk(chunk, "pipeline/chunks_lost")
                return
            target = self._target_index.get(getattr(err.cause, "actor_id", None))
            if target is not None:  # StageError names the actor whose death failed it
                # the scorer died under the stage: once it is back on the current
                # weights, the chunk's stages run again (the batch is still there)
                self._recover_target(target)
                self.failures["pipeline/stages_redone"] += 1
                chunk.staged = chunk.report_ref = chunk.report = None
                self._start_stages(chunk)
                return
            raise self._stage_error(err, f"groups {chunk.groups}") from err
        self._advance_targets()  # maybe the last chunk sampled with the targets' weights

    def _report(self, ref: Any, what: str) -> dict:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:
            raise self._stage_error(err, what) from err

    @staticmethod
    def _stage_error(err: Exception, what: str) -> StageError:
        cause = getattr(err, "cause", None)
        return StageError(
            f"the stages of {what} failed: {cause if isinstance(cause, StageError) else err}"
        )

    def _on_trained(self, training: _Training) -> None:
        metrics = training.call.result(timeout=self.config.timeout_s)
        now = time.perf_counter()
        training.interval = (training.interval[0], time.time())
        out = self._step_metrics(training)
        out.update(metrics)
        out.update(self._memory_metrics())
        train_s = now - training.started
        out["time/train_s"] = train_s
        out["speed/train_tokens_per_s"] = out["train/tokens"] / max(train_s, 1e-9)
        first = self.step * self.config.groups_per_step
        for chunk in training.chunks:
            del self._chunks[chunk.start]
        self.trained_groups.extend(range(first, first + self.config.groups_per_step))
        self.version += 1
        self.step += 1
        self._training = None
        self._trained_intervals = [
            *self._trained_intervals[-(self.config.max_staleness + 2) :],
            training.interval,
        ]
        t0 = time.perf_counter()
        self._wait_publication()  # the last one: the part of its transfer not hidden
        t1 = time.perf_counter()  # behind this update
        self._publish()
        out["time/wait_publication_s"] = t1 - t0
        out["time/publish_submit_s"] = time.perf_counter() - t1
        out.update(self._sync_metrics())
        out.update(self.failures)
        # the checkpoint written after the last step (its seconds are in this step's)
        out["time/checkpoint_s"], self._checkpoint_s = self._checkpoint_s, 0.0
        self._dispatch()  # the new version admits more groups: start them first
        out.update(
            {
                "pipeline/step": float(self.step),
                "pipeline/policy_version": float(self.version),
                "pipeline/groups_trained": float(len(self.trained_groups)),
                "pipeline/groups_ahead": float(sum(c.size for c in self._chunks.values())),
                "time/step_s": time.perf_counter() - self._step_ended,
            }
        )
        self._step_ended = time.perf_counter()
        self.history.append(out)
        if self.on_step is not None:
            self.on_step(out)
        cfg = self.config
        if cfg.checkpoint_dir and (
            self.step == cfg.steps
            or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
        ):
            t0 = time.perf_counter()
            self.save(cfg.checkpoint_dir)
            self._checkpoint_s = time.perf_counter() - t0  # reported with the next step
        self._free_since = time.perf_counter()  # the learner's next wait starts now

    def _memory_metrics(self) -> dict[str, float]:
        """``memory/*`` in GiB (docs/metrics.md): the driver, the services' latest answers,
        Ray's own processes and the node's use, on the driver's node. The learner's and
        the generators' come with their updates and chunks."""
        import ray

        out = {}
        driver = memory_report(self._memory)
        if driver is not None:
            out["memory/driver_rss_gb"] = driver["rss_gb"]
            out["memory/driver_peak_gb"] = driver["peak_gb"]
        for role, actors in self.services.items():
            asked = self._memory_asked.get(role)
            if asked is not None:
                done, _ = ray.wait(asked, num_returns=len(asked), timeout=0, fetch_local=True)
                if len(done) == len(asked):
                    del self._memory_asked[role]
                    reports = [r for r in _memory_answers(done) if r is not None]
                    if reports:  # the largest process of the role
                        out[f"memory/{role}_rss_gb"] = max(r["rss_gb"] for r in reports)
                        out[f"memory/{role}_peak_gb"] = max(r["peak_gb"] for r in reports)
            if role not in self._memory_asked:
                self._memory_asked[role] = [actor.memory.remote() for actor in actors]
        if self._session_dir is not None:
            held = ray_processes_gb(self._session_dir)
            if held is not None:
                out["memory/ray_gb"] = held
        node = node_memory()
        if node is not None:
            out["memory/node_used_gb"] = node["used"]
            out["memory/node_total_gb"] = node["total"]
            out["memory/node_shared_gb"] = node["shared"]
        return out

    def _step_metrics(self, training: _Training) -> dict[str, float]:
        """The step's combined metrics and where the learner's time went (module docstring)."""
        chunks = training.chunks
        reports = [c.report for c in chunks]
        if training.step_report is not None:
            reports.append(training.step_report)
        out = step_metrics(
            [c.summary for c in chunks],
            reports,
            version=self.version,
            max_staleness=self.config.max_staleness,
            outcome_from=training.step_report,
        )
        intervals = [r["interval"] for r in reports]
        out.update(
            {
                "time/wait_generation_s": training.waited_generation,
                "time/wait_stages_s": training.waited_stages,
                "time/stages_s": sum(end - start for start, end in intervals),
                "time/stages_hidden_s": sum(
                    _overlap(interval, self._trained_intervals) for interval in intervals
                ),
            }
        )
        for key in [k for k in out if k.startswith("time/stage_")]:
            name = key.removeprefix("time/stage_").removesuffix("_s")
            out[f"speed/stage_{name}_tokens_per_s"] = out["train/tokens"] / max(out[key], 1e-9)
        return out

    # ----------------------------------------------------------------- failures
    def _recover(self, g: int) -> None:
        """Generator ``g`` died: once Ray has restarted it, bring it to the current weights
        (it then takes work again); if it is gone for good, drop it."""
        import ray

        from ray_credit.pipeline.weights import WeightSyncError

        self.failures["pipeline/generator_failures"] += 1
        try:
            self._bring_current(self.publisher, g)
            self._progress[g] = time.monotonic()  # its restart is not time spent hung
        except (ray.exceptions.RayActorError, WeightSyncError, TimeoutError):
            ray.kill(self.generators[g], no_restart=True)  # never half-alive in the pool
            self._lost.add(g)
            self.publisher.drop(g)
            self.failures["pipeline/generators_lost"] += 1
            if len(self._lost) == len(self.generators):
                raise RuntimeError(
                    f"all {len(self.generators)} generators died; see their logs (OOM? a "
                    "crash?) and give them max_restarts"
                ) from None

    def _recover_target(self, index: int) -> None:
        """Weight target ``index`` (the scorer) died: wait until Ray has restarted it and
        re-send the current weights. The run cannot go on without it (its signal would be
        missing from every later chunk), so one gone for good stops the run, named."""
        import ray

        from ray_credit.pipeline.weights import WeightSyncError

        name = self.target_publisher.names[index]
        self.failures["pipeline/weight_target_failures"] += 1
        try:
            self._bring_current(self.target_publisher, index)
        except (ray.exceptions.RayActorError, WeightSyncError, TimeoutError) as err:
            raise RuntimeError(
                f"{name} (a weight target: the info-gain scorer) died and did not come back "
                f"({type(err).__name__}: {err}); give it restarts "
                "(resources.generator_max_restarts) or see its log (OOM? a crash?)"
            ) from err

    def _start_on_the_learners_weights(self) -> None:
        """Bring every weight target to the learner's policy version before the first chunk.

        Fresh actors hold the base weights as version 0: a resumed learner's weights are
        published to them and waited for (the chunks the checkpoint buffered are scored at
        once). Actors that served an earlier run on this learner (a script that
        trains in phases on the same actors) hold its version already: the run goes on
        with them, and one of them found back on older weights is sent the learner's.
        Actors ahead of the learner served another learner: refused, by name, since
        their turns would be labelled with versions this learner never had.
        """
        publishers = (self.publisher, self.target_publisher)
        actors = [(p, i) for p in publishers for i in range(len(p.targets))]
        versions = [self._await_actor(p.targets[i], p.names[i]) for p, i in actors]
        ahead = [
            f"{p.names[i]} (version {v})"
            for (p, i), v in zip(actors, versions, strict=True)
            if v > self.version
        ]
        if ahead:
            raise ValueError(
                f"{', '.join(ahead)} ahead of the learner's policy version {self.version}: "
                "they hold weights of another learner's run. Give this run new generators "
                "(make_generator_actor), or the learner they trained with"
            )
        behind = [a for a, v in zip(actors, versions, strict=True) if v < self.version]
        if len(behind) == len(actors):  # a resumed learner's weights, to fresh actors
            self._publish()
            # in place before the first chunk: the chunks the checkpoint buffered, sampled
            # with these weights, go to the scorer's stage at once (a generator that died
            # meanwhile is recovered, as during the run)
            self._wait_publication()
            self._wait_targets()
            return
        if self.version == 0:  # fresh actors, a fresh learner
            return
        # the actors go on from an earlier run on this learner: nothing to send to them
        weights = (
            None
            if self.publisher.sends_itself
            else self.learner.weights(dtype=self._publication_dtype())
        )
        for publisher in publishers:
            publisher.adopt(self.version, weights if publisher.targets else None)
        for publisher, i in behind:  # Ray restarted it after that run's last publication
            publisher.resync(i)

    def _publish(self) -> None:
        import ray

        self._epoch_published = list(self._epoch)
        if self.publisher.sends_itself:
            self.publisher.publish(self.version, None)
            return
        weights = self.learner.weights(dtype=self._publication_dtype())
        if not isinstance(weights, ray.ObjectRef):  # once in the object store, for both
            weights = ray.put(weights)
        self.publisher.publish(self.version, weights)
        if self.target_publisher.targets:
            self._unloaded[self.version] = weights
            self._advance_targets()

    def _publication_dtype(self) -> str | None:
        """The dtype every generator and weight target holds its weights in, when they
        agree on one narrower than float32 (asked once: a bf16 generator's publications
        then travel at half the size); None: the learner's float32."""
        if self._weights_dtype is _UNASKED:
            from ray_credit.pipeline.weights import publication_dtype

            actors = [*self.generators, *self.target_publisher.targets]
            self._weights_dtype = publication_dtype(actors, self.config.timeout_s)
        return self._weights_dtype

    def _sync_metrics(self) -> dict[str, float]:
        """Running totals of weight transfers: the generators' publications, the weight
        targets' loads, and the re-sends to a restarted actor of either kind."""
        generators, targets = self.publisher.metrics, self.target_publisher.metrics
        return {
            "sync/publications": generators["sync/publications"],
            "sync/target_loads": targets["sync/publications"],
            "sync/resyncs": generators["sync/resyncs"] + targets["sync/resyncs"],
        }

    def _bring_current(self, publisher: Any, index: int) -> None:
        """``publisher``'s target ``index`` (a generator, or a weight target) once it
        answers, re-sent the last weights published to it when it is back on older ones
        (Ray restarted it on the base model)."""
        version = self._await_actor(publisher.targets[index], publisher.names[index])
        published = publisher.version
        if published is not None and version < published:
            publisher.resync(index)

    def _await_actor(self, actor: Any, name: str) -> int:
        """``actor``'s policy version once it answers (Ray restarted it and its model
        loaded, or it never died: a transient error); ``ActorDiedError`` if it is gone for
        good, ``TimeoutError`` if it does not answer within ``timeout_s``."""
        import ray

        deadline = time.monotonic() + self.config.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{name} did not come back within {self.config.timeout_s:.0f}s")
            try:
                return ray.get(actor.get_policy_version.remote(), timeout=left)
            except ray.exceptions.ActorUnavailableError:  # restarting: not reachable yet
                time.sleep(0.5)
            except ray.exceptions.GetTimeoutError as err:
                raise TimeoutError(f"{name} did not answer: {err}") from err

    def _wait_publication(self) -> None:
        """Wait for the weight publication in flight; a generator that died meanwhile is
        recovered (through its failed call when one is running, else here)."""
        from ray_credit.pipeline.weights import WeightSyncError

        # A hung generator answers its update_weights only after its stuck generate call:
        # kill it at its deadline, so that the publication sees a death.
        refs = self.publisher.pending_refs()
        if refs:
            self._wait_killing_hung(refs, num_returns=len(refs))
        try:
            self.publisher.wait()
        except WeightSyncError as err:
            if not err.only_deaths:  # the learner's side, or not a death
                raise
            for i in err.died:
                if (
                    not self._queued[i]  # no call of its own to fail
                    and i not in self._lost
                    # a death after the weights were sent, not one already handled (its
                    # failed call was the news: the update went to the process it killed)
                    and self._epoch[i] == self._epoch_published[i]
                ):
                    self._epoch[i] += 1
                    self._recover(i)

    # ----------------------------------------------------------------- checkpoints
    def save(self, folder: str | os.PathLike | StoragePath) -> StoragePath:
        """Learner state, data cursor and every generated chunk not trained yet, staged
        when its stages have run, in ``folder/step_NNNNNN`` (called between steps: the
        learner is idle); then only the newest ``keep_checkpoints`` are kept. ``folder``: a
        path (made absolute here, so workers in other working directories write to the
        same place) or a URI (see :mod:`ray_credit.pipeline.checkpointing`). Returns the
        step's folder.

        A run resumed from it trains on what this run would have: the chunks sampled with
        weights older than the learner's are waited for, generated and staged, and kept
        (a resumed run has only the learner's weights, so it could neither sample them nor
        score them as this run does); those sampled with the learner's weights may still
        be in flight, since the resumed run makes them again the same way (the same
        weights, and each chunk's seed from its place)."""
        import ray

        root = StoragePath(folder)
        staging = begin_save(root, self.step)
        self.learner.save(staging / LEARNER_DIR)  # rank 0 writes (uploads) its part there
        self._settle_older_chunks()
        done = [c for c in self._chunks.values() if c.summary is not None]
        if done:  # the batches are written by tasks: the driver never holds one
            write = ray.remote(_write_chunk).options(
                num_cpus=0, scheduling_strategy=_on_this_node()
            )
            writes = [write.remote(_buffered(staging, c, ".arrow"), [_kept_batch(c)]) for c in done]
            ray.get(writes, timeout=self.config.timeout_s)
            for c in done:
                oldest = list(c.summary["oldest_versions"].items())
                record = {**c.summary, "oldest_versions": oldest}
                if c.report is not None:  # kept staged: its stages do not run again
                    record[_STAGED_REPORT] = c.report
                _buffered(staging, c, ".json").write_text(json.dumps(record))
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "policy_version": self.version,
            "groups_per_step": self.config.groups_per_step,
            "seed": self.config.seed,
            "num_questions": len(self.questions),
            "buffered": [[c.start, c.size] for c in done],
            # the running totals of faults and weight publications, so that a resumed
            # run's rows go on counting from where this one stopped
            "counters": {**self.failures, **self._sync_metrics()},
            # the last learner calls (wall clock): a kept chunk's stages ran beside them
            "trained_intervals": self._trained_intervals,
            "config": asdict(self.config),
            "metadata": self.metadata,
        }
        return end_save(root, self.step, state, keep=self.config.keep_checkpoints)

    def _settle_older_chunks(self) -> None:
        """Wait until no chunk sampled with weights older than the learner's is generating
        or staging, handling each chunk event meanwhile as the loop does (a generator lost
        under one sends it to be made again on the current weights, as it would be
        anyway). Nothing new is dispatched, and the learner is idle."""
        while pending := self._chunks_pending(
            c for c in self._chunks.values() if c.min_version < self.version
        ):
            self._handle(self._wait(pending))

    def _restore(self, folder: str | os.PathLike | StoragePath) -> None:
        import ray

        folder = resolve_checkpoint(folder)
        state = checkpoint_state(folder)
        path = folder / STATE_FILE
        if state.get("format") not in (2, CHECKPOINT_FORMAT):
            raise ValueError(
                f"{path} has checkpoint format {state.get('format')}, this version reads 2 "
                f"and {CHECKPOINT_FORMAT}; "
                "resume with the ray_credit version that wrote it"
            )
        cfg = self.config
        for key, mine in (
            ("groups_per_step", cfg.groups_per_step),
            ("seed", cfg.seed),
            ("num_questions", len(self.questions)),
            ("stratify_by", cfg.stratify_by),
        ):
            if state.get(key, state.get("config", {}).get(key)) != mine:
                raise ValueError(
                    f"checkpoint {folder} was written with {key}={state.get(key)}, this run has "
                    f"{key}={mine}; resume with the same data and settings"
                )
        if state["policy_version"] != self.version:
            raise ValueError(
                f"checkpoint {folder} is at policy version {state['policy_version']} but the "
                f"learner is at {self.version}: build the learner with resume_from={folder}/"
                f"{LEARNER_DIR}"
            )
        self.step = int(state["step"])
        counters = state.get("counters", {})  # none in a checkpoint from before they were
        for totals in (self.failures, self.publisher.metrics):
            for key in totals:
                totals[key] = float(counters.get(key, 0.0))
        loads = float(counters.get("sync/target_loads", 0.0))
        self.target_publisher.metrics["sync/publications"] = loads
        self._trained_intervals = [tuple(i) for i in state.get("trained_intervals", [])]
        self.trained_groups = list(range(self.step * cfg.groups_per_step))
        self._next = self.step * cfg.groups_per_step
        read = ray.remote(_read_chunk).options(num_cpus=0, scheduling_strategy=_on_this_node())
        for start, size in state["buffered"]:
            chunk = _Chunk(start, size)
            summary_file = _buffered(folder, chunk, ".json")
            try:
                summary = json.loads(summary_file.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(
                    f"buffered chunk summary {summary_file} is unreadable: {err}"
                ) from err
            summary["oldest_versions"] = {int(v): n for v, n in summary["oldest_versions"]}
            chunk.min_version = min(summary["oldest_versions"], default=0)  # sampled with
            report = summary.pop(_STAGED_REPORT, None)
            batch_file = _buffered(folder, chunk, ".arrow")
            if not batch_file.is_file():
                raise ValueError(f"buffered trajectories {batch_file} are missing")
            chunk.batch, chunk.summary = read.remote(batch_file), summary
            if report is not None:  # staged by the run that wrote it, with its weights
                chunk.staged, chunk.report = chunk.batch, report
            self._chunks[start] = chunk


def _overlap(span: tuple[float, float], spans: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``span`` inside any of ``spans`` (which do not overlap each other)."""
    return sum(max(0.0, min(span[1], end) - max(span[0], start)) for start, end in spans)


def _on_this_node() -> Any:
    """A scheduling strategy that keeps a task on the driver's node (checkpoint files)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def _memory_answers(refs: Sequence[Any]) -> list[dict | None]:
    """The services' ``memory()`` answers; a service that died or failed meanwhile gives
    none (its death is handled where its work is: the generators retry the retriever)."""
    import ray

    answers = []
    for ref in refs:
        try:
            answers.append(ray.get(ref))
        except (*actor_lost_errors(), ray.exceptions.RayTaskError):
            answers.append(None)
    return answers


def _session_dir() -> str | None:
    """The Ray session's folder (Ray's own processes name it), None without one."""
    import ray

    node = ray._private.worker._global_node  # the only handle on the session's folder
    return None if node is None else node.get_session_dir_path()
