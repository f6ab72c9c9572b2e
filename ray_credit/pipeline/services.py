"""Starting the run's services on Ray: the connection, the retriever, the generators,
the judge pool, the info-gain scorer and the learner, each with the resources its
section of :class:`~ray_credit.pipeline.configs.ResourcesConfig` gives it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.log import log, worker_env
from ray_credit.pipeline.configs import JudgeConfig, ResourcesConfig, RetrieverConfig
from ray_credit.pipeline.plan import Plan
from ray_credit.progress import wants_progress
from ray_credit.storage import StoragePath

__all__ = [
    "ServiceStartError",
    "connect",
    "make_generators",
    "make_judge_pool",
    "make_learner",
    "make_retriever",
    "make_scorer",
    "resource_demand",
    "wait_started",
]


def connect(cfg: Any, demand: Mapping[str, float] | None = None):
    """Ray: the cluster of RAY_ADDRESS (``ray job submit`` sets it), else a local one with
    at least the CPUs ``demand`` asks for (:func:`resource_demand`: logical CPUs, since
    the actors ask for more than they keep busy at once). A local cluster that cannot
    hold ``demand`` is refused before any actor starts; a cluster that holds less is told
    of in a warning (an autoscaler may add nodes)."""
    import ray

    from ray_credit.config import InputError

    demand = dict(demand or {})
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
        short = _shortage(demand, ray.cluster_resources())
        if short:
            log.warning(
                f"warning: this run's actors ask for {short} at once; they will wait for an "
                "autoscaler to add nodes. Without one, lower --resources.* (generator_cpus, "
                "learner_cpus, eval_cpus, ...) or unset the custom resources to fit.",
            )
        return ray
    needed = math.ceil(demand.get("CPU", 0.0) - 1e-9)
    cpus = cfg.resources.local_cpus or max(6, os.cpu_count() or 1, needed)
    # address="local": a new cluster even when a `ray start` head runs on this machine
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, **quiet)
    short = _shortage(demand, ray.cluster_resources())
    if short:
        ray.shutdown()
        raise InputError(
            f"this run's actors ask for {short} at once, and the local Ray this script "
            "starts has no autoscaler: raise --resources.local_cpus, lower --resources.* "
            "(generator_cpus, learner_cpus, eval_cpus, ...), unset the custom resources "
            "(resources.*_resource), or submit the run to a cluster that has them"
        )
    log.info(f"started a local Ray with {cpus} logical CPUs")
    return ray


def resource_demand(cfg: Any, plan: Plan) -> dict[str, float]:
    """The most of each resource (CPU, GPU, the custom ones) that the run's actors hold at
    once. The run's phases, in order: the base policy's evaluation (retriever, evaluation
    generator), the warm-start (retriever, a learner-sized task), the evaluation before
    training (retriever, learner, evaluation generator), training (retriever, judges,
    scorer, generators, learner) and the evaluation after it (the training generators and
    scorer gone, the judges still up)."""
    res = cfg.resources
    judges = (
        cfg.judge.num_actors if "judge" in plan.services and cfg.judge.backend != "evidence" else 0
    )
    kinds = {  # name: (how many, CPUs, GPUs, role)
        "retriever": (
            0 if cfg.retriever.url else 1,
            res.retriever_cpus,
            res.retriever_gpus,
            "service",
        ),
        "judges": (judges, res.judge_cpus, 0.0, "service"),
        "scorer": (
            int("scorer" in plan.services),
            res.generator_cpus,
            res.generator_gpus,
            "generator",
        ),  # fmt: skip
        "generators": (res.num_generators, res.generator_cpus, res.generator_gpus, "generator"),
        "learner": (res.learner_workers, res.learner_cpus, float(res.use_gpu), "learner"),
        "warm_start": (
            int(cfg.warm_start.enabled),
            res.learner_cpus,
            float(res.use_gpu),
            "learner",
        ),  # fmt: skip
        "eval": (int(cfg.eval.enabled), res.eval_cpus, res.generator_gpus, "generator"),
    }
    phases = [
        ("retriever", "eval"),
        ("retriever", "warm_start"),
        ("retriever", "learner", "eval"),
        ("retriever", "judges", "scorer", "generators", "learner"),
        ("retriever", "judges", "learner", "eval"),
    ]
    demand: dict[str, float] = {}
    for phase in phases:
        held: dict[str, float] = {}
        for kind in phase:
            count, cpus, gpus, role = kinds[kind]
            for name, amount in {"CPU": cpus, "GPU": gpus, **res.custom(role)}.items():
                held[name] = held.get(name, 0.0) + count * amount
        for name, amount in held.items():
            demand[name] = max(demand.get(name, 0.0), amount)
    return {name: amount for name, amount in demand.items() if amount > 0}


def _shortage(demand: Mapping[str, float], have: Mapping[str, float]) -> str:
    """``"7 CPU (cluster has 6)"``, ... for each resource ``have`` holds less of; '' if none."""
    return ", ".join(
        f"{amount:g} {name} (cluster has {have.get(name, 0.0):g})"
        for name, amount in demand.items()
        if amount > have.get(name, 0.0) + 1e-9
    )


def make_retriever(
    corpus: Any, cfg: RetrieverConfig, res: ResourcesConfig, index_folder: str | None
) -> list:
    """What generators search: a client of the server at ``cfg.url`` (each generator gets
    its own copy), else ``res.retriever_replicas`` retriever actors over ``corpus``, each a
    :class:`~ray_credit.actors.generator.NamedActor` (generators, which Ray may restart,
    get its name, not its handle). The index (``index_folder``; None: the shared index
    cache, see ``RetrieverConfig.index_folder``) is built by the first replica, once,
    before the others start: they only open it."""
    if cfg.url:
        from ray_credit.actors.retrieval_server import RemoteRetriever

        return [RemoteRetriever(cfg.url)]  # its URL answered before Ray started (preflight)
    import uuid

    import ray

    from ray_credit.actors.generator import NamedActor
    from ray_credit.actors.retriever import make_retriever_actor

    run = uuid.uuid4().hex[:12]  # one set per run, also in one process (the study)
    replicas = []
    for i in range(res.retriever_replicas):
        name = f"retriever-{run}-{i}"
        handle = make_retriever_actor(
            corpus,
            encoder=cfg.encoder,
            index=cfg.index,
            index_folder=index_folder,
            index_file=cfg.index_file,
            build=cfg.build.kwargs(),
            num_cpus=res.retriever_cpus,
            num_gpus=res.retriever_gpus,
            resources=res.custom("service"),
            name=name,
        )
        if i == 0:  # it loads, or builds once, the index before any other starts
            wait_started({"retriever": handle})
            index_folder = ray.get(handle.info.remote())["index_folder"]
        replicas.append(NamedActor(name, handle))
    wait_started({f"retriever replica {i}": r.handle for i, r in enumerate(replicas)})
    return replicas


class ServiceStartError(RuntimeError):
    """A service actor's constructor failed: the run cannot go on without it."""


def wait_started(actors: Mapping[str, Any]) -> None:
    """Return once every actor's constructor has run; the first that failed ends the run
    with :class:`ServiceStartError`: one line naming the actor and the cause."""
    import ray

    refs = {name: handle.__ray_ready__.remote() for name, handle in actors.items()}
    for name, ref in refs.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise ServiceStartError(f"the {name} failed to start: {_cause(err)}") from None


def _cause(err: Exception) -> str:
    """The exception a creation task raised (``InputError: ...``), from Ray's message."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else "(no message)"
    name, sep, message = last.partition(": ")
    if sep and name.replace(".", "").replace("_", "").isalnum():
        return f"{name.rsplit('.', 1)[-1]}: {message}"  # ray_credit.config.InputError -> InputError
    return last


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
    ... (None: unnamed), searching ``retriever`` (a list: generator i searches entry i mod
    its length), each with ``num_cpus`` (default ``resources.generator_cpus``), the
    GPUs and the custom generator resource of ``cfg.resources``."""
    from ray_credit.actors.generator import make_generator_actor

    res = cfg.resources
    replicas = retriever if isinstance(retriever, list) else [retriever]
    return [
        make_generator_actor(
            model,
            replicas[i % len(replicas)],
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
