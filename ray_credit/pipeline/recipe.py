"""What every pipeline script shares: its config sections and one :func:`train` that reads
top to bottom: data, the method's plan, services, evaluation before, the pipeline,
evaluation after, outputs.

A pipeline script (``pipelines/tspo.py``) is a run config with its estimator's section
plus one call: ``main(TSPORun, "tspo", __doc__, default_config=...)``. Settings come from,
in order: the config classes' defaults (general ones: Search-R1's rollout protocol,
verl's learner), the estimator's recipe (the loss, KL and signal settings its paper trains
with; :mod:`ray_credit.pipeline.plan`), one YAML file (``--config``; by default
``pipelines/configs/embedded.yaml``, the small CPU run of the embedded model) and the
flags. ``--help`` shows the result.

:func:`train` connects to Ray (the cluster of ``ray job submit`` / ``RAY_ADDRESS``, else
a local one) and writes, under ``output_dir/name``: ``metrics.jsonl`` (one line per step),
``summary.json``, ``plot.png`` (reward and EM over steps), the checkpoint, the retrieval
index (reused by a resumed run), Search-P1's reference plans when it makes them, and
wandb's run (offline unless asked). The driver never holds a batch: evaluation and
training batches are read by Ray tasks and actors, the driver gets their summaries.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ray_credit.actors.generator import RETRIEVAL_TIMEOUT_S, GeneratorConfig
from ray_credit.actors.judge import Backend as JudgeBackend
from ray_credit.actors.learner import LearnerConfig, Strategy
from ray_credit.actors.retriever import EncoderConfig, IndexConfig
from ray_credit.config import check_fields
from ray_credit.data import WorldConfig
from ray_credit.log import LogLevel, log, setup_logging, worker_env
from ray_credit.pipeline.plan import Plan, make_plan, recipe_defaults
from ray_credit.pipeline.runner import Pipeline, PipelineConfig, checkpoint_state
from ray_credit.progress import wants_progress
from ray_credit.storage import StoragePath
from ray_credit.warm_start import WarmStartConfig, rl_questions, settings_fingerprint

__all__ = [
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "ResourcesConfig",
    "RetrieverConfig",
    "RunConfig",
    "connect",
    "describe_change",
    "eval_change",
    "evaluate",
    "load_config",
    "load_data",
    "main",
    "make_generators",
    "make_judge_pool",
    "make_retriever",
    "run_config_class",
    "sampled_title",
    "submit_evaluation",
    "train",
]


@dataclass(frozen=True)
class DataConfig:
    """Where questions and documents come from."""

    questions: str = "synthetic"
    """'synthetic' (the seeded world) or a Search-R1 parquet / jsonl question file."""
    corpus: str | None = None
    """A FlashRAG jsonl corpus (needed with a question file; the world brings its own)."""
    eval_questions: int = 24
    """Questions held out for evaluation (taken from the question set, never trained on)."""
    eval_file: str | None = None
    """A separate evaluation question file (then nothing is held out of the training set)."""
    world: WorldConfig = field(default_factory=WorldConfig)
    """The synthetic world's settings."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.questions == "synthetic" and self.corpus is not None:
            raise ValueError(
                f"data.corpus={self.corpus!r} is set but data.questions is 'synthetic', which "
                "brings its own corpus: give the question file it belongs to "
                "(--data.questions FILE), or drop data.corpus"
            )


@dataclass(frozen=True)
class EvalConfig:
    """Exact match before and after training: greedy, one rollout per question (and,
    with ``samples``, the sampled EM too)."""

    enabled: bool = True
    """Evaluate before and after training."""
    before_warm_start: bool = True
    """With a warm-start, also evaluate the policy before it (its gain is then reported
    apart from RL's)."""
    max_new_tokens: int | None = None
    """Token limit per turn (None: the generator's)."""
    samples: int = 0
    """Also roll out every held-out question this many times with the generator's
    sampling settings (temperature, top_p, seed) and report the sampled EM: the mean over
    the samples, per question, with its paired interval. It measures the sampled policy
    RL optimizes, and moves with it before a greedy answer flips; it costs about this
    many times the greedy evaluation. 0: greedy only."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"eval.max_new_tokens must be >= 1, or null for the generator's, got "
                f"{self.max_new_tokens}"
            )
        if self.samples < 0:
            raise ValueError(f"eval.samples must be >= 0 (0: greedy only), got {self.samples}")


@dataclass(frozen=True)
class RetrieverConfig:
    """What the generators search: an index built here, or an existing server."""

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """The query and passage encoder."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """The faiss index."""
    index_folder: str | None = None
    """Where the index is saved, and loaded from when it is there (None: a shared cache
    folder keyed by the corpus, encoder and index settings, $RAY_CREDIT_CACHE/indexes/...,
    so every run, method, seed and resume over them builds it once)."""
    url: str | None = None
    """An existing Search-R1 style /retrieve server (http://host:port/retrieve) to search
    instead of building an index; the corpus then only feeds the judges."""
    timeout_s: float = RETRIEVAL_TIMEOUT_S
    """Longest wait for one retrieval call from a generator."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"retriever.timeout_s must be a finite number of seconds > 0, got {self.timeout_s}"
            )
        _check_url("retriever.url", self.url, "http://host:8000/retrieve")


@dataclass(frozen=True)
class JudgeConfig:
    """The judge pool of CW-GRPO and Search-P1."""

    backend: JudgeBackend = "evidence"
    """'evidence' (from gold answers and supporting documents, in the stage task), 'hf'
    (a local model on judge actors) or 'openai' (any OpenAI-compatible endpoint)."""
    model: str | None = None
    """hf: the judge model (an embedded name, HF id or folder); openai: the served
    model's name."""
    base_url: str | None = None
    """openai: the endpoint (e.g. a vLLM server's http://host:8000/v1)."""
    num_actors: int = 1
    """Judge actors of an LLM backend (the evidence judge needs none)."""
    batch_size: int = 16
    """Judgements per backend call."""
    max_concurrency: int = 8
    """Backend calls in flight per chunk's stage task (each judge actor runs at most
    ceil(max_concurrency / num_actors) at once)."""
    timeout_s: float = 60.0
    """Per backend call: one HTTP request (openai), one generate (hf)."""
    max_retries: int = 3
    """Retries of a failed HTTP request, and of a call whose judge actor died."""
    guided: bool | None = None
    """Constrain replies to each signal's reply schema (None: on for hf, so small judges
    answer in form; off for openai, where it asks for a json_schema response format)."""

    def __post_init__(self) -> None:
        check_fields(self)  # backend among its choices too
        for name, least in (("batch_size", 1), ("max_concurrency", 1), ("max_retries", 0),
                            ("num_actors", 0)):  # fmt: skip
            if getattr(self, name) < least:
                raise ValueError(f"judge.{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"judge.timeout_s must be a finite number of seconds > 0, got {self.timeout_s}"
            )
        _check_url("judge.base_url", self.base_url, "http://host:8000/v1")

    def check(self) -> None:
        """Checks across fields (once the whole config is assembled)."""
        if self.backend != "evidence" and not self.model:
            raise ValueError(f"judge.backend={self.backend!r} needs judge.model")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("judge.backend='openai' needs judge.base_url (http://host:port/v1)")
        if self.backend != "evidence" and self.num_actors < 1:
            raise ValueError(
                "an LLM judge runs on actors in a pipeline: judge.num_actors must be >= 1"
            )


