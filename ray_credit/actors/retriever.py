"""Dense retrieval for search agents: an HF encoder + a faiss index over a FlashRAG corpus.

Pieces, each usable alone:

* :class:`Corpus`: validated documents in the FlashRAG / Search-R1 format (``id``,
  ``contents`` = title line + text) with a fingerprint over ids and contents.
* :class:`Encoder` (from :mod:`ray_credit.actors.encoder`, re-exported here): a
  sentence-transformers model (each model's own pooling and normalization; a plain HF
  encoder pooled as ``EncoderConfig.pooling`` says), L2-normalized, with query / passage
  prefixes (E5's ``"query: "`` / ``"passage: "``, BGE's query instruction). ``"minilm"``
  is the embedded all-MiniLM-L6-v2.
* :class:`DenseIndex`: faiss Flat inner product (default), HNSW or IVF-PQ, on GPU when
  faiss has GPU support and sees one; saved atomically with a manifest that pins the
  corpus fingerprint and the encoder (pooling and prefixes included), so a stale index is
  refused instead of returning wrong docs.
* :class:`Retriever`: ``search(queries, topk)`` -> hits best first, with counters.
  ``Retriever.create`` loads the index from a shared cache folder keyed by the corpus and
  the settings (:func:`index_cache_folder`), or builds it there once.
* :class:`QueryBatcher` / :class:`RetrieverActor`: request coalescing. Concurrent
  ``search`` calls are gathered into one encoder + faiss call (up to ``max_batch_queries``
  queries, waiting at most ``batch_wait_ms`` for the batch to fill) and split back per
  caller. ``RetrieverActor`` is a plain class; :func:`make_retriever_actor` wraps it with
  ``ray.remote(...).options(...)``.

The HTTP side (a Ray Serve ``/retrieve`` endpoint and a client for any Search-R1 retrieval
server) is in :mod:`ray_credit.actors.retrieval_server`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from ray_credit.actors.encoder import (
    ENCODER_PRESETS,
    Encoder,
    EncoderConfig,
    EncoderPreset,
    resolve_encoder_path,
)
from ray_credit.config import InputError, check_fields
from ray_credit.log import log
from ray_credit.progress import progress_bar

if TYPE_CHECKING:  # pragma: no cover
    from ray.actor import ActorHandle

__all__ = [
    "Corpus",
    "DenseIndex",
    "ENCODER_PRESETS",
    "Encoder",
    "EncoderConfig",
    "EncoderPreset",
    "IndexConfig",
    "QueryBatcher",
    "Retriever",
    "RetrieverActor",
    "corpus_fingerprint",
    "index_cache_folder",
    "check_index_folder",
    "make_retriever_actor",
    "resolve_encoder_path",
]

Hit = dict[str, Any]
"""One retrieved document: ``{"id", "contents", "title", "text", "score"}``."""
CorpusSource = Union["Corpus", Sequence[Mapping[str, Any]], str, os.PathLike]
"""A :class:`Corpus`, a list of document dicts, or the path of a FlashRAG ``.jsonl`` file."""

_MANIFEST = "manifest.json"
_INDEX_FILE = "index.faiss"
_FORMAT_VERSION = 2
"""2 records the encoder's pooling and query prefix; a version 1 index (always mean-pooled,
query prefix not recorded) still loads."""
_READABLE_VERSIONS = (1, 2)


# ---------------------------------------------------------------------------- corpus
def corpus_fingerprint(ids: Sequence[str], contents: Sequence[str]) -> str:
    """blake2b over every id and contents, in order (hex, 32 chars).

    Strings are joined in chunks (NUL-separated) and hashed chunk by chunk: one C call per
    10,000 documents instead of one per document, so a 21 M passage Wikipedia corpus
    fingerprints in seconds.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{len(ids)}\0".encode())
    chunk = 10_000
    for start in range(0, len(ids), chunk):
        digest.update("\0".join(ids[start : start + chunk]).encode("utf-8", "surrogatepass"))
        digest.update(b"\1")
        digest.update("\0".join(contents[start : start + chunk]).encode("utf-8", "surrogatepass"))
        digest.update(b"\2")
    return digest.hexdigest()


