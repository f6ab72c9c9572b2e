"""A flat faiss index read from its file in row slices and searched with torch: the header
parsed as faiss writes it, other kinds and cut-off files refused, and the merged slices'
results equal to faiss's own search of the whole index. No Ray."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch

faiss = pytest.importorskip("faiss")

from ray_credit.actors.flat_slices import (  # noqa: E402
    FlatLayout,
    FlatSlice,
    merge_topk,
    read_flat_layout,
    slice_bounds,
)
from ray_credit.actors.index_build import _write_flat_file  # noqa: E402
from ray_credit.config import InputError  # noqa: E402


def _unit_vectors(n, dim, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _write(path, index):
    faiss.write_index(index, str(path))
    return path


def _flat_ip(path, vectors):
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return _write(path, index)


def _mapped(layout):
    return np.memmap(layout.path, dtype=np.float32, mode="r", offset=layout.offset,
                     shape=(layout.ntotal, layout.dim))  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A random unit-vector index of 5,000 x 64, its file, and faiss's answers to 20
    queries at k=10 (exact inner product in float32)."""
    vectors = _unit_vectors(5000, 64)
    path = _flat_ip(tmp_path_factory.mktemp("flat") / "index.faiss", vectors)
    queries = _unit_vectors(20, 64, seed=1)
    index = faiss.IndexFlatIP(64)
    index.add(vectors)
    scores, rows = index.search(queries, 10)
    return read_flat_layout(path), vectors, queries, scores, rows


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize(("n", "dim"), [(1, 1), (3, 7), (257, 64), (100, 768)])
def test_layout_of_faiss_files(tmp_path, n, dim):
    vectors = _unit_vectors(n, dim)
    layout = read_flat_layout(_flat_ip(tmp_path / "i.faiss", vectors))
    # fourcc, d, ntotal, two dummies, is_trained, metric_type, the vector's length
    assert (layout.dim, layout.ntotal, layout.offset) == (dim, n, 4 + 4 + 8 + 8 + 8 + 1 + 4 + 8)
    assert layout.path == str(tmp_path / "i.faiss")
    np.testing.assert_array_equal(_mapped(layout), vectors)


def test_layout_of_an_empty_index(tmp_path):
    layout = read_flat_layout(_write(tmp_path / "e.faiss", faiss.IndexFlatIP(16)))
    assert (layout.dim, layout.ntotal, layout.offset) == (16, 0, 45)


def test_layout_of_a_streamed_file(tmp_path):
    """index_build streams a flat index shard by shard: it reads as faiss's own file."""
    vectors = _unit_vectors(300, 32)
    path = tmp_path / "streamed.faiss"
    _write_flat_file(path, 32, 300, iter([vectors[:120], vectors[120:]]))
    layout = read_flat_layout(path)
    assert layout == FlatLayout(dim=32, ntotal=300, offset=45, path=str(path))
    assert path.read_bytes() == _flat_ip(tmp_path / "whole.faiss", vectors).read_bytes()
    np.testing.assert_array_equal(_mapped(layout), vectors)


def test_count_in_bytes_is_read_too(tmp_path):
    """Faiss writes the vectors' length in floats; a file counting bytes is taken too."""
    vectors = _unit_vectors(10, 8)
    data = bytearray(_flat_ip(tmp_path / "i.faiss", vectors).read_bytes())
    assert int.from_bytes(data[37:45], "little") == 10 * 8  # floats, as faiss writes now
    data[37:45] = (10 * 8 * 4).to_bytes(8, "little")
    (tmp_path / "bytes.faiss").write_bytes(bytes(data))
    layout = read_flat_layout(tmp_path / "bytes.faiss")
    np.testing.assert_array_equal(_mapped(layout), vectors)
    data[37:45] = (10 * 8 * 2).to_bytes(8, "little")
    (tmp_path / "odd.faiss").write_bytes(bytes(data))
    with pytest.raises(InputError, match="damaged"):
        read_flat_layout(tmp_path / "odd.faiss")


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_flat_layout(tmp_path / "nothing.faiss")


def test_cut_off_files_are_refused(tmp_path):
    data = _flat_ip(tmp_path / "i.faiss", _unit_vectors(50, 16)).read_bytes()
    for keep in (len(data) - 1, 45 + 4 * 16, 40, 20, 2, 0):
        (tmp_path / "cut.faiss").write_bytes(data[:keep])
        with pytest.raises(InputError, match=r"cut\.faiss is cut off.*download"):
            read_flat_layout(tmp_path / "cut.faiss")
    (tmp_path / "long.faiss").write_bytes(data + b"\0" * 8)
    with pytest.raises(InputError, match="8 bytes after its 50 vectors"):
        read_flat_layout(tmp_path / "long.faiss")


