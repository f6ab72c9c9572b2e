"""What every pipeline script shares: its config tree and one ``train(config, stages)``.

A pipeline script (``pipelines/tspo.py``) is its estimator's config plus a few lines:
parse the config, say which stages make its signals, call :func:`train`. ``train``
connects to Ray (the cluster of ``ray job submit`` / ``RAY_ADDRESS``, else a local one),
builds the data, the retriever, generators, an evaluation generator and the learner,
evaluates exact match on held-out questions, runs the :class:`Pipeline`, evaluates again
and writes, under ``output_dir/name``: ``metrics.jsonl`` (one line per step),
``summary.json``, ``plot.png`` (reward and EM over steps), the checkpoint and wandb's run
(offline unless asked).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.actors.learner import LearnerConfig
from ray_credit.data import WorldConfig
from ray_credit.losses import PolicyLossConfig
from ray_credit.pipeline.runner import Pipeline, PipelineConfig

__all__ = [
    "DataConfig",
    "EvalConfig",
    "JudgeConfig",
    "ResourcesConfig",
    "RunConfig",
    "connect",
    "evaluate",
    "load_data",
    "make_generators",
    "make_judge_pool",
    "make_retriever",
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
    world: WorldConfig = field(default_factory=lambda: WorldConfig(num_entities=60))
    """The synthetic world's settings."""


@dataclass(frozen=True)
class EvalConfig:
    """Exact match before and after training: greedy, one sample per question."""

    enabled: bool = True
    """Evaluate before and after training."""
    max_new_tokens: int | None = None
    """Token limit per turn (None: the generator's)."""


@dataclass(frozen=True)
class JudgeConfig:
    """The judge pool of CW-GRPO and Search-P1."""

    backend: str = "evidence"
    """'evidence' (from gold answers and supporting documents), 'hf' or 'openai'."""
    num_actors: int = 1
    """Judge actors (0: in the driver)."""
    model: str | None = None
    """hf: the judge model (id or folder); openai: the served model's name."""
    base_url: str | None = None
    """openai: the endpoint (e.g. a vLLM server's http://host:8000/v1)."""
    max_concurrency: int = 8
    """Judge calls in flight across the pool."""
    timeout_s: float = 60.0
    """Per-call timeout."""
    max_retries: int = 3
    """Retries of a failed call before its judgements are null (and counted)."""