@dataclass(frozen=True)
class ResourcesConfig:
    """What each actor asks Ray for (local runs: logical CPUs of one machine)."""

    num_generators: int = 1
    """Generator actors (each a full model replica)."""
    generator_cpus: float = 1.0
    """CPUs per generator (Ray gives an actor as many torch threads)."""
    generator_gpus: float = 0.0
    """GPUs per generator."""
    generator_max_restarts: int = 2
    """How often Ray may restart a generator whose process died; the pipeline re-sends it
    the current weights and the call it lost (0: a dead generator leaves the pool)."""
    learner_workers: int = 1
    """Learner replicas (>1: data parallel, strategy below)."""
    learner_cpus: float = 2.0
    """CPUs per learner replica."""
    learner_strategy: Strategy = "ddp"
    """With learner_workers > 1: 'ddp' (a full replica per worker) or 'fsdp' (parameters,
    gradients and optimizer state sharded over the workers)."""
    use_gpu: bool = False
    """Train on GPUs (one per learner replica)."""
    retriever_cpus: float = 0.25
    """CPUs of the retriever actor."""
    judge_cpus: float = 0.25
    """CPUs of each judge actor (LLM backends)."""
    eval_cpus: float = 2.0
    """CPUs of the evaluation generator (busy only before and after training)."""
    local_cpus: int | None = None
    """Logical CPUs of a local Ray started by the script (None: the machine's, at least 6:
    the actors ask for more CPUs than they keep busy at once)."""
    generator_resource: str | None = None
    """A custom resource that each generator, the evaluation generator and the info-gain
    scorer ask one unit of, to land on a cluster's generator nodes (cluster.yaml:
    'generator'; None: none)."""
    learner_resource: str | None = None
    """A custom resource that each learner replica asks one unit of (cluster.yaml:
    'learner'; None: none)."""
    service_resource: str | None = None
    """A custom resource that the retriever and each judge actor ask one unit of
    (cluster.yaml: 'service'; None: none)."""

    def __post_init__(self) -> None:
        check_fields(self)  # learner_strategy among its choices too: at parse time
        for name in ("num_generators", "learner_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"resources.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("generator_cpus", "generator_gpus", "learner_cpus", "retriever_cpus",
                     "judge_cpus", "eval_cpus"):  # fmt: skip
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"resources.{name} must be a finite number >= 0, got {getattr(self, name)}"
                )
        if self.generator_max_restarts < -1:
            raise ValueError(
                "resources.generator_max_restarts must be >= 0, or -1 for as many as Ray "
                f"allows, got {self.generator_max_restarts}"
            )
        if self.local_cpus is not None and self.local_cpus < 1:
            raise ValueError(
                f"resources.local_cpus must be >= 1, or null for the machine's, got "
                f"{self.local_cpus}"
            )

    def custom(self, role: str) -> dict[str, float]:
        """The custom resources of an actor of ``role`` ('generator', 'learner',
        'service'): one unit of the configured resource, or none."""
        name = getattr(self, f"{role}_resource")
        return {name: 1.0} if name else {}


@dataclass(frozen=True)
class RunConfig:
    """One training run."""

    name: str = "run"
    """Run name: the output folder and the wandb run."""
    model: str = "smollm2-135m"
    """Policy: an embedded name, an HF id or a folder."""
    output_dir: str = "runs"
    """Outputs go to output_dir/name."""
    resume: str | None = None
    """A checkpoint folder to continue from (storage_path/name/checkpoint, a path or a URI)."""
    storage_path: str | None = None
    """Where the checkpoints go, and a copy of summary.json, metrics.jsonl and plot.png:
    storage_path/name (None: output_dir). A path, or a URI pyarrow opens (s3://bucket/runs,
    gs://..., hdfs://...), as Ray Train's RunConfig(storage_path) takes; on a multi-node
    cluster, one every node sees (a shared filesystem or a bucket)."""
    wandb: Literal["offline", "online", "disabled"] = "offline"
    """'offline' (default), 'online' (needs a key: WANDB_API_KEY or `wandb login`) or 'disabled'."""
    log_level: LogLevel = "info"
    """What the run prints: 'info' (each stage and step), 'warning' (problems only),
    'error', or 'debug' (also the libraries' own logs: vLLM, transformers, warnings)."""
    data: DataConfig = field(default_factory=DataConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised fine-tuning on scripted demonstrations before RL (ray_credit.warm_start)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (
            not self.name
            or self.name.strip() != self.name
            or "/" in self.name
            or "\\" in self.name
            or self.name in (".", "..")
        ):
            raise ValueError(
                f"name={self.name!r} must be a plain folder name (no slashes, not '.' or "
                "'..', not blank): the run is written to output_dir/name"
            )
        if not self.model:
            raise ValueError("model must name a model: an embedded name, an HF id or a folder")
        if self.storage_path is not None and not self.storage_path.strip():
            raise ValueError(
                "storage_path must be a path or a URI such as s3://bucket/runs (None: output_dir)"
            )

    def check(self) -> None:
        """Checks across sections (run once the whole config is assembled)."""
        gen_t = self.generator.temperature or 1.0
        if abs(gen_t - self.learner.temperature) > 1e-9:
            raise ValueError(
                f"learner.temperature ({self.learner.temperature}) must equal the generator's "
                f"sampling temperature ({gen_t}; greedy: 1), or the on-policy ratio is not 1: "
                f"pass --generator.temperature T --learner.temperature T together"
            )
        if self.generator.backend == "vllm":
            _check_vllm(self.generator, self.resources, self.pipeline)


def _check_url(name: str, url: str | None, example: str) -> None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"{name}={url!r} must be an http:// or https:// URL, e.g. {example}")


def _check_vllm(gen: GeneratorConfig, res: ResourcesConfig, pipe: PipelineConfig) -> None:
    if pipe.weight_sync != "object_store":
        raise ValueError(
            f"pipeline.weight_sync={pipe.weight_sync!r} broadcasts into the generators' own "
            "memory, which vLLM's workers do not join: vLLM generators load published weights "
            "through the object store; use --pipeline.weight_sync object_store"
        )
    tp = gen.vllm.tensor_parallel_size
    if tp > 1 and res.generator_gpus != tp:
        raise ValueError(
            f"generator.vllm.tensor_parallel_size={tp} spans {tp} GPUs, but each generator "
            f"asks Ray for resources.generator_gpus={res.generator_gpus:g}; set them equal"
        )


def check_resume_folder(folder: str) -> StoragePath:
    """The checkpoint ``--resume FOLDER`` resumes from (the newest whole one in a run's
    checkpoint folder, or FOLDER itself: :func:`~ray_credit.pipeline.resolve_checkpoint`;
    a path or a URI), refused before Ray starts unless it is whole: the pipeline's state
    (readable JSON) and the learner's part (what :meth:`Pipeline.save` writes)."""
    from ray_credit.config import InputError, InputFileNotFoundError
    from ray_credit.pipeline.checkpointing import LEARNER_DIR, STATE_FILE, resolve_checkpoint

    usage = "pass the checkpoint folder a run wrote (storage_path/name/checkpoint)"
    try:
        path = StoragePath(folder)
        found = path.is_dir()
    except (ValueError, OSError) as err:
        raise InputError(f"--resume {folder}: {err}; {usage}") from None
    if not found:
        raise InputFileNotFoundError(f"--resume {folder}: no such folder; {usage}")
    if (path / "checkpoint").is_dir() and not (path / STATE_FILE).is_file():
        raise InputError(
            f"--resume {folder}: that is a run's folder; its checkpoint is "
            f"{path / 'checkpoint'}: --resume {path / 'checkpoint'}"
        )
    try:
        chosen = resolve_checkpoint(path)
    except FileNotFoundError as err:
        raise InputError(f"--resume {folder}: {err}; {usage}") from None
    where = "" if chosen == path else f" ({chosen.name}, the newest there)"
    if not (chosen / LEARNER_DIR).is_dir():
        raise InputError(
            f"--resume {folder}{where}: not a pipeline checkpoint (it has no learner); {usage}"
        )
    try:
        json.loads((chosen / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(
            f"--resume {folder}{where}: {STATE_FILE} is damaged ({err}); resume from an "
            "intact checkpoint"
        ) from None
    return chosen


# ----------------------------------------------------------------------------- data
def load_data(data: DataConfig, *, seed: int) -> tuple[Any, list[dict], list[dict]]:
    """(corpus, training questions, evaluation questions); ``seed`` (the pipeline's)
    decides which questions are held out."""
    from ray_credit.config import InputError

    if data.questions == "synthetic":
        from ray_credit.data import make_world

        world = make_world(data.world)
        corpus, questions = world.corpus, list(world.questions)
    else:
        from ray_credit.data.loaders import load_qa

        if data.corpus is None:
            raise InputError(
                f"data.questions={data.questions!r} needs data.corpus (FlashRAG jsonl)"
            )
        if not Path(data.corpus).is_file():
            raise InputError(
                f"data.corpus {data.corpus!r} does not exist (or is not a file); give a "
                "FlashRAG jsonl corpus the driver can read"
            )
        corpus, questions = data.corpus, load_qa(data.questions)
    if data.eval_file is not None:
        from ray_credit.data.loaders import load_qa

        return corpus, questions, load_qa(data.eval_file)
    if not 0 < data.eval_questions < len(questions):
        raise InputError(
            f"data.eval_questions={data.eval_questions} must hold out at least one of the "
            f"{len(questions)} questions and leave at least one to train on"
        )
    order = np.random.default_rng(seed + 7919).permutation(len(questions))
    held = set(order[: data.eval_questions].tolist())
    train_q = [q for i, q in enumerate(questions) if i not in held]
    eval_q = [questions[i] for i in sorted(held)]
    return corpus, train_q, eval_q


# ----------------------------------------------------------------------------- eval
def question_key(position: int, question: str) -> str:
    """How an evaluation names a question in its per-question outcomes: an evaluation
    rolls its list out in order, one trajectory per question, so "<position>:<question>"
    pairs it with another evaluation of the same list (and tells repeats apart)."""
    return f"{position}:{question}"


def _eval_summary(batch: Any) -> dict[str, Any]:
    """Exact match of the rollouts of each question (one, greedy; or several sampled:
    then a question's score is the share of its rollouts that are right), overall and per
    data source (runs where the batch is, in a Ray task)."""
    from ray_credit.stats import proportion_interval

    right = (batch.traj_values("outcome_reward") >= 1.0).astype(np.float64)
    searched = (batch.turn_values("turns.action") == "search").astype(np.int64)
    searches = np.add.reduceat(searched, batch.turn_offsets[:-1]) if len(batch) else searched
    starts = batch.group_starts if len(batch) else np.zeros(0, np.int64)

    def per_question(values: np.ndarray) -> np.ndarray:
        """Mean over each question's rollouts (groups come in the order of the questions)."""
        return np.add.reduceat(values, starts) / batch.group_sizes if len(batch) else values

    score, search = per_question(right), per_question(searches)
    sources = [s or "unknown" for s in batch.column("data_source").to_pylist()]
    sources = [sources[i] for i in starts]
    questions = batch.column("question").to_pylist()
    keys = [question_key(g, questions[i]) for g, i in enumerate(starts)]
    per_source: dict[str, list[float]] = {}
    searches_by_source: dict[str, list[float]] = {}
    for source, r, s in zip(sources, score, search, strict=True):
        per_source.setdefault(source, []).append(float(r))
        searches_by_source.setdefault(source, []).append(float(s))
    samples = int(batch.group_sizes.max()) if len(batch) else 1
    m, n = batch.metrics, max(len(batch), 1)
    return {
        "em": float(right.mean()) if len(batch) else 0.0,
        # a Wilson interval holds for one rollout per question (its outcomes independent)
        "em_interval": list(proportion_interval(int(right.sum()), len(right)))
        if len(batch) and samples == 1
        else None,
        "em_by_source": {k: float(np.mean(v)) for k, v in sorted(per_source.items())},
        "count_by_source": {k: len(v) for k, v in sorted(per_source.items())},
        "correct": dict(
            zip(keys, [float(v) if samples > 1 else int(v) for v in score], strict=True)
        ),
        "source": dict(zip(keys, sources, strict=True)),
        "answered": m.get("gen/answered", 0.0) / n,
        "searches_per_traj": m.get("gen/searches", 0.0) / n,
        "searches_by_source": {k: float(np.mean(v)) for k, v in sorted(searches_by_source.items())},
        "questions": len(keys),
        "samples": samples,
    }


def _eval_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    low, high = result.get("em_interval") or (result["em"], result["em"])
    metrics = {"eval/em": result["em"], "eval/em_low": low, "eval/em_high": high}
    if "sampled" in result:
        metrics["eval/em_sampled"] = result["sampled"]["em"]
    return metrics


def eval_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, dict]:
    """EM after minus EM before on the same held-out questions, with a paired 95 %
    bootstrap interval (:func:`ray_credit.stats.paired_difference`), overall ("all") and
    per data source."""
    from ray_credit.stats import paired_difference

    change = {"all": paired_difference(before["correct"], after["correct"])}
    for source in sorted(set(before["source"].values())):
        keys = [k for k, s in before["source"].items() if s == source]
        change[source] = paired_difference(
            {k: before["correct"][k] for k in keys}, {k: after["correct"][k] for k in keys}
        )
    return change


def describe_change(
    before: Mapping,
    after: Mapping,
    change: Mapping[str, dict],
    title: str = "held-out EM, paired on the same questions",
) -> str:
    """Lines saying how held-out EM moved, with the paired interval, overall and per
    source, under ``title``."""
    lines = []
    for name, c in change.items():
        em_b = before["em"] if name == "all" else before["em_by_source"][name]
        em_a = after["em"] if name == "all" else after["em_by_source"][name]
        verdict = "excludes 0" if c["low"] > 0 or c["high"] < 0 else "includes 0"
        lines.append(
            f"  {name:<16} EM {em_b:.3f} -> {em_a:.3f}  change {c['diff']:+.3f} "
            f"[95% CI {c['low']:+.3f}, {c['high']:+.3f}; {verdict}]  n={c['n']} "
            f"({c['better']} better, {c['worse']} worse){_searches(before, after, name)}"
        )
    return f"{title}:\n" + "\n".join(lines)


def sampled_title(before: Mapping, after: Mapping) -> str:
    """The title of :func:`describe_change` for the sampled EM (``eval.samples``) of two
    evaluations, with how many samples each took per question."""
    b, a = before["samples"], after["samples"]
    counts = f"{a}" if b == a else f"{b} before, {a} now"
    return (
        f"held-out sampled EM ({counts} samples per question), paired on the same questions "
        "(better/worse: questions whose share of right samples rose/fell)"
    )


def _searches(before: Mapping, after: Mapping, name: str) -> str:
    """The end of one line of :func:`describe_change`: how searches per question moved,
    where both evaluations counted them (an older summary did not, per source)."""
    if name == "all":
        b, a = before.get("searches_per_traj"), after.get("searches_per_traj")
    else:
        b = before.get("searches_by_source", {}).get(name)
        a = after.get("searches_by_source", {}).get(name)
    return "" if b is None or a is None else f", searches per question {b:.2f} -> {a:.2f}"


def submit_evaluation(generator: Any, questions: Sequence[Mapping[str, Any]]) -> Any:
    """An ObjectRef to the exact match (overall and per data source) of ``generator``'s
    rollouts of ``questions``; the batch is summarized by a task, never fetched here."""
    import ray

    batch = generator.generate.remote(list(questions), progress="held-out rollouts")
    return ray.remote(_eval_summary).options(num_cpus=0).remote(batch)


def evaluate(generator: Any, questions: Sequence[Mapping[str, Any]], timeout_s: float) -> dict:
    """:func:`submit_evaluation`, waited for."""
    import ray

    return ray.get(submit_evaluation(generator, questions), timeout=timeout_s)


# ----------------------------------------------------------------------------- services
def connect(cfg: Any):
    """Ray: the cluster of RAY_ADDRESS (``ray job submit`` sets it), else a local one."""
    import ray

    if ray.is_initialized():
        return ray
    # the run's workers as quiet as its log level (vLLM, transformers, torch's C++ logs)
    quiet = {
        "runtime_env": {"env_vars": worker_env(cfg.log_level, progress=wants_progress())},
        "logging_level": "INFO" if cfg.log_level == "debug" else "WARNING",
    }
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **quiet)
        log.info(f"connected to the Ray cluster at {os.environ['RAY_ADDRESS']}")
    else:
        cpus = cfg.resources.local_cpus or max(6, os.cpu_count() or 1)
        # address="local": a new cluster even when a `ray start` head runs on this machine
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)
        log.info(f"started a local Ray with {cpus} logical CPUs")
    return ray