class Corpus:
    """Documents in the FlashRAG / Search-R1 format: ``{"id": ..., "contents": "title\\ntext"}``.

    Ids may be str or int and are kept (and returned in hits) as str. Other keys of a
    document are ignored. Construction fails on an empty corpus, a document without an id
    or without non-blank ``contents``, and duplicate ids (the error names them).
    """

    def __init__(self, docs: Iterable[Mapping[str, Any]], *, source: str = "corpus") -> None:
        ids: list[str] = []
        contents: list[str] = []
        missing_contents: list[str] = []
        for position, doc in enumerate(docs):
            if not isinstance(doc, Mapping):
                raise TypeError(
                    f"{source}: document {position} is a {type(doc).__name__}; each document "
                    "must be a dict with 'id' and 'contents'"
                )
            doc_id = doc.get("id")
            if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
                raise InputError(
                    f"{source}: document {position} has id {doc_id!r}; every document needs "
                    "an 'id' (str or int)"
                )
            text = doc.get("contents")
            if not isinstance(text, str) or not text.strip():
                missing_contents.append(str(doc_id))
            ids.append(str(doc_id))
            contents.append(text if isinstance(text, str) else "")
        if not ids:
            raise InputError(f"{source} is empty; a retriever needs at least one document")
        if missing_contents:
            raise InputError(
                f"{source}: {len(missing_contents)} document(s) have no 'contents' (a non-blank "
                f"str, title on the first line): ids {_preview(missing_contents)}"
            )
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            duplicates = sorted({i for i in ids if i in seen or seen.add(i)})
            raise InputError(
                f"{source}: duplicate document ids {_preview(duplicates)}; ids must be unique"
            )
        self.ids = ids
        self.contents = contents
        self.fingerprint = corpus_fingerprint(ids, contents)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike) -> Corpus:
        """Read a FlashRAG ``.jsonl`` (or ``.jsonl.gz``) corpus with
        :func:`ray_credit.data.iter_corpus` (its format rules and errors)."""
        from ray_credit.data.loaders import iter_corpus

        docs = [doc for chunk in iter_corpus(path, check_duplicates=False) for doc in chunk]
        return cls(docs, source=str(path))

    @classmethod
    def coerce(cls, source: CorpusSource) -> Corpus:
        """A :class:`Corpus` from itself, a list of document dicts or a ``.jsonl`` path."""
        if isinstance(source, Corpus):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_jsonl(source)
        return cls(source)

    def __len__(self) -> int:
        return len(self.ids)

    def hit(self, row: int, score: float) -> Hit:
        """Document ``row`` as a hit: id, contents, title (first line), text (the rest), score."""
        contents = self.contents[row]
        title, _, text = contents.partition("\n")
        return {
            "id": self.ids[row],
            "contents": contents,
            "title": title,
            "text": text,
            "score": score,
        }


