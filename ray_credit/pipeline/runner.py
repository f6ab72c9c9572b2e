"""The asynchronous training loop: generators run ahead of the learner, within a hard
staleness bound, through the object store.

Data. The training questions form an endless stream: epoch ``e`` is a seeded
permutation of the question list, and group ``i`` of the stream is one question rolled
out ``G`` times. Step ``k`` trains exactly groups ``[k*B, (k+1)*B)`` (``B`` =
``groups_per_step``), in stream order whatever order generations finish in, so a run is
a pure function of its seed and a checkpoint's data cursor is one integer.

Admission control (DESIGN.md section 6). Groups are dispatched to idle generators in
chunks of ``chunk_groups``; a chunk whose last group is ``j`` starts only while
``j < (max_staleness + version + 1) * B``, ``version`` being the learner's. Group ``j``
is trained at step ``j // B`` and was generated with weights of version ``>= version at
dispatch``, so its staleness at training is at most ``max_staleness``: a hard bound that
the loop also checks on every trajectory (per-turn version tags) and raises on, rather
than trusting arithmetic. ``max_staleness = 0`` is synchronous on-policy training.
Nothing is discarded: admission delays a group instead.

Failures. A generator whose process dies loses its call, not the run: the chunk goes
back to the front of the queue for the next idle generator. Ray restarts the actor when
it was made with ``max_restarts`` (it comes back on the base weights, so the current ones
are re-sent before it gets work); one that is gone for good leaves the pool, and the run
goes on with the others. Every such event is counted (``pipeline/generator_failures``,
``pipeline/generators_lost``, ``pipeline/chunks_redone``, ``sync/resyncs``). The
retriever and the judges retry their own calls (see the generator and the judge pool).

Backpressure. At most ``(max_staleness + 1) * B`` groups exist beyond the trained
ones (in flight or buffered), each generator runs one chunk at a time, the weight
publisher has one publication in flight. Every wait has a timeout.

Stages. ``stages`` is a list of callables ``batch -> batch`` run in order on every
training batch before the learner (judge, info-gain scorer, estimator, any user
function); :func:`actor_stage` wraps an actor method. Each stage's seconds are in the
metrics.

Checkpoints. :meth:`Pipeline.save` writes the learner (model, optimizer, scheduler, RNG,
version) and ``pipeline.json`` (step, seed, data cursor) with every generated chunk that
is not trained yet (Arrow IPC). :meth:`Pipeline.run` resumed from it regenerates only the
chunks that were in flight, so no group is lost or trained twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_credit.actors.generator import COUNTERS
from ray_credit.batch import TrajectoryBatch

__all__ = ["Pipeline", "PipelineConfig", "actor_stage", "estimator_stage"]

_STATE_FILE = "pipeline.json"
_BUFFER_DIR = "buffer"


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
    """Groups per generate call (default: ``groups_per_step`` split evenly over the
    generators, at least 1)."""
    seed: int = 0
    """Seed of the question order."""
    timeout_s: float = 1800.0
    """Longest wait for one generate call, stage, learner update or weight publication."""
    checkpoint_every: int = 0
    """Save every this many steps into ``checkpoint_dir`` (0: only at the end)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (None: no checkpoints)."""
    weight_sync: str = "object_store"
    """How weights reach the generators: 'object_store' (everywhere; survives generator
    restarts), 'nccl' (a broadcast between GPUs) or 'gloo' (the same broadcast on CPUs)."""

    def __post_init__(self) -> None:
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
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.weight_sync not in ("object_store", "nccl", "gloo"):
            raise ValueError(
                f"weight_sync must be 'object_store', 'nccl' or 'gloo', got {self.weight_sync!r}"
            )


def actor_stage(method: Any, *, name: str | None = None, timeout_s: float = 1800.0) -> Callable:
    """A stage that calls an actor method (``actor.score``) on the batch and waits for it."""

    def stage(batch: TrajectoryBatch) -> TrajectoryBatch:
        import ray

        return ray.get(method.remote(batch), timeout=timeout_s)

    stage.__name__ = name or getattr(method, "_method_name", "actor_stage")
    return stage


def estimator_stage(estimator: str | Callable, **params: Any) -> Callable:
    """A stage that runs a registered estimator (by name) or an ``Estimator`` object."""
    from ray_credit.estimators import get_estimator

    est = get_estimator(estimator) if isinstance(estimator, str) else estimator

    def stage(batch: TrajectoryBatch) -> TrajectoryBatch:
        return est(batch, **params)

    stage.__name__ = f"estimator_{getattr(est, 'name', 'custom')}"
    return stage


@dataclass
class _Chunk:
    start: int  # stream index of its first group
    size: int
    generator: int
    ref: Any = None
    dispatched_version: int = 0
    dispatched_at: float = 0.0
    batch: TrajectoryBatch | None = None


class Pipeline:
    """Generators ahead of a learner, stages in between, weights published back.

    Args:
        generators: generator actor handles (``generate(questions)`` ->
            ``TrajectoryBatch``, ``update_weights(version, weights)``).
        learner: a :class:`~ray_credit.actors.learner_group.LearnerGroup` (or anything
            with ``train(batch) -> metrics``, ``weights()``, ``save(folder)`` and
            ``policy_version``).
        questions: the training questions (mappings as ``Generator.generate`` takes).
        stages: callables ``batch -> batch`` run in order before the learner; the last
            must leave ``turn_advantages`` on the batch.
        config: :class:`PipelineConfig`.
        weight_targets: more actors to publish weights to (an info-gain scorer).
        resume_from: a checkpoint folder written by :meth:`save` (the learner must have
            been built from the same folder: ``LearnerGroup(resume_from=...)``).
        on_step: called with each step's metrics dict (progress display, loggers).
    """

    def __init__(
        self,
        generators: Sequence[Any],
        learner: Any,
        questions: Sequence[Mapping[str, Any]],
        stages: Sequence[Callable[[TrajectoryBatch], TrajectoryBatch]],
        config: PipelineConfig | None = None,
        *,
        weight_targets: Sequence[Any] = (),
        resume_from: str | os.PathLike | None = None,
        on_step: Callable[[dict[str, float]], None] | None = None,
    ):
        from ray_credit.pipeline.weights import CollectivePublisher, WeightPublisher

        if not generators:
            raise ValueError("Pipeline needs at least one generator actor")
        if not questions:
            raise ValueError("Pipeline needs at least one training question")
        self.config = config or PipelineConfig()
        self.generators = list(generators)
        self.learner = learner
        self.questions = list(questions)
        self.stages = list(stages)
        self.on_step = on_step
        cfg = self.config
        self.chunk = cfg.chunk_groups or max(1, math.ceil(cfg.groups_per_step / len(generators)))
        targets = [*self.generators, *weight_targets]
        names = [f"generator{i}" for i in range(len(self.generators))] + [
            f"target{i}" for i in range(len(weight_targets))
        ]
        if cfg.weight_sync != "object_store" and weight_targets:
            raise ValueError(
                f"weight_sync={cfg.weight_sync!r} broadcasts to generators only; the weight "
                "targets (an info-gain scorer) load through the object store: use "
                "weight_sync='object_store' with them"
            )
        if cfg.weight_sync == "object_store":
            self.publisher = WeightPublisher(targets, timeout_s=cfg.timeout_s, names=names)
        else:
            self.publisher = CollectivePublisher(
                targets, learner, backend=cfg.weight_sync, timeout_s=cfg.timeout_s, names=names
            )
        self.step = 0
        self.version = int(learner.policy_version)
        self._next = 0  # stream index of the next group to dispatch
        self._chunks: dict[int, _Chunk] = {}  # by start index: in flight or done, not trained
        self._idle = list(range(len(self.generators)))
        self._redo: list[_Chunk] = []  # lost with their generator, to dispatch first
        self._lost: set[int] = set()
        self.failures = {
            "pipeline/generator_failures": 0.0,
            "pipeline/generators_lost": 0.0,
            "pipeline/chunks_redone": 0.0,
        }
        self._orders: dict[int, np.ndarray] = {}
        self.history: list[dict[str, float]] = []
        self.trained_groups: list[int] = []  # stream indices trained, in order (for checks)
        if resume_from is not None:
            self._restore(Path(resume_from))
        if self.version > 0:  # resumed: generators start from the base weights
            self._publish()

    # ----------------------------------------------------------------- data stream
    def question_at(self, index: int) -> Mapping[str, Any]:
        n = len(self.questions)
        epoch, pos = divmod(index, n)
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.config.seed, epoch]).permutation(n)
        return self.questions[int(self._orders[epoch][pos])]

    # ----------------------------------------------------------------- the loop
    def run(self) -> list[dict[str, float]]:
        """Train until ``config.steps`` steps are done; return every step's metrics."""
        cfg = self.config
        while self.step < cfg.steps:
            started = time.perf_counter()
            waited = self._fill_step()
            metrics = self._train_step(waited, started)
            self.history.append(metrics)
            if self.on_step is not None:
                self.on_step(metrics)
            if cfg.checkpoint_dir and (
                self.step == cfg.steps
                or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
            ):
                self.save(cfg.checkpoint_dir)
        self._wait_publication()
        return self.history

    def _admissible_end(self) -> int:
        """Stream index below which groups may be dispatched now."""
        cfg = self.config
        return (cfg.max_staleness + self.version + 1) * cfg.groups_per_step

    def _submit(self, chunk: _Chunk, g: int) -> None:
        questions = [self.question_at(i) for i in range(chunk.start, chunk.start + chunk.size)]
        chunk.generator, chunk.dispatched_version = g, self.version
        chunk.ref = self.generators[g].generate.remote(questions)
        chunk.dispatched_at = time.perf_counter()

    def _dispatch(self) -> None:
        while self._idle and self._redo:  # admitted already: versions only move forward
            chunk = self._redo.pop(0)
            self._submit(chunk, self._idle.pop(0))
            self.failures["pipeline/chunks_redone"] += 1
        limit = self._admissible_end()
        while self._idle:
            while self._next in self._chunks:  # restored from a checkpoint: already generated
                self._next += self._chunks[self._next].size
            if self._next >= limit:
                return
            step_end = (self._next // self.config.groups_per_step + 1) * self.config.groups_per_step
            size = min(self.chunk, limit - self._next, step_end - self._next)  # never straddles
            chunk = _Chunk(self._next, size, -1)
            self._submit(chunk, self._idle.pop(0))
            self._chunks[chunk.start] = chunk
            self._next += size

    def _fill_step(self) -> float:
        """Dispatch and collect until the next step's groups are all generated; return the
        seconds spent waiting on generation."""
        import ray

        cfg = self.config
        first, end = self.step * cfg.groups_per_step, (self.step + 1) * cfg.groups_per_step
        waited = 0.0
        while True:
            self._dispatch()
            needed = [c for s, c in sorted(self._chunks.items()) if s < end and s >= first]
            covered = sum(c.size for c in needed if c.batch is not None)
            if covered >= end - first:
                return waited
            running = {
                c.ref: c for c in self._chunks.values() if c.batch is None and c.ref is not None
            }
            if not running:  # (all generators lost already raised in _recover)
                raise RuntimeError(
                    f"step {self.step} needs groups [{first}, {end}) but nothing is generating "
                    f"them (next={self._next}, admissible below {self._admissible_end()})"
                )
            t0 = time.perf_counter()
            ready, _ = ray.wait(list(running), num_returns=1, timeout=cfg.timeout_s)
            waited += time.perf_counter() - t0
            if not ready:
                raise TimeoutError(
                    f"no generator finished a chunk within {cfg.timeout_s:.0f}s "
                    f"({len(running)} chunks running)"
                )
            for ref in ready:
                chunk = running[ref]
                chunk.ref = None
                try:
                    chunk.batch = ray.get(ref)
                except ray.exceptions.RayActorError:
                    g, chunk.generator = chunk.generator, -1
                    self._redo.append(chunk)
                    self._recover(g)
                    continue
                self._idle.append(chunk.generator)

    # ----------------------------------------------------------------- failures
    def _recover(self, g: int) -> None:
        """Generator ``g`` died: once Ray has restarted it, bring it to the current weights
        and back to the idle pool; if it is gone for good, drop it."""
        import ray

        from ray_credit.pipeline.weights import WeightSyncError

        self.failures["pipeline/generator_failures"] += 1
        try:
            version = self._await_restart(g)
            published = self.publisher.version
            if published is not None and version < published:  # back on older weights
                self.publisher.resync(g)
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
            return
        self._idle.append(g)

    def _publish(self) -> None:
        sends_itself = self.publisher.sends_itself
        self.publisher.publish(self.version, None if sends_itself else self.learner.weights())

    def _await_restart(self, g: int) -> int:
        """Generator ``g``'s policy version once it answers (Ray restarted it and its model
        loaded, or it never died: a transient error); ``ActorDiedError`` if it is gone for
        good, ``TimeoutError`` if it does not answer within ``timeout_s``."""
        import ray

        deadline = time.monotonic() + self.config.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"generator{g} did not come back within {self.config.timeout_s:.0f}s"
                )
            try:
                return ray.get(self.generators[g].get_policy_version.remote(), timeout=left)
            except ray.exceptions.ActorUnavailableError:  # restarting: not reachable yet
                time.sleep(0.5)
            except ray.exceptions.GetTimeoutError as err:
                raise TimeoutError(f"generator{g} did not answer: {err}") from err

    def _wait_publication(self) -> None:
        """Wait for the weight publication in flight; a generator that died meanwhile is
        recovered (through its failed call when one is running, else here)."""
        from ray_credit.pipeline.weights import WeightSyncError

        try:
            self.publisher.wait()
        except WeightSyncError as err:
            undead = {i for i, _ in err.failed} - set(err.died)
            strangers = {i for i in err.died if i >= len(self.generators)}
            if not err.died or undead or strangers:  # the learner's side, or not a death
                raise
            busy = {c.generator for c in self._chunks.values() if c.ref is not None}
            for g in err.died:
                if g not in busy and g not in self._lost:
                    if g in self._idle:
                        self._idle.remove(g)
                    self._recover(g)

    def _train_step(self, waited: float, started: float) -> dict[str, float]:
        cfg = self.config
        first, end = self.step * cfg.groups_per_step, (self.step + 1) * cfg.groups_per_step
        chunks = [self._chunks.pop(s) for s in sorted(self._chunks) if first <= s < end]
        if sum(c.size for c in chunks) != end - first or chunks[0].start != first:
            raise RuntimeError(f"step {self.step}: chunks do not tile groups [{first}, {end})")
        batches = [c.batch for c in chunks]
        batch = TrajectoryBatch.concat(batches)
        tokens = float(batch.token_offsets[-1]) if "input_ids" in batch.column_names else 0.0
        metrics: dict[str, float] = _generation_metrics(batches)
        metrics.update(self._staleness(batch))
        for stage in self.stages:
            t0 = time.perf_counter()
            batch = stage(batch)
            seconds = time.perf_counter() - t0
            metrics[f"time/stage_{stage.__name__}_s"] = seconds
            metrics[f"speed/stage_{stage.__name__}_tokens_per_s"] = tokens / max(seconds, 1e-9)
            metrics.update({k: v for k, v in batch.metrics.items() if not k.startswith("gen/")})
        t0 = time.perf_counter()
        metrics.update(self.learner.train(batch))
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics["speed/train_tokens_per_s"] = tokens / max(metrics["time/train_s"], 1e-9)
        self.version += 1
        self.step += 1
        self.trained_groups.extend(range(first, end))
        t0 = time.perf_counter()
        self._wait_publication()
        self._publish()
        metrics["time/publish_submit_s"] = time.perf_counter() - t0
        metrics.update(self.publisher.metrics)
        metrics.update(self.failures)
        self._dispatch()  # the new version admits more groups: start them before returning
        step_s = time.perf_counter() - started
        metrics.update(
            {
                "pipeline/step": float(self.step),
                "pipeline/policy_version": float(self.version),
                "pipeline/groups_trained": float(len(self.trained_groups)),
                "pipeline/groups_ahead": float(sum(c.size for c in self._chunks.values())),
                "time/wait_generation_s": waited,
                "time/step_s": step_s,
                **_outcome_metrics(batch),
                **_judge_agreement(batch),
            }
        )
        return metrics

    def _staleness(self, batch: TrajectoryBatch) -> dict[str, float]:
        versions = np.array(
            [
                min((t["policy_version"] for t in turns), default=self.version)
                for turns in batch.column("turns").to_pylist()
            ],
            dtype=np.int64,
        )
        staleness = self.version - versions
        worst = int(staleness.max()) if len(staleness) else 0
        if worst > self.config.max_staleness:
            raise RuntimeError(
                f"a trajectory is {worst} versions stale at step {self.step}, over "
                f"max_staleness={self.config.max_staleness}: a bug in admission control"
            )
        out = {
            f"staleness/{k}": float((staleness == k).sum())
            for k in range(self.config.max_staleness + 1)
        }
        out["staleness/max"] = float(worst)
        out["staleness/mean"] = float(staleness.mean()) if len(staleness) else 0.0
        return out

    # ----------------------------------------------------------------- checkpoints
    def save(self, folder: str | os.PathLike) -> Path:
        """Learner state, data cursor and every generated chunk not trained yet."""
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        if tmp.exists():
            _rmtree(tmp)
        (tmp / _BUFFER_DIR).mkdir(parents=True)
        self._wait_publication()
        self.learner.save(str(tmp / "learner"))
        done = [c for c in self._chunks.values() if c.batch is not None]
        for c in done:
            (tmp / _BUFFER_DIR / f"{c.start:09d}_{c.size}.arrow").write_bytes(
                c.batch.to_ipc().to_pybytes()
            )
        state = {
            "format": 1,
            "step": self.step,
            "policy_version": self.version,
            "groups_per_step": self.config.groups_per_step,
            "seed": self.config.seed,
            "num_questions": len(self.questions),
            "buffered": [[c.start, c.size] for c in done],
            "config": asdict(self.config),
        }
        (tmp / _STATE_FILE).write_text(json.dumps(state, indent=2))
        if folder.exists():
            _rmtree(folder)
        tmp.rename(folder)
        return folder

    def _restore(self, folder: Path) -> None:
        path = folder / _STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} is not a pipeline checkpoint (no {_STATE_FILE}); pass the folder "
                "a run wrote with checkpoint_dir"
            )
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} is corrupt ({err}); resume from an intact checkpoint"
            ) from err
        cfg = self.config
        for key, mine in (
            ("groups_per_step", cfg.groups_per_step),
            ("seed", cfg.seed),
            ("num_questions", len(self.questions)),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"checkpoint {folder} was written with {key}={state.get(key)}, this run has "
                    f"{key}={mine}; resume with the same data and settings"
                )
        if state["policy_version"] != self.version:
            raise ValueError(
                f"checkpoint {folder} is at policy version {state['policy_version']} but the "
                f"learner is at {self.version}: build the learner with resume_from={folder}/learner"
            )
        self.step = int(state["step"])
        self.trained_groups = list(range(self.step * cfg.groups_per_step))
        self._next = self.step * cfg.groups_per_step
        for start, size in state["buffered"]:
            file = folder / _BUFFER_DIR / f"{start:09d}_{size}.arrow"
            try:
                batch = TrajectoryBatch.from_ipc(file.read_bytes())
            except Exception as err:
                raise ValueError(f"buffered trajectories {file} are unreadable: {err}") from err
            self._chunks[start] = _Chunk(start, size, -1, batch=batch)