def make_retriever(
    corpus: Any, cfg: RetrieverConfig, res: ResourcesConfig, index_folder: str | None
):
    """What generators search: a client of the server at ``cfg.url`` (each generator gets
    its own copy), else a retriever actor over ``corpus`` (index saved in / loaded from
    ``index_folder``; None: the shared index cache, see ``RetrieverConfig.index_folder``),
    as a :class:`~ray_credit.actors.generator.NamedActor`: generators, which Ray may
    restart, get its name, not its handle."""
    if cfg.url:
        from ray_credit.actors.retrieval_server import RemoteRetriever

        return RemoteRetriever(cfg.url)  # its URL answered before Ray started (_preflight)
    import uuid

    from ray_credit.actors.generator import NamedActor
    from ray_credit.actors.retriever import make_retriever_actor

    name = f"retriever-{uuid.uuid4().hex[:12]}"  # one per run, also in one process (the study)
    handle = make_retriever_actor(
        corpus,
        encoder=cfg.encoder,
        index=cfg.index,
        index_folder=index_folder,
        num_cpus=res.retriever_cpus,
        resources=res.custom("service"),
        name=name,
    )
    return NamedActor(name, handle)


def make_generators(
    model: str,
    retriever: Any,
    cfg: Any,
    generator: GeneratorConfig,
    *,
    prefix: str | None,
    count: int | None = None,
    num_cpus: float | None = None,
) -> list:
    """``count`` (default ``resources.num_generators``) generator actors named ``prefix0``,
    ... (None: unnamed), each with ``num_cpus`` (default ``resources.generator_cpus``), the
    GPUs and the custom generator resource of ``cfg.resources``."""
    from ray_credit.actors.generator import make_generator_actor

    res = cfg.resources
    return [
        make_generator_actor(
            model,
            retriever,
            generator,
            num_cpus=res.generator_cpus if num_cpus is None else num_cpus,
            num_gpus=res.generator_gpus,
            resources=res.custom("generator"),
            max_restarts=res.generator_max_restarts,
            device="cuda" if res.generator_gpus else "cpu",
            name=None if prefix is None else f"{prefix}{i}",
            retrieval_timeout_s=cfg.retriever.timeout_s,
        )
        for i in range(res.num_generators if count is None else count)
    ]


def make_judge_pool(cfg: JudgeConfig, res: ResourcesConfig):
    """A JudgePool from its config section. The evidence judge needs no actors and no
    corpus: its rules read the batch (and its signals need no reference plans)."""
    from ray_credit.actors.judge import JudgePool

    if cfg.backend == "evidence":
        return JudgePool("evidence")
    kwargs = {"base_url": cfg.base_url} if cfg.backend == "openai" else {}
    return JudgePool(
        cfg.backend,
        num_actors=cfg.num_actors,
        max_concurrency=cfg.max_concurrency,
        batch_size=cfg.batch_size,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        guided=cfg.guided,
        num_cpus=res.judge_cpus,
        resources=res.custom("service"),
        model=cfg.model,
        **kwargs,
    )


def make_scorer(cfg: Any, plan: Plan):
    """The info-gain scorer actor on the policy model (it joins the weight targets)."""
    from ray_credit.actors.scorer import make_scorer_actor

    (signal,) = [s for s in plan.signals if s.service == "scorer"]
    res = cfg.resources
    return make_scorer_actor(
        cfg.model,
        mode=signal.mode,
        max_batch_tokens=signal.max_batch_tokens,
        num_cpus=res.generator_cpus,
        num_gpus=res.generator_gpus,
        resources=res.custom("generator"),
        device="cuda" if res.generator_gpus else "cpu",
        autocast=cfg.learner.autocast,  # the policy's beliefs in the learner's numerics
        max_restarts=res.generator_max_restarts,
    )


def make_learner(cfg: Any):
    from ray_credit.actors.learner_group import LearnerGroup

    res = cfg.resources
    return LearnerGroup(
        cfg.model,
        cfg.learner,
        num_workers=res.learner_workers,
        use_gpu=res.use_gpu,
        resources_per_worker={
            "CPU": res.learner_cpus,
            **({"GPU": 1} if res.use_gpu else {}),
            **res.custom("learner"),
        },
        resume_from=None if cfg.resume is None else StoragePath(cfg.resume) / "learner",
        timeout_s=cfg.pipeline.timeout_s,
        strategy=res.learner_strategy,
    )


