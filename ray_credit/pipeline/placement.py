"""Where every actor of a run goes, known before any of them starts.

A run's actors live through phases: the evaluation of the base policy (before a
warm-start), the warm-start, the evaluation before training, training, the evaluation
after it. :func:`run_asks` lists what each actor asks Ray for and in which phases it is
up; :func:`place` packs them, phase by phase, on the nodes a run has (:func:`local_nodes`,
:func:`cluster_nodes`): whole GPUs first, then fractions of one GPU on the fullest GPU that
holds them, an actor keeping its place for as long as it lives. A plan that does not fit is
refused with the arithmetic (:class:`PlacementError`); one that fits prints as a short
table (:meth:`Placement.table`). Ray's scheduler then places the same requests: the plan
shows that they fit, and where.

The info-gain scorer (IGPO, A²TGPO) may share generator 0's GPU
(``resources.scorer_gpus`` below 1 with generators of one GPU each): both then start in
one placement-group bundle of one GPU, generator 0 asking the rest of it
(:func:`ray_credit.pipeline.services.shared_gpu_bundle`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_credit.config import InputError

__all__ = [
    "EVALUATION",
    "PHASES",
    "Ask",
    "ClusterNodes",
    "Node",
    "Placement",
    "PlacementError",
    "SLICE_CPUS",
    "cluster_nodes",
    "evaluation_asks",
    "held_in",
    "local_nodes",
    "nodes_of_cluster_yaml",
    "place",
    "run_asks",
    "check_storage",
    "scorer_shares_gpu",
    "slice_hosts",
]

PHASES = ("base", "warm_start", "eval_before", "training", "eval_after")
TITLES = {
    "base": "evaluation of the base policy",
    "warm_start": "warm-start",
    "eval_before": "evaluation before training",
    "training": "training",
    "eval_after": "evaluation after training",
    "evaluation": "the evaluation",  # pipelines/eval.py's one phase (EVALUATION)
}
EVALUATION = "evaluation"
"""The one phase of ``pipelines/eval.py``'s actors (:func:`evaluation_asks`)."""
_EPS = 1e-9


class PlacementError(InputError):
    """The run's actors cannot all be placed on the nodes it has."""


@dataclass(frozen=True)
class Ask:
    """One actor's request, and the phases it is up in."""

    name: str
    cpus: float
    gpus: float
    custom: Mapping[str, float]
    phases: tuple[str, ...]
    share: str | None = None
    """Asks with the same ``share`` go on one GPU together (the scorer and generator 0)."""


@dataclass
class Node:
    """A node's resources (a kind of node the autoscaler may add is listed once per node
    it may add)."""

    name: str
    cpus: float
    gpus: int
    custom: dict[str, float] = field(default_factory=dict)
    free_cpus: float = 0.0
    free_gpus: list[float] = field(default_factory=list)
    free_custom: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free_cpus = self.cpus
        self.free_gpus = [1.0] * self.gpus
        self.free_custom = dict(self.custom)


@dataclass(frozen=True)
class Spot:
    """Where an ask went: a node, and a share of each GPU it holds."""

    node: int
    gpus: tuple[tuple[int, float], ...]


@dataclass
class Placement:
    """Every ask's spot, and the most held at once."""

    nodes: list[Node]
    asks: list[Ask]
    spots: dict[str, Spot]
    peak: dict[str, tuple[float, str]]
    """resource -> (most held at once, the phase that holds it)."""
    source: str

    def table(self) -> str:
        """The plan: one line per actor (grouped where several of one kind sit alike)."""
        total_gpus = sum(n.gpus for n in self.nodes)
        used = sorted({self.spots[a.name].node for a in self.asks})
        lines = [
            f"placement ({self.source}; {len(used)} of {len(self.nodes)} node(s) used, "
            f"{total_gpus} GPU(s)):",
            f"  {'actor':<26} {'node':<18} {'GPU':<14} {'CPU':>5}  up",
        ]
        for ask in self.asks:
            spot = self.spots[ask.name]
            gpus = ", ".join(
                f"{i}" if share >= 1 - _EPS else f"{i} ({share:g})" for i, share in spot.gpus
            )
            lines.append(
                f"  {ask.name:<26} {self.nodes[spot.node].name:<18} {gpus or '-':<14} "
                f"{ask.cpus:>5g}  {_phases(ask.phases)}"
            )
        peaks = ", ".join(
            f"{amount:g} {name} ({TITLES[phase]})" for name, (amount, phase) in self.peak.items()
        )
        lines.append(f"  most held at once: {peaks}")
        return "\n".join(lines)