def make_judge_pool(cfg: JudgeConfig, corpus: Any, resources: ResourcesConfig | None = None):
    """A JudgePool from its config section (``corpus`` feeds the evidence judge's titles;
    ``resources.service_resource`` places its actors)."""
    from ray_credit.actors.judge import JudgePool

    kwargs: dict[str, Any] = {}
    if cfg.backend == "evidence":
        from ray_credit.data.loaders import load_corpus

        kwargs["corpus"] = load_corpus(corpus) if isinstance(corpus, (str, os.PathLike)) else corpus
    elif cfg.backend == "hf":
        kwargs["model"] = cfg.model
    elif cfg.backend == "openai":
        kwargs.update(model=cfg.model, base_url=cfg.base_url)
    return JudgePool(
        cfg.backend,
        num_actors=cfg.num_actors,
        max_concurrency=cfg.max_concurrency,
        timeout_s=cfg.timeout_s,
        max_retries=cfg.max_retries,
        num_cpus=0.25,
        resources=resources.custom("service") if resources is not None else None,
        **kwargs,
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
    """Learner replicas (>1: Ray Train DDP)."""
    learner_cpus: float = 2.0
    """CPUs per learner replica."""
    learner_strategy: str = "ddp"
    """With learner_workers > 1: 'ddp' (a full replica per worker) or 'fsdp' (parameters,
    gradients and optimizer state sharded over the workers)."""
    use_gpu: bool = False
    """Train on GPUs (one per learner replica)."""
    retriever_cpus: float = 0.25
    """CPUs of the retriever actor."""
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
        from ray_credit.actors.learner_group import check_strategy

        check_strategy(self.learner_strategy)  # at parse time, not after the actors start

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
    encoder: str = "minilm"
    """Retriever encoder: 'minilm', 'e5' or an HF id / folder."""
    retriever_url: str | None = None
    """An existing Search-R1 style `/retrieve` server (http://host:port/retrieve) to search
    instead of building an index here; the corpus then only feeds the judges."""
    output_dir: str = "runs"
    """Outputs go to output_dir/name."""
    resume: str | None = None
    """A checkpoint folder to continue from (output_dir/name/checkpoint)."""
    wandb: str = "offline"
    """'offline' (default), 'online' (needs a key: WANDB_API_KEY or `wandb login`) or 'disabled'."""
    data: DataConfig = field(default_factory=DataConfig)
    generator: GeneratorConfig = field(
        default_factory=lambda: GeneratorConfig(
            group_size=4,
            max_turns=2,
            max_new_tokens=32,
            topk=2,
            prompt_template="search_tags_fewshot",
            response_prefix="<search>",
            final_turn_prefix="<answer>",
            temperature=0.8,
            top_p=0.95,
            max_context_tokens=2048,
        )
    )
    learner: LearnerConfig = field(
        default_factory=lambda: LearnerConfig(
            lr=1e-5,
            temperature=0.8,
            micro_batch_tokens=1024,  # logits of a 49k vocabulary: ~0.2 GB per 1k tokens
            loss=PolicyLossConfig(agg_mode="token-mean"),
        )
    )
    pipeline: PipelineConfig = field(
        default_factory=lambda: PipelineConfig(steps=6, groups_per_step=4, max_staleness=1)
    )
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb must be offline, online or disabled, got {self.wandb!r}")

    def check(self) -> None:
        """Checks across sections (run once the whole config is assembled)."""
        gen_t = self.generator.temperature or 1.0
        if abs(gen_t - self.learner.temperature) > 1e-9:
            raise ValueError(
                f"learner.temperature ({self.learner.temperature}) must equal the generator's "
                f"sampling temperature ({gen_t}; greedy: 1), or the on-policy ratio is not 1: "
                f"pass --generator.temperature T --learner.temperature T together"
            )


# ----------------------------------------------------------------------------- data
def load_data(cfg: RunConfig):
    """(corpus, training questions, evaluation questions)."""
    data = cfg.data
    if data.questions == "synthetic":
        from ray_credit.data import make_world

        world = make_world(data.world)
        corpus, questions = world.corpus, list(world.questions)
    else:
        from ray_credit.data.loaders import load_qa

        if data.corpus is None:
            raise ValueError(
                f"data.questions={data.questions!r} needs data.corpus (FlashRAG jsonl)"
            )
        corpus, questions = data.corpus, load_qa(data.questions)
    if data.eval_file is not None:
        from ray_credit.data.loaders import load_qa

        return corpus, questions, load_qa(data.eval_file)
    if data.eval_questions >= len(questions):
        raise ValueError(
            f"data.eval_questions={data.eval_questions} leaves no training question out of "
            f"{len(questions)}"
        )
    order = np.random.default_rng(cfg.pipeline.seed + 7919).permutation(len(questions))
    held = set(order[: data.eval_questions].tolist())
    train_q = [q for i, q in enumerate(questions) if i not in held]
    eval_q = [questions[i] for i in sorted(held)]
    return corpus, train_q, eval_q


# ----------------------------------------------------------------------------- eval
def evaluate(generator: Any, questions: Sequence[Mapping[str, Any]], timeout_s: float) -> dict:
    """Exact match (overall and per data source) of one greedy rollout per question."""
    import ray

    batch = ray.get(generator.generate.remote(list(questions)), timeout=timeout_s)
    reward = batch.traj_values("outcome_reward")
    sources = batch.column("data_source").to_pylist()
    per_source: dict[str, list[float]] = {}
    for source, r in zip(sources, reward, strict=True):
        per_source.setdefault(source or "unknown", []).append(float(r >= 1.0))
    m = batch.metrics
    return {
        "em": float((reward >= 1.0).mean()),
        "em_by_source": {k: float(np.mean(v)) for k, v in sorted(per_source.items())},
        "answered": m.get("gen/answered", 0.0) / max(len(batch), 1),
        "searches_per_traj": m.get("gen/searches", 0.0) / max(len(batch), 1),
        "questions": len(batch),
    }


# ----------------------------------------------------------------------------- run
def connect(cfg: RunConfig):
    """Ray: the cluster of RAY_ADDRESS (``ray job submit`` sets it), else a local one."""
    import ray

    if ray.is_initialized():
        return ray
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        print(f"connected to the Ray cluster at {os.environ['RAY_ADDRESS']}", flush=True)
    else:
        cpus = cfg.resources.local_cpus or max(6, os.cpu_count() or 1)
        # address="local": a new cluster even when a `ray start` head runs on this machine
        ray.init(address="local", num_cpus=cpus, include_dashboard=False)
        print(f"started a local Ray with {cpus} logical CPUs", flush=True)
    return ray


def train(cfg: RunConfig, stages: Callable[[Any], list[Callable]]) -> dict:
    """Run one training job; ``stages(ctx)`` returns the stage list. ``ctx`` has the
    config, the retriever handle, the corpus, and ``weight_targets``: a list where a
    stage that needs the current policy (an info-gain scorer actor) puts its actor.
    Returns the summary it writes."""
    from ray_credit.actors.learner_group import LearnerGroup

    cfg.check()
    t_start = time.perf_counter()
    out = Path(cfg.output_dir) / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    ray = connect(cfg)
    res = cfg.resources
    _warn_if_short(ray, cfg)
    corpus, train_q, eval_q = load_data(cfg)
    print(f"data: {len(train_q)} training questions, {len(eval_q)} held out", flush=True)
    retriever = make_retriever(corpus, cfg.encoder, cfg.retriever_url, res)
    generators = make_generators(cfg.model, retriever, cfg.generator, res, prefix="gen")
    ctx = _Context(cfg=cfg, retriever=retriever, corpus=corpus, ray=ray)
    stage_list = stages(ctx)
    checkpoint = out / "checkpoint"
    learner = LearnerGroup(
        cfg.model,
        cfg.learner,
        num_workers=res.learner_workers,
        use_gpu=res.use_gpu,
        resources_per_worker={
            "CPU": res.learner_cpus,
            **({"GPU": 1} if res.use_gpu else {}),
            **res.custom("learner"),
        },
        resume_from=None if cfg.resume is None else f"{cfg.resume}/learner",
        timeout_s=cfg.pipeline.timeout_s,
        strategy=res.learner_strategy,
    )
    pipe_cfg = cfg.pipeline
    if pipe_cfg.checkpoint_dir is None:
        pipe_cfg = replace(pipe_cfg, checkpoint_dir=str(checkpoint))
    logger = _Logger(cfg, out)
    summary: dict[str, Any] = {"config": asdict(cfg), "output_dir": str(out)}

    def eval_generator(version: int):
        """A greedy generator on the learner's weights of ``version``; started for each
        evaluation and killed after it, so that it holds no resources while training."""
        greedy = replace(
            cfg.generator,
            temperature=0.0,
            group_size=1,
            max_new_tokens=cfg.eval.max_new_tokens or cfg.generator.max_new_tokens,
        )
        (actor,) = make_generators(
            cfg.model, retriever, greedy, res, prefix=None, count=1, num_cpus=res.eval_cpus
        )
        if version > 0:
            ray.get(
                actor.update_weights.remote(version, learner.weights()),
                timeout=pipe_cfg.timeout_s,
            )
        return actor

    if cfg.eval.enabled:
        t0 = time.perf_counter()
        eval_gen = eval_generator(learner.policy_version)  # resumed: the resumed policy
        summary["eval_before"] = evaluate(eval_gen, eval_q, pipe_cfg.timeout_s)
        ray.kill(eval_gen)
        print(
            f"eval before training: EM {summary['eval_before']['em']:.3f} on {len(eval_q)} "
            f"held-out questions ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
        logger.log({"eval/em": summary["eval_before"]["em"]}, step=0)

    pipeline = Pipeline(
        generators,
        learner,
        train_q,
        stage_list,
        pipe_cfg,
        weight_targets=ctx.weight_targets,
        resume_from=cfg.resume,
        on_step=lambda m: logger.step(m, pipe_cfg.steps),
    )
    history = pipeline.run()
    summary["steps"] = pipeline.step
    summary["groups_trained"] = len(pipeline.trained_groups)
    summary["checkpoint"] = pipe_cfg.checkpoint_dir

    if cfg.eval.enabled:
        eval_gen = eval_generator(pipeline.version)
        summary["eval_after"] = evaluate(eval_gen, eval_q, pipe_cfg.timeout_s)
        ray.kill(eval_gen)
        logger.log({"eval/em": summary["eval_after"]["em"]}, step=pipeline.step)
        print(
            f"eval after {pipeline.step} steps: EM {summary['eval_after']['em']:.3f} "
            f"(before: {summary['eval_before']['em']:.3f})",
            flush=True,
        )
    summary["final_step_metrics"] = history[-1] if history else {}
    summary["seconds"] = time.perf_counter() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _plot(logger.rows, summary, out / "plot.png")
    logger.finish()
    learner.shutdown()
    print(
        f"wrote {out}/summary.json, {out}/plot.png, {out}/metrics.jsonl, checkpoint {pipe_cfg.checkpoint_dir}"
    )
    return summary


def _warn_if_short(ray: Any, cfg: RunConfig) -> None:
    """Say so when the cluster has less of a resource than the run's main actors ask for
    (generators, learner, retriever, evaluation generator): they would wait (for an
    autoscaler, or forever) without a word from Ray."""
    from collections import Counter

    res = cfg.resources
    actors = [  # (how many, CPUs, GPUs, role) of each kind
        (res.num_generators, res.generator_cpus, res.generator_gpus, "generator"),
        (int(cfg.eval.enabled), res.eval_cpus, res.generator_gpus, "generator"),
        (res.learner_workers, res.learner_cpus, float(res.use_gpu), "learner"),
        (0 if cfg.retriever_url else 1, res.retriever_cpus, 0.0, "service"),
    ]
    wanted: Counter[str] = Counter()
    for count, cpus, gpus, role in actors:
        for name, amount in {"CPU": cpus, "GPU": gpus, **res.custom(role)}.items():
            wanted[name] += count * amount
    have = ray.cluster_resources()
    short = {k: v for k, v in wanted.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        needs = ", ".join(f"{v:g} {k} (cluster has {have.get(k, 0.0):g})" for k, v in short.items())
        print(
            f"warning: this run's actors ask for {needs}; they will wait for an autoscaler "
            "to add nodes. Without one, lower --resources.* (generator_cpus, learner_cpus, "
            "eval_cpus, ...) or unset the custom resources to fit.",
            flush=True,
        )


def make_retriever(corpus: Any, encoder: str, url: str | None, res: ResourcesConfig) -> Any:
    """What generators search: a client of the server at ``url`` (each generator gets its
    own copy), else a retriever actor over ``corpus`` with the resources of ``res``."""
    if url:
        from ray_credit.actors.retrieval_server import RemoteRetriever

        retriever = RemoteRetriever(url)
        retriever.search(["connection check"], 1)  # a wrong URL fails here, not mid-run
        return retriever
    from ray_credit.actors.retriever import make_retriever_actor

    return make_retriever_actor(
        corpus, encoder=encoder, num_cpus=res.retriever_cpus, resources=res.custom("service")
    )


def make_generators(
    model: str,
    retriever: Any,
    config: GeneratorConfig,
    res: ResourcesConfig,
    *,
    prefix: str | None,
    count: int | None = None,
    num_cpus: float | None = None,
) -> list:
    """``count`` (default ``res.num_generators``) generator actors named ``prefix0``, ...
    (None: unnamed), each with ``num_cpus`` (default ``res.generator_cpus``), the GPUs and
    the custom generator resource of ``res``."""
    from ray_credit.actors.generator import make_generator_actor

    return [
        make_generator_actor(
            model,
            retriever,
            config,
            num_cpus=res.generator_cpus if num_cpus is None else num_cpus,
            num_gpus=res.generator_gpus,
            resources=res.custom("generator"),
            max_restarts=res.generator_max_restarts,
            device="cuda" if res.generator_gpus else "cpu",
            name=None if prefix is None else f"{prefix}{i}",
        )
        for i in range(res.num_generators if count is None else count)
    ]


@dataclass
class _Context:
    cfg: RunConfig
    retriever: Any
    corpus: Any
    ray: Any
    weight_targets: list = field(default_factory=list)


class _Logger:
    """metrics.jsonl, a progress line per step, and wandb (offline by default)."""

    def __init__(self, cfg: RunConfig, out: Path):
        self.rows: list[dict] = []
        self.file = (out / "metrics.jsonl").open("a")
        self.run = None
        self.started = time.perf_counter()
        if cfg.wandb != "disabled":
            try:
                import wandb
            except ImportError as err:
                raise ImportError(
                    "wandb logging needs `pip install ray-credit[pipeline]` (or pass --wandb disabled)"
                ) from err
            self.run = wandb.init(
                project="ray_credit",
                name=cfg.name,
                dir=str(out),
                mode=cfg.wandb,
                config=asdict(cfg),
                reinit=True,
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def step(self, metrics: dict, total: int) -> None:
        row = {k: float(v) for k, v in metrics.items()}
        self.rows.append(row)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.log(row, step=int(row["pipeline/step"]))
        elapsed = time.perf_counter() - self.started
        print(
            f"step {int(row['pipeline/step'])}/{total}  reward {row.get('train/reward_mean', 0):.3f}  "
            f"EM {row.get('train/em', 0):.3f}  loss {row.get('learner/loss', 0):+.4f}  "
            f"kl {row.get('learner/approx_kl', 0):.2e}  stale≤{int(row.get('staleness/max', 0))}  "
            f"gen {row.get('gen/tokens_per_s', 0):.0f} tok/s  step {row.get('time/step_s', 0):.0f}s  "
            f"[{elapsed / 60:.1f} min]",
            flush=True,
        )

    def finish(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.finish()


def _plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["pipeline/step"] for r in rows]
    ax.plot(steps, [r.get("train/reward_mean", 0) for r in rows], marker="o", label="train reward")
    ax.plot(steps, [r.get("train/em", 0) for r in rows], marker=".", label="train EM")
    evals = [(0, summary.get("eval_before")), (summary.get("steps", 0), summary.get("eval_after"))]
    points = [(s, e["em"]) for s, e in evals if e]
    if points:
        ax.plot(*zip(*points, strict=True), marker="s", linestyle="--", label="held-out EM")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / exact match")
    ax.set_title(summary["config"]["name"])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(cls: type, argv: Sequence[str] | None, doc: str, stages) -> dict:
    """Parse ``cls`` from the command line / YAML and run :func:`train`."""
    from ray_credit.config import parse_config

    cfg = parse_config(cls, sys.argv[1:] if argv is None else argv, description=doc)
    return train(cfg, stages)


def scorer_stage(ctx: Any, mode: str) -> Callable:
    """An info-gain scorer actor on the policy model, kept on the current weights (it
    joins ``ctx.weight_targets``), as a stage."""
    from ray_credit.actors.scorer import make_scorer_actor
    from ray_credit.pipeline.runner import actor_stage

    res = ctx.cfg.resources
    scorer = make_scorer_actor(
        ctx.cfg.model,
        mode=mode,
        num_cpus=res.generator_cpus,
        num_gpus=res.generator_gpus,
        resources=res.custom("generator"),
        device="cuda" if res.generator_gpus else "cpu",
    )
    ctx.weight_targets.append(scorer)
    return actor_stage(scorer.score, name="info_gain", timeout_s=ctx.cfg.pipeline.timeout_s)