def with_reference_plans(plan: Plan, judges: Any, questions: list[dict], cache: Path) -> list[dict]:
    """The questions with Search-P1's reference plans: the question file's, else the
    cached ones (``cache``, JSON lines), else made now by the judge pool and cached. A plan
    the judge failed to make is not cached (the next run asks again); its question's
    trajectories go unjudged, counted in ``judge/no_evidence``."""
    if not plan.question_signals:
        return questions
    (signal,) = plan.question_signals
    known: dict[str, list[str]] = {}
    if cache.is_file():
        for line in cache.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            known[row["question"]] = row["reference_plan"]
    todo = [q for q in questions if not q.get("reference_plan") and q["question"] not in known]
    if todo:
        t0 = time.perf_counter()
        made = judges.judge(signal, todo)
        with cache.open("a", encoding="utf-8") as out:
            for q, value in zip(todo, made, strict=True):
                if value is not None:
                    known[q["question"]] = value["reference_plan"]
                    row = {"question": q["question"], "reference_plan": value["reference_plan"]}
                    out.write(json.dumps(row) + "\n")
        log.info(
            f"reference plans: {sum(v is not None for v in made)} made of {len(todo)} "
            f"({time.perf_counter() - t0:.0f}s), kept in {cache}",
        )
    out_q = [
        q if q.get("reference_plan") else {**q, "reference_plan": known.get(q["question"])}
        for q in questions
    ]
    missing = sum(not q["reference_plan"] for q in out_q)
    if missing:
        log.warning(
            f"warning: {missing} of {len(out_q)} training questions have no reference plan "
            "(the judge failed to make one); their trajectories go unjudged, counted in "
            "judge/no_evidence",
        )
    return out_q


# ----------------------------------------------------------------------------- the run
def train(cfg: Any, estimator: str) -> dict:
    """Run one training job of ``estimator`` with ``cfg``; returns the summary it writes."""
    from ray_credit.config import check_config
    from ray_credit.pipeline.outputs import Logger, plot

    check_config(cfg)  # every section's check(), as parse_config does
    setup_logging(cfg.log_level)
    t_start = time.perf_counter()
    run_config = asdict(cfg)  # as given: what a --resume of this run starts from
    out = Path(cfg.output_dir).resolve() / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    run_dir = _run_storage(cfg, out)  # the checkpoints, and a copy of the outputs
    # Data and the method's plan: everything that can be refused is refused here.
    corpus, train_q, eval_q = load_data(cfg.data, seed=cfg.pipeline.seed)
    titles = _checked_demonstrations(cfg, corpus, train_q) if cfg.warm_start.enabled else {}
    rl_q = rl_questions(train_q, cfg.warm_start)  # all, or those not demonstrated
    plan = make_plan(cfg, estimator, rl_q)
    for departure in plan.departures:
        log.info(f"note: departs from {estimator}'s recipe: {departure}")
    _preflight(cfg, rl_q)
    resumed_step, previous = None, {}
    if cfg.resume is not None:  # the newest whole checkpoint in the folder given
        cfg = replace(cfg, resume=str(check_resume_folder(cfg.resume)))
        resumed_step = int(checkpoint_state(cfg.resume)["step"])
        _sync_outputs(out, run_dir, fetch=True)  # on a new head node: the run's history
        previous = _previous_summary(out)
    # Services: retriever, judges, scorer, generators, learner.
    ray = connect(cfg)
    _warn_if_short(ray, cfg, plan)
    log.info(
        f"data: {len(train_q)} training questions, {len(eval_q)} held out"
        + (f"; RL draws from the {len(rl_q)} the warm-start does not demonstrate"
           if len(rl_q) < len(train_q) else "")
    )  # fmt: skip
    retriever = make_retriever(corpus, cfg.retriever, cfg.resources, cfg.retriever.index_folder)
    logger = Logger(cfg, out, resumed_step=resumed_step, wandb_id=previous.get("wandb_id"))
    summary: dict[str, Any] = {
        "config": run_config,
        "estimator": estimator,
        "departures": list(plan.departures),
        "output_dir": str(out),
        "wandb_id": logger.run.id if logger.run is not None else None,
        # every start of this run: its own config is "config"; a resume keeps the
        # evaluations and history of the starts before it
        "starts": [*previous.get("starts", []), {"resumed_from": cfg.resume,
                                                   "step": resumed_step or 0}],
    }  # fmt: skip
    kept = _kept_evaluations(previous, run_config) if previous else {}
    summary.update(kept)
    # The warm-start: every actor below then loads the warm-started policy as its model.
    if cfg.warm_start.enabled:
        shared = run_dir.local_path or out  # a shared filesystem's, where storage_path is one
        cfg = _warm_start(cfg, retriever, train_q, eval_q, titles, shared, summary, logger)
    summary["policy"] = cfg.model  # what every actor below loads
    judges = make_judge_pool(cfg.judge, cfg.resources) if "judge" in plan.services else None
    scorer = make_scorer(cfg, plan) if "scorer" in plan.services else None
    rl_q = with_reference_plans(plan, judges, rl_q, out / "reference_plans.jsonl")
    generators = make_generators(cfg.model, retriever, cfg, cfg.generator, prefix="gen")
    learner = make_learner(cfg)
    # Evaluation before training (a resumed run: the first run's, or the resumed policy's).
    if cfg.eval.enabled and "eval_before" in kept:
        log.info(
            f"eval before training: EM {kept['eval_before']['em']:.3f} on {len(eval_q)} "
            f"held-out questions (kept from {out / 'summary.json'}: before the run's first step)"
        )
    elif cfg.eval.enabled:
        when = "before training" if resumed_step is None else f"at step {resumed_step}"
        summary["eval_before"] = _evaluate_policy(cfg, retriever, learner, eval_q, when)
        logger.log(_eval_metrics(summary["eval_before"]), step=resumed_step or 0)
    _write_summary(out, summary)  # a run cut off later keeps what it measured so far
    _sync_outputs(out, run_dir)
    # The pipeline.
    pipe_cfg = cfg.pipeline
    if pipe_cfg.checkpoint_dir is None:
        pipe_cfg = replace(pipe_cfg, checkpoint_dir=str(run_dir / "checkpoint"))

    def on_step(metrics: dict[str, float]) -> None:
        logger.step(metrics, pipe_cfg.steps)
        _sync_outputs(out, run_dir)

    stages, step_stages = plan.stages(judges=judges, scorer=scorer, timeout_s=pipe_cfg.timeout_s)
    pipeline = Pipeline(
        generators,
        learner,
        rl_q,
        stages,
        pipe_cfg,
        step_stages=step_stages,
        weight_targets=[scorer] if scorer is not None else [],
        resume_from=cfg.resume,
        on_step=on_step,
        metadata={"run_config": run_config},
    )
    history = pipeline.run()
    summary.update(
        steps=pipeline.step,
        groups_trained=len(pipeline.trained_groups),
        checkpoint=pipe_cfg.checkpoint_dir,
    )
    # Training's generators and scorer are done: their memory (a vLLM engine's KV cache
    # each) goes back before the evaluation's generator starts.
    for actor in [*pipeline.generators, *([scorer] if scorer is not None else [])]:
        ray.kill(actor)
    # Evaluation after training.
    if cfg.eval.enabled:
        summary["eval_after"] = _evaluate_policy(
            cfg, retriever, learner, eval_q, f"after {pipeline.step} steps"
        )
        logger.log(_eval_metrics(summary["eval_after"]), step=pipeline.step)
        if "eval_before" in summary:
            _report_change(summary, logger, pipeline.step)
    # Outputs.
    summary["final_step_metrics"] = history[-1] if history else {}
    summary["seconds"] = time.perf_counter() - t_start
    _write_summary(out, summary)
    plot(logger.rows, summary, out / "plot.png")
    logger.finish()
    _sync_outputs(out, run_dir)
    learner.shutdown()
    log.info(
        f"wrote {out}/summary.json, {out}/plot.png, {out}/metrics.jsonl, checkpoint "
        f"{pipe_cfg.checkpoint_dir}",
    )
    return summary