def test_other_kinds_are_refused(tmp_path):
    vectors = _unit_vectors(400, 16)
    l2 = faiss.IndexFlatL2(16)
    l2.add(vectors)
    with pytest.raises(InputError, match=r"flat L2 index; the slices search by inner product"):
        read_flat_layout(_write(tmp_path / "l2.faiss", l2))
    hnsw = faiss.IndexHNSWFlat(16, 8, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(vectors)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(16), 16, 4, faiss.METRIC_INNER_PRODUCT)
    ivfpq = faiss.IndexIVFPQ(faiss.IndexFlatIP(16), 16, 4, 4, 4, faiss.METRIC_INNER_PRODUCT)
    for index in (ivf, ivfpq):
        index.train(vectors)
        index.add(vectors)
    for name, index, kind in [("hnsw", hnsw, "an HNSW index"), ("ivf", ivf, "an IVF-Flat"),
                              ("ivfpq", ivfpq, "an IVF-PQ")]:  # fmt: skip
        with pytest.raises(InputError, match=rf"{name}\.faiss is {kind}.*flat inner-product "
                           "indexes only; serve this one on CPU"):  # fmt: skip
            read_flat_layout(_write(tmp_path / f"{name}.faiss", index))
    (tmp_path / "text.faiss").write_bytes(b"hello, not an index at all")
    with pytest.raises(InputError, match=r"not a faiss flat index \(it starts b'hell'\)"):
        read_flat_layout(tmp_path / "text.faiss")


# ---------------------------------------------------------------------------- slices
@pytest.mark.parametrize(("ntotal", "parts"), [(1, 1), (10, 3), (10, 10), (5000, 7), (8, 4)])
def test_slice_bounds(ntotal, parts):
    bounds = slice_bounds(ntotal, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == ntotal
    assert all(hi == lo for (_, hi), (lo, _) in pairwise(bounds))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("ntotal", "parts"), [(10, 0), (10, 11), (0, 1), (5, -1)])
def test_slice_bounds_refuses(ntotal, parts):
    with pytest.raises(ValueError, match=f"{ntotal} rows into {parts} slices"):
        slice_bounds(ntotal, parts)


def test_load_reads_its_rows_in_chunks(corpus):
    layout, vectors = corpus[:2]
    part = FlatSlice.load(layout, 1234, 2345, chunk_rows=100)
    assert (part.lo, part.hi, part.dim, part.dtype) == (1234, 2345, 64, torch.float32)
    assert part.device == torch.device("cpu") and part.nbytes == 1111 * 64 * 4
    np.testing.assert_array_equal(part.vectors.numpy(), vectors[1234:2345])
    last = FlatSlice.load(layout, 4999, 5000, dtype=torch.float16, chunk_rows=7)
    assert last.nbytes == 64 * 2
    np.testing.assert_array_equal(last.vectors.float().numpy(), vectors[4999:].astype(np.float16))
    for lo, hi in [(-1, 5), (5, 5), (10, 5), (0, 5001)]:
        with pytest.raises(ValueError, match=rf"\[{lo}, {hi}\) are not a slice of 5000"):
            FlatSlice.load(layout, lo, hi)


@pytest.mark.parametrize("parts", [1, 3, 7])
def test_slices_merged_equal_faiss(corpus, parts):
    layout, _, queries, want_scores, want_rows = corpus
    results = [FlatSlice.load(layout, lo, hi).search(queries, 10)
               for lo, hi in slice_bounds(layout.ntotal, parts)]  # fmt: skip
    scores, rows = merge_topk(results, 10)
    assert scores.dtype == np.float32 and rows.dtype == np.int64 and rows.shape == (20, 10)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, atol=1e-5)


def test_k_larger_than_a_slice(corpus):
    layout, vectors, queries = corpus[:3]
    part = FlatSlice.load(layout, 100, 104)
    scores, rows = part.search(queries, 10)
    assert rows.shape == (20, 4) and set(rows[0]) == {100, 101, 102, 103}
    want = queries @ vectors[100:104].T
    np.testing.assert_allclose(scores, -np.sort(-want, axis=1), atol=1e-6)
    np.testing.assert_allclose(np.take_along_axis(want, rows - 100, 1), scores, atol=1e-6)
    merged = merge_topk([(scores, rows), FlatSlice.load(layout, 0, 2).search(queries, 10)], 10)
    assert merged[1].shape == (20, 6)


def test_chunked_search_equals_one_chunk(corpus):
    layout, _, queries, want_scores, want_rows = corpus
    part = FlatSlice.load(layout, 0, layout.ntotal)
    whole = part.search(queries, 10)
    for chunk_rows in (1, 9, 333, 4999):
        scores, rows = part.search(queries, 10, chunk_rows=chunk_rows)
        np.testing.assert_array_equal(rows, whole[1])
        np.testing.assert_allclose(scores, whole[0], atol=1e-6)  # matmul blocks round apart
    np.testing.assert_array_equal(whole[1], want_rows)


def test_float16_agrees_with_float32(corpus):
    layout, vectors, _, _, _ = corpus
    # well separated: each query is a stored vector, slightly moved; its own row wins
    own = np.arange(0, 5000, 250)
    queries = vectors[own] + 0.01 * _unit_vectors(len(own), 64, seed=2)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    try:
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
    except RuntimeError as err:
        pytest.skip(f"this torch cannot multiply float16 on CPU: {err}")
    half = FlatSlice.load(layout, 0, 5000, dtype=torch.float16)
    scores16, rows16 = half.search(queries, 5, chunk_rows=1000)
    scores32, rows32 = FlatSlice.load(layout, 0, 5000).search(queries, 5)
    assert half.nbytes == 5000 * 64 * 2 and scores16.dtype == np.float32
    np.testing.assert_array_equal(rows16[:, 0], own)
    np.testing.assert_array_equal(rows32[:, 0], own)
    np.testing.assert_allclose(scores16, scores32, atol=1e-2)


