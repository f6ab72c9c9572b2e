"""A flat inner-product faiss index searched in row slices with torch, one slice per GPU.

faiss-gpu is often not installable; torch always is. A flat (exact) index is only its
vectors, so its search is a matmul and a top-k: the file written by ``faiss.write_index``
for an ``IndexFlatIP`` is split into contiguous row slices (:func:`slice_bounds`), each
held by a :class:`FlatSlice` (float16 on its GPU, float32 on CPU) and searched there; the
slices' results are merged into the global top-k (:func:`merge_topk`).

* :func:`read_flat_layout` reads the file's header: the dimension, the vector count and
  where the float32 vectors start. Anything but a whole flat inner-product index (L2,
  HNSW, IVF, a cut-off download) is refused, saying what it is.
* :meth:`FlatSlice.load` reads its rows from a memory map a chunk at a time into a tensor
  allocated on the device first: a 64 GB index (wiki-18, 21 M x 768) never passes through
  host memory whole.
* :meth:`FlatSlice.search` scores a chunk of rows at a time (an ``n x chunk_rows`` score
  matrix, :meth:`FlatSlice.workspace_bytes`) and keeps a running top-k.

Ties are broken by the lower row everywhere, also at the k-th place (float16 scores tie
often), so a search gives the same rows however the index is sliced.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from ray_credit.config import InputError, InputFileNotFoundError

__all__ = ["FlatLayout", "FlatSlice", "merge_topk", "read_flat_layout", "slice_bounds"]

# faiss's index header after the fourcc: d (int32), ntotal (int64), two dummy int64
# fields, is_trained (uint8), metric_type (int32) (a float32 metric_arg follows only if
# metric_type > 1: never for inner product, 0).
_HEADER = struct.Struct("<iqqq?i")
_COUNT = struct.Struct("<Q")  # the vectors' length, ahead of them (a faiss vector)
_METRIC_INNER_PRODUCT = 0

_OTHER_KINDS = {
    b"IHNf": "an HNSW index (HNSWFlat)",
    b"IHNs": "an HNSW index over scalar-quantized vectors (HNSWSQ)",
    b"IHNp": "an HNSW index over PQ codes (HNSWPQ)",
    b"IwFl": "an IVF-Flat index",
    b"IwPQ": "an IVF-PQ index",
    b"IwSq": "an IVF scalar-quantizer index (IVF-SQ)",
    b"IxPq": "a PQ index",
    b"IxSQ": "a scalar-quantizer index (SQ)",
    b"IxMp": "an IDMap index (ids around another index)",
    b"IxPT": "a pre-transformed index (PCA/OPQ before another index)",
    b"IxFl": "a flat index with neither the inner-product nor the L2 metric",
}
_SERVE_ON_CPU = (
    "a GPU share (resources.retriever_gpu_share) serves flat inner-product indexes only; "
    "serve this one on CPU, without the share"
)


@dataclass(frozen=True)
class FlatLayout:
    """Where the vectors of a flat index file lie: ``ntotal`` rows of ``dim`` float32s,
    row-major, from byte ``offset`` of ``path``."""

    dim: int
    ntotal: int
    offset: int
    path: str


def read_flat_layout(path: str | os.PathLike) -> FlatLayout:
    """The layout of a file ``faiss.write_index`` wrote for an ``IndexFlatIP`` (or one as
    ``index_build`` streams it). InputError, naming the file and what to do: missing,
    cut off, another metric or another kind of index."""
    path = Path(path)
    if not path.is_file():
        raise InputFileNotFoundError(f"flat index file {path} does not exist (or is not a file)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4 + _HEADER.size + _COUNT.size)
    fourcc = head[:4]
    if len(fourcc) == 4 and fourcc != b"IxFI":
        if fourcc == b"IxF2":
            raise InputError(
                f"{path} is a flat L2 index; the slices search by inner product, so this "
                f"index would rank differently. Build it with inner product ({_SERVE_ON_CPU})"
            )
        kind = _OTHER_KINDS.get(fourcc, f"not a faiss flat index (it starts {fourcc!r})")
        raise InputError(f"{path} is {kind}: {_SERVE_ON_CPU}")
    offset = 4 + _HEADER.size + _COUNT.size  # no metric_arg: inner product has none
    if len(head) < offset:
        _cut_off(path, size, offset)
    dim, ntotal, _, _, _, metric = _HEADER.unpack_from(head, 4)
    if metric != _METRIC_INNER_PRODUCT or dim < 1 or ntotal < 0:
        raise InputError(
            f"{path} has a damaged flat index header (dim {dim}, ntotal {ntotal}, metric "
            f"{metric}); download or build it again"
        )
    (count,) = _COUNT.unpack_from(head, 4 + _HEADER.size)
    floats = ntotal * dim
    if count not in (floats, 4 * floats):  # faiss 1.15 counts floats; bytes are taken too
        raise InputError(
            f"{path}: its header says {ntotal} vectors of dimension {dim}, but its data "
            f"holds {count} elements, neither {floats} floats nor {4 * floats} bytes; the "
            "file is damaged: download or build it again"
        )
    expected = offset + 4 * floats
    if size < expected:
        _cut_off(path, size, expected)
    if size > expected:
        raise InputError(
            f"{path} holds {size - expected} bytes after its {ntotal} vectors: not a plain "
            f"faiss flat index file; {_SERVE_ON_CPU}"
        )
    return FlatLayout(dim=dim, ntotal=ntotal, offset=offset, path=str(path))


def _cut_off(path: Path, size: int, expected: int) -> NoReturn:
    raise InputError(
        f"{path} is cut off: {size} bytes where its header needs {expected}; download it "
        "(or join its parts) again"
    )


def slice_bounds(ntotal: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[lo, hi)`` slices covering ``[0, ntotal)``, sizes differing
    by at most 1, the larger ones first."""
    if not 1 <= parts <= ntotal:
        raise ValueError(f"cannot cut {ntotal} rows into {parts} slices (1 to {ntotal})")
    size, larger = divmod(ntotal, parts)
    bounds, lo = [], 0
    for part in range(parts):
        hi = lo + size + (part < larger)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class FlatSlice:
    """Rows ``[lo, hi)`` of a flat index, held as a ``(hi - lo, dim)`` tensor on
    ``device``; searched by inner product, exactly (up to its dtype)."""

    def __init__(self, vectors: torch.Tensor, lo: int) -> None:
        self.vectors = vectors
        self.lo = lo
        self.hi = lo + vectors.shape[0]
        self.dim = vectors.shape[1]
        self.device = vectors.device
        self.dtype = vectors.dtype
        self.nbytes = vectors.numel() * vectors.element_size()  # held on the device

    @classmethod
    def load(
        cls,
        layout: FlatLayout,
        lo: int,
        hi: int,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        chunk_rows: int = 65536,
    ) -> FlatSlice:
        """Rows ``[lo, hi)`` of the file of ``layout``, copied onto ``device`` in ``dtype``
        (None: float16 on CUDA, float32 elsewhere) ``chunk_rows`` rows at a time: host
        memory holds one chunk, never the slice."""
        if not 0 <= lo < hi <= layout.ntotal:
            raise ValueError(f"rows [{lo}, {hi}) are not a slice of {layout.ntotal} rows")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
        device = torch.device(device)
        if dtype is None:
            dtype = torch.float16 if device.type == "cuda" else torch.float32
        vectors = torch.empty((hi - lo, layout.dim), dtype=dtype, device=device)
        mapped = np.memmap(layout.path, dtype=np.float32, mode="r",
                           offset=layout.offset + 4 * lo * layout.dim,
                           shape=(hi - lo, layout.dim))  # fmt: skip
        for start in range(0, hi - lo, chunk_rows):
            chunk = np.array(mapped[start : start + chunk_rows])  # read: one chunk in memory
            vectors[start : start + len(chunk)].copy_(torch.from_numpy(chunk))
        return cls(vectors, lo)

    @staticmethod
    def workspace_bytes(
        n_queries: int, k: int, *, dim: int, dtype: torch.dtype, chunk_rows: int = 262144
    ) -> int:
        """About the device memory a search of ``n_queries`` queries takes beyond the
        slice: the queries, one chunk's scores and its masks, the top-k buffers."""
        item = torch.empty((), dtype=dtype).element_size()
        chunk = n_queries * chunk_rows * (item + 2)  # scores, the chosen mask, a tie mask
        topk = n_queries * k * 3 * (item + 8) + n_queries * k * 16  # values+positions, nonzero
        return n_queries * dim * item + chunk + topk

    def search(
        self, queries: np.ndarray, k: int, *, chunk_rows: int = 262144
    ) -> tuple[np.ndarray, np.ndarray]:
        """The best ``min(k, hi - lo)`` rows of this slice for each query: ``(scores
        float32, rows int64)``, each ``(n, min(k, hi - lo))``, best first (equal scores:
        the lower row first), rows global (``lo`` added). The scores are computed in the
        slice's dtype, ``chunk_rows`` rows at a time."""
        queries = np.asarray(queries)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(
                f"queries of shape {queries.shape} do not fit a slice of shape "
                f"{tuple(self.vectors.shape)}: give (n, {self.dim})"
            )
        if k < 1 or chunk_rows < 1:
            raise ValueError(f"k and chunk_rows must be at least 1, got {k} and {chunk_rows}")
        k = min(k, self.hi - self.lo)
        if not np.isfinite(queries).all():
            raise ValueError("queries hold NaN or infinite values")
        with torch.inference_mode():
            q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
            q = q.to(device=self.device, dtype=self.dtype)
            best_scores = best_rows = None  # the running top-k, kept in row order
            for start in range(0, self.hi - self.lo, chunk_rows):
                scores = q @ self.vectors[start : start + chunk_rows].T
                positions = _top_lowest(scores, min(k, scores.shape[1]))
                chunk_scores = scores.gather(1, positions)
                chunk_rows_found = positions + (self.lo + start)
                if best_scores is None:
                    best_scores, best_rows = chunk_scores, chunk_rows_found
                    continue
                scores = torch.cat([best_scores, chunk_scores], dim=1)
                rows = torch.cat([best_rows, chunk_rows_found], dim=1)
                positions = _top_lowest(scores, min(k, scores.shape[1]))
                best_scores, best_rows = scores.gather(1, positions), rows.gather(1, positions)
            scores = best_scores.float().cpu().numpy()
            rows = best_rows.cpu().numpy()
        order = np.argsort(-scores, axis=1, kind="stable")  # rows ascend: ties stay in order
        return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


