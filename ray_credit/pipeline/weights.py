"""Versioned weight publication from the learner to generators and scorers.

:class:`WeightPublisher` puts the learner's state dict in the object store once and asks
every target (any actor with ``update_weights(version, weights)``: a generator, an
info-gain scorer) to load it. Ray hands each actor the same object: one copy per node,
read zero-copy by the actors there. Where every target holds its weights in one dtype
narrower than the learner's float32 (a bf16 generator: :func:`publication_dtype`), the
learner casts them first: the object is half the size, and the target loads the same
weights it would have rounded from float32 itself.

Guarantees:

* **Versioned, forward only.** Targets refuse a version that is not newer than theirs
  (see ``Generator.update_weights``), so a late delivery never rolls a policy back.
* **Never half-updated.** An actor runs one call at a time, and ``update_weights``
  validates every name and shape before copying (``load_weights_checked``): a ``generate``
  call runs wholly before or wholly after an update. Calls from one caller reach an actor
  in submission order, so everything the pipeline asks a generator after ``publish``
  runs on the new weights.
* **Bounded.** ``publish`` returns at once; :meth:`WeightPublisher.wait` (called by the
  pipeline before the next publication and before a checkpoint) waits at most
  ``timeout_s`` and raises :class:`WeightSyncError` naming the targets that failed or did
  not answer, instead of hanging.

GPU clusters: the object-store path moves weights through host memory.
:class:`CollectivePublisher` broadcasts them instead, in a process group of the learner
and the generators (NCCL between GPUs, gloo on CPUs; see :mod:`.collective`). The vLLM
backend still loads through the object store (``collective_rpc``); joining vLLM's workers
to the group needs a worker extension with its ``StatelessProcessGroup``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ray_credit.actors import actor_lost_errors

__all__ = ["CollectivePublisher", "WeightPublisher", "WeightSyncError", "publication_dtype"]


def publication_dtype(actors: Sequence[Any], timeout_s: float = 300.0) -> str | None:
    """The dtype to publish weights to ``actors`` in: the one each holds its weights in
    (``weights_dtype()``, e.g. a bf16 generator's ``"bfloat16"``) when they all agree on
    one other than float32; None (the learner's own float32) when one differs, does not
    say, or has no such method."""
    import ray

    if not actors or not all(hasattr(a, "weights_dtype") for a in actors):
        return None
    return common_dtype(ray.get([a.weights_dtype.remote() for a in actors], timeout=timeout_s))


def common_dtype(held: Sequence[str | None]) -> str | None:
    """The dtype all of ``held`` name when it is one other than float32, else None."""
    if len(set(held)) != 1:
        return None
    return None if held[0] in (None, "float32") else held[0]


class WeightSyncError(RuntimeError):
    """A weight publication failed or timed out on at least one target.

    ``failed`` lists ``(target index, reason)``; ``died`` the indices whose actor died
    (a restarted one can be brought up to date with :meth:`WeightPublisher.resync`)."""

    def __init__(self, message: str, failed=(), died=()):
        super().__init__(message)
        self.failed = list(failed)
        self.died = list(died)

    @property
    def only_deaths(self) -> bool:
        """Every target that failed died (each can be brought back); False for a failure
        on the learner's side, a version refused, or a target that did not answer."""
        return bool(self.died) and not {i for i, _ in self.failed} - set(self.died)


class WeightPublisher:
    """Publish versioned weights to actors with ``update_weights(version, weights)``.

    Args:
        targets: actor handles (generators, scorers).
        timeout_s: how long one publication may take on every target together.
        names: a label per target for errors and metrics (default ``target<i>``).
    """

    sends_itself = False
    """True when the publisher moves the learner's weights itself (no ``weights`` arg)."""

    def __init__(self, targets: Sequence[Any], *, timeout_s: float = 300.0, names=None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.targets = list(targets)
        self.names = (
            list(names) if names is not None else [f"target{i}" for i in range(len(targets))]
        )
        if len(self.names) != len(self.targets):
            raise ValueError(f"{len(self.names)} names for {len(self.targets)} targets")
        self.timeout_s = timeout_s
        self.version: int | None = None
        self.active = [True] * len(self.targets)
        self._weights: Any = None  # the last publication's ObjectRef (for resync)
        self._pending: list[tuple[int, Any]] = []
        self._started = 0.0
        # running totals; how long a publication took to load is the targets' to say
        # (a generator's gen/weight_load_seconds): here it is only seen when waited on
        self.metrics: dict[str, float] = {"sync/publications": 0.0, "sync/resyncs": 0.0}

    def publish(self, version: int, weights: Any) -> None:
        """Send ``weights`` (a state dict or an ObjectRef to one) as ``version``.

        Waits for the previous publication first, so at most one is in flight.
        """
        self.wait()
        self._check_newer(version)
        self._started = time.perf_counter()
        self._send(version, weights)
        self.version = version
        self.metrics["sync/publications"] += 1

    def adopt(self, version: int, weights: Any) -> None:
        """Take ``version`` as published without sending it: the targets hold it already
        (they served an earlier run on the same learner). ``weights`` (a state dict or an
        ObjectRef to one; None for a publisher that sends its own) is what :meth:`resync`
        sends a target found back on older weights."""
        import ray

        self._check_newer(version)
        self.version = version
        if weights is not None:
            self._weights = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)

    def _check_newer(self, version: int) -> None:
        if self.version is not None and version <= self.version:
            raise ValueError(
                f"version {version} is not newer than the last published {self.version}"
            )

    def _send(self, version: int, weights: Any) -> None:
        """Start the transfer of one publication: one ``update_weights`` per live target."""
        import ray

        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self._pending = [
            (i, t.update_weights.remote(version, ref))
            for i, t in enumerate(self.targets)
            if self.active[i]
        ]
        self._weights = ref

    def pending_refs(self) -> list:
        """The targets' calls of the publication in flight (to wait on in slices)."""
        return [ref for _, ref in self._pending]

    def wait(self) -> float:
        """Wait for the publication in flight; return the seconds since it was sent (0 if
        none): the transfer's time when it is waited on at once, an upper bound of it when
        it is waited on later (the pipeline waits at the end of the next update)."""
        import ray

        if not self._pending:
            return 0.0
        pending, self._pending = self._pending, []
        refs = [ref for _, ref in pending]
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        failed, died = [], []
        for i, ref in pending:
            if ref in late:
                failed.append((i, f"no answer within {self.timeout_s:.0f}s"))
                continue
            try:
                ray.get(ref)
            except actor_lost_errors() as err:
                failed.append((i, f"the actor died: {type(err).__name__}"))
                died.append(i)
            except Exception as err:  # noqa: BLE001 - reported with the target's name
                failed.append((i, f"{type(err).__name__}: {err}"))
        if failed:
            for ref in late:
                ray.cancel(ref)
            raise WeightSyncError(
                f"publishing weights version {self.version} failed on {len(failed)} of "
                f"{len(pending)} targets: "
                + "; ".join(f"{self.names[i]}: {why}" for i, why in failed),
                failed=failed,
                died=died,
            )
        return time.perf_counter() - self._started

    def resync(self, index: int) -> None:
        """Send the last published weights to target ``index`` (an actor Ray restarted, back
        on its base weights) and wait for it; raises :class:`WeightSyncError` on failure.
        Nothing to send before the first publication: the base weights are version 0."""
        import ray

        if self.version is None:
            return
        self._forget(index)
        ref = self.targets[index].update_weights.remote(self.version, self._weights)
        try:
            ray.get(ref, timeout=self.timeout_s)
        except Exception as err:  # noqa: BLE001 - reported with the target's name
            raise WeightSyncError(
                f"re-sending weights version {self.version} to {self.names[index]} failed: "
                f"{type(err).__name__}: {err}",
                failed=[(index, str(err))],
            ) from err
        self.metrics["sync/resyncs"] += 1

    def drop(self, index: int) -> None:
        """Stop publishing to target ``index`` (its actor is gone for good)."""
        self.active[index] = False
        self._forget(index)

    def _forget(self, index: int) -> None:
        """No longer wait for target ``index``'s part of the publication in flight."""
        self._pending = [(i, ref) for i, ref in self._pending if i != index]


class CollectivePublisher(WeightPublisher):
    """Publish by broadcast: the learner (rank 0) and every target (ranks 1..n) in one
    process group (``backend`` ``"nccl"`` or ``"gloo"``, see :mod:`.collective`).

    ``publish(version)`` asks every target to receive and the learner to send; the
    learner's own weights never go through the object store. The group is fixed at
    construction: a target that dies cannot be replaced (:meth:`resync` and :meth:`drop`
    raise), so use :class:`WeightPublisher` where generators must survive restarts.

    Args:
        targets: actors with ``join_weight_group`` and ``receive_weights`` (generators).
        learner: a :class:`~ray_credit.actors.learner_group.LearnerGroup`.
    """

    sends_itself = True

    def __init__(self, targets, learner, *, backend: str, timeout_s: float = 300.0, names=None):
        import ray

        super().__init__(targets, timeout_s=timeout_s, names=names)
        self.learner = learner
        self._learner_ref: Any = None
        world = len(self.targets) + 1
        address, manifest = learner.open_weight_group(world, backend)
        refs = [learner.join_weight_group(address, manifest)] + [
            t.join_weight_group.remote(address, i + 1, world, backend, manifest, timeout_s)
            for i, t in enumerate(self.targets)
        ]
        _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            raise WeightSyncError(
                f"{len(late)} of {world} members did not join the {backend} weight group at "
                f"{address} within {timeout_s:.0f}s (firewall between nodes? GPUs for nccl?)"
            )
        learner.check(ray.get(refs[0]))
        ray.get(refs[1:])
        self.backend, self.address = backend, address

    def publish(self, version: int, weights: Any = None) -> None:
        """Broadcast the learner's current weights as ``version`` (``weights`` unused)."""
        super().publish(version, weights)

    def _send(self, version: int, weights: Any) -> None:
        self._pending = [
            (i, t.receive_weights.remote(version))
            for i, t in enumerate(self.targets)
            if self.active[i]
        ]
        self._learner_ref = self.learner.broadcast_weights()

    def wait(self) -> float:
        import ray

        ref, self._learner_ref = self._learner_ref, None
        if ref is not None:
            ready, _ = ray.wait([ref], timeout=self.timeout_s)
            try:
                if not ready:
                    raise TimeoutError(f"no answer within {self.timeout_s:.0f}s")
                self.learner.check(ray.get(ref))
            except Exception as err:  # noqa: BLE001 - reported with its side
                self._pending = []
                raise WeightSyncError(
                    f"broadcasting weights version {self.version} failed on the learner: "
                    f"{type(err).__name__}: {err}"
                ) from err
        return super().wait()

    def resync(self, index: int) -> None:
        raise WeightSyncError(
            f"{self.names[index]} died; a {self.backend} weight group cannot take a restarted "
            "member back. Resume from the last checkpoint, or use the object-store weight "
            "sync (pipeline.weight_sync='object_store'), which survives generator restarts"
        )

    drop = resync
