"""Starting the run's services on Ray: the connection, the retriever, the generators,
the judge pool, the info-gain scorer and the learner, each with the resources its
section of :class:`~ray_credit.pipeline.configs.ResourcesConfig` gives it."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ray_credit.actors.generator import GeneratorConfig
from ray_credit.log import log, worker_env
from ray_credit.models import REHEARSAL_ENV, device_for
from ray_credit.pipeline.configs import JudgeConfig, ResourcesConfig, RetrieverConfig
from ray_credit.pipeline.placement import (
    PHASES,
    SLICE_CPUS,
    Ask,
    PlacementError,
    check_storage,
    cluster_nodes,
    held_in,
    local_nodes,
    place,
    run_asks,
    scorer_shares_gpu,
)
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
    "reserve_slice_bundles",
    "resource_demand",
    "shared_gpu_bundle",
    "SliceBundles",
    "wait_started",
]


def connect(cfg: Any, demand: Mapping[str, float] | None = None, *, asks: Sequence[Ask] = ()):
    """Ray: the cluster of RAY_ADDRESS (``ray job submit`` sets it), else a local one with
    at least the CPUs ``demand`` asks for (:func:`resource_demand`: logical CPUs, since
    the actors ask for more than they keep busy at once) and ``resources.local_gpus``.
    ``asks`` (:func:`~ray_credit.pipeline.placement.run_asks`) are placed on the nodes
    before any actor starts and the plan printed: a local Ray's plan that does not fit is
    refused before Ray starts, and so is a cluster's placed against its cluster YAML; one
    placed against the nodes up now is told of in a warning (an autoscaler may add nodes)."""
    import ray

    from ray_credit.config import InputError

    demand = dict(demand or {})
    if ray.is_initialized():
        if asks:
            _place_on_cluster(cfg, asks, ray)
        return ray
    # the run's workers as quiet as its log level (vLLM, transformers, torch's C++ logs)
    env = worker_env(cfg.log_level, progress=wants_progress())
    if getattr(cfg.resources, "cpu_rehearsal", False):  # every actor computes on CPUs
        env[REHEARSAL_ENV] = os.environ[REHEARSAL_ENV] = "1"
    quiet = {
        "runtime_env": {"env_vars": env},
        "logging_level": "INFO" if cfg.log_level == "debug" else "WARNING",
    }
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **quiet)
        log.info(f"connected to the Ray cluster at {os.environ['RAY_ADDRESS']}")
        if asks:
            _place_on_cluster(cfg, asks, ray)
            return ray
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
    if asks:  # refused here, before Ray starts, when it cannot fit
        log.info(place(asks, local_nodes(cfg.resources, cpus), "a local Ray").table())
    gpus = cfg.resources.local_gpus
    # address="local": a new cluster even when a `ray start` head runs on this machine.
    # With its dashboard: Ray Train's placement-group cleaner (the warm-start's and SFT's
    # jobs) asks the state API it serves whether the training's controller lives. Without
    # one it warns every second of the job, and another Ray's dashboard answers in its
    # place: it knows no such actor, the cleaner reads the controller as dead and removes
    # the placement group under the running training. On a free port that the workers are
    # told of (RAY_API_SERVER_ADDRESS): left to look, the state API in a worker asks the
    # cluster that the last `ray start` on this machine recorded, or gives up among several.
    dashboard_port = _free_port()
    env["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"  # quiet's runtime_env
    context = ray.init(address="local", num_cpus=cpus, include_dashboard=True,
                       dashboard_port=dashboard_port,
                       **({"num_gpus": gpus} if gpus is not None else {}), **quiet)  # fmt: skip
    short = _shortage(demand, ray.cluster_resources())
    if short:
        ray.shutdown()
        raise InputError(
            f"this run's actors ask for {short} at once, and the local Ray this script "
            "starts has no autoscaler: raise --resources.local_cpus, lower --resources.* "
            "(generator_cpus, learner_cpus, eval_cpus, ...), unset the custom resources "
            "(resources.*_resource), or submit the run to a cluster that has them"
        )
    dashboard = getattr(context, "dashboard_url", None)
    log.info(
        f"started a local Ray with {cpus} logical CPUs"
        + (f" (dashboard: http://{dashboard})" if dashboard else "")
    )
    return ray


def _free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick), released for Ray to bind."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _place_on_cluster(cfg: Any, asks: Sequence[Ask], ray: Any) -> None:
    nodes, source = cluster_nodes(cfg.resources, ray.nodes())
    try:
        placement = place(asks, nodes, source)
        log.info(placement.table())
        check_storage(placement, cfg)
    except PlacementError as err:
        if "node types" in source:  # placed against the cluster's YAML: it cannot fit
            raise
        log.warning(
            f"warning: the nodes up now cannot hold the run ({err}); its actors will wait "
            "for an autoscaler to add nodes. Give the cluster's YAML to place the run "
            "against its node types before any actor starts: --resources.cluster_config FILE"
        )


def resource_demand(cfg: Any, plan: Plan) -> dict[str, float]:
    """The most of each resource (CPU, GPU, the custom ones) that the run's actors hold at
    once, over the run's phases (:mod:`~ray_credit.pipeline.placement`)."""
    asks = run_asks(cfg, plan.services)
    demand: dict[str, float] = {}
    for phase in PHASES:
        for name, amount in held_in(asks, phase).items():
            demand[name] = max(demand.get(name, 0.0), amount)
    order = sorted(demand, key=lambda name: (name not in ("CPU", "GPU"), name))  # CPU, GPU, ...
    return {name: demand[name] for name in order if demand[name] > 0}


def _shortage(demand: Mapping[str, float], have: Mapping[str, float]) -> str:
    """``"7 CPU (cluster has 6)"``, ... for each resource ``have`` holds less of; '' if none."""
    return ", ".join(
        f"{amount:g} {name} (cluster has {have.get(name, 0.0):g})"
        for name, amount in demand.items()
        if amount > have.get(name, 0.0) + 1e-9
    )


@dataclass(frozen=True)
class SliceBundles:
    """The GPUs that hold an index slice each (``resources.retriever_gpu_share``): one
    placement-group bundle per learner worker and per generator, each one GPU and the CPUs
    of its host and its slice, reserved before the retriever starts and kept for the run.
    The retriever starts slice i in bundle i (:meth:`hosts`); the learner and the
    generators then start in theirs, asking the rest of the GPU."""

    share: float
    learners: Any  # a placement group, or None (pipelines/eval.py has no learner)
    generators: Any

    def hosts(self) -> list[tuple[Any, int]]:
        """(group, bundle index) of each slice, learners first (the plan's order)."""
        return [(group, i) for group in (self.learners, self.generators)
                if group is not None for i in range(len(group.bundle_specs))]  # fmt: skip

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in (self.learners, self.generators):
            if group is not None:
                remove_placement_group(group)


def reserve_slice_bundles(
    cfg: Any, plan: Plan | None = None, *, learners: bool = True
) -> SliceBundles | None:
    """The bundles of :class:`SliceBundles` (None without a share, or with a retriever
    server); generator 0's holds the info-gain scorer's CPUs too when the scorer shares
    its GPU (``plan``'s services; :func:`shared_gpu_bundle`). A reservation the cluster
    cannot place within ``pipeline.timeout_s`` (or ten minutes) fails naming what it
    asked for."""
    res = cfg.resources
    if not res.retriever_gpu_share or cfg.retriever.url:
        return None
    from ray_credit.actors.learner_group import reserve_bundles

    pipeline = getattr(cfg, "pipeline", None)  # pipelines/eval.py's config has none
    timeout_s = pipeline.timeout_s if pipeline is not None else getattr(cfg, "timeout_s", 600.0)

    def group(role: str, count: int, cpus: float, first_cpus: float = 0.0) -> Any:
        bundle = {"CPU": cpus + SLICE_CPUS, "GPU": 1.0, **res.custom(role)}
        bundles = [{**bundle, "CPU": bundle["CPU"] + (first_cpus if i == 0 else 0.0)}
                   for i in range(count)]  # fmt: skip
        return reserve_bundles(bundles, timeout_s=timeout_s,
                               name=f"the {role}s' GPUs with their index slices")  # fmt: skip

    scorer = plan is not None and "scorer" in plan.services and scorer_shares_gpu(res)
    return SliceBundles(
        res.retriever_gpu_share,
        group("learner", res.learner_workers, res.learner_cpus) if learners else None,
        group(
            "generator",
            res.num_generators,
            res.generator_cpus,
            res.generator_cpus if scorer else 0.0,
        ),  # fmt: skip
    )