_SHORT = {"base": "base eval", "warm_start": "warm-start", "eval_before": "eval before",
          "training": "training", "eval_after": "eval after"}  # fmt: skip


def _phases(phases: Sequence[str]) -> str:
    if tuple(phases) in (PHASES, (EVALUATION,)):
        return "the whole run"
    names = [_SHORT[p] for p in phases]
    at = [PHASES.index(p) for p in phases]
    if len(names) > 1 and at == list(range(at[0], at[0] + len(at))):
        return f"{names[0]} -> {names[-1]}"
    return ", ".join(names)


def scorer_shares_gpu(res: Any) -> bool:
    """Whether the info-gain scorer shares generator 0's GPU: a scorer GPU share below 1
    beside generators of one GPU each."""
    share = res.scorer_gpus
    return share is not None and 0 < share < 1 and res.generator_gpus == 1


SLICE_CPUS = 1.0
"""CPUs of each index slice actor (``resources.retriever_gpu_share``): one thread that
hands its GPU a matmul and a top-k per search."""


def slice_hosts(cfg: Any, *, learners: bool = True) -> list[str]:
    """The actors whose GPUs hold an index slice each (``resources.retriever_gpu_share``),
    in slice order: the learner workers, then the generators; none without a share (or
    with a retriever server). ``learners`` False: the generators only (pipelines/eval.py)."""
    res = cfg.resources
    if not res.retriever_gpu_share or cfg.retriever.url:
        return []
    hosts = [f"learner {i}" for i in range(res.learner_workers)] if learners else []
    return hosts + [f"generator {i}" for i in range(res.num_generators)]


def _with_slices(
    asks: list[Ask], hosts: Sequence[str], share: float, phases: tuple[str, ...]
) -> list[Ask]:
    """``asks`` with an index slice beside each host: the host asks the rest of its GPU
    in all ``phases`` (its bundle is reserved before the retriever starts, and kept), the
    slice ``share`` of it, both in one unit of placement (with what already shared the
    host's GPU: the info-gain scorer on generator 0's)."""
    if not hosts:
        return asks
    tags = {a.share: f"slice {hosts.index(a.name)}" for a in asks if a.name in hosts and a.share}
    out, slices = [], []
    for ask in asks:
        if ask.name in hosts:
            tag = f"slice {hosts.index(ask.name)}"
            out.append(Ask(ask.name, ask.cpus, ask.gpus - share, ask.custom, phases, share=tag))
            slices.append(Ask(f"index slice {hosts.index(ask.name)}", SLICE_CPUS, share, {},
                              phases, share=tag))  # fmt: skip
        elif ask.share in tags:
            out.append(Ask(ask.name, ask.cpus, ask.gpus, ask.custom, ask.phases, tags[ask.share]))
        else:
            out.append(ask)
    return out + sorted(slices, key=lambda a: int(a.name.rsplit(" ", 1)[1]))


