"""A flat index held in slices on a share of many GPUs, searched as one.

Search-R1 serves wiki-18's e5 index (21 M x 768) as float16 spread over every GPU of the
node, beside training: about 4 GB a GPU over 8. Here each slice is an actor
(:class:`FlatSliceActor`) holding rows ``[lo, hi)`` of the index file as a torch tensor
(:class:`~ray_credit.actors.flat_slices.FlatSlice`: float16 on its GPU, float32 on a
CPU), started in a placement-group bundle beside a learner worker or a generator and
asking Ray for ``share`` of that GPU (``resources.retriever_gpu_share``).
:class:`SlicedIndex` is what the retriever searches instead of a whole
:class:`~ray_credit.actors.dense_index.DenseIndex`: the query embeddings go to the object
store once, every slice returns its best ``k`` (global rows), and the merge keeps the
best ``k`` of all (ties to the lower row). The retriever never holds the vectors: the
slices read their rows from the index file (on the node's disk or a shared filesystem),
a chunk at a time.

The retriever actor owns the slices: they die with it, and a restarted retriever starts
them again in the same bundles. A slice that dies is restarted by Ray and reads its rows
again; a search in flight then fails, and its callers retry.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ray_credit.actors.dense_index import IndexConfig, check_query_embeddings, index_file_of
from ray_credit.actors.flat_slices import FlatSlice, merge_topk, read_flat_layout, slice_bounds
from ray_credit.config import InputError
from ray_credit.log import log

__all__ = ["FlatSliceActor", "SlicedIndex"]

SliceHosts = Sequence[tuple[Any, int]]
"""(placement group, bundle index) of each slice, in slice order."""


class FlatSliceActor:
    """Rows ``[lo, hi)`` of a flat index file on this actor's device; a Ray actor."""

    def __init__(self, path: str, lo: int, hi: int, device: str) -> None:
        if device == "cuda":
            import torch

            # scores summed in float32, as faiss-gpu's float16 flat index does
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        start = time.perf_counter()
        self.slice = FlatSlice.load(read_flat_layout(path), lo, hi, device=device)
        self.load_seconds = time.perf_counter() - start

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.slice.search(queries, k)

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "lo": self.slice.lo,
            "hi": self.slice.hi,
            "device": str(self.slice.device),
            "dtype": str(self.slice.dtype).replace("torch.", ""),
            "gib": self.slice.nbytes / 2**30,
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "node": ray.get_runtime_context().get_node_id(),
            "load_seconds": self.load_seconds,
        }


class SlicedIndex:
    """The slices of one flat index, searched as one (module docstring). Has what the
    retriever reads of a :class:`~ray_credit.actors.dense_index.DenseIndex`: ``manifest``,
    ``config``, ``ntotal``, ``on_gpu``, ``gpus``, ``mmapped`` and :meth:`search`."""

    mmapped = False

    def __init__(self, actors: list[Any], info: list[dict[str, Any]], manifest: dict[str, Any],
                 config: IndexConfig) -> None:  # fmt: skip
        self.actors, self.slices = actors, info
        self.manifest, self.config = manifest, config

    @classmethod
    def start(
        cls,
        folder: str | os.PathLike,
        manifest: dict[str, Any],
        config: IndexConfig,
        hosts: SliceHosts,
        *,
        share: float,
        cpus: float,
        device: str,
        timeout_s: float = 3600.0,
    ) -> SlicedIndex:
        """Start one slice per host (placement group, bundle) on rows of the flat index
        of the whole folder ``folder`` (``manifest``: its manifest), each asking ``cpus``
        and ``share`` of its bundle's GPU and computing on ``device``; returns once every
        slice has read its rows (at most ``timeout_s``)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        kind = manifest["index"]["kind"]
        if kind != "flat":
            raise InputError(
                f"the index of {folder} is {kind!r}, and a GPU share (resources."
                "retriever_gpu_share) serves a flat index in slices; serve this one on the "
                "retriever's CPUs (drop the share), or build a flat index"
            )
        path = Path(index_file_of(folder))
        layout = read_flat_layout(path)
        if (layout.ntotal, layout.dim) != (manifest["num_docs"], manifest["dim"]):
            raise InputError(
                f"{path} holds {layout.ntotal} vectors of dimension {layout.dim}, but the "
                f"manifest of {folder} says {manifest['num_docs']} of dimension "
                f"{manifest['dim']}; delete {folder} to have it built (or imported) again"
            )
        if not hosts:
            raise ValueError("a sliced index needs at least one host bundle")
        bounds = slice_bounds(layout.ntotal, len(hosts))
        actor = ray.remote(FlatSliceActor)
        actors = [
            actor.options(
                num_cpus=cpus,
                num_gpus=share,
                max_restarts=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, index),
            ).remote(str(path), lo, hi, device)
            for (group, index), (lo, hi) in zip(hosts, bounds, strict=True)
        ]
        start = time.perf_counter()
        refs = [a.info.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            for a in actors:
                ray.kill(a)
            raise TimeoutError(
                f"{len(refs) - len(ready)} of {len(refs)} index slices of {path} were not "
                f"loaded within {timeout_s:g} s; is the file on a slow or remote filesystem?"
            )
        info = []
        for i, ref in enumerate(refs):
            try:
                info.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                for a in actors:
                    ray.kill(a)
                last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                raise RuntimeError(f"index slice {i} of {path} failed to load: {last}") from None
        gib = sum(s["gib"] for s in info)
        log.info(
            f"retriever: {layout.ntotal} vectors of {path} in {len(actors)} slices of "
            f"{gib / len(actors):.2f} GiB ({info[0]['dtype']} on {info[0]['device']}, "
            f"{share:g} of each GPU; {time.perf_counter() - start:.0f}s)"
        )
        return cls(actors, info, manifest, config)

    @property
    def ntotal(self) -> int:
        return int(self.manifest["num_docs"])

    @property
    def on_gpu(self) -> bool:
        return any(s["device"].startswith("cuda") for s in self.slices)

    @property
    def gpus(self) -> list[str]:
        """Each slice's GPU, as ``node:gpu`` (its node's id shortened)."""
        return [f"{s['node'][:8]}:{','.join(s['gpu_ids'])}" for s in self.slices]

    def search(self, embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)``, each ``(len(embeddings), k)``, best first, over every slice."""
        import ray

        check_query_embeddings(self.manifest, embeddings)
        queries = ray.put(np.ascontiguousarray(embeddings, dtype=np.float32))
        parts = ray.get([a.search.remote(queries, k) for a in self.actors])
        return merge_topk(parts, k)
