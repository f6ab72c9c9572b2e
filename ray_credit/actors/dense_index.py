"""The retriever's faiss index: its settings, a folder format, and loading it where it serves.

An index folder holds everything a retriever needs, each file written once:

* ``corpus.arrow`` + ``corpus.json``: the corpus, converted (:mod:`ray_credit.actors.corpus`);
* ``index.faiss``: the faiss index, rows in the corpus's order (or ``manifest.json`` names
  an index file elsewhere: one imported as it was shipped, never copied);
* ``manifest.json``: written last, so its presence means the folder is whole. It records the
  corpus fingerprint, the encoder (model, pooling, prefixes, length), the index settings.

Building one (across workers, resumable) is :mod:`ray_credit.actors.index_build`. Here:

* :class:`IndexConfig`: Flat (exact), HNSW, IVF-Flat or IVF-PQ, each with its knobs.
* :class:`DenseIndex`: a loaded index. On CPU it is memory-mapped where the kind allows
  (every process of a node shares the pages); with faiss-gpu it is copied to the GPUs,
  sharded over all of a node's GPUs or a chosen set, so one search meets each shard once.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ray_credit.config import InputError, check_fields

__all__ = [
    "FORMAT_VERSION",
    "INDEX_FILE",
    "MANIFEST",
    "DenseIndex",
    "IndexConfig",
    "check_index_config",
    "check_index_folder",
    "check_query_embeddings",
    "check_whole_folder",
    "faiss_module",
    "index_file_of",
    "index_manifest",
    "read_manifest",
]

MANIFEST = "manifest.json"
INDEX_FILE = "index.faiss"
FORMAT_VERSION = 3
"""3: the folder holds its corpus (``corpus.arrow``); the corpus fingerprint ends with the
document count. Folders of versions 1 and 2 (no corpus inside) are rebuilt."""
_MANIFEST_FIELDS = ("corpus_fingerprint", "num_docs", "dim", "encoder", "index")
BUILD_FILES = frozenset({MANIFEST, INDEX_FILE, "corpus.arrow", "corpus.json", "build.json",
                         "embeddings", ".build.lock"})  # fmt: skip
"""What a build writes into an index folder (besides its temporary files): all an
``--overwrite`` deletes, and all a folder being built may hold."""

IndexKind = Literal["flat", "hnsw", "ivfflat", "ivfpq"]


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """Which faiss index to build and how to serve it. All use inner product on unit
    vectors (cosine). See docs/retrieval.md for what each kind costs at Wikipedia scale."""

    kind: IndexKind = "flat"
    """'flat' (exact; 4*dim bytes per passage), 'hnsw' (graph; fast on CPU, flat storage
    plus the graph), 'ivfflat' (clusters; exact vectors, nprobe of nlist lists searched) or
    'ivfpq' (clusters + product quantization; pq_m bytes per passage at pq_nbits=8)."""
    hnsw_m: int = 32
    """HNSW graph degree M."""
    ef_construction: int = 200
    """HNSW build-time beam width."""
    ef_search: int = 128
    """HNSW search-time beam width (>= topk for good recall)."""
    nlist: int = 1024
    """IVF coarse clusters (ivfflat, ivfpq); training needs at least this many passages.
    About 4*sqrt(N) is usual: 16384-65536 for wiki-18's 21 M passages."""
    pq_m: int = 16
    """IVF-PQ sub-quantizers (bytes per passage at pq_nbits=8); must divide the dimension."""
    pq_nbits: int = 8
    """Bits per IVF-PQ sub-quantizer code; training needs at least 2**pq_nbits passages."""
    nprobe: int = 32
    """IVF clusters visited per query (more: better recall, slower)."""
    train_sample: int = 1_000_000
    """IVF and PQ train on this many passages drawn at random (seeded), then every
    passage is added shard by shard; the whole corpus when it is smaller."""
    use_gpu: bool | None = None
    """None: on the GPUs when faiss has GPU support and sees one (not for HNSW, which faiss
    runs on CPU only); true: required; false: CPU."""
    gpu_devices: str = "all"
    """With the index on GPUs: 'all' (every GPU the process sees, the index sharded over
    them) or a comma-separated list of device numbers ('0,1')."""
    gpu_float16: bool = False
    """With the index on GPUs: store its vectors in float16 there (half the GPU memory:
    32 GB for wiki-18's Flat e5-base index, as Search-R1's server does; scores rounded to
    about 3 decimal digits)."""
    mmap: bool = True
    """A CPU index is memory-mapped from its file where faiss allows it (Flat, HNSW's
    vectors, IVF lists): every process of a node shares one copy in the page cache.
    False: read into each process's memory."""

    def __post_init__(self) -> None:
        check_fields(self)  # types (and kind among its choices) first: the checks below
        for name, least in (("hnsw_m", 2), ("ef_construction", 1), ("ef_search", 1),
                            ("nlist", 1), ("pq_m", 1), ("nprobe", 1),
                            ("train_sample", 1)):  # fmt: skip
            if getattr(self, name) < least:
                raise ValueError(f"index {name} must be >= {least}, got {getattr(self, name)}")
        if not 1 <= self.pq_nbits <= 16:
            raise ValueError(f"index pq_nbits must lie in [1, 16] (faiss's), got {self.pq_nbits}")
        if self.kind in ("ivfflat", "ivfpq") and self.nprobe > self.nlist:
            raise ValueError(
                f"index nprobe={self.nprobe} visits more clusters than nlist={self.nlist} has; "
                "give nprobe <= nlist"
            )
        if self.kind == "hnsw" and self.use_gpu:
            raise ValueError("faiss has no GPU HNSW index; use kind='flat' or an IVF kind on GPU")
        self.devices()  # a malformed list fails at parse time

    def devices(self) -> list[int] | None:
        """The GPU devices asked for (None: all)."""
        if self.gpu_devices.strip() == "all":
            return None
        parts = [p.strip() for p in self.gpu_devices.split(",")]
        if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(
                f"index gpu_devices={self.gpu_devices!r} is neither 'all' nor a list of "
                "distinct device numbers such as '0,1'"
            )
        return [int(p) for p in parts]

    @property
    def is_ivf(self) -> bool:
        return self.kind in ("ivfflat", "ivfpq")

    def manifest(self) -> dict[str, Any]:
        """The fields that shape the saved index (where and how it is served do not)."""
        fields = asdict(self)
        for serving in ("use_gpu", "gpu_devices", "gpu_float16", "mmap"):
            del fields[serving]
        return fields