def run_asks(cfg: Any, services: set[str]) -> list[Ask]:
    """What each actor of the run ``cfg`` asks for, and when it is up (``services``: the
    plan's, ``{"judge", "scorer"}`` or fewer)."""
    res, ev, ws = cfg.resources, cfg.eval, cfg.warm_start
    asks: list[Ask] = []
    if not cfg.retriever.url:
        for i in range(res.retriever_replicas):
            name = "retriever" if res.retriever_replicas == 1 else f"retriever {i}"
            asks.append(
                Ask(name, res.retriever_cpus, res.retriever_gpus, res.custom("service"), PHASES)
            )
    if ev.enabled and ws.enabled and ev.before_warm_start:
        asks.append(Ask("evaluation (base policy)", res.eval_cpus, res.generator_gpus,
                        res.custom("generator"), ("base",)))  # fmt: skip
    if ws.enabled:  # a Ray Train job on the learner's workers
        for i in range(res.learner_workers):
            asks.append(Ask(f"warm-start {i}", res.learner_cpus, res.learner_gpus * res.use_gpu,
                            res.custom("learner"), ("warm_start",)))  # fmt: skip
    after = ("eval_before", "training", "eval_after")
    for i in range(res.learner_workers):
        asks.append(Ask(f"learner {i}", res.learner_cpus, res.learner_gpus * res.use_gpu,
                        res.custom("learner"), after))  # fmt: skip
    if "judge" in services and cfg.judge.backend != "evidence":
        for i in range(cfg.judge.num_actors):
            asks.append(Ask(f"judge {i}", res.judge_cpus, 0.0, res.custom("service"),
                            ("training", "eval_after")))  # fmt: skip
    on_training = ev.enabled and ev.generators == "training"
    gen_phases = after if on_training else ("training",)
    shares = "scorer" in services and scorer_shares_gpu(res)
    if "scorer" not in services and res.scorer_gpus is not None:
        raise InputError(
            f"resources.scorer_gpus={res.scorer_gpus:g} is for the info-gain scorer of a run "
            "that has one (pipelines/igpo.py, pipelines/a2tgpo.py), and this run has none; "
            "drop it"
        )
    if "scorer" in services:
        gpus = res.generator_gpus if res.scorer_gpus is None else res.scorer_gpus
        if gpus > 1:  # a generator's GPUs, that a tensor-parallel engine spans
            raise InputError(
                f"resources.scorer_gpus is unset, so the info-gain scorer asks a generator's "
                f"{gpus:g} GPUs (resources.generator_gpus), but it is one model on one device: "
                f"{gpus - 1:g} would be held and never used; give --resources.scorer_gpus 1 "
                "(or a share below 1)"
            )
        custom = {} if shares else res.custom("generator")  # it rides in generator 0's
        asks.append(Ask("info-gain scorer", res.generator_cpus, gpus, custom,
                        gen_phases[:2] if on_training else ("training",),
                        share="gen0" if shares else None))  # fmt: skip
    for i in range(res.num_generators):
        gpus = res.generator_gpus
        if shares and i == 0:
            gpus = res.generator_gpus - res.scorer_gpus
        asks.append(Ask(f"generator {i}", res.generator_cpus, gpus, res.custom("generator"),
                        gen_phases, share="gen0" if shares and i == 0 else None))  # fmt: skip
    if ev.enabled and not on_training:
        asks.append(Ask("evaluation generator", res.eval_cpus, res.generator_gpus,
                        res.custom("generator"), ("eval_before", "eval_after")))  # fmt: skip
    # a share's run has no warm-start (RunConfig refuses it): its phases begin after one
    return _with_slices(asks, slice_hosts(cfg), res.retriever_gpu_share, after)


def evaluation_asks(cfg: Any) -> list[Ask]:
    """What ``pipelines/eval.py``'s actors ask for: the retriever replicas (none for a
    retriever server) and ``resources.num_generators`` generators, up together in its one
    phase (:data:`EVALUATION`)."""
    res = cfg.resources
    asks = [] if cfg.retriever.url else [
        Ask("retriever" if res.retriever_replicas == 1 else f"retriever {i}", res.retriever_cpus,
            res.retriever_gpus, res.custom("service"), (EVALUATION,))
        for i in range(res.retriever_replicas)
    ]  # fmt: skip
    asks += [
        Ask(f"generator {i}", res.generator_cpus, res.generator_gpus, res.custom("generator"),
            (EVALUATION,))
        for i in range(res.num_generators)
    ]  # fmt: skip
    hosts = slice_hosts(cfg, learners=False)
    return _with_slices(asks, hosts, res.retriever_gpu_share, (EVALUATION,))