def _top_lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of each row's ``k`` best scores, ascending; among scores tied at the
    k-th place, the lowest positions. ``torch.topk`` picks among ties as it likes."""
    n, width = scores.shape
    if k >= width:
        return torch.arange(width, device=scores.device).expand(n, width)
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    chosen = scores >= kth
    extra = chosen.sum(dim=1) - k  # ties at the k-th place beyond k
    if bool((extra > 0).any()):
        row, col = (scores == kth).nonzero(as_tuple=True)  # row-major: columns ascend
        tied = torch.bincount(row, minlength=n)
        rank = torch.arange(len(row), device=scores.device) - (tied.cumsum(0) - tied)[row]
        drop = rank >= (tied - extra)[row]  # keep each row's first tied - extra ties
        chosen[row[drop], col[drop]] = False
    return chosen.nonzero(as_tuple=True)[1].view(n, k)


def merge_topk(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of the slices' results ``(scores, rows)`` (each ``(n, k_i)``) for
    each query: ``(scores, rows)``, ``(n, min(k, sum k_i))``, best first, equal scores by
    the lower row."""
    if not parts or k < 1:
        raise ValueError(f"merge_topk needs at least one part and k >= 1, got {len(parts)} "
                         f"parts and k={k}")  # fmt: skip
    scores = np.concatenate([np.asarray(s, dtype=np.float32) for s, _ in parts], axis=1)
    rows = np.concatenate([np.asarray(r, dtype=np.int64) for _, r in parts], axis=1)
    order = np.lexsort((rows, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)