def _reference(vectors, queries, k):
    """The best k rows by exact score, equal scores by the lower row: a loop."""
    found = []
    for query in queries:
        scores = vectors.astype(np.float64) @ query.astype(np.float64)
        found.append(sorted(range(len(vectors)), key=lambda row: (-scores[row], row))[:k])
    return np.array(found)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ties_go_to_the_lower_row(tmp_path, dtype):
    """Vectors of quarters score exactly in any summation order and dtype, so copies of a
    vector, and many others, tie: the lower rows win, at the k-th place too, however the
    index is sliced or chunked."""
    vectors = np.random.default_rng(3).integers(-2, 3, (60, 8)).astype(np.float32) / 4
    vectors[[3, 11, 12, 25, 30, 39, 59]] = vectors[0]
    layout = read_flat_layout(_flat_ip(tmp_path / "ties.faiss", vectors))
    queries = np.concatenate([vectors[:1], vectors[5:6] / 2, np.eye(8, dtype=np.float32)])
    assert _reference(vectors, queries[:1], 8).tolist() == [[0, 3, 11, 12, 25, 30, 39, 59]]
    whole = FlatSlice.load(layout, 0, 60, dtype=dtype)
    for k in (1, 4, 7, 9, 30):
        want = _reference(vectors, queries, k)
        for chunk_rows in (1, 5, 13, 60):
            scores, rows = whole.search(queries, k, chunk_rows=chunk_rows)
            np.testing.assert_array_equal(rows, want)
            assert np.all(np.diff(scores, axis=1) <= 0)
        for parts in (2, 3, 7):
            results = [FlatSlice.load(layout, lo, hi, dtype=dtype).search(queries, k, chunk_rows=3)
                       for lo, hi in slice_bounds(60, parts)]  # fmt: skip
            np.testing.assert_array_equal(merge_topk(results, k)[1], want)


def test_merge_topk_orders_by_score_then_row():
    a = (np.array([[0.9, 0.5, 0.1]], np.float32), np.array([[7, 2, 4]]))
    b = (np.array([[0.5, 0.3]], np.float32), np.array([[1, 9]]))
    scores, rows = merge_topk([a, b], 4)
    assert rows.tolist() == [[7, 1, 2, 9]] and scores.tolist()[0][:2] == [
        pytest.approx(0.9),
        pytest.approx(0.5),
    ]
    assert merge_topk([a, b], 10)[1].shape == (1, 5)
    with pytest.raises(ValueError, match="at least one part"):
        merge_topk([], 3)


def test_wrong_queries_are_refused(corpus):
    part = FlatSlice.load(corpus[0], 0, 10)
    with pytest.raises(ValueError, match=r"queries of shape \(2, 32\) do not fit a slice of "
                       r"shape \(10, 64\): give \(n, 64\)"):  # fmt: skip
        part.search(np.zeros((2, 32), np.float32), 3)
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        part.search(np.zeros(64, np.float32), 3)
    with pytest.raises(ValueError, match="k and chunk_rows"):
        part.search(np.zeros((2, 64), np.float32), 0)


def test_workspace_grows_with_queries_and_chunk():
    small = FlatSlice.workspace_bytes(8, 10, dim=768, dtype=torch.float16, chunk_rows=1024)
    assert small >= 8 * 1024 * 2 + 8 * 768 * 2
    assert FlatSlice.workspace_bytes(16, 10, dim=768, dtype=torch.float16, chunk_rows=1024) > small
    assert FlatSlice.workspace_bytes(8, 10, dim=768, dtype=torch.float32, chunk_rows=1024) > small


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float16_slices_on_cuda(corpus):
    layout, _, queries, want_scores, want_rows = corpus
    results = []
    for lo, hi in slice_bounds(layout.ntotal, 3):
        part = FlatSlice.load(layout, lo, hi, device="cuda", chunk_rows=500)
        assert part.dtype == torch.float16 and part.device.type == "cuda"
        part.search(queries, 10, chunk_rows=1000)  # cuBLAS takes its workspace once
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results.append(part.search(queries, 10, chunk_rows=1000))
        used = torch.cuda.max_memory_allocated() - before
        plan = FlatSlice.workspace_bytes(20, 10, dim=64, dtype=torch.float16, chunk_rows=1000)
        assert used <= plan + 64 * 1024  # the allocator rounds each small tensor up
    scores, rows = merge_topk(results, 10)
    np.testing.assert_allclose(scores, want_scores, atol=1e-2)
    assert (rows[:, 0] == want_rows[:, 0]).mean() >= 0.9
    np.testing.assert_allclose(scores[:, 0], want_scores[:, 0], atol=1e-2)