def _report_change(summary: dict, logger: Any, step: int) -> None:
    """The paired change of held-out EM from before training to after (and the
    warm-start's own, when the base policy was evaluated): kept, printed and logged."""
    before, after = summary["eval_before"], summary["eval_after"]
    summary["eval_change"] = eval_change(before, after)
    log.info(describe_change(before, after, summary["eval_change"]))
    if "eval_base" in summary:
        summary["eval_change_warm_start"] = eval_change(summary["eval_base"], before)
        warm = describe_change(summary["eval_base"], before, summary["eval_change_warm_start"])
        log.info(f"the warm-start's part ({warm})")
    change = summary["eval_change"]["all"]
    metrics = {"eval/em_change": change["diff"], "eval/em_change_low": change["low"],
               "eval/em_change_high": change["high"]}  # fmt: skip
    if "sampled" in before and "sampled" in after:
        b, a = before["sampled"], after["sampled"]
        summary["eval_change_sampled"] = eval_change(b, a)
        log.info(describe_change(b, a, summary["eval_change_sampled"], sampled_title(b, a)))
        sampled = summary["eval_change_sampled"]["all"]
        metrics |= {"eval/em_sampled_change": sampled["diff"],
                    "eval/em_sampled_change_low": sampled["low"],
                    "eval/em_sampled_change_high": sampled["high"]}  # fmt: skip
    logger.log(metrics, step=step)


def _run_storage(cfg: Any, out: Path) -> StoragePath:
    """Where the run's checkpoints go: ``storage_path/name`` (made here, so that a location
    it cannot write is refused before Ray starts), else ``out``."""
    from ray_credit.config import InputError

    if cfg.storage_path is None:
        return StoragePath(out)
    try:
        run_dir = StoragePath(cfg.storage_path) / cfg.name
        run_dir.mkdir()
    except (ValueError, OSError) as err:
        raise InputError(
            f"storage_path={cfg.storage_path!r}: cannot write there ({err}); give a folder "
            "every node sees or a URI such as s3://bucket/runs (credentials from the "
            "environment, as pyarrow finds them)"
        ) from None
    return run_dir


_OUTPUTS = ("summary.json", "metrics.jsonl", "plot.png")


def _sync_outputs(out: Path, run_dir: StoragePath, *, fetch: bool = False) -> None:
    """The driver's outputs in ``out`` copied to the run's storage folder, so that it holds
    the whole run (nothing to do when they are one folder); ``fetch``: the other way,
    each one missing here (a resume on another machine keeps the run's history)."""
    here = StoragePath(out)
    if here == run_dir:
        return
    for name in _OUTPUTS:
        source, target = (run_dir / name, here / name) if fetch else (here / name, run_dir / name)
        if source.is_file() and not (fetch and target.exists()):
            target.write_bytes(source.read_bytes())


def _write_summary(out: Path, summary: dict) -> None:
    """``summary.json``, replaced whole (a reader never sees half of it)."""
    partial = out / "summary.json.partial"
    partial.write_text(json.dumps(summary, indent=2, default=str))
    partial.replace(out / "summary.json")


def _previous_summary(out: Path) -> dict:
    """What the run being resumed wrote to its ``summary.json`` so far ({} if nothing)."""
    path = out / "summary.json"
    try:
        previous = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        log.warning(f"note: {path} is not readable ({err}); the resumed run starts a new one")
        return {}
    return previous if isinstance(previous, dict) else {}


_EVALUATION_SETTINGS = ("model", "data", "generator", "retriever", "eval", "warm_start")


def _kept_evaluations(previous: dict, run_config: dict) -> dict:
    """The evaluations before training (and before the warm-start) of the run a resume
    continues, kept when what decides them is unchanged (the policy it started from, the
    data, the generator, retriever, evaluation and warm-start settings): its paired change
    is then measured from the run's true start, not from where it was resumed."""
    config = previous.get("config", {})
    if any(config.get(key) != run_config.get(key) for key in _EVALUATION_SETTINGS):
        changed = [k for k in _EVALUATION_SETTINGS if config.get(k) != run_config.get(k)]
        log.info(f"note: the resumed run changes {', '.join(changed)}: its evaluation before "
              "training is not the first run's, and is made again")  # fmt: skip
        return {}
    keys = ("eval_before", "eval_base", "warm_start")
    return {key: previous[key] for key in keys if key in previous}


def _preflight(cfg: Any, train_q: list[dict]) -> None:
    """Refuse, before Ray starts, what would otherwise fail inside an actor minutes later
    (after the warm-start, with a traceback): the model, the judge's model, the prompt
    template, the field steps are stratified by."""
    from ray_credit.config import InputError
    from ray_credit.pipeline.runner import _strata
    from ray_credit.protocol import load_prompt_template

    check_model("model", cfg.model)
    judge = getattr(cfg, "judge", None)
    if judge is not None and judge.backend == "hf" and judge.model:
        check_model("judge.model", judge.model)
    try:
        load_prompt_template(cfg.generator.prompt_template)
    except (OSError, ValueError, TypeError) as err:
        raise InputError(f"generator.prompt_template: {err}") from None
    try:
        _strata(train_q, cfg.pipeline.stratify_by)
    except ValueError as err:
        raise InputError(str(err)) from None
    _preflight_retrieval(cfg)


def _preflight_retrieval(cfg: Any) -> None:
    """The retriever's inputs, before Ray starts: a server's URL answers; else the corpus
    file's first document reads, the encoder is a preset, a model folder or a known hub id,
    and an index folder given holds an index (or nothing yet)."""
    from ray_credit.actors.retriever import check_index_folder, resolve_encoder_path
    from ray_credit.config import InputError
    from ray_credit.data.loaders import iter_corpus

    retriever = cfg.retriever
    if retriever.url:
        from ray_credit.actors.retrieval_server import RemoteRetriever, RetrievalServiceError

        try:  # a wrong URL fails here, not in every generator mid-run
            RemoteRetriever(retriever.url, retries=1).search(["connection check"], 1)
        except (RetrievalServiceError, ValueError) as err:
            raise InputError(f"retriever.url: {err}") from None
        return
    if cfg.data.corpus is not None and cfg.data.questions != "synthetic":
        try:
            first = next(iter_corpus(cfg.data.corpus, batch_size=1, check_duplicates=False), None)
        except InputError as err:
            raise type(err)(f"data.corpus: {err}") from None
        if first is None:
            raise InputError(f"data.corpus {cfg.data.corpus}: the file holds no document")
    try:
        encoder = resolve_encoder_path(retriever.encoder.name)
    except (ImportError, FileNotFoundError) as err:
        raise InputError(f"retriever.encoder.name: {err}") from None
    check_model("retriever.encoder.name", encoder)
    if retriever.index_folder is not None:
        try:
            check_index_folder(retriever.index_folder)
        except (ValueError, OSError) as err:
            raise InputError(f"retriever.index_folder: {err}") from None