def place(asks: Sequence[Ask], nodes: Sequence[Node], source: str) -> Placement:
    """Pack ``asks`` on ``nodes`` phase by phase (module docstring); raises
    :class:`PlacementError` with the arithmetic when a phase cannot fit."""
    budget = getattr(nodes, "max_workers", None)  # a cluster YAML's: workers up at once
    nodes = [Node(n.name, n.cpus, n.gpus, dict(n.custom)) for n in nodes]  # fresh free counts
    spots: dict[str, Spot] = {}  # where each ask is up now
    shown: dict[str, Spot] = {}  # where each went first (the table's)
    peak: dict[str, tuple[float, str]] = {}
    for phase in (*PHASES, EVALUATION):
        for ask in asks:  # those not up in this phase give back what they held
            if ask.name in spots and phase not in ask.phases:
                _release(nodes[spots[ask.name].node], ask, spots.pop(ask.name))
        new = [a for a in asks if phase in a.phases and a.name not in spots]
        if not any(phase in a.phases for a in asks):
            continue
        _check_totals(asks, nodes, phase)
        for unit in _units(new):
            _place_unit(unit, nodes, spots, phase)
        workers = sorted({spot.node for spot in spots.values()} - {0})  # node 0: the head
        if budget is not None and len(workers) > budget:
            raise PlacementError(
                f"{TITLES[phase]} needs {len(workers)} worker nodes at once "
                f"({', '.join(nodes[i].name for i in workers)}), and the cluster's "
                f"max_workers lets the autoscaler run {budget}: raise max_workers in the "
                "cluster YAML, or ask for less (--resources.num_generators, learner_workers)"
            )
        for name, spot in spots.items():
            shown.setdefault(name, spot)
        held = held_in(asks, phase)
        for name, amount in held.items():
            if amount > peak.get(name, (0.0, ""))[0] + _EPS:
                peak[name] = (amount, phase)
    return Placement(nodes, list(asks), shown, peak, source)


def held_in(asks: Sequence[Ask], phase: str) -> dict[str, float]:
    """Each resource the asks up in ``phase`` hold together."""
    held: dict[str, float] = {}
    for ask in asks:
        if phase in ask.phases:
            for name, amount in {"CPU": ask.cpus, "GPU": ask.gpus, **ask.custom}.items():
                if amount:
                    held[name] = held.get(name, 0.0) + amount
    return {name: round(amount, 9) for name, amount in held.items()}  # 0.9 + 0.1: 1


def _check_totals(asks: Sequence[Ask], nodes: Sequence[Node], phase: str) -> None:
    """The phase's sum of each resource against the nodes' sum, with the sum written out."""
    have: dict[str, float] = {"CPU": sum(n.cpus for n in nodes), "GPU": sum(n.gpus for n in nodes)}
    for n in nodes:
        for name, amount in n.custom.items():
            have[name] = have.get(name, 0.0) + amount
    for name, amount in held_in(asks, phase).items():
        if amount > have.get(name, 0.0) + _EPS:
            terms = _terms(asks, phase, name)
            raise PlacementError(
                f"{TITLES[phase]} needs {amount:g} {name} at once: {terms} = {amount:g}; the "
                f"nodes have {have.get(name, 0.0):g} ({_describe(nodes, name)}). "
                + _advice(name, asks)
            )


def _terms(asks: Sequence[Ask], phase: str, name: str) -> str:
    """``4 generators x 1 + learner x 1 ...`` for one resource of one phase."""
    groups: dict[tuple[str, float], int] = {}
    for ask in asks:
        if phase not in ask.phases:
            continue
        amount = {"CPU": ask.cpus, "GPU": ask.gpus, **ask.custom}.get(name, 0.0)
        if amount:
            kind = ask.name.rsplit(" ", 1)[0] if ask.name[-1].isdigit() else ask.name
            groups[(kind, amount)] = groups.get((kind, amount), 0) + 1
    return " + ".join(
        f"{count} {kind}{'s' if count > 1 and not kind.endswith('s') else ''} x {amount:g}"
        for (kind, amount), count in groups.items()
    )