def _preview(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


# ---------------------------------------------------------------------------- index
IndexKind = Literal["flat", "hnsw", "ivfpq"]


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """Which faiss index to build. All use inner product on unit vectors (cosine)."""

    kind: IndexKind = "flat"
    """'flat' (exact), 'hnsw' or 'ivfpq'."""
    hnsw_m: int = 32
    """HNSW graph degree M."""
    ef_construction: int = 200
    """HNSW build-time beam width."""
    ef_search: int = 128
    """HNSW search-time beam width (>= topk for good recall)."""
    nlist: int = 1024
    """IVF-PQ coarse clusters; training needs at least this many documents."""
    pq_m: int = 16
    """IVF-PQ sub-quantizers; must divide the embedding dimension."""
    pq_nbits: int = 8
    """Bits per IVF-PQ sub-quantizer code; training needs at least 2**pq_nbits documents."""
    nprobe: int = 32
    """IVF-PQ clusters visited per query."""
    use_gpu: bool | None = None
    """None: on a GPU when faiss has GPU support and sees one (not for HNSW, which faiss
    runs on CPU only); true: required; false: CPU."""

    def __post_init__(self) -> None:
        check_fields(self)  # types (and kind among its choices) first: the checks below
        for name, least in (("hnsw_m", 2), ("ef_construction", 1), ("ef_search", 1),
                            ("nlist", 1), ("pq_m", 1), ("nprobe", 1)):  # fmt: skip
            if getattr(self, name) < least:
                raise ValueError(f"index {name} must be >= {least}, got {getattr(self, name)}")
        if not 1 <= self.pq_nbits <= 16:
            raise ValueError(f"index pq_nbits must lie in [1, 16] (faiss's), got {self.pq_nbits}")
        if self.kind == "ivfpq" and self.nprobe > self.nlist:
            raise ValueError(
                f"index nprobe={self.nprobe} visits more clusters than nlist={self.nlist} has; "
                "give nprobe <= nlist"
            )
        if self.kind == "hnsw" and self.use_gpu:
            raise ValueError("faiss has no GPU HNSW index; use kind='flat' or 'ivfpq' on GPU")

    def manifest(self) -> dict[str, Any]:
        """The fields that shape the saved index (``use_gpu`` does not)."""
        fields = asdict(self)
        del fields["use_gpu"]
        return fields


class DenseIndex:
    """A faiss index over a corpus's passage embeddings, with its manifest.

    Build with :meth:`build`, persist with :meth:`save`, reopen with :meth:`load` (which
    checks the corpus fingerprint and the encoder against the manifest).
    """

    def __init__(self, index: Any, manifest: dict[str, Any], config: IndexConfig) -> None:
        faiss = _faiss()
        self.manifest = manifest
        self.config = config
        self._cpu_index = index
        self._gpu_resources = None
        self.index = index
        if _wants_gpu(config, faiss):
            self._gpu_resources = faiss.StandardGpuResources()
            self.index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, index)

    @property
    def on_gpu(self) -> bool:
        return self._gpu_resources is not None

    @classmethod
    def build(
        cls, corpus: Corpus, encoder: Encoder, config: IndexConfig | str = "flat"
    ) -> DenseIndex:
        """Embed every passage and index it."""
        faiss = _faiss()

        config = IndexConfig(kind=config) if isinstance(config, str) else config
        n, dim = len(corpus), encoder.dim
        _check_trainable(config, n, dim)
        embeddings = _encode_passages(encoder, corpus.contents)
        if config.kind == "flat":
            index = faiss.IndexFlatIP(dim)
        elif config.kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = config.ef_construction
        else:
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFPQ(
                quantizer,
                dim,
                config.nlist,
                config.pq_m,
                config.pq_nbits,
                faiss.METRIC_INNER_PRODUCT,
            )
            index.train(embeddings)
        index.add(embeddings)
        _set_search_params(index, config)
        manifest = {
            "format_version": _FORMAT_VERSION,
            "corpus_fingerprint": corpus.fingerprint,
            "num_docs": n,
            "dim": dim,
            "encoder": encoder.manifest(),
            "index": config.manifest(),
            "faiss_version": faiss.__version__,
        }
        return cls(index, manifest, config)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``index.faiss`` and ``manifest.json`` as the folder ``folder``, atomically.

        Both files are written into a temporary folder beside it, which is then renamed to
        ``folder`` (a rename is atomic): a reader, or another process building the same
        index, sees the whole index or none, never half of one. ``folder`` may not exist or
        be empty; when it already holds this same index (another process saved it first),
        that copy is kept. Any other content is refused: it is not ours to overwrite.
        """
        faiss = _faiss()
        folder = Path(folder)
        check_index_folder(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
        try:
            faiss.write_index(self._cpu_index, str(tmp / _INDEX_FILE))
            (tmp / _MANIFEST).write_text(json.dumps(self.manifest, indent=2) + "\n")
            try:
                os.rename(tmp, folder)  # replaces an empty folder; fails on a non-empty one
            except OSError:
                if not folder.is_dir() or not any(folder.iterdir()):
                    raise
                check_index_folder(folder)  # no manifest there: refused
                there = json.loads((folder / _MANIFEST).read_text())
                if there != self.manifest:
                    raise InputError(
                        f"{folder} already holds another index ({there.get('num_docs')} docs, "
                        f"encoder {there.get('encoder')}); delete it or save elsewhere"
                    ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename, else ours is
        return folder

    @classmethod
    def load(
        cls,
        folder: str | os.PathLike,
        corpus: Corpus,
        encoder: Encoder,
        *,
        use_gpu: bool | None = None,
    ) -> DenseIndex:
        """Reopen a saved index; refuse it when it was built from another corpus or encoder."""
        faiss = _faiss()

        folder = Path(folder)
        manifest_path = folder / _MANIFEST
        if not manifest_path.is_file() or not (folder / _INDEX_FILE).is_file():
            raise FileNotFoundError(
                f"{folder} holds no saved index ({_MANIFEST} and {_INDEX_FILE}); build one "
                "with DenseIndex.build(...).save(folder)"
            )
        manifest = json.loads(manifest_path.read_text())
        rebuild = (
            f"rebuild it with DenseIndex.build(corpus, encoder, config).save({str(folder)!r}) "
            "or point at another folder"
        )
        version = manifest.get("format_version")
        if version not in _READABLE_VERSIONS:
            raise ValueError(
                f"index in {folder} has format_version {version!r}, this library reads "
                f"{_READABLE_VERSIONS}; {rebuild}"
            )
        if manifest["corpus_fingerprint"] != corpus.fingerprint:
            raise ValueError(
                f"index in {folder} was built from another corpus ({manifest['num_docs']} docs, "
                f"fingerprint {manifest['corpus_fingerprint']}) than the one given "
                f"({len(corpus)} docs, fingerprint {corpus.fingerprint}); {rebuild}"
            )
        recorded, want = dict(manifest["encoder"]), encoder.manifest()
        if version == 1:  # mean-pooled, the only pooling then; the query prefix not recorded
            recorded.setdefault("pooling", "mean")
            want.pop("query_prefix")
        differ = sorted(k for k in want if recorded.get(k) != want[k])
        if differ:
            got = {k: recorded.get(k) for k in differ}
            raise ValueError(
                f"index in {folder} was built with another encoder: {got} there, "
                f"{ {k: want[k] for k in differ} } now; {rebuild}"
            )
        try:
            index = faiss.read_index(str(folder / _INDEX_FILE))
        except (RuntimeError, MemoryError) as err:  # faiss: a cut-off or foreign file
            first = str(err).strip().splitlines()[0] if str(err).strip() else "unreadable"
            raise ValueError(
                f"{folder / _INDEX_FILE} is not a readable faiss index (faiss: {first}); it "
                f"is damaged or was cut off while written: delete {folder} to have it built "
                f"again, or {rebuild}"
            ) from None
        if index.d != encoder.dim or index.ntotal != len(corpus):
            raise ValueError(
                f"{folder / _INDEX_FILE} holds {index.ntotal} vectors of dimension {index.d}, "
                f"but the encoder gives dimension {encoder.dim} and the corpus has "
                f"{len(corpus)} docs; {rebuild}"
            )
        config = IndexConfig(**manifest["index"], use_gpu=use_gpu)
        _set_search_params(index, config)
        return cls(index, manifest, config)

    def search(self, embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)``, each ``(len(embeddings), k)``; row -1 where faiss found fewer."""
        if embeddings.ndim != 2 or embeddings.shape[1] != self.manifest["dim"]:
            raise ValueError(
                f"query embeddings have shape {embeddings.shape}, the index holds vectors of "
                f"dimension {self.manifest['dim']}; embed queries with the index's encoder "
                f"({self.manifest['encoder']['name']!r})"
            )
        return self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), k)