def check_index_config(config: IndexConfig, num_docs: int, dim: int | None) -> None:
    """Refuse settings that cannot work for a corpus of ``num_docs`` passages embedded in
    ``dim`` dimensions (None: not known yet), before any passage is embedded."""
    if not config.is_ivf:
        return
    if config.kind == "ivfpq" and dim is not None and dim % config.pq_m:
        divisors = [m for m in (8, 12, 16, 24, 32, 48, 64, 96) if dim % m == 0]
        raise InputError(
            f"index pq_m={config.pq_m} must divide the embedding dimension {dim}; pick a "
            f"divisor such as {divisors}"
        )
    need = config.nlist if config.kind == "ivfflat" else max(config.nlist, 2**config.pq_nbits)
    if num_docs < need:
        what = f"nlist={config.nlist}" + (
            f", pq_nbits={config.pq_nbits}" if config.kind == "ivfpq" else ""
        )
        raise InputError(
            f"index kind {config.kind!r} with {what} trains on the corpus and needs at least "
            f"{need} passages; the corpus has {num_docs}. Lower nlist (about 4*sqrt(N)), or "
            "use kind 'flat' (exact, and fast below ~1 M passages)"
        )
    if config.train_sample < need:
        raise InputError(
            f"index train_sample={config.train_sample} is below the {need} vectors "
            f"{config.kind} needs to train; raise it"
        )


def faiss_module() -> Any:
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


def new_index(config: IndexConfig, dim: int) -> Any:
    """An empty faiss index of ``config``'s kind (untrained where the kind trains)."""
    faiss = faiss_module()
    if config.kind == "flat":
        return faiss.IndexFlatIP(dim)
    if config.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.ef_construction
        return index
    quantizer = faiss.IndexFlatIP(dim)
    if config.kind == "ivfflat":
        index = faiss.IndexIVFFlat(quantizer, dim, config.nlist, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQ(
            quantizer, dim, config.nlist, config.pq_m, config.pq_nbits,
            faiss.METRIC_INNER_PRODUCT,
        )  # fmt: skip
    return index  # faiss's Python layer keeps the quantizer alive with the index


def set_search_params(index: Any, config: IndexConfig) -> None:
    faiss = faiss_module()
    if config.kind == "hnsw":
        faiss.downcast_index(index).hnsw.efSearch = config.ef_search
    elif config.is_ivf:
        faiss.extract_index_ivf(index).nprobe = config.nprobe


def index_manifest(corpus: Any, encoder: dict[str, Any], config: IndexConfig) -> dict[str, Any]:
    """What an index folder's ``manifest.json`` records of an index of ``corpus`` (its
    fingerprint and size) embedded by the encoder of manifest ``encoder``."""
    return {
        "format_version": FORMAT_VERSION,
        "corpus_fingerprint": corpus.fingerprint,
        "num_docs": len(corpus),
        "dim": encoder["dim"],
        "encoder": encoder,
        "index": config.manifest(),
        "faiss_version": faiss_module().__version__,
    }


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """A folder's ``manifest.json``, None when it has none (not built, or not whole); one
    that is not readable JSON, or of this format without its fields, is an InputError
    naming it (:func:`~ray_credit.actors.corpus.read_json`)."""
    from ray_credit.actors.corpus import read_json, rebuild_hint, require_fields

    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    fix = rebuild_hint(folder)
    manifest = read_json(path, fix, ("format_version",))
    if manifest["format_version"] == FORMAT_VERSION:  # an older format is refused by version
        require_fields(manifest, path, fix, _MANIFEST_FIELDS)
    return manifest


def _check_version(folder: Path, manifest: dict[str, Any]) -> None:
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise InputError(
            f"index in {folder} has format_version {version!r}; this version reads "
            f"{FORMAT_VERSION} (the folder also holds its corpus): delete the folder to "
            "have it built again, or build it anew with `python -m ray_credit.index build "
            "... --overwrite`"
        )


def _index_path(folder: Path, manifest: dict[str, Any]) -> Path:
    """The index file of a whole folder's manifest, which must be there."""
    from ray_credit.actors.corpus import rebuild_hint

    imported = manifest.get("index_path")
    path = Path(imported or folder / INDEX_FILE)
    if path.is_file():
        return path
    if imported:
        raise InputError(
            f"the index of {folder} was imported from {path}, which is gone (the folder "
            f"names it, never copies it); put it back, or {rebuild_hint(folder)}"
        )
    raise InputError(f"{folder} holds {MANIFEST} but not {INDEX_FILE}; {rebuild_hint(folder)}")


def _whole_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a whole index folder, of a format this version reads."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(
            f"{folder} holds no whole index ({MANIFEST} is written last); build one with "
            f"`python -m ray_credit.index build --out {folder} ...`"
        )
    _check_version(folder, manifest)
    return manifest


def index_file_of(folder: str | os.PathLike) -> Path:
    """The faiss file of the whole index folder ``folder``: its own ``index.faiss``, or
    the file it was imported from."""
    folder = Path(folder)
    return _index_path(folder, _whole_manifest(folder))