def _describe(nodes: Sequence[Node], name: str) -> str:
    counts: dict[tuple[str, float], int] = {}
    for n in nodes:
        amount = {"CPU": n.cpus, "GPU": float(n.gpus), **n.custom}.get(name, 0.0)
        kind = n.name.rsplit("#", 1)[0]
        counts[(kind, amount)] = counts.get((kind, amount), 0) + 1
    return ", ".join(f"{c} x {kind} with {a:g}" for (kind, a), c in counts.items())


def _advice(name: str, asks: Sequence[Ask]) -> str:
    if name == "GPU":
        scorer = any(a.name == "info-gain scorer" and a.share is None for a in asks)
        return (
            "Lower --resources.num_generators or --resources.learner_workers"
            + (", or let the scorer share generator 0's GPU: --resources.scorer_gpus 0.25"
               if scorer else "")
            + "; a local run takes the machine's GPUs (--resources.local_gpus N for logical ones)"
        )  # fmt: skip
    if name == "CPU":
        return (
            "Lower --resources.*_cpus (generator_cpus, learner_cpus, retriever_cpus, "
            "eval_cpus), or give a local run more logical CPUs: --resources.local_cpus N"
        )
    return (
        f"No node offers enough '{name}': unset the custom resource (--resources.*_resource "
        "none) or add the node type that has it"
    )


def _units(new: Sequence[Ask]) -> list[list[Ask]]:
    """The asks to place, asks that share a GPU together, most GPU first, then most CPU."""
    groups: dict[str, list[Ask]] = {}
    units: list[list[Ask]] = []
    for ask in new:
        if ask.share is None:
            units.append([ask])
        else:
            if ask.share not in groups:
                groups[ask.share] = []
                units.append(groups[ask.share])
            groups[ask.share].append(ask)
    return sorted(units, key=lambda u: (-sum(a.gpus for a in u), -sum(a.cpus for a in u)))


def _place_unit(unit: list[Ask], nodes: list[Node], spots: dict[str, Spot], phase: str) -> None:
    cpus = sum(a.cpus for a in unit)
    gpus = sum(a.gpus for a in unit)
    custom: dict[str, float] = {}
    for a in unit:
        for name, amount in a.custom.items():
            custom[name] = custom.get(name, 0.0) + amount
    for i, node in enumerate(nodes):
        if node.free_cpus + _EPS < cpus:
            continue
        if any(node.free_custom.get(k, 0.0) + _EPS < v for k, v in custom.items()):
            continue
        chosen = _gpus_on(node, gpus)
        if chosen is None:
            continue
        node.free_cpus -= cpus
        for k, v in custom.items():
            node.free_custom[k] -= v
        if len(unit) == 1:
            for g, share in chosen:
                node.free_gpus[g] -= share
            spots[unit[0].name] = Spot(i, chosen)
        else:  # asks sharing one GPU: each its share of it
            ((g, _),) = chosen if chosen else ((None, 0),)
            for a in unit:
                if g is not None:
                    node.free_gpus[g] -= a.gpus
                spots[a.name] = Spot(i, ((g, a.gpus),) if g is not None else ())
        return
    names = " and ".join(a.name for a in unit)
    free = "; ".join(
        f"{n.name}: {n.free_cpus:g} CPU, GPUs free {[round(f, 3) for f in n.free_gpus]}"
        + "".join(f", {k} {v:g}" for k, v in n.free_custom.items())
        for n in nodes
    )
    raise PlacementError(
        f"{TITLES[phase]}: no node can hold {names} ({gpus:g} GPU, {cpus:g} CPU"
        + "".join(f", {k} {v:g}" for k, v in custom.items())
        + f") once the actors before it are placed; free then: {free}. A GPU is not split "
        "across nodes, and an ask above 1 GPU takes whole GPUs of one node"
    )


def _gpus_on(node: Node, gpus: float) -> tuple[tuple[int, float], ...] | None:
    """The GPUs of ``node`` an ask of ``gpus`` takes: whole free ones, or the fullest GPU
    with room for a fraction; None if it cannot."""
    if gpus <= _EPS:
        return ()
    if gpus >= 1 - _EPS:
        whole = [g for g, free in enumerate(node.free_gpus) if free >= 1 - _EPS]
        need = math.ceil(gpus - _EPS)
        return tuple((g, 1.0) for g in whole[:need]) if len(whole) >= need else None
    fits = [(free, g) for g, free in enumerate(node.free_gpus) if free + _EPS >= gpus]
    if not fits:
        return None
    _, g = min(fits)
    return ((g, gpus),)


def _release(node: Node, ask: Ask, spot: Spot) -> None:
    node.free_cpus += ask.cpus
    for g, share in spot.gpus:
        node.free_gpus[g] += share
    for k, v in ask.custom.items():
        node.free_custom[k] += v


def local_nodes(res: Any, cpus: int) -> list[Node]:
    """The one node of a local Ray this script starts: ``cpus`` logical CPUs and
    ``resources.local_gpus`` GPUs (None: the machine's, counted as Ray counts them, from
    CUDA_VISIBLE_DEVICES or the driver, with no CUDA call)."""
    gpus = res.local_gpus if res.local_gpus is not None else detected_gpus()
    return [Node("this machine", float(cpus), gpus)]  # a local Ray has no custom resources


