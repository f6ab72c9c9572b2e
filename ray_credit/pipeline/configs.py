"""A run's settings: one config section per part of the run, the run config that holds
them, and how a pipeline script builds it.

A pipeline script (``pipelines/tspo.py``) is a run config with its estimator's section
plus one call: ``main(TSPORun, "tspo", __doc__)``. Settings come from, in order: the
config classes' defaults (general ones: Search-R1's rollout protocol, verl's learner), the
estimator's recipe (the loss, KL and signal settings its paper trains with;
:mod:`ray_credit.pipeline.plan`), one YAML file (``--config``; by default
:data:`EMBEDDED_CONFIG`, the small CPU run of the embedded model, shipped in the package)
and the flags. ``--help`` shows the result; an unknown flag or key is refused with the
nearest settings.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from ray_credit.actors.generator import RETRIEVAL_TIMEOUT_S, GeneratorConfig
from ray_credit.actors.index_build import BuildConfig
from ray_credit.actors.judge import Backend as JudgeBackend
from ray_credit.actors.learner import LearnerConfig, Strategy
from ray_credit.actors.retriever import EncoderConfig, IndexConfig
from ray_credit.config import check_fields
from ray_credit.data import WorldConfig
from ray_credit.log import LogLevel, log
from ray_credit.pipeline.plan import recipe_defaults
from ray_credit.pipeline.runner import PipelineConfig, checkpoint_state
from ray_credit.warm_start import WarmStartConfig

__all__ = [
    "EMBEDDED_CONFIG",
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "ResourcesConfig",
    "RetrieverConfig",
    "RunConfig",
    "WandbConfig",
    "check_gpu_share",
    "check_resource_use",
    "foreign_sections",
    "load_config",
]

EMBEDDED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "embedded.yaml"
"""The embedded run's settings (SmolLM2-135M, MiniLM, the synthetic world, sized for a
2-core CPU): what a pipeline script trains when no ``--config`` is given."""


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
    prompts: Literal["file", "template"] = "file"
    """Each question's prompt: 'file' (a question file's own 'prompt' column, the chat
    messages Search-R1's parquet files hold, used as given where a question has one;
    generator.prompt_template renders the others) or 'template' (generator.prompt_template
    for every question)."""

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
    generators: Literal["training", "own"] = "training"
    """Who rolls the evaluations out: 'training' (the training generators, between the
    steps they train: nothing extra to place) or 'own' (one generator of its own,
    resources.eval_cpus and a generator's GPUs, made for each evaluation while training's
    are not up)."""
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
class WandbConfig:
    """Weights & Biases: the run's metrics, its evaluations and its settings (``--wandb
    MODE`` is short for ``--wandb.mode MODE``)."""

    SHORTHAND: ClassVar[str] = "mode"

    mode: Literal["offline", "online", "disabled"] = "offline"
    """'offline' (default: kept in the run's folder, `wandb sync` uploads it), 'online'
    (needs a key: WANDB_API_KEY or `wandb login`) or 'disabled'."""
    project: str = "ray_credit"
    """The wandb project."""
    entity: str | None = None
    """The team or user the project belongs to (None: the key's default entity)."""
    group: str | None = None
    """Groups runs in wandb's interface (the seeds of one method, a sweep)."""
    tags: tuple[str, ...] = ()
    """Tags of the run (comma-separated on the command line: --wandb.tags tspo,3b)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.project.strip():
            raise ValueError("wandb.project must name a project, got a blank string")
        if "/" in self.project and self.entity is None:  # wandb's own 'entity/project'
            team, _, project = self.project.partition("/")
            raise ValueError(
                f"wandb.project={self.project!r}: a project name cannot hold '/'; for project "
                f"{project!r} of team {team!r} give --wandb.entity {team} --wandb.project "
                f"{project}"
            )
        _check_wandb_name("project", self.project)
        if self.entity is not None:
            if not self.entity.strip() or any(c.isspace() for c in self.entity):
                raise ValueError(
                    f"wandb.entity={self.entity!r}: a wandb user or team name has no spaces "
                    "(and is not blank); give the name in your wandb URL (wandb.ai/ENTITY), or "
                    "null for your key's default entity"
                )
            _check_wandb_name("entity", self.entity)
        if self.group is not None and not 1 <= len(self.group) <= WANDB_NAME_MAX:
            raise ValueError(
                f"wandb.group is {len(self.group)} characters; wandb takes a group of 1 to "
                f"{WANDB_NAME_MAX} (null for none)"
            )
        for tag in self.tags:
            if not tag.strip() or len(tag) > 64:
                raise ValueError(
                    f"wandb.tags: {tag!r} is not a tag wandb takes (1 to 64 characters)"
                )


WANDB_NAME_MAX = 128
"""The longest project, entity, group and run name wandb takes (its client refuses a
longer project at ``wandb.init``; its server a longer group or run name)."""
WANDB_FORBIDDEN = "/\\#?%:"
"""What a wandb project name cannot hold (``wandb.sdk.wandb_settings``'s check, made at
``wandb.init``, after the retriever is up); an entity is the project's path before it."""


def _check_wandb_name(field: str, value: str) -> None:
    """wandb's own rules for a project name (and, as the first part of a project's path,
    an entity's), checked here so that a run is refused before Ray starts."""
    if len(value) > WANDB_NAME_MAX:
        raise ValueError(
            f"wandb.{field} is {len(value)} characters; wandb takes at most {WANDB_NAME_MAX}"
        )
    found = "".join(sorted({c for c in value if c in WANDB_FORBIDDEN}))
    if found:
        raise ValueError(
            f"wandb.{field}={value!r} holds {', '.join(map(repr, found))}, which wandb does not "
            f"take in a {field} name ({' '.join(WANDB_FORBIDDEN)}); use '-' or '_' instead"
        )


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
    index_file: str | None = None
    """A faiss index built elsewhere on the corpus's line order (Search-R1's e5_Flat.index):
    checked against the corpus and the encoder once, then served (never copied)."""
    build: BuildConfig = field(default_factory=BuildConfig)
    """How the index is built when index_folder (or the cache) holds none; wiki-scale
    corpora are best built beforehand: python -m ray_credit.index build."""
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
    learner_gpus: float = 1.0
    """With use_gpu: the GPUs of each learner replica: 1, or a share of one for a single
    replica that shares its GPU with a generator (a one-GPU machine)."""
    retriever_cpus: float = 0.25
    """CPUs of the retriever actor."""
    retriever_gpus: float = 0.0
    """GPUs of each retriever actor: its encoder runs on them, and with faiss-gpu its index,
    sharded over them (see retriever.index.gpu_devices)."""
    retriever_gpu_share: float = 0.0
    """A share of every learner and generator GPU for the retriever's index (0: none;
    e.g. 0.1): a flat index is split into one slice per such GPU, each slice held in
    float16 by an actor asking this share of the GPU, beside the learner or generator,
    which asks the rest; a search meets every slice at once (Search-R1's layout: wiki-18's
    e5 index is 4 GB a GPU over 8). The encoder and the corpus stay in the retriever actor
    (its retriever_cpus, and retriever_gpus if any are free). A share is what Ray counts;
    the memory plan printed before Ray starts adds each slice to its GPU's memory."""
    retriever_replicas: int = 1
    """Retriever actors; generator i searches replica i mod this. Replicas of one node
    share the memory-mapped corpus and CPU index; the index is built once, before them."""
    judge_cpus: float = 0.25
    """CPUs of each judge actor (LLM backends)."""
    eval_cpus: float = 2.0
    """CPUs of the evaluation's own generator (eval.generators: own, and the base policy's
    evaluation before a warm-start)."""
    scorer_gpus: float | None = None
    """GPUs of the info-gain scorer (IGPO, A²TGPO). None: as a generator's. A share below 1
    beside whole-GPU generators puts it on generator 0's GPU: both start in one bundle of
    that GPU, generator 0 asking (and its vLLM engine using) the rest."""
    cpu_rehearsal: bool = False
    """Rehearse a GPU run on CPUs: every actor asks Ray for its GPUs (logical ones, as a
    local Ray given resources.local_gpus or a fake cluster's node types have) and is
    placed as on the GPU cluster, but computes on CPUs: a small model checks a cluster
    config end to end before the GPUs are paid for."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU, for the estimate printed before Ray starts (None: what
    nvidia-smi reports on this machine; a cluster's head may have no GPU to ask)."""
    local_gpus: int | None = None
    """GPUs of a local Ray started by the script (None: the machine's, as Ray counts them).
    Logical: more than the machine has lets a plan be placed and tried without them."""
    cluster_config: str | None = None
    """The cluster launcher YAML a run on a cluster is placed against before any actor
    starts: its node types, each up to its max_workers (None: ~/ray_bootstrap_config.yaml,
    which `ray up` leaves on the head; else the nodes up now)."""
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
        for name in ("num_generators", "learner_workers", "retriever_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"resources.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("generator_cpus", "generator_gpus", "learner_cpus", "retriever_cpus",
                     "retriever_gpus", "judge_cpus", "eval_cpus"):  # fmt: skip
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"resources.{name} must be a finite number >= 0, got {getattr(self, name)}"
                )
        if not 0 <= self.retriever_gpu_share < 1:
            raise ValueError(
                f"resources.retriever_gpu_share must lie in [0, 1): a share of each learner "
                f"and generator GPU (0.1 for a flat index's slices), got {self.retriever_gpu_share}"
            )
        for name in ("generator_gpus", "retriever_gpus", "scorer_gpus"):
            gpus = getattr(self, name)
            if gpus is not None and gpus > 1 and not float(gpus).is_integer():
                raise ValueError(
                    f"resources.{name}={gpus:g}: Ray gives a share of one GPU (below 1) or "
                    "whole GPUs; use a fraction below 1 or a whole number"
                )
        if self.scorer_gpus is not None and not 0 <= self.scorer_gpus < math.inf:
            raise ValueError(
                f"resources.scorer_gpus must be a finite number >= 0, or null for a "
                f"generator's, got {self.scorer_gpus}"
            )
        if self.scorer_gpus is not None and self.scorer_gpus > 1:
            raise ValueError(
                f"resources.scorer_gpus={self.scorer_gpus:g}: the info-gain scorer is one model "
                f"on one device, so {self.scorer_gpus - 1:g} of its GPUs would be held and never "
                "used; give --resources.scorer_gpus 1, or a share below 1 (0.25: on generator "
                "0's GPU)"
            )
        if not 0 < self.learner_gpus <= 1:
            raise ValueError(
                f"resources.learner_gpus must be in (0, 1]: a learner replica drives one GPU, "
                f"or a share of one; got {self.learner_gpus}"
            )
        if self.learner_gpus != 1 and not self.use_gpu:
            raise ValueError(
                f"resources.learner_gpus={self.learner_gpus:g} is the GPU share of a learner "
                "replica that trains on GPUs, but resources.use_gpu is false (it trains on "
                "CPUs and asks for no GPU); add --resources.use_gpu true, or drop learner_gpus"
            )
        if self.learner_gpus < 1 and self.learner_workers > 1:
            raise ValueError(
                f"resources.learner_gpus={self.learner_gpus:g} shares a GPU, which "
                f"{self.learner_workers} data-parallel replicas cannot do (each drives its "
                "own device): use learner_gpus 1, or one learner_workers"
            )
        if self.gpu_memory_gb is not None and not 0 < self.gpu_memory_gb < math.inf:
            raise ValueError(
                f"resources.gpu_memory_gb must be a size in GB > 0, or null for nvidia-smi's, "
                f"got {self.gpu_memory_gb}"
            )
        if self.local_gpus is not None and self.local_gpus < 0:
            raise ValueError(
                f"resources.local_gpus must be >= 0, or null for the machine's, got "
                f"{self.local_gpus}"
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
    storage_shared: bool | None = None
    """Whether every node sees storage_path as this one does. None: judged from its
    filesystem (a URI, or NFS, EFS, Lustre, a FUSE mount: yes; a local disk: no, and a run
    across nodes is refused before any actor starts). true: you vouch for it (a
    filesystem not recognized, a fake-multinode cluster on one machine)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (--wandb disabled | offline | online; --wandb.project, ...)."""
    log_level: LogLevel = "info"
    """What the run prints: 'info' (each stage and step), 'warning' (problems only),
    'error', or 'debug' (also the libraries' own logs: vLLM, transformers, warnings)."""
    reproduces: str | None = None
    """A published setup this config reproduces ('search-r1': Search-R1's NQ + HotpotQA
    run as TSPO trains it): before Ray starts the run prints every setting where it
    departs from that setup, with the setup's value and its source
    (ray_credit.pipeline.published). None: no such comparison."""
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
        if self.reproduces is not None:
            from ray_credit.pipeline.published import SETUPS

            if self.reproduces not in SETUPS:
                raise ValueError(
                    f"reproduces={self.reproduces!r} names no published setup; give one of "
                    f"{sorted(SETUPS)}, or leave it out"
                )
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
        if self.generator.group_size < 2:
            raise ValueError(
                f"generator.group_size={self.generator.group_size}: every estimator compares "
                "the G samples of a question with each other, and one sample has nothing to "
                "compare with (its group-normalized advantage is 0, or under GRPO's singleton "
                "rule the raw reward with no baseline); use --generator.group_size 2 or more "
                "(Search-R1 and the papers use 5)"
            )
        if self.generator.backend == "vllm":
            _check_vllm(self.generator, self.resources, self.pipeline)
        check_resource_use(self.resources, self.generator, self.retriever)
        if self.resources.retriever_gpu_share and self.warm_start.enabled:
            raise ValueError(
                f"resources.retriever_gpu_share={self.resources.retriever_gpu_share:g} holds "
                "a share of every learner GPU for the whole run, and the warm-start trains on "
                "those GPUs whole (a Ray Train job) before RL; warm-start in a run without the "
                "share, then train with the share from the policy it saved: --model <its "
                "warm_start folder> --warm_start.enabled false"
            )
        if self.wandb.mode != "disabled" and len(self.name) > WANDB_NAME_MAX:
            raise ValueError(
                f"name is {len(self.name)} characters, and it names the wandb run too, which "
                f"takes at most {WANDB_NAME_MAX}; give a shorter --name (or --wandb disabled)"
            )


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


def check_resource_use(res: ResourcesConfig, gen: GeneratorConfig, retriever: Any) -> None:
    """Refuse what an actor would ask Ray for and never use, and a share it would overrun
    (a training run's, and ``pipelines/eval.py``'s, before Ray starts). Ray holds what an
    actor asks for, for as long as it lives, away from every other actor: a second GPU a
    generator's engine does not span is a GPU no one computes on, without a word. Each
    refusal names the flag and what to set. The info-gain scorer's GPUs are checked with
    the plan that has one (:func:`~ray_credit.pipeline.placement.run_asks`)."""
    gpus, tp = res.generator_gpus, gen.vllm.tensor_parallel_size
    if gen.backend == "vllm":
        if tp > 1 and gpus != tp:
            raise ValueError(
                f"generator.vllm.tensor_parallel_size={tp} spans {tp} GPUs, but each generator "
                f"asks Ray for resources.generator_gpus={gpus:g}; set them equal"
            )
        if tp == 1 and gpus > 1:
            raise ValueError(
                f"resources.generator_gpus={gpus:g} gives each generator {gpus:g} GPUs, but its "
                "vLLM engine runs on one (generator.vllm.tensor_parallel_size=1): the others "
                "would be held and never used; set --resources.generator_gpus 1, or "
                f"--generator.vllm.tensor_parallel_size {gpus:g} to span them"
            )
        util = gen.vllm.gpu_memory_utilization
        if 0 < gpus < 1 and util > gpus + 1e-9:
            raise ValueError(
                f"resources.generator_gpus={gpus:g} gives each generator {gpus:g} of a GPU, but "
                f"its vLLM engine takes generator.vllm.gpu_memory_utilization={util:g} of the "
                "GPU's memory, more than its share, and fails to start beside the actors "
                f"sharing the GPU; set --generator.vllm.gpu_memory_utilization {gpus:g} or "
                "less, or --resources.generator_gpus 1"
            )
    else:
        if tp > 1:
            raise ValueError(
                f"generator.vllm.tensor_parallel_size={tp} is a setting of vLLM's engine, and "
                f"generator.backend is {gen.backend!r}, which does not read it; use "
                "--generator.backend vllm, or drop the setting"
            )
        if gpus > 1:
            raise ValueError(
                f"resources.generator_gpus={gpus:g} gives each generator {gpus:g} GPUs, but a "
                f"{gen.backend} generator computes on one device: the others would be held "
                "and never used; set --resources.generator_gpus 1 (or a share below 1), or "
                f"span them with --generator.backend vllm --generator.vllm.tensor_parallel_size "
                f"{gpus:g}"
            )
    if retriever.url:
        for name, unused in (("retriever_gpus", res.retriever_gpus > 0),
                             ("retriever_replicas", res.retriever_replicas > 1),
                             ("retriever_gpu_share", res.retriever_gpu_share > 0)):  # fmt: skip
            if unused:
                raise ValueError(
                    f"resources.{name}={getattr(res, name):g} is for the retriever actors a run "
                    f"builds, and retriever.url={retriever.url!r} searches a server instead "
                    f"(no retriever actor starts); drop one of them"
                )
        return
    if res.retriever_gpu_share:
        check_gpu_share(res, gen, retriever)
    if res.retriever_replicas > res.num_generators:
        idle = res.retriever_replicas - res.num_generators
        raise ValueError(
            f"resources.retriever_replicas={res.retriever_replicas} with "
            f"resources.num_generators={res.num_generators}: generator i searches replica i "
            f"mod {res.retriever_replicas}, so {idle} replica(s) would each load the index "
            "and hold their resources, and never be searched; give --resources."
            f"retriever_replicas {res.num_generators} or fewer"
        )
    index = retriever.index
    if res.retriever_gpus > 1 and (index.use_gpu is False or index.kind == "hnsw"):
        hnsw = index.kind == "hnsw"
        why = "faiss runs HNSW on CPUs only" if hnsw else "retriever.index.use_gpu is false"
        raise ValueError(
            f"resources.retriever_gpus={res.retriever_gpus:g}: a retriever's encoder runs on "
            f"one GPU, and its index on none ({why}), so the others would be held and never "
            "used; set --resources.retriever_gpus 1 (or shard a flat or IVF index over them "
            "with faiss-gpu: --retriever.index.use_gpu true)"
        )
    devices = index.devices()
    if devices is None or index.use_gpu is False or index.kind == "hnsw":
        return
    seen = math.ceil(res.retriever_gpus)  # the devices Ray makes visible to the actor
    if not seen:
        raise ValueError(
            f"retriever.index.gpu_devices={index.gpu_devices!r} names GPUs, but the retriever "
            "asks Ray for none (resources.retriever_gpus=0); give --resources.retriever_gpus "
            "N, or leave gpu_devices 'all'"
        )
    beyond = [d for d in devices if d >= seen]
    if beyond:
        raise ValueError(
            f"retriever.index.gpu_devices={index.gpu_devices!r} names device {beyond[0]}, but "
            f"each retriever actor sees only the {seen} GPU(s) it asks Ray for "
            f"(resources.retriever_gpus={res.retriever_gpus:g}: devices 0 to {seen - 1}); give "
            "devices below that, 'all', or more resources.retriever_gpus"
        )
    used = {0, *devices}  # the encoder computes on device 0
    if len(used) < seen:
        raise ValueError(
            f"retriever.index.gpu_devices={index.gpu_devices!r} and the encoder (device 0) use "
            f"{len(used)} of the {seen} GPUs each retriever actor asks for "
            f"(resources.retriever_gpus={res.retriever_gpus:g}): the others would be held and "
            f"never used; give gpu_devices 'all', or --resources.retriever_gpus {len(used)}"
        )


def check_gpu_share(res: ResourcesConfig, gen: GeneratorConfig, retriever: Any) -> None:
    """Refuse a ``resources.retriever_gpu_share`` its run cannot place: the slices go
    beside learners and generators of one whole GPU each, and hold a flat index."""
    share = res.retriever_gpu_share
    flag = f"resources.retriever_gpu_share={share:g}"
    if not res.use_gpu:
        raise ValueError(
            f"{flag} puts index slices on the learners' GPUs, and the learners ask for none "
            "(resources.use_gpu false); give --resources.use_gpu true (a CPU rehearsal "
            "too: its GPUs are logical), or drop the share"
        )
    whole = [(name, value) for name, value in (("learner_gpus", res.learner_gpus),
             ("generator_gpus", res.generator_gpus)) if value != 1]  # fmt: skip
    if whole:
        name, value = whole[0]
        raise ValueError(
            f"{flag} splits each learner and generator GPU between it and an index slice, "
            f"so each must hold one whole GPU; resources.{name} is {value:g}: set it to 1"
        )
    if retriever.index.kind != "flat":
        raise ValueError(
            f"{flag} serves a flat index in slices, and retriever.index.kind is "
            f"{retriever.index.kind!r} (searched whole, on CPUs); use --retriever.index.kind "
            "flat, or drop the share and serve this index on the retriever's CPUs"
        )
    if retriever.index.use_gpu:
        raise ValueError(
            f"{flag} holds the index in slices on the learners' and generators' GPUs, with "
            "torch; retriever.index.use_gpu true asks faiss-gpu to copy it whole to the "
            "retriever's own GPUs as well: drop one of them"
        )
    if res.retriever_replicas > 1:
        raise ValueError(
            f"{flag}: one retriever searches the slices of every GPU; "
            f"resources.retriever_replicas={res.retriever_replicas} would ask each GPU for "
            "a slice per replica; drop retriever_replicas (one retriever keeps up: its "
            "search is spread over all the GPUs)"
        )


def load_config(
    cls: type,
    estimator: Any,
    argv: Sequence[str] | None = None,
    *,
    doc: str | None = None,
    default_config: str | Path | None = EMBEDDED_CONFIG,
) -> Any:
    """``cls`` from its defaults, the recipe of ``estimator`` (a registered name or an
    :class:`~ray_credit.estimators.Estimator`, a composition's), the YAML file (``--config``, else
    ``default_config``; None: none) and the flags in ``argv``, in that order. A flag or key
    no section of ``cls`` has is refused with the nearest settings, or, for another
    method's section, with the pipeline it belongs to (:func:`foreign_sections`)."""
    from ray_credit.config import apply_overrides, parse_config

    argv = list(sys.argv[1:] if argv is None else argv)
    _note_demo_settings(argv, default_config)
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
        cls,
        argv,
        description=doc,
        defaults=defaults,
        default_config=default_config,
        foreign_sections=foreign_sections(cls),
    )


def _note_demo_settings(argv: Sequence[str], default_config: str | Path | None) -> None:
    """One line when a question file of the user's meets the embedded CPU demo's settings
    (no --config): which file the settings come from, and the one for real data."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if "--config" in given or "--resume" in given or default_config is None:
        return
    questions = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--data.questions"),
                     next((a.split("=", 1)[1] for a in argv if a.startswith("--data.questions=")),
                          None))  # fmt: skip
    if questions in (None, "synthetic"):
        return
    log.info(
        f"note: --data.questions {questions} with the embedded demo's settings ({default_config}: "
        "SmolLM2 on a CPU, 32 tokens a turn, one document a search, a warm-start on scripted "
        "demonstrations); for Search-R1's recipe on GPUs add --config "
        "pipelines/configs/search_r1.yaml"
    )


def foreign_sections(cls: type) -> dict[str, str]:
    """The sections that other methods' run configs have and ``cls`` lacks (an estimator's,
    a signal's, the judge's), each with the sentence that says where it belongs, for the
    error a setting of one gets (``--igpo.gamma`` given to ``pipelines/tspo.py``)."""
    import dataclasses

    from ray_credit.estimators import ESTIMATORS
    from ray_credit.signals import get_signal

    own = {f.name for f in dataclasses.fields(cls)}
    users: dict[str, list[str]] = {}
    for name, est in ESTIMATORS.items():
        users.setdefault(name, []).append(name)
        for signal in est.signals:
            if dataclasses.fields(get_signal(signal)):  # a signal with settings has a section
                users.setdefault(signal, []).append(name)
            if get_signal(signal).service == "judge":
                users.setdefault("judge", []).append(name)
    trained = [name for name in own if name in ESTIMATORS]
    this = f"; this run trains {trained[0]} (its settings: --{trained[0]}.*)" if trained else ""
    scripts = Path(sys.argv[0]).resolve().parent  # pipelines/, when a script runs
    out = {}
    for section, names in users.items():
        if section in own:
            continue
        names = list(dict.fromkeys(names))
        shipped = [f"pipelines/{n}.py" for n in names if (scripts / f"{n}.py").is_file()]
        where = f" ({', '.join(shipped)})" if shipped else ""
        whose = (
            f"the {section} estimator's"
            if section in ESTIMATORS
            else "the judge's"
            if section == "judge"
            else f"the {section} signal's"
        )
        out[section] = (
            f"--{section}.* are {whose} settings, for a run that trains "
            f"{' or '.join(names)}{where}{this}"
        )
    return out


def _resumed_settings(argv: Sequence[str]) -> dict[str, Any] | None:
    """The settings of the run ``--resume`` continues (``{"section.field": value}``, what
    :func:`~ray_credit.pipeline.recipe.train` saved with its checkpoints), so that a resume repeats none of its flags;
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
    from ray_credit.pipeline.preflight import check_resume_folder

    chosen = check_resume_folder(known.resume)  # refused here, naming it, when not whole
    run = checkpoint_state(chosen)["metadata"].get("run_config")
    if run is None:
        log.info(
            f"note: {chosen} holds no run config (an older checkpoint): the settings come "
            "from the defaults, --config and the flags, as for a new run",
        )
        return None
    return {key: value for key, value in _flatten(run) if key != "resume"}
