"""Versioned weight publication from the learner to generators and scorers.

:class:`WeightPublisher` puts the learner's state dict in the object store once and asks
every target (any actor with ``update_weights(version, weights)``: a generator, an
info-gain scorer) to load it. Ray hands each actor the same object: one copy per node,
read zero-copy by the actors there.

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

GPU clusters: the object-store path moves weights through host memory. An NCCL broadcast
straight between GPUs needs the learner and the vLLM workers in one process group;
vLLM's documented way is a worker extension that joins a ``StatelessProcessGroup``, which
this library's vLLM backend does not yet wire (it loads weights through
``collective_rpc`` from the object store).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

__all__ = ["WeightPublisher", "WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight publication failed or timed out on at least one target."""


class WeightPublisher:
    """Publish versioned weights to actors with ``update_weights(version, weights)``.

    Args:
        targets: actor handles (generators, scorers).
        timeout_s: how long one publication may take on every target together.
        names: a label per target for errors and metrics (default ``target<i>``).
    """

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
        self._pending: list[Any] = []
        self._started = 0.0
        self.metrics: dict[str, float] = {"sync/publications": 0.0, "sync/seconds": 0.0}

    def publish(self, version: int, weights: Any) -> None:
        """Send ``weights`` (a state dict or an ObjectRef to one) as ``version``.

        Waits for the previous publication first, so at most one is in flight.
        """
        import ray

        self.wait()
        if self.version is not None and version <= self.version:
            raise ValueError(
                f"version {version} is not newer than the last published {self.version}"
            )
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        self._started = time.perf_counter()
        self._pending = [t.update_weights.remote(version, ref) for t in self.targets]
        self.version = version
        self.metrics["sync/publications"] += 1

    def wait(self) -> float:
        """Wait for the publication in flight; return its seconds (0 if none)."""
        import ray

        if not self._pending:
            return 0.0
        pending, self._pending = self._pending, []
        ready, late = ray.wait(pending, num_returns=len(pending), timeout=self.timeout_s)
        failed = []
        for ref, name in zip(pending, self.names, strict=True):
            if ref in late:
                failed.append(f"{name}: no answer within {self.timeout_s:.0f}s")
                continue
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001 - reported with the target's name
                failed.append(f"{name}: {type(err).__name__}: {err}")
        if failed:
            for ref in late:
                ray.cancel(ref)
            raise WeightSyncError(
                f"publishing weights version {self.version} failed on {len(failed)} of "
                f"{len(pending)} targets: " + "; ".join(failed)
            )
        seconds = time.perf_counter() - self._started
        self.metrics["sync/seconds"] += seconds
        self.metrics["sync/last_seconds"] = seconds
        return seconds