def detected_gpus() -> int:
    """The GPUs Ray would give a local cluster on this machine (no CUDA context made)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        visible = manager.get_current_process_visible_accelerator_ids()
        count = manager.get_current_node_num_accelerators()
        return min(count, len(visible)) if visible is not None else count
    except Exception:  # no driver, no library: no GPUs
        return 0


def cluster_nodes(res: Any, live: Sequence[Mapping[str, Any]]) -> tuple[list[Node], str]:
    """The nodes a run on a cluster is placed against: the node types of
    ``resources.cluster_config`` (else ``~/ray_bootstrap_config.yaml``, which ``ray up``
    leaves on the head), each as many times as the autoscaler may start it; else the
    ``live`` nodes (``ray.nodes()``) as they are now."""
    path = res.cluster_config
    if path is None:
        default = Path(os.path.expanduser("~/ray_bootstrap_config.yaml"))
        path = str(default) if default.is_file() else None
    if path is not None:
        return nodes_of_cluster_yaml(path), f"the node types of {path}"
    nodes = []
    for i, n in enumerate(n for n in live if n.get("Alive", n.get("alive", True))):
        total = dict(n.get("Resources") or {})
        custom = {k: v for k, v in total.items() if k not in ("CPU", "GPU", "memory",
                  "object_store_memory") and not k.startswith(("node:", "accelerator_type"))}  # fmt: skip
        nodes.append(Node(f"node {i}", total.get("CPU", 0.0), int(total.get("GPU", 0)), custom))
    return nodes, "the cluster's nodes up now (an autoscaler may add others)"


def nodes_of_cluster_yaml(path: str) -> list[Node]:
    """Every node a cluster launcher YAML lets the autoscaler run: the head, and each
    worker type up to its max_workers (and the file's max_workers in all; a worker type
    without one may start that many, as Ray fills it in). The file is checked as far as
    the plan reads it, each refusal an :class:`~ray_credit.config.InputError` naming the
    file, the node type and the key (a worker type must give its CPUs: Ray's fill-in from
    the instance type comes too late for the plan) (``cluster.yaml: available_node_types.gpu_worker.
    resources.CPU: expected a number, got 'many'``), where Ray's own check would fail
    later, on the cluster, or a Python conversion here would name nothing."""
    from ray_credit.config import InputFileNotFoundError, read_yaml_file

    if not Path(path).expanduser().is_file():
        what = "a folder, not a file" if Path(path).expanduser().is_dir() else "no such file"
        raise InputFileNotFoundError(
            f"resources.cluster_config {path!r}: {what}; give the cluster launcher YAML "
            "the cluster runs with (the file given to `ray up`, such as cluster.yaml)"
        )
    where = f"resources.cluster_config {path}"
    try:
        config = read_yaml_file(Path(path).expanduser())
    except InputError as err:  # it names the file, the line and the column
        raise type(err)(f"resources.cluster_config {err}") from None
    usage = "a cluster launcher YAML (as `ray up` takes): available_node_types, head_node_type"
    if config is None:
        raise InputError(f"{where}: the file is empty; give {usage}")
    if not isinstance(config, dict):
        raise InputError(f"{where}: the top level is a {_kind(config)}; give {usage}")
    for key in ("available_node_types", "head_node_type"):
        if key not in config:
            raise InputError(f"{where}: {key} is missing; give {usage}")
    types = config["available_node_types"]
    if not isinstance(types, dict):
        raise InputError(
            f"{where}: available_node_types: expected a mapping of node type names to their "
            f"resources, node_config, min_workers and max_workers, got a {_kind(types)}"
        )
    if not types:
        raise InputError(
            f"{where}: available_node_types is empty; list the head's node type and the "
            "workers' (each with its resources and max_workers)"
        )
    head = config["head_node_type"]
    if not isinstance(head, str) or head not in types:
        raise InputError(
            f"{where}: head_node_type {head!r} is not one of available_node_types "
            f"({', '.join(map(str, types))}); name the head's type there"
        )
    budget = _count(config, "max_workers", where, "max_workers")
    for name, spec in types.items():
        key = f"available_node_types.{name}"
        if not isinstance(spec, dict):
            raise InputError(
                f"{where}: {key}: expected a mapping (resources, node_config, min_workers, "
                f"max_workers), got a {_kind(spec)}"
            )
        low = _count(spec, "min_workers", where, f"{key}.min_workers")
        high = _count(spec, "max_workers", where, f"{key}.max_workers")
        if low is not None and high is not None and low > high:
            raise InputError(
                f"{where}: {key}: min_workers {low} is above max_workers {high}; the "
                "autoscaler keeps at least min_workers and at most max_workers of the type"
            )
        if name != head and high is None and budget is None:
            raise InputError(
                f"{where}: {key} has no max_workers and the file no global max_workers (Ray "
                "then takes its provider's default); give max_workers, the most nodes of "
                "this type the autoscaler may start"
            )
        if name != head and "CPU" not in _resources(spec, where, key):
            given = "has no CPU in its resources" if spec.get("resources") else "gives no resources"
            raise InputError(
                f"{where}: {key} {given}; Ray fills them in from the instance type only once "
                "such a node starts, too late to place the run against this file: give the "
                "node's CPUs and GPUs as its instance has them (a p4d.24xlarge: resources: "
                "{CPU: 96, GPU: 8}, with any custom resource the run asks for)"
            )
    lowest = sum(_count(spec, "min_workers", where, "") or 0 for spec in types.values())
    if budget is not None and lowest > budget:
        raise InputError(
            f"{where}: max_workers {budget} is below the node types' min_workers together "
            f"({lowest}); raise max_workers or lower a type's min_workers"
        )
    nodes = ClusterNodes([_yaml_node(head, _resources(types[head], where, ""), 0)])
    nodes.max_workers = budget
    for name, spec in types.items():
        high = _count(spec, "max_workers", where, "")
        if high is None:  # Ray's fill-in: the head's type none, a worker's the file's
            high = 0 if name == head else budget
        count = high if budget is None else min(high, budget)
        resources = _resources(spec, where, "")
        first = 1 if name == head else 0  # workers of the head's type follow the head
        nodes += [_yaml_node(name, resources, i) for i in range(first, first + count)]
    return nodes


class ClusterNodes(list):
    """The nodes of a cluster launcher YAML (:func:`nodes_of_cluster_yaml`): the head,
    then every worker the autoscaler may start, of which at most ``max_workers`` (the
    file's) are up at once (:func:`place` holds a plan to it)."""

    max_workers: int | None = None


def _kind(value: Any) -> str:
    """``a list``, ``a string``: what a YAML value is, in the words of a YAML file."""
    if value is None:
        return "null"
    names = {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "number",
             float: "number"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


def _count(mapping: Mapping[str, Any], key: str, where: str, name: str) -> int | None:
    """A count of nodes (``max_workers``, ``min_workers``): a whole number >= 0, or None
    where the key is not given; anything else refused, naming ``name``."""
    if key not in mapping:
        return None
    value = mapping[key]
    whole = isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not whole or value < 0:
        raise InputError(f"{where}: {name}: expected a whole number of nodes >= 0, got {value!r}")
    return int(value)


def _resources(spec: Mapping[str, Any], where: str, key: str) -> dict[str, int]:
    """A node type's resources: names to whole numbers >= 0, as Ray's cluster schema takes
    them (a bool, a string, a fraction refused, naming the key)."""
    resources = spec.get("resources", {})
    if resources is None:
        resources = {}
    if not isinstance(resources, dict):
        raise InputError(
            f"{where}: {key}.resources: expected a mapping of resource names to numbers "
            f"({{CPU: 8, GPU: 1}}), got a {_kind(resources)}"
        )
    out = {}
    for name, value in resources.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise InputError(f"{where}: {key}.resources.{name}: expected a number, got {value!r}")
        if value < 0 or not float(value).is_integer():
            raise InputError(
                f"{where}: {key}.resources.{name}: expected a whole number >= 0 (Ray's "
                f"cluster schema takes no fractions), got {value!r}"
            )
        out[str(name)] = int(value)
    return out


def _yaml_node(name: str, resources: Mapping[str, int], i: int) -> Node:
    custom = {k: float(v) for k, v in resources.items()
              if k not in ("CPU", "GPU", "memory", "object_store_memory")}  # fmt: skip
    return Node(f"{name}#{i}", float(resources.get("CPU", 0)), resources.get("GPU", 0), custom)


# Filesystems every node of a cluster may mount as one (a local path on one is shared).
_SHARED_FS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
              "efs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.mountpoint-s3")  # fmt: skip


def filesystem_of(path: str) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on, from
    /proc/mounts (None where that cannot be read)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = Path(path).expanduser().resolve()
    best, kind = -1, None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == Path(point) or Path(point) in target.parents) and len(point) > best:
            best, kind = len(point), fields[2]
    return kind