_ENCODE_SLICE = 8192  # passages per encoder call while building: the bar moves per slice


def _encode_passages(encoder: Encoder, passages: Sequence[str]) -> np.ndarray:
    """Every passage's embedding, slice by slice under a progress bar where one is seen
    (a Wikipedia dump's 21M passages take hours on one GPU)."""
    if len(passages) <= _ENCODE_SLICE:
        return encoder.encode_passages(passages)
    out = np.empty((len(passages), encoder.dim), dtype=np.float32)
    bar = progress_bar(len(passages), "embedding the corpus", unit="doc")
    for start in range(0, len(passages), _ENCODE_SLICE):
        part = passages[start : start + _ENCODE_SLICE]
        out[start : start + len(part)] = encoder.encode_passages(part)
        bar.update(len(part))
    bar.close()
    return out


def _wants_gpu(config: IndexConfig, faiss: Any) -> bool:
    gpus = faiss.get_num_gpus()
    if config.use_gpu and gpus == 0:
        raise RuntimeError(
            "use_gpu=True but faiss sees no GPU (faiss-cpu, or no visible device); install "
            "faiss-gpu in place of faiss-cpu (`pip uninstall faiss-cpu && pip install "
            "'ray-credit[faiss-gpu]'`), give the actor num_gpus, or set use_gpu=None / False"
        )
    return config.kind != "hnsw" and gpus > 0 and config.use_gpu is not False