def check_model(setting: str, model: str) -> None:
    """Refuse a model name no actor could load, before Ray starts: an embedded name, a
    folder with ``config.json`` (a Hugging Face model folder) or an id the hub or its
    cache knows (only its config is fetched)."""
    from ray_credit.config import InputError, InputFileNotFoundError
    from ray_credit.models import EMBEDDED_MODELS, _model_name

    usage = (
        f"give an embedded name {sorted(EMBEDDED_MODELS)}, a Hugging Face model folder "
        "(with config.json; a run's policy is its checkpoint's learner/model), or a hub id"
    )
    try:
        name = _model_name(model)  # not a name, blank, or a folder without config.json
    except (TypeError, InputError) as err:
        raise InputError(f"{setting}={model!r}: {err}") from None
    path = Path(name).expanduser()
    if name in EMBEDDED_MODELS or path.is_dir():
        return
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise InputFileNotFoundError(f"{setting}={model!r}: no such folder; {usage}")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(
            f"{setting}={model!r} is not a folder here, and the Hugging Face hub (or its "
            f"cache) gave no such model ({reason}); {usage}"
        ) from None


def _checked_demonstrations(cfg: Any, corpus: Any, questions: list[dict]) -> dict[str, str]:
    """The titles of the documents the training questions' demonstrations search, by id,
    once every demonstration is known to be writable (refused here, before Ray starts,
    when one is not)."""
    from ray_credit.actors.retriever import Corpus
    from ray_credit.config import InputError
    from ray_credit.warm_start import expert_turns

    if cfg.warm_start.questions > len(questions):
        raise InputError(
            f"warm_start.questions={cfg.warm_start.questions} is more than the "
            f"{len(questions)} training questions; give at most {len(questions)} (0: all)"
        )
    docs = Corpus.coerce(corpus)
    titles = {i: c.partition("\n")[0] for i, c in zip(docs.ids, docs.contents, strict=True)}
    for q in questions:
        expert_turns(q, titles, cfg.generator)
    needed = {str(i) for q in questions for i in q["supporting_doc_ids"]}
    return {i: titles[i] for i in needed}  # a large corpus's titles stay here


def _warm_start(
    cfg: Any,
    retriever: Any,
    train_q: list[dict],
    eval_q: list[dict],
    titles: dict[str, str],
    out: Path,
    summary: dict,
    logger: Any,
) -> Any:
    """Evaluate the base policy (``eval.before_warm_start``), fine-tune it on scripted
    demonstrations of the training questions in a task with the learner's resources
    (:func:`ray_credit.warm_start.warm_start`), and return ``cfg`` with ``model`` set to
    the warm-started folder."""
    import ray

    from ray_credit.warm_start import warm_start

    if cfg.eval.enabled and cfg.eval.before_warm_start and "eval_base" not in summary:
        summary["eval_base"] = _evaluate_policy(
            cfg, retriever, None, eval_q, "before the warm-start"
        )
    res, ws = cfg.resources, cfg.warm_start
    folder = ws.folder or str(out / "warm_start")
    task = ray.remote(warm_start).options(
        num_cpus=res.learner_cpus,
        num_gpus=1 if res.use_gpu else 0,
        resources=res.custom("learner"),
    )
    t0 = time.perf_counter()
    manifest = ray.get(task.remote(
        cfg.model, train_q, titles, retriever, cfg.generator, ws, folder,
        device="cuda" if res.use_gpu else "cpu",
    ))  # fmt: skip
    m = manifest["metrics"]
    log.info(
        f"warm-start: {'reused ' + folder if manifest['reused'] else 'saved in ' + folder}; "
        f"{m['warm_start/demonstrations']:.0f} demonstrations of {m['warm_start/questions']:.0f} "
        f"questions ({m['warm_start/left_out_no_gold_seen']:.0f} left out: no gold answer seen), "
        f"loss {m['warm_start/loss_first_epoch']:.3f} -> {m['warm_start/loss_last_epoch']:.3f} "
        f"over {ws.epochs} epoch(s) ({time.perf_counter() - t0:.0f}s)",
    )
    summary["warm_start"] = {"folder": folder, "reused": manifest["reused"], **m}
    logger.log(m, step=0)
    return replace(cfg, model=folder)


def _evaluate_policy(
    cfg: Any, retriever: Any, learner: Any, questions: list[dict], when: str
) -> dict:
    """Exact match of a greedy generator on the learner's current weights (no learner:
    ``cfg.model``'s own) and, with ``eval.samples``, of ``eval.samples`` sampled rollouts
    per question (under ``"sampled"``); each generator lives only for its evaluation, so
    it holds no resources while training."""
    greedy = replace(
        cfg.generator,
        temperature=0.0,
        group_size=1,
        max_new_tokens=cfg.eval.max_new_tokens or cfg.generator.max_new_tokens,
    )
    result = _rollout_evaluation(cfg, retriever, learner, questions, when, greedy)
    if cfg.eval.samples:
        sampled = replace(greedy, temperature=cfg.generator.temperature,
                          group_size=cfg.eval.samples)  # fmt: skip
        result["sampled"] = _rollout_evaluation(cfg, retriever, learner, questions, when, sampled)
    return result


def _rollout_evaluation(
    cfg: Any, retriever: Any, learner: Any, questions: list[dict], when: str, gen: Any
) -> dict:
    """One evaluation of :func:`_evaluate_policy`: ``gen``'s rollouts of ``questions``
    (kept in the warm-started policy's folder, and reused from there, at version 0)."""
    import ray

    t0 = time.perf_counter()
    version = learner.policy_version if learner is not None else 0
    cached = _evaluation_file(cfg, gen, questions) if version == 0 else None
    greedy = gen.group_size == 1
    what = "EM" if greedy else "sampled EM"
    how = "" if greedy else f" ({gen.group_size} samples each at temperature {gen.temperature:g})"
    if cached is not None and cached.is_file():
        result = json.loads(cached.read_text())
        log.info(
            f"eval {when}: {what} {result['em']:.3f} on {len(questions)} held-out questions"
            f"{how} (policy version 0: the {'greedy' if greedy else 'sampled'} "
            f"evaluation of the same policy, questions and settings saved in {cached})",
        )
        return {**result, "reused": str(cached)}
    (actor,) = make_generators(
        cfg.model, retriever, cfg, gen, prefix=None, count=1, num_cpus=cfg.resources.eval_cpus
    )
    if version > 0:
        ray.get(
            actor.update_weights.remote(version, learner.weights()), timeout=cfg.pipeline.timeout_s
        )
    result = evaluate(actor, questions, cfg.pipeline.timeout_s)
    ray.kill(actor)
    if cached is not None:
        cached.parent.mkdir(exist_ok=True)
        partial = cached.with_suffix(".partial")
        partial.write_text(json.dumps(result))
        partial.rename(cached)  # whole or absent
    log.info(
        f"eval {when}: {what} {result['em']:.3f} on {len(questions)} held-out questions{how} "
        f"(policy version {version}, {time.perf_counter() - t0:.0f}s)",
    )
    return result


def _evaluation_file(cfg: Any, gen: Any, questions: list[dict]) -> Path | None:
    """Where the evaluation of a warm-started policy (unchanged since it was saved)
    on ``questions`` is kept, in the policy's folder, named by a fingerprint of everything
    that decides it: the warm start's own fingerprint, the questions and their answers,
    the generator, retriever and data settings. Runs of several methods from one warm
    start (bench/learning.py) then evaluate it once. None: not a warm-started folder, or
    an external retriever (its index can change under the same URL)."""
    manifest = Path(cfg.model) / "warm_start.json"
    if not manifest.is_file() or cfg.retriever.url:
        return None
    settings = {
        "warm_start": json.loads(manifest.read_text())["fingerprint"],
        "questions": [[q["question"], list(q.get("golden_answers") or ())] for q in questions],
        "generator": asdict(gen),
        "retriever": asdict(cfg.retriever),
        "data": asdict(cfg.data),
    }
    return Path(cfg.model) / "evaluations" / f"{settings_fingerprint(settings)}.json"


def _warn_if_short(ray: Any, cfg: Any, plan: Plan) -> None:
    """Say so when the cluster has less of a resource than the run's main actors ask for
    (they would wait, for an autoscaler or forever, without a word from Ray)."""
    from collections import Counter

    res = cfg.resources
    judge_actors = (
        cfg.judge.num_actors if "judge" in plan.services and cfg.judge.backend != "evidence" else 0
    )
    actors = [  # (how many, CPUs, GPUs, role) of each kind
        (res.num_generators, res.generator_cpus, res.generator_gpus, "generator"),
        (int(cfg.eval.enabled), res.eval_cpus, res.generator_gpus, "generator"),
        (int("scorer" in plan.services), res.generator_cpus, res.generator_gpus, "generator"),
        (res.learner_workers, res.learner_cpus, float(res.use_gpu), "learner"),
        (0 if cfg.retriever.url else 1, res.retriever_cpus, 0.0, "service"),
        (judge_actors, res.judge_cpus, 0.0, "service"),
    ]
    wanted: Counter[str] = Counter()
    for count, cpus, gpus, role in actors:
        for name, amount in {"CPU": cpus, "GPU": gpus, **res.custom(role)}.items():
            wanted[name] += count * amount
    have = ray.cluster_resources()
    short = {k: v for k, v in wanted.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        needs = ", ".join(f"{v:g} {k} (cluster has {have.get(k, 0.0):g})" for k, v in short.items())
        log.warning(
            f"warning: this run's actors ask for {needs}; they will wait for an autoscaler "
            "to add nodes. Without one, lower --resources.* (generator_cpus, learner_cpus, "
            "eval_cpus, ...) or unset the custom resources to fit.",
        )


def run_config_class(script: str | os.PathLike[str], name: str) -> type:
    """The run config class ``name`` of a pipeline script (``pipelines/<method>.py``; the
    scripts are not a package), imported once per process."""
    import importlib.util

    path = Path(script)
    module_name = "pipelines_" + path.stem
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return getattr(sys.modules[module_name], name)


def load_config(
    cls: type,
    estimator: str,
    argv: Sequence[str] | None = None,
    *,
    doc: str | None = None,
    default_config: str | Path | None = None,
) -> Any:
    """``cls`` from its defaults, the estimator's recipe, the YAML file (``--config``, else
    ``default_config``) and the flags in ``argv``, in that order."""
    from ray_credit.config import apply_overrides, parse_config

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = recipe_defaults(cls(), estimator)
    resumed = _resumed_settings(argv)
    if resumed is not None:  # the run being resumed replaces the default file
        try:
            defaults = apply_overrides(defaults, resumed)
        except (TypeError, ValueError) as err:
            from ray_credit.config import InputError

            raise InputError(
                f"--resume: the checkpoint's run config does not fit this pipeline ({err}); "
                "resume it with the pipeline that wrote it"
            ) from None
        default_config = None
    return parse_config(
        cls, argv, description=doc, defaults=defaults, default_config=default_config
    )


def _resumed_settings(argv: Sequence[str]) -> dict[str, Any] | None:
    """The settings of the run ``--resume`` continues (``{"section.field": value}``, what
    :func:`train` saved with its checkpoints), so that a resume repeats none of its flags;
    ``--config`` and flags given with ``--resume`` still override them. None without
    ``--resume`` (or ``--help``), or for a checkpoint saved without its run's settings."""
    import argparse

    from ray_credit.config import _flatten

    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--resume")
    first.add_argument("-h", "--help", action="store_true")
    known, _ = first.parse_known_args(argv)
    if known.help or known.resume in (None, "none", "None"):
        return None
    chosen = check_resume_folder(known.resume)  # refused here, naming it, when not whole
    run = checkpoint_state(chosen)["metadata"].get("run_config")
    if run is None:
        log.info(
            f"note: {chosen} holds no run config (an older checkpoint): the settings come "
            "from the defaults, --config and the flags, as for a new run",
        )
        return None
    return {key: value for key, value in _flatten(run) if key != "resume"}


def main(
    cls: type,
    estimator: str,
    doc: str,
    *,
    default_config: str | Path | None = None,
    argv: Sequence[str] | None = None,
) -> dict:
    """What a pipeline script runs: :func:`load_config`, then :func:`train`."""
    from ray_credit.config import InputError

    prog = Path(sys.argv[0]).name
    try:
        cfg = load_config(cls, estimator, argv, doc=doc, default_config=default_config)
    except InputError as err:  # the user's to fix: one line, as argparse's errors
        raise SystemExit(f"{prog}: error: {err}") from None
    try:
        return train(cfg, estimator)
    except InputError as err:
        raise SystemExit(f"{prog}: error: {err}") from None
    except Exception as err:  # an actor, a task or the loop failed: one line, not 300
        trace = Path(cfg.output_dir).resolve() / cfg.name / "error.log"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        log.debug(trace.read_text())
        raise SystemExit(
            f"{prog}: error: {failure_summary(err)} (traceback: {trace}{_worker_logs()})"
        ) from None


def failure_summary(err: BaseException) -> str:
    """One line naming what failed and why: the remote exception of a failed task or actor
    call (its type, function, process and node), an actor's death, or the error itself."""
    import ray.exceptions

    for cause in _chain(err):
        if isinstance(cause, ray.exceptions.RayTaskError):
            inner = cause.cause
            where = f"{cause.function_name} (pid {cause.pid}, node {cause.ip})"
            return f"{type(inner).__name__} in {where}: {_first_line(inner)}"
    for cause in _chain(err):
        if isinstance(cause, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)):
            return f"{type(err).__name__}: {_first_line(err)}; cause: {_first_line(cause)}"
    return f"{type(err).__name__}: {_first_line(err)}"


def _chain(err: BaseException | None):
    """``err`` and the exceptions it was raised from, outermost first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "(no message)"


def _worker_logs() -> str:
    """``; worker logs: <the session's log folder>`` while Ray is connected, else ''."""
    import ray

    if not ray.is_initialized():
        return ""
    node = ray._private.worker._global_node  # the only handle on the session's folder
    return f"; worker logs: {node.get_logs_dir_path()}" if node is not None else ""