# --------------------------------------------------------------------- metrics
_ADDITIVE_GEN = (
    *COUNTERS,
    *("prefill_tokens", "reused_tokens", "kv_not_stored"),  # the sampler's, when it has them
    *("trajectories", "turns", "answered", "seconds"),
)


def _generation_metrics(batches: Sequence[TrajectoryBatch]) -> dict[str, float]:
    out = {f"gen/{k}": 0.0 for k in _ADDITIVE_GEN}
    for b in batches:
        for k in _ADDITIVE_GEN:
            out[f"gen/{k}"] += float(b.metrics.get(f"gen/{k}", 0.0))
    out["gen/tokens_per_s"] = (
        out["gen/generated_tokens"] / out["gen/seconds"] if out["gen/seconds"] else 0.0
    )
    n = max(out["gen/trajectories"], 1.0)
    out["gen/turns_per_traj"] = out["gen/turns"] / n
    out["gen/searches_per_traj"] = out["gen/searches"] / n
    turns = max(out["gen/turns"], 1.0)
    out["gen/invalid_rate"] = out["gen/invalid_actions"] / turns
    out["gen/truncation_rate"] = out["gen/truncated_turns"] / turns
    return out


def _outcome_metrics(batch: TrajectoryBatch) -> dict[str, float]:
    """Reward, group make-up, the turn where gold first shows, near misses."""
    reward = batch.traj_values("outcome_reward")
    groups = batch.group_index
    n_groups = batch.num_groups
    correct = np.bincount(groups, weights=(reward > 0).astype(float), minlength=n_groups)
    sizes = np.bincount(groups, minlength=n_groups)
    contains = batch.turn_values("turn_contains_gold", null=0.0) > 0
    owner = batch.turn_traj_index
    position = batch.turn_position
    never = np.iinfo(np.int64).max
    first = np.full(len(batch), never, dtype=np.int64)
    np.minimum.at(first, owner[contains], position[contains].astype(np.int64))
    seen_gold = first != never
    out = {
        "train/reward_mean": float(reward.mean()),
        "train/em": float((reward >= 1.0).mean()),
        "train/groups_all_wrong": float((correct == 0).mean()),
        "train/groups_all_correct": float((correct == sizes).mean()),
        "train/groups_mixed": float(((correct > 0) & (correct < sizes)).mean()),
        "train/gold_retrieved": float(seen_gold.mean()),
        "train/near_miss": float((seen_gold & (reward <= 0)).mean()),
        "train/first_gold_turn": float(first[seen_gold].mean()) if seen_gold.any() else -1.0,
    }
    if "turn_advantages" in batch.column_names:
        adv = batch.turn_values("turn_advantages")
        per_group = np.bincount(groups[owner], weights=np.abs(adv), minlength=n_groups)
        out["train/groups_zero_advantage"] = float((per_group < 1e-6).mean())
    return out


def _judge_agreement(batch: TrajectoryBatch) -> dict[str, float]:
    """How often an LLM judge's verdict on the answer matches exact match: Search-P1's
    outcome accuracy (>= 0.5 counts as correct), else CW-GRPO's correctness label on the
    answer turn. Only judged trajectories count (``judge/agreement_n``); no judge, no keys."""
    em = batch.traj_values("outcome_reward") >= 1.0
    if "sp1_outcome_accuracy" in batch.column_names:
        judged = batch.traj_valid("sp1_outcome_accuracy")
        says = batch.traj_values("sp1_outcome_accuracy", null=0.0) >= 0.5
        agree = (says == em)[judged]
    elif "judge_correct" in batch.column_names:
        judged = batch.turn_valid("judge_correct") & batch.is_last_turn
        says = batch.turn_values("judge_correct", null=0.0) > 0
        agree = (says == em[batch.turn_traj_index])[judged]
    else:
        return {}
    out = {"judge/agreement_n": float(len(agree))}
    if len(agree):
        out["judge/agreement_em"] = float(agree.mean())
    return out


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