def _check_trainable(config: IndexConfig, n: int, dim: int) -> None:
    if config.kind != "ivfpq":
        return
    if dim % config.pq_m:
        raise ValueError(
            f"IVF-PQ pq_m={config.pq_m} must divide the embedding dimension {dim}; pick a "
            f"divisor of {dim}"
        )
    need = max(config.nlist, 2**config.pq_nbits)
    if n < need:
        raise ValueError(
            f"IVF-PQ with nlist={config.nlist}, pq_nbits={config.pq_nbits} is trained on the "
            f"corpus and needs at least {need} docs; the corpus has {n}. Lower nlist / "
            "pq_nbits, or use kind='flat' (exact, and fast below ~1 M docs)"
        )


def _set_search_params(index: Any, config: IndexConfig) -> None:
    if config.kind == "hnsw":
        index.hnsw.efSearch = config.ef_search
    elif config.kind == "ivfpq":
        index.nprobe = config.nprobe  # copied along when the index moves to a GPU


def _faiss() -> Any:
    """The faiss module, or an ImportError that says which extra installs it."""
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "the retriever's index needs faiss, which no extra installs by default (two builds "
            "side by side break each other): `pip install 'ray-credit[faiss-cpu]'`, or "
            "`pip install 'ray-credit[faiss-gpu]'` (CUDA 12) on GPU machines; one of them"
        ) from err
    return faiss