def check_storage(placement: Placement, cfg: Any) -> None:
    """A run whose actors span several nodes writes its checkpoints (and the warm-start's
    folder) from the learner's node and reads them from others: refuse, before any actor
    starts, a storage location that is a local path on a disk of one node."""
    used = {placement.spots[a.name].node for a in placement.asks}
    if len(used) < 2:
        return
    where = getattr(cfg, "storage_path", None)
    what = "storage_path" if where is not None else "output_dir (storage_path is not set)"
    location = where if where is not None else getattr(cfg, "output_dir", None)
    if location is None or "://" in location and not location.startswith("file://"):
        return  # a bucket (s3://, gs://, hdfs://...): every node reaches it
    if getattr(cfg, "storage_shared", None) is not None:
        if cfg.storage_shared:
            return  # the user vouches for it
        kind = "storage_shared is false"
    else:
        kind = filesystem_of(location.removeprefix("file://"))
        if kind is not None and (kind in _SHARED_FS or kind.startswith("fuse.")):
            return
    raise InputError(
        f"this run's actors span {len(used)} nodes, and its checkpoints go to {what} "
        f"{location!r}, a folder on this node's own disk ({kind or 'filesystem unknown'}): "
        "the learner would write them on another node's. Give a bucket every node "
        "writes, --storage_path s3://BUCKET/runs (gs://, hdfs:// alike), or a folder on a "
        "filesystem every node mounts (NFS, EFS, Lustre; --storage_shared true where you "
        "know every node sees it)"
    )