def make_retriever(
    corpus: Any,
    cfg: RetrieverConfig,
    res: ResourcesConfig,
    index_folder: str | None,
    slices: SliceBundles | None = None,
) -> list:
    """What generators search: a client of the server at ``cfg.url`` (each generator gets
    its own copy), else ``res.retriever_replicas`` retriever actors over ``corpus``, each a
    :class:`~ray_credit.actors.generator.NamedActor` (generators, which Ray may restart,
    get its name, not its handle). The index (``index_folder``; None: the shared index
    cache, see ``RetrieverConfig.index_folder``) is built by the first replica, once,
    before the others start: they only open it. ``slices``: the retriever holds the index
    in slices on a share of those GPUs (:class:`SliceBundles`), not whole."""
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
            slices=None if slices is None else (slices.hosts(), slices.share, SLICE_CPUS),
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
    shared: Any = None,
    slices: SliceBundles | None = None,
) -> list:
    """``count`` (default ``resources.num_generators``) generator actors named ``prefix0``,
    ... (None: unnamed), searching ``retriever`` (a list: generator i searches entry i mod
    its length), each with ``num_cpus`` (default ``resources.generator_cpus``), the
    GPUs and the custom generator resource of ``cfg.resources``. ``shared``: the bundle
    (:func:`shared_gpu_bundle`) generator 0 shares with the scorer: it asks the GPU's rest
    and its vLLM engine takes that share of the memory it would take alone. ``slices``:
    generator i starts in its bundle of :class:`SliceBundles`, asking the GPU's rest beside
    index slice i (its vLLM engine's memory is generator.vllm's, of the whole GPU: the
    memory plan adds the slice to it)."""
    from ray_credit.actors.generator import make_generator_actor

    res = cfg.resources
    replicas = retriever if isinstance(retriever, list) else [retriever]
    actors = []
    for i in range(res.num_generators if count is None else count):
        gen, gpus, options = generator, res.generator_gpus, {"resources": res.custom("generator")}
        if slices is not None:
            gpus, options = gpus - slices.share, _in_bundle(slices.generators, i)
        if shared is not None and i == 0:
            rest = res.generator_gpus - res.scorer_gpus  # of the memory: the slice's is apart
            gpus, options = gpus - res.scorer_gpus, _in_bundle(shared)
            util = generator.vllm.gpu_memory_utilization * rest
            gen = replace(generator, vllm=replace(generator.vllm, gpu_memory_utilization=util))
            if generator.backend == "vllm":
                log.info(
                    f"generator 0 shares its GPU with the info-gain scorer: {rest:g} of it, "
                    f"vLLM at gpu_memory_utilization {util:.2f} (generator.vllm's "
                    f"{generator.vllm.gpu_memory_utilization:g} x {rest:g})"
                )
        actors.append(make_generator_actor(
            model,
            replicas[i % len(replicas)],
            gen,
            num_cpus=res.generator_cpus if num_cpus is None else num_cpus,
            num_gpus=gpus,
            max_restarts=res.generator_max_restarts,
            device=device_for(res.generator_gpus),
            name=None if prefix is None else f"{prefix}{i}",
            retrieval_timeout_s=cfg.retriever.timeout_s,
            **options,
        ))  # fmt: skip
    return actors


def shared_gpu_bundle(cfg: Any, plan: Plan, slices: SliceBundles | None = None) -> Any:
    """A placement group of one bundle, one GPU and the CPUs of two generators, that
    generator 0 and the info-gain scorer start in (``resources.scorer_gpus`` below 1:
    :func:`~ray_credit.pipeline.placement.scorer_shares_gpu`); None when they do not share.
    With ``slices``, the generators' group, whose bundle 0 holds generator 0, the scorer
    and index slice beside them (:func:`reserve_slice_bundles`)."""
    res = cfg.resources
    if "scorer" not in plan.services or not scorer_shares_gpu(res):
        return None
    if slices is not None:
        return slices.generators
    from ray.util.placement_group import placement_group

    bundle = {"CPU": 2 * res.generator_cpus, "GPU": 1.0, **res.custom("generator")}
    return placement_group([bundle], name="generator0-and-scorer")


def _in_bundle(group: Any, index: int = 0) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}


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


def make_scorer(cfg: Any, plan: Plan, shared: Any = None):
    """The info-gain scorer actor on the policy model (it joins the weight targets), in
    the bundle it shares with generator 0 when ``shared`` (:func:`shared_gpu_bundle`)."""
    from ray_credit.actors.scorer import make_scorer_actor

    (signal,) = [s for s in plan.signals if s.service == "scorer"]
    res = cfg.resources
    gpus = res.generator_gpus if res.scorer_gpus is None else res.scorer_gpus
    return make_scorer_actor(
        cfg.model,
        mode=signal.mode,
        max_batch_tokens=signal.max_batch_tokens,
        num_cpus=res.generator_cpus,
        num_gpus=gpus,
        **(_in_bundle(shared) if shared is not None else {"resources": res.custom("generator")}),
        device=device_for(gpus),
        autocast=cfg.learner.autocast,  # the policy's beliefs in the learner's numerics
        max_restarts=res.generator_max_restarts,
    )


def make_learner(cfg: Any, slices: SliceBundles | None = None):
    """The learner group; with ``slices``, its workers start in their bundles of
    :class:`SliceBundles`, each asking its GPU's rest beside an index slice."""
    from ray_credit.actors.learner_group import LearnerGroup

    res = cfg.resources
    gpus = res.learner_gpus - (slices.share if slices is not None else 0.0)
    return LearnerGroup(
        cfg.model,
        cfg.learner,
        num_workers=res.learner_workers,
        use_gpu=res.use_gpu,
        resources_per_worker={
            "CPU": res.learner_cpus,
            **({"GPU": gpus} if res.use_gpu else {}),
            **res.custom("learner"),
        },
        resume_from=None if cfg.resume is None else StoragePath(cfg.resume) / "learner",
        timeout_s=cfg.pipeline.timeout_s,
        strategy=res.learner_strategy,
        placement_group=None if slices is None else slices.learners,
    )