def check_index_folder(folder: str | os.PathLike) -> None:
    """Refuse, before any work, an index folder that is a file or holds other things than
    a saved index (building there would fail at the end, or clobber them)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"index folder {folder} is a file; give a folder (new or empty)")
    if folder.is_dir() and not (folder / _MANIFEST).is_file() and any(folder.iterdir()):
        raise InputError(
            f"index folder {folder} holds files but no saved index ({_MANIFEST}); give a new "
            f"or empty folder, or delete {folder} (an index cut off by an older version)"
        )


def _model_stamp(path: str) -> str:
    """A cheap stamp of a local model folder (each file's name, size and mtime), so a model
    retrained in place gets a new index cache key; a hub id is its own stamp."""
    folder = Path(path)
    if not folder.is_dir():
        return path
    digest = hashlib.blake2b(digest_size=8)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def index_cache_folder(corpus: Corpus, encoder: Encoder, config: IndexConfig) -> Path:
    """The shared folder of the index of ``corpus`` under ``encoder`` and ``config``:
    ``$RAY_CREDIT_CACHE/indexes/<name>`` (default ``~/.cache/ray_credit/indexes``).

    The name is a hash of everything the index depends on: the corpus fingerprint, the
    encoder manifest (model, pooling, prefixes, max_length), a stamp of a local model
    folder's files, the index config and the format version. Every run, method, seed and
    resume over the same corpus and settings finds the index built once; a changed setting
    gets a folder of its own.
    """
    from ray_credit.models import cache_dir

    settings = {
        "format_version": _FORMAT_VERSION,
        "corpus": corpus.fingerprint,
        "encoder": encoder.manifest(),
        "model_files": _model_stamp(encoder.path),
        "index": config.manifest(),
    }
    blob = json.dumps(settings, sort_keys=True).encode()
    key = hashlib.blake2b(blob, digest_size=10).hexdigest()
    readable = "".join(c if c.isalnum() or c in "._-" else "_" for c in encoder.config.name)
    name = f"{readable[-40:]}-{config.kind}-{len(corpus)}docs-{key}"
    return cache_dir().parent / "indexes" / name


# ---------------------------------------------------------------------------- retriever
def _check_search_args(queries: Any, topk: Any) -> None:
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise TypeError(
            f"queries must be a list of str, got {type(queries).__name__}; wrap one query "
            "as [query]"
        )
    bad = [i for i, q in enumerate(queries) if not isinstance(q, str)]
    if bad:
        raise TypeError(f"queries must be str; entries {bad[:5]} are not")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")


class Retriever:
    """Encoder + index + corpus: ``search(queries, topk)`` -> hits, best first. No Ray inside."""

    def __init__(self, corpus: Corpus, encoder: Encoder, index: DenseIndex) -> None:
        if index.manifest["corpus_fingerprint"] != corpus.fingerprint:
            raise ValueError(
                "the index was built from another corpus than the one given; build it with "
                "DenseIndex.build(corpus, encoder)"
            )
        if index.manifest["dim"] != encoder.dim:
            raise ValueError(
                f"index dimension {index.manifest['dim']} != encoder dimension {encoder.dim}; "
                "build the index with this encoder"
            )
        self.corpus, self.encoder, self.index = corpus, encoder, index
        # where create() loaded the index from or saved it to (None: built by the caller)
        self.index_folder: str | None = None
        self.index_loaded = False
        self._metrics = {
            "queries": 0,
            "batches": 0,
            "encode_seconds": 0.0,
            "search_seconds": 0.0,
            "missing_hits": 0,
        }

    @classmethod
    def create(
        cls,
        corpus: CorpusSource,
        *,
        encoder: EncoderConfig | str = "minilm",
        index: IndexConfig | str = "flat",
        index_folder: str | os.PathLike | None = None,
    ) -> Retriever:
        """Load the corpus and encoder, then the index: load it from ``index_folder`` when
        the folder holds one (a mismatched corpus, encoder or index config raises; it is
        never rebuilt silently), else build it and save it there (atomically, see
        :meth:`DenseIndex.save`). One line says which folder was loaded or built.

        ``index_folder`` None: the shared cache folder of this corpus and these settings
        (:func:`index_cache_folder`), so runs, methods, seeds and resumes build it once.
        """
        _faiss()  # a missing faiss fails here, not after the encoder has loaded
        corpus = Corpus.coerce(corpus)
        config = IndexConfig(kind=index) if isinstance(index, str) else index
        if index_folder is not None:
            check_index_folder(index_folder)
        enc = Encoder(encoder)
        folder = Path(index_folder or index_cache_folder(corpus, enc, config))
        loaded = (folder / _MANIFEST).is_file()
        if loaded:
            dense = DenseIndex.load(folder, corpus, enc, use_gpu=config.use_gpu)
            if dense.config.manifest() != config.manifest():
                raise ValueError(
                    f"index in {folder} is {dense.config.manifest()}, but {config} was "
                    "asked for; delete the folder to rebuild, or ask for the saved config"
                )
            log.info(f"retriever: loaded the index of {len(corpus)} docs from {folder}")
        else:
            start = time.perf_counter()
            dense = DenseIndex.build(corpus, enc, config)
            dense.save(folder)
            log.info(
                f"retriever: built the index of {len(corpus)} docs in "
                f"{time.perf_counter() - start:.1f}s and saved it in {folder}",
            )
        retriever = cls(corpus, enc, dense)
        retriever.index_folder = str(folder)
        retriever.index_loaded = loaded
        return retriever

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """The ``topk`` best documents per query, best first.

        ``topk`` above the corpus size raises. An approximate index (HNSW, IVF-PQ) can
        return fewer than ``topk`` hits; the shortfall is counted as ``missing_hits``.
        """
        _check_search_args(queries, topk)
        if topk > len(self.corpus):
            raise ValueError(f"topk={topk} exceeds the corpus size {len(self.corpus)}")
        if not queries:
            return []
        start = time.perf_counter()
        embeddings = self.encoder.encode_queries(queries)
        encoded = time.perf_counter()
        scores, rows = self.index.search(embeddings, topk)
        self._metrics["encode_seconds"] += encoded - start
        self._metrics["search_seconds"] += time.perf_counter() - encoded
        self._metrics["queries"] += len(queries)
        self._metrics["batches"] += 1
        results = []
        for query_scores, query_rows in zip(scores.tolist(), rows.tolist(), strict=True):
            hits = [
                self.corpus.hit(r, s)
                for s, r in zip(query_scores, query_rows, strict=True)
                if r >= 0
            ]
            self._metrics["missing_hits"] += topk - len(hits)
            results.append(hits)
        return results

    def metrics(self) -> dict[str, float]:
        """Counters since creation: queries, batches (search calls), encode / search seconds,
        missing_hits (hits an approximate index could not fill)."""
        return dict(self._metrics)


# ---------------------------------------------------------------------------- coalescing
@dataclass
class _Request:
    queries: Sequence[str]
    topk: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class QueryBatcher:
    """Coalesce concurrent ``search`` calls into one call of a blocking ``search_fn``.

    A batch starts when ``max_batch_queries`` queries wait, or ``batch_wait_ms`` after its
    oldest request arrived, whichever comes first; it runs in one worker thread (so the
    event loop keeps accepting requests) with the largest ``topk`` asked for, and each
    caller gets its own queries' hits cut to its own ``topk``. While one batch runs, the
    next fills. A request larger than ``max_batch_queries`` runs as a batch of its own.
    A failed batch fails every request in it with the same exception (counted).
    ``max_topk`` (the corpus size) is checked per call, before queueing.

    Must be used from one event loop (an async Ray actor's, or a Serve replica's).
    """

    def __init__(
        self,
        search_fn: Callable[[list[str], int], list[list[Hit]]],
        *,
        max_batch_queries: int = 256,
        batch_wait_ms: float = 2.0,
        max_topk: int | None = None,
    ) -> None:
        if max_batch_queries < 1 or batch_wait_ms < 0:
            raise ValueError(
                f"max_batch_queries must be >= 1 and batch_wait_ms >= 0, got "
                f"{max_batch_queries}, {batch_wait_ms}"
            )
        self._search_fn = search_fn
        self.max_topk = max_topk
        self.max_batch_queries = max_batch_queries
        self.batch_wait_s = batch_wait_ms / 1000
        self._pending: deque[_Request] = deque()
        self._pending_queries = 0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retriever")
        self._metrics = {
            "requests": 0,
            "coalesced_batches": 0,
            "largest_batch_queries": 0,
            "failed_batches": 0,
            "cancelled_requests": 0,
            "queue_seconds": 0.0,
        }

    def check(self, queries: Sequence[str], topk: int) -> None:
        """Raise TypeError / ValueError for arguments that would fail a whole batch."""
        _check_search_args(queries, topk)
        if self.max_topk is not None and topk > self.max_topk:
            raise ValueError(f"topk={topk} exceeds the corpus size {self.max_topk}")

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Queue ``queries`` for the next batch and wait for their hits.

        Arguments are checked first, so a bad call fails alone instead of failing its batch.
        """
        self.check(queries, topk)
        self._metrics["requests"] += 1
        if not queries:
            return []
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._run())
        request = _Request(list(queries), topk, loop.create_future())
        self._pending.append(request)
        self._pending_queries += len(request.queries)
        self._wakeup.set()
        return await request.future

    def metrics(self) -> dict[str, float]:
        """requests, coalesced_batches, largest_batch_queries, failed_batches,
        cancelled_requests (callers gone before their batch ended), queue_seconds (summed
        time requests waited before their batch started)."""
        return dict(self._metrics)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._pending[0].arrived + self.batch_wait_s
            while self._pending_queries < self.max_batch_queries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            await self._run_batch(self._take_batch())

    def _take_batch(self) -> list[_Request]:
        batch, size = [], 0
        while self._pending and (
            not batch or size + len(self._pending[0].queries) <= self.max_batch_queries
        ):
            request = self._pending.popleft()
            batch.append(request)
            size += len(request.queries)
        self._pending_queries -= size
        return batch

    async def _run_batch(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        queries = [q for request in batch for q in request.queries]
        metrics = self._metrics
        metrics["coalesced_batches"] += 1
        metrics["largest_batch_queries"] = max(metrics["largest_batch_queries"], len(queries))
        metrics["queue_seconds"] += sum(now - request.arrived for request in batch)
        topk = max(request.topk for request in batch)
        loop = asyncio.get_running_loop()
        try:
            hits = await loop.run_in_executor(self._executor, self._search_fn, queries, topk)
        except Exception as err:  # every caller in the batch sees the error; none hangs
            metrics["failed_batches"] += 1
            for request in batch:
                self._resolve(request, error=err)
            return
        offset = 0
        for request in batch:
            mine = hits[offset : offset + len(request.queries)]
            offset += len(request.queries)
            self._resolve(request, result=[query_hits[: request.topk] for query_hits in mine])

    def _resolve(self, request: _Request, *, result: Any = None, error: Any = None) -> None:
        if request.future.done():  # the caller was cancelled while its batch ran
            self._metrics["cancelled_requests"] += 1
        elif error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(result)


class RetrieverActor:
    """A :class:`Retriever` behind a :class:`QueryBatcher`, meant to run as an async Ray actor.

    Create it with :func:`make_retriever_actor`, or ``ray.remote(RetrieverActor).options(...)``.
    The retriever (model, index) is built in the actor, from a corpus path or the documents.
    """

    def __init__(
        self,
        corpus: CorpusSource,
        *,
        encoder: EncoderConfig | str = "minilm",
        index: IndexConfig | str = "flat",
        index_folder: str | os.PathLike | None = None,
        max_batch_queries: int = 256,
        batch_wait_ms: float = 2.0,
    ) -> None:
        self.retriever = Retriever.create(
            corpus, encoder=encoder, index=index, index_folder=index_folder
        )
        self.batcher = QueryBatcher(
            self.retriever.search,
            max_batch_queries=max_batch_queries,
            batch_wait_ms=batch_wait_ms,
            max_topk=len(self.retriever.corpus),
        )

    async def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """Hits for ``queries``, best first, coalesced with other callers' concurrent calls."""
        return await self.batcher.search(queries, topk)

    async def metrics(self) -> dict[str, float]:
        """:meth:`Retriever.metrics` and :meth:`QueryBatcher.metrics` in one dict."""
        return {**self.retriever.metrics(), **self.batcher.metrics()}

    async def info(self) -> dict[str, Any]:
        """The index manifest plus where it runs (``encoder_device``, ``index_on_gpu``) and
        where it came from (``index_folder``, ``index_loaded``)."""
        return {
            **self.retriever.index.manifest,
            "index_folder": self.retriever.index_folder,
            "index_loaded": self.retriever.index_loaded,
            "encoder_device": self.retriever.encoder.device,
            "index_on_gpu": self.retriever.index.on_gpu,
        }


def make_retriever_actor(
    corpus: CorpusSource,
    *,
    encoder: EncoderConfig | str = "minilm",
    index: IndexConfig | str = "flat",
    index_folder: str | os.PathLike | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: dict[str, float] | None = None,
    max_batch_queries: int = 256,
    batch_wait_ms: float = 2.0,
    max_concurrency: int = 1000,
    max_restarts: int = 3,
    name: str | None = None,
) -> ActorHandle:
    """Start a :class:`RetrieverActor` on the connected Ray cluster and return its handle.

    Pass a ``.jsonl`` path rather than a large list of documents: the path travels to the
    actor, the documents would go through the object store. With ``num_gpus`` > 0 and the
    default ``device="auto"`` / ``use_gpu=None``, the encoder and (with faiss-gpu) the
    index run on the actor's GPU. ``index_folder`` None: the shared index cache of the
    actor's node (:func:`index_cache_folder`). ``max_restarts``: the actor holds no state but counters,
    so Ray may restart it after a crash; calls in flight then fail with Ray's actor error
    and the caller retries (no hidden task retries). ``resources``: custom resources
    (``{"service": 1}`` places it on a cluster's service nodes). Call
    ``handle.search.remote(queries, topk)``; ``handle.metrics.remote()`` for counters.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError(
            "make_retriever_actor needs a connected Ray cluster; call ray.init() first"
        )
    if isinstance(corpus, (str, os.PathLike)):
        corpus = os.path.abspath(corpus)  # the actor's working directory may differ
    if index_folder is not None:
        index_folder = os.path.abspath(index_folder)
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": resources,
        "max_concurrency": max_concurrency,
        "max_restarts": max_restarts,
    }
    if name is not None:
        options["name"] = name
    return (
        ray.remote(RetrieverActor)
        .options(**options)
        .remote(
            corpus,
            encoder=encoder,
            index=index,
            index_folder=index_folder,
            max_batch_queries=max_batch_queries,
            batch_wait_ms=batch_wait_ms,
        )
    )
