"""Weight sync by collective broadcast: the learner's rank 0 and every generator in one
process group of their own (NCCL between GPUs, gloo on CPUs), apart from the learner's.

Setup (:func:`open_weight_group`): the learner opens a ``TCPStore`` on a free port of its
node and returns ``host:port``; then the learner and each generator join at once (joining
blocks until all ``world_size`` members are in). Each publication then moves the weights
once, straight from the learner's memory into each generator's, in per-dtype buckets of
at most ``bucket_mb``: no object store, no host round trip on GPUs.

Every member walks the same manifest (names, shapes, dtypes in order), fixed at join
time and checked by the generator against its own model, so a mismatch fails at setup,
not as garbage weights. A group cannot lose a member: a generator that dies breaks it
(the pipeline then stops with an error naming the cause; the object-store path is the one
that survives restarts).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["WeightGroup", "manifest_of"]

Manifest = list[tuple[str, tuple[int, ...], str]]


def manifest_of(state: Mapping[str, Any]) -> Manifest:
    """``(name, shape, dtype)`` of every tensor, in a fixed (sorted) order."""
    return [
        (k, tuple(state[k].shape), str(state[k].dtype).removeprefix("torch."))
        for k in sorted(state)
    ]


class WeightGroup:
    """One member of a broadcast group; rank 0 is the learner and sends."""

    def __init__(self, backend: str, world_size: int, timeout_s: float = 600.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if world_size < 2:
            raise ValueError(
                f"a weight group needs the learner and >= 1 generator, got {world_size}"
            )
        self.backend, self.world_size = backend, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = None
        self.pg = None
        self.rank: int | None = None
        self.manifest: Manifest | None = None

    def open(self, host: str) -> str:
        """Rank 0: start the rendezvous store on a free port; returns ``host:port``."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            host, 0, self.world_size, True, self.timeout, wait_for_workers=False
        )
        return f"{host}:{self.store.port}"

    def join(self, address: str, rank: int, manifest: Manifest) -> None:
        """Join the group (blocks until every member has joined)."""
        import torch.distributed as dist

        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a group of {self.world_size}")
        if self.store is None:
            host, port = address.rsplit(":", 1)
            self.store = dist.TCPStore(host, int(port), self.world_size, False, self.timeout)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout  # as torch's own group helper sets it
            self.pg = dist.ProcessGroupNCCL(self.store, rank, self.world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, self.world_size, self.timeout)
        self.rank, self.manifest = rank, list(manifest)

    def broadcast(
        self, state: Mapping[str, Any] | None, *, device: str = "cpu", bucket_mb: float = 512.0
    ) -> dict[str, Any]:
        """Rank 0 sends ``state``; the others receive and get the state dict (on ``device``)."""
        import torch
        import torch.distributed as dist

        if self.pg is None or self.manifest is None:
            raise RuntimeError("join the weight group before broadcasting")
        out: dict[str, Any] = {}
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for bucket in _buckets(self.manifest, bucket_mb * 2**20):
            dtype = getattr(torch, bucket[0][2])
            sizes = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
            if self.rank == 0:
                flat = torch.cat(
                    [state[name].detach().reshape(-1).to(device) for name, _, _ in bucket]
                )
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            self.pg.broadcast([flat], opts).wait()
            if self.rank != 0:
                for (name, shape, _), part in zip(bucket, flat.split(sizes), strict=True):
                    out[name] = part.view(shape)
        return out


def _buckets(manifest: Sequence[tuple[str, tuple[int, ...], str]], limit: float):
    """Consecutive same-dtype runs of the manifest, each at most ``limit`` bytes (a
    larger tensor gets a bucket of its own)."""
    import torch

    bucket: list = []
    size = 0.0
    for entry in manifest:
        _, shape, dtype = entry
        nbytes = (
            float(torch.Size(shape).numel())
            * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        )
        if bucket and (dtype != bucket[0][2] or size + nbytes > limit):
            yield bucket
            bucket, size = [], 0.0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket
