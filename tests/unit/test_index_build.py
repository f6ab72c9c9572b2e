"""The corpus as a memory-mapped Arrow file, and index folders built once: in shards that a
killed build resumes from, with every index kind, or imported from a faiss file built
elsewhere (and refused when it does not match). No Ray here: workers=0 embeds in-process;
the Ray Data pool is tested in tests/ray/test_retriever_actor.py."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
faiss = pytest.importorskip("faiss")
pytest.importorskip("transformers")

from ray_credit.actors import index_build  # noqa: E402
from ray_credit.actors.corpus import Corpus, cached_corpus, convert_corpus  # noqa: E402
from ray_credit.actors.dense_index import DenseIndex, IndexConfig  # noqa: E402
from ray_credit.actors.encoder import Encoder, resolve_encoder_path  # noqa: E402
from ray_credit.actors.index_build import ensure_index  # noqa: E402
from ray_credit.actors.retriever import Retriever  # noqa: E402
from ray_credit.config import InputError  # noqa: E402
from tests.unit.test_retriever import CORPUS_DOCS, QUERIES  # noqa: E402


def _jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _top(retriever, k=3):
    return [[h["id"] for h in hits] for hits in retriever.search(list(QUERIES), topk=k)]


@pytest.fixture(scope="module")
def encoder():
    return Encoder("minilm")


# ---------------------------------------------------------------------------- corpus
def test_a_converted_corpus_is_the_same_corpus_mapped(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", CORPUS_DOCS)
    info = convert_corpus(path, tmp_path / "arrow")
    mapped, memory = Corpus.open(tmp_path / "arrow"), Corpus(CORPUS_DOCS)
    assert info["num_docs"] == len(mapped) == 20
    assert mapped.fingerprint == memory.fingerprint == info["fingerprint"]
    assert mapped.path == str(tmp_path / "arrow" / "corpus.arrow")
    assert mapped.hits([3, 0], [0.5, 0.25]) == memory.hits([3, 0], [0.5, 0.25])
    assert mapped.hit(0, 1.0)["title"] == "Paris" and mapped.texts(1, 3) == memory.contents[1:3]
    assert mapped.rows_of(["nile", "paris", "absent"]) == {"paris": 0, "nile": 6}
    # gzip and parquet give the same corpus
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(CORPUS_DOCS), tmp_path / "c.parquet")
    for other in (gz, tmp_path / "c.parquet"):
        assert Corpus.from_file(other).fingerprint == memory.fingerprint


def test_conversion_keeps_the_loaders_messages_and_names_duplicates(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "a\\nb"}\nnot json\n')
    with pytest.raises(InputError, match="bad.jsonl:2: invalid JSON"):
        convert_corpus(bad, tmp_path / "out")
    dup = _jsonl(tmp_path / "dup.jsonl", CORPUS_DOCS + [CORPUS_DOCS[2], CORPUS_DOCS[5]])
    with pytest.raises(InputError, match=r"dup.jsonl: duplicate document ids \['photosynthesis', "
                       r"'python'\]"):  # fmt: skip
        convert_corpus(dup, tmp_path / "out")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "a", "contents": " "}]), tmp_path / "e.parquet")
    with pytest.raises(InputError, match=r"e.parquet: row 0 \(id 'a'\): empty contents"):
        convert_corpus(tmp_path / "e.parquet", tmp_path / "out")
    assert not (tmp_path / "out" / "corpus.json").exists()  # nothing half-written


def test_a_corpus_file_is_converted_once_and_again_when_edited(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", CORPUS_DOCS)
    first = cached_corpus(path)
    stamp = (first / "corpus.arrow").stat().st_mtime_ns
    assert cached_corpus(path) == first and (first / "corpus.arrow").stat().st_mtime_ns == stamp
    _jsonl(path, CORPUS_DOCS[:-1])
    assert cached_corpus(path) != first and len(Corpus.from_file(path)) == 19


# ---------------------------------------------------------------------------- building
def test_a_sharded_build_returns_the_one_pass_top_k(tmp_path, encoder):
    for config in (IndexConfig(), IndexConfig(kind="ivfflat", nlist=2, nprobe=1)):
        one_pass = Retriever(Corpus(CORPUS_DOCS), encoder,
                             DenseIndex.build(Corpus(CORPUS_DOCS), encoder, config))  # fmt: skip
        folder = ensure_index(CORPUS_DOCS, tmp_path / config.kind, index=config, shard_docs=3)
        sharded = Retriever.create(None, index=config, index_folder=folder)
        assert _top(sharded, 5) == _top(one_pass, 5)
        built = json.loads((folder / "manifest.json").read_text())["built"]
        assert built["shard_docs"] == 3 and not (folder / "embeddings").exists()


def test_a_killed_build_resumes_without_re_encoding_finished_shards(tmp_path, monkeypatch):
    encoded: list[int] = []
    real = Encoder.encode_passages

    def counting(self, passages):
        if len(encoded) == 2 and fail:
            raise KeyboardInterrupt  # killed while embedding the third shard
        encoded.append(len(passages))
        return real(self, passages)

    monkeypatch.setattr(Encoder, "encode_passages", counting)
    folder = tmp_path / "idx"
    fail = True
    with pytest.raises(KeyboardInterrupt):
        ensure_index(CORPUS_DOCS, folder, shard_docs=6)
    shards = sorted(p.name for p in (folder / "embeddings").glob("shard_*.npy"))
    assert shards == ["shard_00000.npy", "shard_00001.npy"] and encoded == [6, 6]
    assert not (folder / "manifest.json").exists()
    with pytest.raises(InputError, match=r"partial build of other settings .*\['shard_docs'\]"):
        ensure_index(CORPUS_DOCS, folder, shard_docs=5)
    fail = False
    ensure_index(CORPUS_DOCS, folder, shard_docs=6)
    assert encoded == [6, 6, 6, 2]  # only the two shards not on disk
    fresh = ensure_index(CORPUS_DOCS, tmp_path / "fresh")
    assert _top(Retriever.create(None, index_folder=folder)) == _top(
        Retriever.create(None, index_folder=fresh)
    )


def test_every_kind_builds_and_finds_the_matching_doc(tmp_path):
    kinds = [IndexConfig(kind="hnsw", hnsw_m=8, ef_search=32),
             IndexConfig(kind="ivfflat", nlist=4, nprobe=4),
             IndexConfig(kind="ivfpq", nlist=2, nprobe=2, pq_m=16, pq_nbits=4)]  # fmt: skip
    for config in kinds:
        retriever = Retriever.create(CORPUS_DOCS, index=config,
                                     index_folder=tmp_path / config.kind)  # fmt: skip
        found = [want in ids for ids, want in zip(_top(retriever, 5), QUERIES.values(),
                                                   strict=True)]  # fmt: skip
        assert sum(found) >= len(QUERIES) - (config.kind == "ivfpq"), config.kind
        assert retriever.index.mmapped, config.kind  # CPU: mapped from the file


def test_settings_that_cannot_work_are_refused_before_any_embedding(tmp_path, monkeypatch):
    monkeypatch.setattr(Encoder, "encode_passages", lambda *a: pytest.fail("embedded"))
    with pytest.raises(InputError, match=r"'ivfflat' with nlist=64 .*needs at least 64 passages; "
                       "the corpus has 20"):  # fmt: skip
        ensure_index(CORPUS_DOCS, tmp_path / "a", index=IndexConfig(kind="ivfflat", nlist=64))
    with pytest.raises(InputError, match="train_sample=10 is below the 16"):
        ensure_index(CORPUS_DOCS, tmp_path / "b", index=IndexConfig(
            kind="ivfpq", nlist=2, nprobe=2, pq_nbits=4, train_sample=10))  # fmt: skip


# ---------------------------------------------------------------------------- import
def _plain_faiss_index(path, docs, *, dim_cut=None, metric="ip"):
    """Built as Search-R1's builder does it: sentence-transformers, normalized embeddings,
    one faiss Flat index in the corpus's line order."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_encoder_path("minilm"), device="cpu")
    vectors = model.encode([d["contents"] for d in docs], normalize_embeddings=True)
    vectors = np.ascontiguousarray(vectors[:, :dim_cut] if dim_cut else vectors, np.float32)
    index = faiss.IndexFlatIP(vectors.shape[1]) if metric == "ip" else faiss.IndexFlatL2(
        vectors.shape[1])  # fmt: skip
    index.add(vectors)
    faiss.write_index(index, str(path))
    return path


def test_an_index_built_elsewhere_is_served_through_index_file(tmp_path):
    corpus = _jsonl(tmp_path / "wiki.jsonl", CORPUS_DOCS)
    shipped = _plain_faiss_index(tmp_path / "minilm_Flat.index", CORPUS_DOCS)
    served = Retriever.create(corpus, index_file=shipped, index_folder=tmp_path / "idx")
    ours = Retriever.create(corpus, index_folder=tmp_path / "ours")
    assert _top(served) == _top(ours)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["imported"] and manifest["index_path"] == str(shipped)
    assert manifest["import_check"] == 1.0 and not (tmp_path / "idx" / "index.faiss").exists()
    # and through the shared cache: found again by its stamp, not checked again
    first = Retriever.create(corpus, index_file=shipped)
    assert not first.index_loaded and Retriever.create(corpus, index_file=shipped).index_loaded


def test_a_mismatched_index_file_is_refused(tmp_path):
    corpus = _jsonl(tmp_path / "wiki.jsonl", CORPUS_DOCS)
    shuffled = CORPUS_DOCS[7:] + CORPUS_DOCS[:7]  # another line order
    other_order = _plain_faiss_index(tmp_path / "shuffled.index", shuffled)
    with pytest.raises(InputError, match=r"does not match the corpus and the encoder: only \d+ "
                       "of 20 sampled passages find their own row first"):  # fmt: skip
        ensure_index(corpus, tmp_path / "a", index_file=other_order)
    short = _plain_faiss_index(tmp_path / "short.index", CORPUS_DOCS[:-1])
    with pytest.raises(InputError, match="holds 19 vectors of dimension 384; the corpus has 20"):
        ensure_index(corpus, tmp_path / "b", index_file=short)
    cut = _plain_faiss_index(tmp_path / "cut.index", CORPUS_DOCS, dim_cut=64)
    with pytest.raises(InputError, match="dimension 64.*gives dimension 384"):
        ensure_index(corpus, tmp_path / "c", index_file=cut)
    l2 = _plain_faiss_index(tmp_path / "l2.index", CORPUS_DOCS, metric="l2")
    with pytest.raises(InputError, match="ranks by L2 distance"):
        ensure_index(corpus, tmp_path / "d", index_file=l2)
    (tmp_path / "junk.index").write_bytes(b"junk")
    with pytest.raises(InputError, match="not a readable faiss index"):
        ensure_index(corpus, tmp_path / "e", index_file=tmp_path / "junk.index")
    assert index_build.read_manifest(tmp_path / "a") is None  # nothing whole was left


def test_a_build_links_the_corpus_the_cache_already_converted(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", CORPUS_DOCS)
    cached = cached_corpus(path)  # the driver read it first (its demonstrations' titles)
    folder = ensure_index(path, tmp_path / "idx")
    assert (folder / "corpus.arrow").stat().st_ino == (cached / "corpus.arrow").stat().st_ino
    assert Corpus.open(folder).fingerprint == Corpus(CORPUS_DOCS).fingerprint


@pytest.mark.parametrize("dim", [8, 64, 384, 768])
def test_a_flat_index_is_written_shard_by_shard_as_faiss_writes_it(tmp_path, dim):
    """The flat index file streamed from its shards is, byte for byte, the file
    faiss.write_index writes for the whole index (which held every vector in memory:
    64.6 GB for wiki-18); faiss reads it back and finds the same neighbours."""
    import faiss

    vectors = np.random.default_rng(dim).normal(size=(1_001, dim)).astype(np.float32)
    whole = faiss.IndexFlatIP(dim)
    whole.add(vectors)
    path = tmp_path / "index.faiss"
    index_build._write_flat_file(path, dim, len(vectors), iter(np.split(vectors, [300, 999])))
    assert path.read_bytes() == faiss.serialize_index(whole).tobytes()
    read = faiss.read_index(str(path), faiss.IO_FLAG_MMAP)
    assert (read.search(vectors[:5], 3)[1] == whole.search(vectors[:5], 3)[1]).all()
    with pytest.raises(RuntimeError, match="999 vectors written, 1001 expected"):
        index_build._write_flat_file(path, dim, len(vectors), iter([vectors[:999]]))
