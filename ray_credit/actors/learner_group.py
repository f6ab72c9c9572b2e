"""LearnerGroup: ``num_workers`` learner actors (one included) behind one dispatch point.

Workers. Each rank is a Ray actor holding a :class:`~ray_credit.actors.learner.Learner`.
It starts empty and is built by its ``setup`` call, because DDP and FSDP wrap the model
over a process group that must exist first: with ``num_workers > 1`` every rank joins
one ``torch.distributed`` group (gloo on CPUs, NCCL on GPUs; the rendezvous is at rank
0's node address, on a port free there), then builds its Learner with
:class:`~ray_credit.actors.learner.TorchDistributed` (``strategy="ddp"``: a replica per
rank) or :class:`~ray_credit.actors.learner.TorchFSDP` (``"fsdp"``: parameters,
gradients and optimizer state sharded), then loads the state of ``resume_from``. One
worker joins no group. Every rank is set up at once, since joining waits for all.

Placement. Before any worker starts, one placement group reserves a bundle per worker
(the per-worker resources, plus one GPU with ``use_gpu``; or the caller gives bundles it
reserved, ``placement_group``), packed onto as few nodes as possible; a group the cluster cannot hold fails within ``timeout_s`` with an error
naming what it asked for, instead of half-starting. With GPUs, the workers of a node
all see the node's learner GPUs (``CUDA_VISIBLE_DEVICES`` = their ids together, as Ray
Train sets it) so that NCCL can go peer-to-peer, and each drives its own.

Commands. Every method sends one command to every rank through one dispatch point
(``LearnerGroup._call``) and gets a :class:`LearnerCall`: one ObjectRef per rank. An
actor runs its calls in the order they were sent, so every rank runs the same sequence
of commands, which the collectives inside them (gradient all-reduce, FSDP gathers)
need. :meth:`LearnerGroup.submit_train` returns at once: Ray resolves the chunk refs it
is given inside every worker (the driver never fetches a batch), each rank concatenates
them into the step's batch and trains on its share of every mini-batch. The loss is
normalized over the whole mini-batch (:mod:`ray_credit.actors.learner`), so the update
equals one worker's on the same data up to float rounding.

Errors. :meth:`LearnerCall.result` waits on every rank and raises
:class:`LearnerWorkerError` as soon as one fails or dies (not only once rank 0 is
done), naming the rank and the command and carrying the worker's traceback; past its
timeout it raises :class:`TimeoutError` naming the command. After an error a rank may
still wait in a collective for the others: shut the group down and resume from the last
checkpoint.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_credit.actors import actor_lost_errors
from ray_credit.actors.learner import (
    Learner,
    LearnerConfig,
    Strategy,
    TorchDistributed,
    TorchFSDP,
)
from ray_credit.batch import TrajectoryBatch
from ray_credit.models import cpu_rehearsal
from ray_credit.storage import StoragePath

__all__ = [
    "LearnerCall",
    "LearnerGroup",
    "LearnerWorkerError",
    "check_strategy",
    "reserve_bundles",
]


class LearnerWorkerError(RuntimeError):
    """A learner rank failed or died; the message names the rank and the command."""


def check_strategy(strategy: str) -> None:
    """Raise unless ``strategy`` is one :class:`LearnerGroup` knows."""
    if strategy not in get_args(Strategy):
        choices = " or ".join(map(repr, get_args(Strategy)))
        raise ValueError(f"learner strategy must be {choices}, got {strategy!r}")


@dataclass(frozen=True)
class LearnerCall:
    """One command running on every rank of a :class:`LearnerGroup`.

    Attributes:
        refs: one ObjectRef per rank, in rank order (for the caller's ``ray.wait``).
        what: the command's name, for errors.
        group: the group's name, for errors.
    """

    refs: tuple[ray.ObjectRef, ...]
    what: str
    group: str = "learner"

    def ready(self) -> bool:
        """Whether every rank has finished (well or not); never blocks."""
        done, _ = ray.wait(
            list(self.refs), num_returns=len(self.refs), timeout=0, fetch_local=False
        )
        return len(done) == len(self.refs)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's value once every rank has finished; raises as :meth:`results` does."""
        return self.results(timeout)[0]

    def results(self, timeout: float | None = None) -> list[Any]:
        """Every rank's value, in rank order, once all have finished.

        Raises:
            LearnerWorkerError: as soon as any rank has failed or died.
            TimeoutError: not all ranks finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        rank_of = {ref: rank for rank, ref in enumerate(self.refs)}
        values: dict[int, Any] = {}
        pending = list(self.refs)
        while pending:  # one finished rank at a time, so that a failure is seen early
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                raise TimeoutError(
                    f"{self.group} command {self.what!r} did not finish within {timeout:g} s "
                    f"(ranks {sorted(rank_of[ref] for ref in pending)} still running)"
                )
            for ref in done:
                values[rank_of[ref]] = self._value(rank_of[ref])
        return [values[rank] for rank in range(len(self.refs))]

    def _value(self, rank: int) -> Any:
        try:
            return ray.get(self.refs[rank])
        except actor_lost_errors() as err:
            raise LearnerWorkerError(
                f"{self.group} rank {rank} died during {self.what!r} (shut the group down "
                f"and resume from the last checkpoint): {err}"
            ) from err
        except ray.exceptions.RayTaskError as err:
            raise LearnerWorkerError(
                f"{self.group} rank {rank} failed during {self.what!r}:\n{err}"
            ) from err


class LearnerGroup:
    """``num_workers`` data-parallel learner ranks (Ray actors) driven as one learner.

    Args:
        model: what :class:`~ray_credit.actors.learner.Learner` takes (a name or folder).
        config: :class:`~ray_credit.actors.learner.LearnerConfig`.
        num_workers: ranks; 1 is a single learner without a process group.
        use_gpu: one GPU per worker (NCCL between them); else CPUs (gloo).
        resources_per_worker: what each worker reserves, e.g. ``{"CPU": 2}`` (default one
            CPU), with custom resources to pin learner nodes; a ``"GPU"`` entry must be 1
            with ``use_gpu`` (and absent without).
        resume_from: a folder written by :meth:`save` (a path or a URI; each worker
            downloads it when it is not on its filesystem): the model is loaded from its
            ``model/`` folder (instead of ``model``), the rest of the state from it.
        timeout_s: the longest that starting the group, or any blocking command, may take
            (also the process group's timeout for one collective).
        name: the group's name in errors (``"learner rank 1 failed during 'train'"``).
        strategy: ``"ddp"`` (a full replica per worker) or ``"fsdp"`` (parameters,
            gradients and optimizer state sharded over the workers, FSDP2); the same
            update either way. Used with ``num_workers > 1``.
        placement_group: bundles the caller reserved (:func:`reserve_bundles`), one per
            worker, each holding at least ``resources_per_worker``: rank i starts in
            bundle i, beside what else the caller puts there (an index slice on a share
            of its GPU); the caller removes it. None: the group reserves its own.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        config: LearnerConfig | None = None,
        *,
        num_workers: int = 1,
        use_gpu: bool = False,
        resources_per_worker: Mapping[str, float] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        timeout_s: float = 1800.0,
        name: str = "learner",
        strategy: str = "ddp",
        placement_group: PlacementGroup | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        check_strategy(strategy)
        bundle = _worker_bundle(resources_per_worker, use_gpu=use_gpu)
        self.config = config or LearnerConfig()
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.name = name
        self.strategy = strategy
        self._settle_task = ray.remote(num_cpus=0, max_retries=0)(_settle)
        self._workers: list[Any] = []
        self._placement_group: PlacementGroup | None = placement_group
        self._owns_group = placement_group is None
        if placement_group is not None and len(placement_group.bundle_specs) != num_workers:
            raise ValueError(
                f"placement_group has {len(placement_group.bundle_specs)} bundles, and "
                f"{num_workers} workers need one each"
            )
        if resume_from is not None:  # absolute here: the workers' cwd may differ
            resume_from = StoragePath(resume_from)
        try:
            if self._owns_group:
                self._placement_group = reserve_bundles(
                    [bundle] * num_workers, timeout_s=timeout_s, name=name
                )
            self._workers = self._start_workers(bundle)
            placements = self._call("placement").results(timeout_s)
            setup = self._call(
                "setup",
                model,
                self.config,
                strategy=strategy,
                placements=placements,
                resume_from=resume_from,
                timeout_s=timeout_s,
            )
            setup.results(timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ training
    def submit_train(self, batches: Sequence[ray.ObjectRef]) -> LearnerCall:
        """Start one policy update and return at once.

        ``batches``: ObjectRefs to TrajectoryBatch chunks (or whole batches), trained as
        one batch in the given order. They are resolved in every worker, never here.
        """
        refs = list(batches)
        if not refs:
            raise ValueError("submit_train needs at least one ObjectRef to a TrajectoryBatch")
        if not all(isinstance(ref, ray.ObjectRef) for ref in refs):
            kinds = sorted({type(ref).__name__ for ref in refs})
            raise TypeError(
                f"submit_train takes ObjectRefs to TrajectoryBatch chunks, got {kinds}: "
                "ray.put the batch first, or call train(), which does"
            )
        return self._call("train_chunks", *refs, what="train")

    def train(
        self, batches: TrajectoryBatch | ray.ObjectRef | Sequence[TrajectoryBatch | ray.ObjectRef]
    ) -> dict[str, float]:
        """One policy update, waited for: :meth:`submit_train` on one batch, one ObjectRef
        or a sequence of either (batches are put in the object store first)."""
        if isinstance(batches, TrajectoryBatch | ray.ObjectRef):
            batches = [batches]
        refs = [part if isinstance(part, ray.ObjectRef) else ray.put(part) for part in batches]
        return self.submit_train(refs).result(self.timeout_s)

    @property
    def policy_version(self) -> int:
        """Updates applied so far; every rank must agree (else :class:`LearnerWorkerError`)."""
        versions = self._call("get_policy_version", what="policy_version").results(self.timeout_s)
        if len(set(versions)) != 1:
            raise LearnerWorkerError(
                f"{self.name} ranks disagree on the policy version (by rank: {versions}); "
                "they no longer train in step: shut the group down and resume from a checkpoint"
            )
        return versions[0]

    # ------------------------------------------------------- weights, checkpoints
    def weights(self, dtype: str | None = None) -> ray.ObjectRef:
        """An ObjectRef to the policy's full state dict (CPU tensors; floating-point ones
        in ``dtype`` when given), without waiting.

        Every rank takes part (FSDP gathers the shards at rank 0); the ref is rank 0's
        value, so a rank that fails during an FSDP gather fails it too."""
        return self._call("get_weights", dtype).refs[0]

    def save(self, folder: str | os.PathLike[str] | StoragePath) -> str:
        """Model, optimizer, scheduler, RNG states and counters under ``folder``, a path
        or a URI (every rank takes part, rank 0 writes wherever it runs); returns the
        folder as an absolute path or URI."""
        folder = StoragePath(folder)  # absolute here: the workers' cwd may differ
        return str(self._call("save", folder).result(self.timeout_s))

    # ------------------------------------------------------ collective weight sync
    def open_weight_group(self, world_size: int, backend: str) -> tuple[str, list]:
        """Open the learner's side of a broadcast group (rank 0 sends); returns the group's
        address and the weights' manifest (see :mod:`ray_credit.actors.collective`)."""
        address = self._call("open_weight_group", world_size, backend, self.timeout_s)
        manifest = self._call("weight_manifest")
        return address.result(self.timeout_s), manifest.result(self.timeout_s)

    def join_weight_group(self, address: str, manifest: list) -> ray.ObjectRef:
        """Join the group (rank 0 as the sender); returns an ObjectRef for :meth:`check`
        (joining waits for every member, so it cannot be waited on here)."""
        return self._settled(self._call("join_weight_group", address, manifest))

    def broadcast_weights(self) -> ray.ObjectRef:
        """Broadcast the current weights to the group (every rank takes part: FSDP gathers
        them, rank 0 sends); returns an ObjectRef for :meth:`check`."""
        return self._settled(self._call("broadcast_weights"))

    @staticmethod
    def check(value: Any) -> Any:
        """The value of a ref from :meth:`join_weight_group` or :meth:`broadcast_weights`
        (rank 0's result); raises the :class:`LearnerWorkerError` of a rank that failed."""
        if isinstance(value, LearnerWorkerError):
            raise value
        return value

    def shutdown(self) -> None:
        """Stop the workers and free their reservation; the group cannot be used after."""
        for worker in self._workers:
            ray.kill(worker)
        self._workers = []
        if self._placement_group is not None and self._owns_group:
            remove_placement_group(self._placement_group)
        self._placement_group = None

    # ----------------------------------------------------------------- plumbing
    def _call(
        self, method: str, /, *args: Any, what: str | None = None, **kwargs: Any
    ) -> LearnerCall:
        """Call ``method`` on every rank, without waiting: the one dispatch point."""
        if not self._workers:
            raise RuntimeError(f"{self.name} was shut down; make a new LearnerGroup")
        refs = tuple(getattr(worker, method).remote(*args, **kwargs) for worker in self._workers)
        return LearnerCall(refs, what or method, self.name)

    def _settled(self, call: LearnerCall) -> ray.ObjectRef:
        """One ref for ``call`` on the whole group: rank 0's value once every rank has
        finished, or the first failed rank's error as its value (see :meth:`check`)."""
        return self._settle_task.remote(call, self.timeout_s)

    def _start_workers(self, bundle: Mapping[str, float]) -> list[Any]:
        """One actor per bundle of the placement group; each builds nothing yet."""
        actor = ray.remote(_LearnerWorker)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return [
            actor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                resources=custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement_group, placement_group_bundle_index=rank
                ),
            ).remote(rank=rank, world_size=self.num_workers)
            for rank in range(self.num_workers)
        ]


def _settle(call: LearnerCall, timeout_s: float) -> Any:
    """Runs as a Ray task: rank 0's value of ``call`` once every rank has finished, or
    the :class:`LearnerWorkerError` of the rank that failed, returned (not raised) so
    that :meth:`LearnerGroup.check` raises it without Ray's task traceback around it."""
    try:
        return call.result(timeout_s)
    except LearnerWorkerError as err:
        return err


def _worker_bundle(resources: Mapping[str, float] | None, *, use_gpu: bool) -> dict[str, float]:
    """What one worker reserves: one CPU unless told, one GPU with ``use_gpu`` (or a
    share of one, for a single worker beside a generator), and the custom resources asked
    for."""
    bundle = {"CPU": 1.0, **(resources or {})}
    gpus = bundle.pop("GPU", 1 if use_gpu else 0)
    if (use_gpu and not 0 < gpus <= 1) or (not use_gpu and gpus):
        raise ValueError(
            f"a learner worker drives one GPU (or a share of one) with use_gpu=True and none "
            f"without; resources_per_worker asks for GPU={gpus} with use_gpu={use_gpu}"
        )
    return {**bundle, "GPU": float(gpus)} if use_gpu else bundle


def reserve_bundles(
    bundles: Sequence[Mapping[str, float]], *, timeout_s: float, name: str
) -> PlacementGroup:
    """A placement group of ``bundles``, packed onto as few nodes as possible; raises
    unless it is placed within ``timeout_s``, so that a group too big for the cluster
    fails before any actor starts in it."""
    group = placement_group([dict(b) for b in bundles], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        count, bundle = len(bundles), dict(bundles[0])
        raise RuntimeError(
            f"{name}: the cluster could not place {count} worker(s) of {bundle} each "
            f"within {timeout_s:g} s (it has {ray.cluster_resources()} in all, "
            f"{ray.available_resources()} free); lower num_workers or resources_per_worker, "
            "or add nodes"
        )
    return group


@dataclass(frozen=True)
class _Placement:
    """Where a rank runs: its node, its GPUs, and a free ``host:port`` on its node (rank
    0's hosts the process group's rendezvous)."""

    node_id: str
    gpu_ids: tuple[str, ...]
    address: str


class _LearnerWorker(Learner):
    """One rank of a :class:`LearnerGroup`: a Learner built by :meth:`setup`, after this
    process joined the group's process group (DDP and FSDP wrap the model over it)."""

    def __init__(self, *, rank: int, world_size: int) -> None:  # the Learner: see setup()
        self._rank = rank
        self._world_size = world_size

    def placement(self) -> _Placement:
        """Where this rank runs, gathered from every rank before :meth:`setup`."""
        with socket.socket() as sock:  # a port free now; rank 0 binds it again at once
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return _Placement(
            node_id=ray.get_runtime_context().get_node_id(),
            gpu_ids=tuple(str(gpu) for gpu in ray.get_gpu_ids()),
            address=f"{ray.util.get_node_ip_address()}:{port}",
        )

    def setup(
        self,
        model: str,
        config: LearnerConfig,
        *,
        strategy: str,
        placements: list[_Placement],
        resume_from: StoragePath | None,
        timeout_s: float,
    ) -> None:
        """Join the process group (more than one rank), build the Learner, resume (from a
        local copy of ``resume_from``: Hugging Face loads a model from a local folder)."""
        device = _claim_device(placements, self._rank)
        world = None
        if self._world_size > 1:
            _join_process_group(
                placements[0].address,
                rank=self._rank,
                world_size=self._world_size,
                backend="gloo" if device == "cpu" else "nccl",
                timeout_s=timeout_s,
            )
            world = TorchFSDP() if strategy == "fsdp" else TorchDistributed()
        if resume_from is None:
            super().__init__(model, config, device=device, world=world)
            return
        with resume_from.as_directory() as local:
            if not config.lora.enabled:  # LoRA: the base model, adapters loaded over it
                model = str(local / "model")
            super().__init__(model, config, device=device, world=world)
            self.load_state(local)

    def train_chunks(self, *chunks: TrajectoryBatch) -> dict[str, float]:
        """One update on the chunks as one batch (Ray fetched them into this process)."""
        return self.train(TrajectoryBatch.concat(chunks))


def _claim_device(placements: Sequence[_Placement], rank: int) -> str:
    """``"cpu"``, or rank ``rank``'s GPU as ``cuda:<i>``. Every learner GPU of its node is
    made visible first, in one order on every rank (as Ray Train does), so that NCCL can
    use peer-to-peer between them; this must run before CUDA is initialized."""
    own = placements[rank]
    if not own.gpu_ids or cpu_rehearsal():  # logical GPUs of a rehearsal: compute on CPUs
        return "cpu"
    import torch

    visible = sorted({gpu for p in placements if p.node_id == own.node_id for gpu in p.gpu_ids})
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    index = visible.index(own.gpu_ids[0])
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _join_process_group(
    address: str, *, rank: int, world_size: int, backend: str, timeout_s: float
) -> None:
    """Join the group's ``torch.distributed`` process group (waits for every rank)."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