def check_whole_folder(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the whole index folder ``folder``, after the checks that need
    neither faiss nor the encoder (milliseconds, whatever the corpus's size): its format,
    its index file there, and its corpus the one the manifest was built on
    (:meth:`~ray_credit.actors.corpus.Corpus.open`: the row count and sampled rows of
    ``corpus.arrow`` against ``corpus.json``, whose fingerprint must be the manifest's).
    What an index folder is opened with before any process is started on it."""
    from ray_credit.actors.corpus import CORPUS_FILE, CORPUS_INFO, Corpus, rebuild_hint

    folder = Path(folder)
    manifest = _whole_manifest(folder)
    _index_path(folder, manifest)
    try:
        docs = Corpus.open(folder)
    except FileNotFoundError:
        raise InputError(
            f"{folder} holds {MANIFEST} but not its corpus ({CORPUS_FILE} and "
            f"{CORPUS_INFO}); {rebuild_hint(folder)}"
        ) from None
    if docs.fingerprint != manifest["corpus_fingerprint"] or len(docs) != manifest["num_docs"]:
        raise InputError(
            f"{folder / CORPUS_INFO} records another corpus ({len(docs)} docs, fingerprint "
            f"{docs.fingerprint}) than the index in {folder} was built on "
            f"({manifest['num_docs']} docs, {manifest['corpus_fingerprint']}); "
            f"{rebuild_hint(folder)}"
        )
    return manifest


def check_index_folder(folder: str | os.PathLike) -> None:
    """Refuse, before any work, an index folder that is a file or holds other things than
    an index or an index being built (building there would fail, or clobber them)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"index folder {folder} is a file; give a folder (new or empty)")
    if not folder.is_dir() or (folder / MANIFEST).is_file():
        return
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in BUILD_FILES
                     and not p.name.startswith("."))  # fmt: skip
    if foreign:
        raise InputError(
            f"index folder {folder} holds files that are not an index ({foreign[:3]}); give "
            "a new or empty folder"
        )


def _gpu_count(faiss: Any) -> int:
    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def wants_gpu(config: IndexConfig) -> bool:
    faiss = faiss_module()
    gpus = _gpu_count(faiss)
    if config.use_gpu and gpus == 0:
        raise RuntimeError(
            "use_gpu=True but faiss sees no GPU (faiss-cpu, or no visible device); install "
            "faiss-gpu in place of faiss-cpu (`pip uninstall faiss-cpu && pip install "
            "'ray-credit[faiss-gpu]'`), give the actor GPUs, or set use_gpu to null / false"
        )
    return config.kind != "hnsw" and gpus > 0 and config.use_gpu is not False


class DenseIndex:
    """A faiss index over a corpus's passage embeddings, with its manifest.

    Open a folder with :meth:`load`; :meth:`from_vectors` indexes vectors held in memory
    (small corpora and tests; :mod:`ray_credit.actors.index_build` builds from shards).
    """

    def __init__(self, index: Any, manifest: dict[str, Any], config: IndexConfig) -> None:
        self.manifest = manifest
        self.config = config
        self.cpu_index = index
        self.index = index
        self.gpus: list[int] = []
        self.mmapped = False
        self._gpu_resources: list[Any] = []
        if wants_gpu(config):
            self._to_gpus()

    def _to_gpus(self) -> None:
        faiss = faiss_module()
        devices = self.config.devices() or list(range(_gpu_count(faiss)))
        options = faiss.GpuMultipleClonerOptions()
        options.shard = True  # each GPU holds a slice; a search meets every slice once
        options.useFloat16 = self.config.gpu_float16
        if len(devices) == 1:
            one = faiss.GpuClonerOptions()
            one.useFloat16 = self.config.gpu_float16
            resources = faiss.StandardGpuResources()
            self.index = faiss.index_cpu_to_gpu(resources, devices[0], self.cpu_index, one)
            self._gpu_resources = [resources]
        else:
            self.index = faiss.index_cpu_to_gpus_list(self.cpu_index, co=options, gpus=devices)
        self.gpus = devices

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpus)

    @property
    def ntotal(self) -> int:
        return int(self.cpu_index.ntotal)

    @classmethod
    def build(cls, corpus: Any, encoder: Any, config: IndexConfig | str = "flat") -> DenseIndex:
        """Embed every passage of ``corpus`` (a :class:`~ray_credit.actors.corpus.Corpus`)
        with ``encoder`` in this process and index it in memory: small corpora and tests.
        A large corpus is built once into a folder, across workers:
        :func:`~ray_credit.actors.index_build.ensure_index`."""
        config = IndexConfig(kind=config) if isinstance(config, str) else config
        check_index_config(config, len(corpus), encoder.dim)
        wants_gpu(config)  # use_gpu=True without a GPU fails before the embedding
        manifest = index_manifest(corpus, encoder.manifest(), config)
        return cls.from_vectors(encoder.encode_passages(corpus.contents), config, manifest)

    @classmethod
    def from_vectors(
        cls, vectors: np.ndarray, config: IndexConfig, manifest: dict[str, Any]
    ) -> DenseIndex:
        """Index ``vectors`` (unit rows, float32) as ``config`` says; ``manifest`` is kept."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        check_index_config(config, len(vectors), vectors.shape[1])
        index = new_index(config, vectors.shape[1])
        if config.is_ivf:
            index.train(_sample(vectors, config.train_sample))
        index.add(vectors)
        set_search_params(index, config)
        return cls(index, manifest, config)

    @classmethod
    def load(cls, folder: str | os.PathLike, config: IndexConfig | None = None) -> DenseIndex:
        """Open the index of a whole folder (``manifest.json`` there), memory-mapped on CPU
        where the kind allows and ``config.mmap`` is on, copied to GPUs where ``config``
        asks. ``config``: the serving settings (its kind and knobs must be the manifest's;
        None: the manifest's with the defaults for serving)."""
        faiss = faiss_module()
        folder = Path(folder)
        manifest = _whole_manifest(folder)
        saved = IndexConfig(**manifest["index"])
        if config is None:
            config = saved
        elif config.manifest() != saved.manifest() and not manifest.get("imported"):
            raise InputError(
                f"index in {folder} is {saved.manifest()}, but {config.manifest()} was asked "
                "for; delete the folder to rebuild, point at another, or ask for the saved "
                "settings"
            )
        path = _index_path(folder, manifest)
        serving = replace_serving(saved, use_gpu=config.use_gpu, gpu_devices=config.gpu_devices,
                                  gpu_float16=config.gpu_float16, mmap=config.mmap)  # fmt: skip
        on_gpu = wants_gpu(serving)
        flags = 0
        if serving.mmap and not on_gpu:  # a GPU copy reads the file whole anyway
            flags = faiss.IO_FLAG_MMAP if saved.is_ivf else getattr(faiss, "IO_FLAG_MMAP_IFC", 0)
        try:
            index = faiss.read_index(str(path), flags)
        except (RuntimeError, MemoryError) as err:  # faiss: a cut-off or foreign file
            first = str(err).strip().splitlines()[0] if str(err).strip() else "unreadable"
            raise InputError(
                f"{path} is not a readable faiss index (faiss: {first[:200]}); it is damaged "
                f"or was cut off while written: delete {folder} to have it built again"
            ) from None
        if index.d != manifest["dim"] or index.ntotal != manifest["num_docs"]:
            raise InputError(
                f"{path} holds {index.ntotal} vectors of dimension {index.d}, but its manifest "
                f"says {manifest['num_docs']} of dimension {manifest['dim']}; delete {folder} "
                "to have it built again"
            )
        set_search_params(index, saved)
        dense = cls(index, manifest, serving)
        dense.mmapped = bool(flags)
        return dense

    def search(self, embeddings: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)``, each ``(len(embeddings), k)``; row -1 where faiss found fewer."""
        check_query_embeddings(self.manifest, embeddings)
        return self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), k)


def check_query_embeddings(manifest: dict[str, Any], embeddings: np.ndarray) -> None:
    """Refuse query embeddings that are not ``(n, dim)`` of the index of ``manifest``."""
    if embeddings.ndim != 2 or embeddings.shape[1] != manifest["dim"]:
        raise ValueError(
            f"query embeddings have shape {embeddings.shape}, the index holds vectors of "
            f"dimension {manifest['dim']}; embed queries with the index's encoder "
            f"({manifest['encoder']['name']!r})"
        )


def replace_serving(config: IndexConfig, **serving: Any) -> IndexConfig:
    from dataclasses import replace

    return replace(config, **serving)


def _sample(vectors: np.ndarray, size: int) -> np.ndarray:
    if len(vectors) <= size:
        return vectors
    rows = np.sort(np.random.default_rng(0).choice(len(vectors), size, replace=False))
    return vectors[rows]
