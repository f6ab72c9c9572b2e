"""Building an index folder once: the corpus converted, passages embedded across workers in
shards on disk, the index trained on a sample and filled shard by shard; or an index built
elsewhere imported and checked against the corpus and the encoder.

:func:`ensure_index` is the one entry point (``python -m ray_credit.index``, the pipeline's
retriever and ``ray_credit.serve`` all call it):

1. the corpus is converted into the folder (``corpus.arrow``; see :mod:`.corpus`);
2. the passages are cut into shards of ``shard_docs`` rows; each shard is embedded and
   saved as ``embeddings/shard_NNNNN.npy`` (written under a temporary name, then renamed).
   With ``workers`` >= 1 and Ray connected, Ray Data hands the shards to a pool of encoder
   actors (``map_batches``; one per GPU with ``worker_gpus=1``); with ``workers=0`` this
   process embeds them. A build that is killed resumes from its finished shards;
3. IVF and PQ train on ``index.train_sample`` vectors drawn from the shards, then every
   shard is added in turn: the embeddings are never all in memory;
4. ``index.faiss`` is written, then ``manifest.json`` (last: the folder is whole; it
   records what made the index: corpus, encoder, index settings); the shards are deleted
   unless ``keep_embeddings``.

Nothing found in the folder is taken unless these same settings made it: a whole index is
compared with the settings asked for, a leftover corpus with the corpus given, leftover
shards with the record beside them (``embeddings/shards.json``: the corpus, the encoder,
the shard size); what differs is refused, naming the folder and the difference, or
deleted and built anew with ``overwrite`` (only what a build writes: a folder holding
anything else is refused).

``index_file`` instead imports a faiss index built elsewhere on the corpus's line order (as
Search-R1 ships ``e5_Flat.index``): its count and dimension are checked, and a sample of
passages is re-encoded and searched; each must find its own row first, or the import is
refused (the index, the encoder or the corpus order do not match).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ray_credit.actors.corpus import (
    Corpus,
    CorpusSource,
    read_info,
    read_json,
    rebuild_hint,
    source_stamp,
)
from ray_credit.actors.dense_index import (
    BUILD_FILES,
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST,
    IndexConfig,
    check_index_config,
    check_index_folder,
    check_whole_folder,
    faiss_module,
    index_manifest,
    new_index,
    read_manifest,
    set_search_params,
    wants_gpu,
)
from ray_credit.actors.encoder import Encoder, EncoderConfig, canonical_encoder_name
from ray_credit.config import InputError, check_fields
from ray_credit.log import log
from ray_credit.progress import progress_bar

__all__ = [
    "SHARD_DOCS",
    "BuildConfig",
    "check_encoder_name",
    "check_made_by",
    "check_writable",
    "ensure_index",
    "import_check",
    "index_identity",
    "same_corpus",
]

SHARD_DOCS = 50_000
_BUILD = "build.json"
_SHARDS = "embeddings"
_ENCODER_INFO = "encoder.json"
_SHARDS_INFO = "shards.json"
_SLICE = 4096  # passages per encoder call inside a shard
# what a build writes in embeddings/, and the temporary names of its files (``_tmp``, and
# the conversion's mkdtemp folder): all an overwrite deletes
_SHARD_NAME = re.compile(r"shard_\d{5,}\.npy|encoder\.json|shards\.json")
_TMP_NAME = re.compile(r"\.[\w.-]+\.tmp(\.\w+)*")


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """How an index is built where none is found (embedding is the long part: wiki-18's
    21 M passages are hours on one GPU)."""

    workers: int = 0
    """Encoder workers: a Ray Data pool of this many actors embeds the shards (one per GPU
    with worker_gpus=1); 0: the process that builds embeds them itself."""
    worker_cpus: float = 1.0
    """CPUs per encoder worker."""
    worker_gpus: float = 0.0
    """GPUs per encoder worker (1 on GPU nodes)."""
    shard_docs: int = SHARD_DOCS
    """Passages per shard of embeddings on disk: what a killed build redoes at most."""
    keep_embeddings: bool = False
    """Keep the shards of embeddings after the index is written (to index them again
    another way); they take 4 * dim bytes per passage."""
    check_sample: int = 64
    """Passages re-encoded to check an imported index against the corpus and the encoder."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.workers < 0 or self.shard_docs < 1 or self.check_sample < 1:
            raise ValueError(
                "build.workers must be >= 0, build.shard_docs and build.check_sample >= 1; got "
                f"{self.workers}, {self.shard_docs}, {self.check_sample}"
            )
        if self.worker_cpus < 0 or self.worker_gpus < 0:
            raise ValueError("build.worker_cpus and build.worker_gpus must be >= 0")

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`ensure_index`."""
        return asdict(self)


def index_identity(
    corpus: CorpusSource, encoder: EncoderConfig, index: IndexConfig, index_file: str | None
) -> dict[str, Any]:
    """What an index folder's content depends on, without reading the corpus: a corpus
    file's stamp (path, size, mtime) or an in-memory corpus's fingerprint; the encoder's
    settings as :meth:`~ray_credit.actors.encoder.EncoderConfig.identity` spells them and a
    stamp of a local model folder; the index settings; an imported index file's stamp."""
    from ray_credit.actors.encoder import resolve_encoder_path

    if isinstance(corpus, (str, os.PathLike)):
        corpus_id: Any = source_stamp(corpus)
    else:
        corpus_id = Corpus.coerce(corpus).fingerprint
    return {
        "format_version": FORMAT_VERSION,
        "corpus": corpus_id,
        "encoder": encoder.identity(),
        "model_files": _model_stamp(resolve_encoder_path(encoder.name)),
        "index": index.manifest(),
        "index_file": source_stamp(index_file) if index_file else None,
    }


def _model_stamp(path: str) -> str:
    """A cheap stamp of a local model folder (each file's name, size and mtime), so a model
    retrained in place gets a new index; a hub id is its own stamp."""
    import hashlib

    folder = Path(path)
    if not folder.is_dir():
        return path
    digest = hashlib.blake2b(digest_size=8)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(folder)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def ensure_index(
    corpus: CorpusSource,
    folder: str | os.PathLike,
    *,
    encoder: EncoderConfig | str = "minilm",
    index: IndexConfig | str = "flat",
    index_file: str | os.PathLike | None = None,
    workers: int = 0,
    worker_cpus: float = 1.0,
    worker_gpus: float = 0.0,
    resources: dict[str, float] | None = None,
    shard_docs: int = SHARD_DOCS,
    keep_embeddings: bool = False,
    check_sample: int = 64,
    overwrite: bool = False,
) -> Path:
    """Make ``folder`` a whole index folder of ``corpus`` (see the module's steps); a whole
    one of these settings is left as it is, a partial build of the same settings is
    resumed; a whole index, a partial build, a corpus or shards of other settings are
    refused (InputError naming the folder and what differs), or, with ``overwrite``,
    deleted and built anew. Returns the folder."""
    encoder = EncoderConfig(name=encoder) if isinstance(encoder, str) else encoder
    index = IndexConfig(kind=index) if isinstance(index, str) else index
    folder = Path(folder).absolute()
    if shard_docs < 1 or workers < 0:
        raise ValueError(f"shard_docs must be >= 1 and workers >= 0, got {shard_docs}, {workers}")
    check_index_folder(folder)
    index_file = str(Path(index_file).absolute()) if index_file else None
    if not overwrite and read_manifest(folder) is not None:
        check_made_by(folder, corpus, encoder, index, index_file)
        return folder
    identity = index_identity(corpus, encoder, index, index_file)
    identity["shard_docs"] = shard_docs
    check_writable(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        _unwritable(folder, err.strerror or str(err))
    with _locked(folder):  # a second builder waits, then finds the folder whole
        if overwrite:
            _clear(folder)
        elif read_manifest(folder) is not None:
            check_made_by(folder, corpus, encoder, index, index_file)
            return folder
        _claim(folder, identity)
        return _build(
            corpus,
            folder,
            encoder,
            index,
            index_file,
            workers,
            worker_cpus,
            worker_gpus,
            resources,
            shard_docs,
            keep_embeddings,
            check_sample,
            identity,
        )


def check_writable(folder: str | os.PathLike) -> None:
    """Refuse, before any work and without writing anything, an index folder that cannot
    be made or written (a read-only place, a path through a file): InputError naming it."""
    folder = Path(folder).absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise InputError(
            f"index folder {folder} cannot be made: {existing} is a file; give a folder path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount too, even for root
        _unwritable(folder, f"{existing} is read-only here")


def check_encoder_name(encoder: EncoderConfig, flag: str = "--encoder.name") -> None:
    """Refuse, before any work, an encoder named by a local path that holds no model (no
    such folder, a file, a folder without ``config.json``): it would fail only when the
    first shard is embedded. A preset or a Hugging Face id is left to the load."""
    from ray_credit.actors.encoder import ENCODER_PRESETS, resolve_encoder_path

    path = Path(resolve_encoder_path(encoder.name)).expanduser()
    local = encoder.name.startswith(("/", ".", "~")) or path.exists()
    if not local or (path / "config.json").is_file() or (path / "modules.json").is_file():
        return
    if not path.exists():
        why = "no such folder"
    else:
        why = "a file, not a model folder" if path.is_file() else "a folder with no config.json"
    raise InputError(
        f"{flag} {encoder.name}: {why}; give a sentence-transformers or Hugging Face model "
        f"folder, a preset ({', '.join(ENCODER_PRESETS)}) or a Hugging Face id"
    )


def _unwritable(folder: Path, why: str) -> NoReturn:
    raise InputError(
        f"index folder {folder} cannot be written ({why}); give a folder you can write "
        "(build it there, then copy it where it is to be read)"
    )


def _clear(folder: Path) -> None:
    """Delete what a build wrote into ``folder`` (``overwrite``), after checking that it
    holds nothing else: another file or folder there is the user's, so nothing is
    deleted and the overwrite is refused, naming it. Other hidden files are left."""
    shards = folder / _SHARDS
    foreign = [p.name for p in folder.iterdir()
               if p.name not in BUILD_FILES and not p.name.startswith(".")]  # fmt: skip
    if shards.is_dir() and not shards.is_symlink():
        foreign += [f"{_SHARDS}/{p.name}" for p in shards.iterdir()
                    if not (_SHARD_NAME.fullmatch(p.name) or _TMP_NAME.fullmatch(p.name))]  # fmt: skip
    if foreign:
        raise InputError(
            f"index folder {folder} holds files no build writes ({sorted(foreign)[:3]}); "
            "--overwrite deletes only what a build wrote: move them out, or give another folder"
        )
    for path in folder.iterdir():
        if path.name == ".build.lock" or not (
            path.name in BUILD_FILES or _TMP_NAME.fullmatch(path.name)
        ):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.info(f"index: --overwrite: deleted what the build had made in {folder}")


def same_corpus(given: CorpusSource, docs: Corpus) -> str | None:
    """None when ``given`` is the corpus ``docs`` (an index folder's) was converted from,
    else ``given``'s fingerprint: a file that is the one converted (same path, size, mtime)
    passes at the cost of a stat; another file is converted (once, into the cache) and its
    fingerprint compared."""
    if isinstance(given, (str, os.PathLike)):
        path = Path(given)
        if path.is_file() and not _is_converted(path) and docs.source == source_stamp(path):
            return None
        fingerprint = Corpus.from_file(path).fingerprint
    else:
        fingerprint = Corpus.coerce(given).fingerprint
    return None if fingerprint == docs.fingerprint else fingerprint


def made_by_differences(
    folder: str | os.PathLike,
    manifest: dict[str, Any],
    corpus: CorpusSource | None,
    encoder: EncoderConfig,
    index: IndexConfig | None,
    index_file: str | None,
) -> dict[str, tuple[Any, Any]]:
    """What differs between the whole index of ``folder`` (its ``manifest``) and the
    settings given: ``{setting: (there, here)}``. The encoder by its settings (as
    :meth:`~ray_credit.actors.encoder.EncoderConfig.identity` spells them; a manifest
    written before it recorded them: the name, the length and the settings given
    explicitly); the index settings, unless the index was imported (``index`` None: not
    compared); the imported file; the corpus last, by content (it may be converted to
    tell), and only when nothing else differs."""
    differ: dict[str, tuple[Any, Any]] = {}
    made_by = manifest.get("made_by") or {}
    if "encoder" in made_by:
        there, here = made_by["encoder"], encoder.identity()
    else:
        recorded = manifest["encoder"]
        there = {"name": canonical_encoder_name(str(recorded.get("name"))),
                 "max_length": recorded.get("max_length")}  # fmt: skip
        here = {"name": canonical_encoder_name(encoder.name), "max_length": encoder.max_length}
        for key in ("pooling", "query_prefix", "passage_prefix"):
            if getattr(encoder, key) not in (None, "auto"):
                there[key], here[key] = recorded.get(key), getattr(encoder, key)
    for key in sorted(set(there) | set(here)):
        if there.get(key) != here.get(key):
            differ[f"encoder.{key}"] = (there.get(key), here.get(key))
    imported = manifest.get("index_path")
    if index_file is not None and imported != index_file:
        differ["index_file"] = (imported, index_file)
    elif index_file is not None and made_by.get("index_file") not in (None, source_stamp(
            index_file)):  # fmt: skip
        differ["index_file"] = ("as it was imported", "changed since (its size or mtime)")
    elif imported is None and index is not None:
        saved = manifest["index"]
        for key, value in index.manifest().items():
            if saved.get(key) != value:
                differ[f"index.{key}"] = (saved.get(key), value)
    if not differ and corpus is not None:
        docs = Corpus.open(folder)
        fingerprint = same_corpus(corpus, docs)
        if fingerprint is not None:
            differ["corpus"] = (f"{len(docs)} docs, fingerprint {docs.fingerprint}",
                                f"fingerprint {fingerprint}")  # fmt: skip
    return differ


def spell_differences(differ: dict[str, tuple[Any, Any]]) -> str:
    """``{setting: (there, here)}`` in words: ``encoder.name 'e5-base-v2' there, 'minilm'
    here; ...``."""
    return "; ".join(f"{key} {there!r} there, {here!r} here" if key != "corpus" else
                     f"corpus of {there} there, {here} here"
                     for key, (there, here) in differ.items())  # fmt: skip


def check_made_by(
    folder: str | os.PathLike,
    corpus: CorpusSource,
    encoder: EncoderConfig,
    index: IndexConfig,
    index_file: str | None,
) -> None:
    """Refuse a whole index folder that these settings did not make (InputError naming
    the folder, what differs and what to do), after :func:`check_whole_folder`'s checks."""
    folder = Path(folder)
    manifest = check_whole_folder(folder)
    if index_file is None and manifest.get("index_path"):
        differ = {"index_file": (manifest["index_path"], None)}  # a build asked, an import there
    else:
        differ = made_by_differences(folder, manifest, corpus, encoder, index, index_file)
    if differ:
        raise InputError(
            f"index folder {folder} already holds a whole index of other settings "
            f"({spell_differences(differ)}); build it anew there with "
            "`python -m ray_credit.index build ... --overwrite`, or give another folder"
        )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold ``folder/.build.lock`` (flock: processes and threads of a node queue on it)."""
    import fcntl

    try:
        lock = open(folder / ".build.lock", "a")  # noqa: SIM115 - closed by the with below
    except OSError as err:
        _unwritable(folder, err.strerror or str(err))
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(corpus, folder, encoder, index, index_file, workers, worker_cpus, worker_gpus,
           resources, shard_docs, keep_embeddings, check_sample, identity) -> Path:  # fmt: skip
    start = time.perf_counter()
    docs = _corpus_into(corpus, folder)
    check_index_config(index, len(docs), None)
    if index_file is not None:
        (folder / INDEX_FILE).unlink(missing_ok=True)  # a build's leftover: the manifest names
        manifest = _import(Path(index_file), docs, encoder, index, folder, check_sample)
    else:
        enc = _embed(folder, docs, encoder, shard_docs, workers, worker_cpus, worker_gpus,
                     resources, identity)  # fmt: skip
        check_index_config(index, len(docs), enc["dim"])
        _index_shards(folder, len(docs), enc["dim"], index, shard_docs)
        manifest = index_manifest(docs, enc, index)
        manifest["built"] = {"shard_docs": shard_docs, "workers": workers,
                             "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    manifest["made_by"] = identity  # what a later build or server compares its settings with
    _write_json(folder / MANIFEST, manifest)  # last: the folder is whole
    if not keep_embeddings:
        shutil.rmtree(folder / _SHARDS, ignore_errors=True)
    (folder / _BUILD).unlink(missing_ok=True)
    (folder / ".build.lock").unlink(missing_ok=True)  # later builders find the manifest first
    log.info(f"index: {len(docs)} passages, {index.kind}, in {folder} "
             f"({time.perf_counter() - start:.1f}s)")  # fmt: skip
    return folder


def _tmp(path: Path) -> Path:
    """A temporary name beside ``path``, this process's and thread's own: builds of one
    folder running at once each write their own file, then rename it (atomic)."""
    import threading

    suffix = "".join(path.suffixes)
    return path.with_name(f".{path.stem}.{os.getpid()}-{threading.get_ident()}.tmp{suffix}")


def _write_json(path: Path, obj: Any) -> None:
    tmp = _tmp(path)
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _claim(folder: Path, identity: dict[str, Any]) -> None:
    """Record what this build makes; a partial build of other settings is refused. What
    the folder holds besides is checked on its own (its corpus, its shards): a refused
    build leaves its claim here, so the claim vouches for nothing else."""
    path = folder / _BUILD
    if path.is_file():
        there = read_json(path, rebuild_hint(folder))
        if there != identity and _made_nothing(folder):  # a build refused before any work
            _write_json(path, identity)
        elif there != identity:
            differ = sorted(k for k in identity if there.get(k) != identity[k])
            raise InputError(
                f"{folder} holds a partial build of other settings (they differ in "
                f"{differ}); build with its settings to resume it, or build it anew there "
                "with `python -m ray_credit.index build ... --overwrite`"
            )
        log.info(f"index: resuming the build in {folder}")
    else:
        _write_json(path, identity)


def _made_nothing(folder: Path) -> bool:
    """True when a build in ``folder`` embedded no shard and wrote no index (it was
    refused, or stopped, before): its claim and its shards' record vouch for nothing, and
    are replaced (a converted corpus it left is checked on its own)."""
    shards = (folder / _SHARDS).glob("shard_*.npy")
    return not (folder / INDEX_FILE).exists() and not any(shards)


def _corpus_into(corpus: CorpusSource, folder: Path) -> Corpus:
    """The corpus, converted into ``folder`` (once), mapped from there."""
    from ray_credit.actors.corpus import CORPUS_FILE, CORPUS_INFO, cache_folder, convert_corpus

    found = read_info(folder)
    if found is not None:  # a build's leftover: this corpus's, or refused
        _same_leftover_corpus(corpus, folder, found)
    else:
        if isinstance(corpus, (str, os.PathLike)) and not _is_converted(corpus):
            cached = cache_folder(corpus)  # converted already (the driver reads it too)
            if read_info(cached) is not None:
                _link_or_copy(cached / CORPUS_FILE, folder / CORPUS_FILE)
                _link_or_copy(cached / CORPUS_INFO, folder / CORPUS_INFO)
            else:
                convert_corpus(corpus, folder)
        else:
            source = Corpus.coerce(corpus)
            if source.path is not None:  # a converted corpus elsewhere: link or copy it
                _link_or_copy(Path(source.path), folder / CORPUS_FILE)
                _link_or_copy(Path(source.path).with_name(CORPUS_INFO), folder / CORPUS_INFO)
            else:
                _write_table(source, folder)
    _add_sample(folder)
    return Corpus.open(folder)


def _same_leftover_corpus(corpus: CorpusSource, folder: Path, info: dict[str, Any]) -> None:
    """Refuse a converted corpus found in the folder that is not ``corpus``: a file's
    conversion by the file's stamp (path, size, mtime: an edited file is another corpus),
    a converted or in-memory corpus by its fingerprint."""
    from ray_credit.actors.corpus import CORPUS_FILE

    if isinstance(corpus, (str, os.PathLike)) and not _is_converted(corpus):
        there, here = info.get("source"), source_stamp(corpus)
    else:
        there, here = info["fingerprint"], Corpus.coerce(corpus).fingerprint
    if there != here:
        raise InputError(
            f"index folder {folder} holds another corpus ({folder / CORPUS_FILE}, from "
            f"{there}) than this build's ({here}), left by a build of other settings; "
            f"{rebuild_hint(folder)}"
        )


def _add_sample(folder: Path) -> None:
    """Give a corpus record converted before records held sampled rows (a link from an
    older cache) its :func:`~ray_credit.actors.corpus.sample_digest`, from the file it was
    just checked against by count, so this folder's corpus is checked when opened."""
    from ray_credit.actors.corpus import CORPUS_INFO, sample_digest

    info = read_info(folder)
    if info is not None and "sample" not in info:
        info["sample"] = sample_digest(Corpus.open(folder).table)
        _write_json(folder / CORPUS_INFO, info)  # a file of its own: the link is left alone


def _is_converted(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() or path.name.endswith(".arrow")


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = _tmp(dst)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _write_table(corpus: Corpus, folder: Path) -> None:
    import tempfile

    from ray_credit.actors.corpus import _CHUNK, CORPUS_FILE, CORPUS_INFO, _write

    tmp = Path(tempfile.mkdtemp(prefix=".corpus.", suffix=".tmp", dir=folder))
    chunks = ((corpus.table.column("id").slice(s, _CHUNK).to_pylist(),
               corpus.table.column("contents").slice(s, _CHUNK).to_pylist())
              for s in range(0, len(corpus), _CHUNK))  # fmt: skip
    info = _write(chunks, tmp, corpus.source if isinstance(corpus.source, dict) else None)
    assert info["fingerprint"] == corpus.fingerprint
    os.replace(tmp / CORPUS_FILE, folder / CORPUS_FILE)
    os.replace(tmp / CORPUS_INFO, folder / CORPUS_INFO)
    tmp.rmdir()


# ---------------------------------------------------------------------------- embedding
def _shard_path(folder: Path, shard: int) -> Path:
    return folder / _SHARDS / f"shard_{shard:05d}.npy"


def _shards(num_docs: int, shard_docs: int) -> list[tuple[int, int, int]]:
    return [(i, start, min(start + shard_docs, num_docs))
            for i, start in enumerate(range(0, num_docs, shard_docs))]  # fmt: skip


class ShardEmbedder:
    """Embeds shards of a converted corpus into ``embeddings/``: the callable class of the
    Ray Data actor pool (one encoder per actor), or called in this process."""

    def __init__(self, folder: str, encoder: EncoderConfig) -> None:
        self.folder = Path(folder)
        self.corpus = Corpus.open(self.folder)
        self.encoder = Encoder(encoder)
        info = self.folder / _SHARDS / _ENCODER_INFO
        if not info.is_file():
            _write_json(info, self.encoder.manifest())

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        docs = []
        for shard, start, stop in zip(batch["shard"], batch["start"], batch["stop"], strict=True):
            vectors = np.empty((int(stop - start), self.encoder.dim), dtype=np.float32)
            for s in range(int(start), int(stop), _SLICE):
                e = min(s + _SLICE, int(stop))
                vectors[s - start : e - start] = self.encoder.encode_passages(
                    self.corpus.texts(s, e)
                )
            path = _shard_path(self.folder, int(shard))
            tmp = _tmp(path)
            np.save(tmp, vectors)
            os.replace(tmp, path)  # a shard is there whole or not at all
            docs.append(int(stop - start))
        return {"shard": np.asarray(batch["shard"]), "docs": np.asarray(docs)}


def _shards_record(corpus: Corpus, identity: dict[str, Any], shard_docs: int) -> dict[str, Any]:
    """What the shards of ``embeddings/`` depend on (``embeddings/shards.json``): the
    corpus, the encoder and its model files, the shard size; not the index kind."""
    return {
        "format_version": FORMAT_VERSION,
        "corpus_fingerprint": corpus.fingerprint,
        "num_docs": len(corpus),
        "encoder": identity["encoder"],
        "model_files": identity["model_files"],
        "shard_docs": shard_docs,
    }


def _claim_shards(folder: Path, record: dict[str, Any]) -> None:
    """Reuse the shards in ``embeddings/`` only when its record (written before the first
    shard) says these settings made them; shards of other settings, or with no record
    (another build's, its record lost), are refused."""
    shards = folder / _SHARDS
    path = shards / _SHARDS_INFO
    shards.mkdir(exist_ok=True)
    if path.is_file():
        there = read_json(path, rebuild_hint(folder))
        differ = {k: (there.get(k), record[k]) for k in record if there.get(k) != record[k]}
        if differ and _made_nothing(folder):
            _write_json(path, record)
        elif differ:
            raise InputError(
                f"{shards} holds embeddings of other settings ({spell_differences(differ)}), "
                f"left by another build; {rebuild_hint(folder)}"
            )
        return
    if any(shards.glob("shard_*.npy")):
        raise InputError(
            f"{shards} holds embeddings with no record of the corpus and encoder that made "
            f"them ({_SHARDS_INFO}), left by another build; {rebuild_hint(folder)}"
        )
    (shards / _ENCODER_INFO).unlink(missing_ok=True)  # unvouched for, as the shards would be
    _write_json(path, record)


def _embed(
    folder: Path,
    corpus: Corpus,
    encoder: EncoderConfig,
    shard_docs: int,
    workers: int,
    worker_cpus: float,
    worker_gpus: float,
    resources: dict[str, float] | None,
    identity: dict[str, Any],
) -> dict[str, Any]:
    """Embed every shard not on disk yet; the encoder's manifest."""
    _claim_shards(folder, _shards_record(corpus, identity, shard_docs))
    shards = _shards(len(corpus), shard_docs)
    todo = [s for s in shards if not _shard_path(folder, s[0]).is_file()]
    done_docs = len(corpus) - sum(stop - start for _, start, stop in todo)
    if done_docs:
        log.info(f"index: {len(shards) - len(todo)} of {len(shards)} shards already embedded")
    if todo:
        columns = {k: np.array([s[i] for s in todo]) for i, k in enumerate(("shard", "start",
                                                                            "stop"))}  # fmt: skip
        bar = progress_bar(len(corpus), "embedding the corpus", unit="doc")
        bar.update(done_docs)
        if workers and _ray_connected():
            for row in _ray_data_embed(folder, encoder, columns, workers, worker_cpus,
                                       worker_gpus, resources):  # fmt: skip
                bar.update(int(row["docs"]))
        else:
            embedder = ShardEmbedder(str(folder), encoder)
            for i in range(len(todo)):
                one = {k: v[i : i + 1] for k, v in columns.items()}
                bar.update(int(embedder(one)["docs"][0]))
        bar.close()
    info = folder / _SHARDS / _ENCODER_INFO
    if not info.is_file():  # every shard there, its encoder's record lost: embed none, ask
        _write_json(info, Encoder(encoder).manifest())
    return read_json(info, rebuild_hint(folder), ("dim",))


def _ray_connected() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized()


def _ray_data_embed(folder, encoder, columns, workers, worker_cpus, worker_gpus, resources):
    """Shards through a Ray Data pool of ``workers`` encoder actors, one shard per call."""
    import ray.data

    items = [{k: int(v[i]) for k, v in columns.items()} for i in range(len(columns["shard"]))]
    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    remote: dict[str, Any] = {"num_cpus": worker_cpus, "num_gpus": worker_gpus}
    if resources:
        remote["resources"] = resources
    embedded = dataset.map_batches(
        ShardEmbedder,
        fn_constructor_kwargs={"folder": str(folder), "encoder": encoder},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers),
        **remote,
    )
    yield from embedded.iter_rows()


# ---------------------------------------------------------------------------- indexing
def _shard_vectors(folder: Path, shard: int) -> np.ndarray:
    return np.load(_shard_path(folder, shard), mmap_mode="r")


def _index_shards(folder: Path, num_docs: int, dim: int, config: IndexConfig,
                  shard_docs: int) -> None:  # fmt: skip
    """Train on a sample (IVF, PQ), add shard by shard, write ``index.faiss``. A flat
    index is written shard by shard instead, never whole in memory
    (:func:`_write_flat_file`)."""
    faiss = faiss_module()
    shards = _shards(num_docs, shard_docs)
    if config.kind == "flat":
        tmp = _tmp(folder / INDEX_FILE)
        bar = progress_bar(num_docs, "writing the flat index", unit="doc")
        _write_flat_file(tmp, dim, num_docs, _checked_shards(folder, shards, dim), bar)
        bar.close()
        os.replace(tmp, folder / INDEX_FILE)
        return
    index = new_index(config, dim)
    if config.is_ivf:
        size = min(config.train_sample, num_docs)
        rows = np.sort(np.random.default_rng(0).choice(num_docs, size, replace=False))
        sample = np.empty((size, dim), dtype=np.float32)
        at = 0
        for shard, start, stop in shards:
            mine = rows[(rows >= start) & (rows < stop)] - start
            sample[at : at + len(mine)] = _shard_vectors(folder, shard)[mine]
            at += len(mine)
        if wants_gpu(config):  # k-means on the GPUs: hours become minutes at 16k+ lists
            ivf = faiss.extract_index_ivf(index)
            ivf.clustering_index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(dim))
        log.info(f"index: training {config.kind} on {size} of {num_docs} vectors")
        index.train(sample)
        del sample
    bar = progress_bar(num_docs, f"adding to the {config.kind} index", unit="doc")
    for vectors in _checked_shards(folder, shards, dim):
        index.add(vectors)
        bar.update(len(vectors))
    bar.close()
    set_search_params(index, config)
    tmp = _tmp(folder / INDEX_FILE)
    faiss.write_index(index, str(tmp))
    os.replace(tmp, folder / INDEX_FILE)


def _checked_shards(folder: Path, shards: list, dim: int) -> Iterator[np.ndarray]:
    """Each shard's vectors in order, float32, checked against the rows it should hold."""
    for shard, start, stop in shards:
        vectors = np.ascontiguousarray(_shard_vectors(folder, shard), dtype=np.float32)
        if vectors.shape != (stop - start, dim):
            raise InputError(
                f"{_shard_path(folder, shard)} holds {vectors.shape}, not ({stop - start}, "
                f"{dim}); delete it and build again to re-embed that shard"
            )
        yield vectors


def _flat_header(dim: int, count: int) -> bytes:
    """The bytes faiss writes before the vectors of a flat inner-product index of
    ``count`` vectors: taken from faiss itself (an empty index's file, its two count
    fields read off the files of one and two vectors), so that the file streamed after
    it is the one ``faiss.write_index`` would write, whatever faiss's version."""
    faiss = faiss_module()

    def serialized(n: int) -> bytes:
        index = faiss.IndexFlatIP(dim)
        if n:
            index.add(np.zeros((n, dim), dtype=np.float32))
        return faiss.serialize_index(index).tobytes()

    empty, one, two = serialized(0), serialized(1), serialized(2)
    vector = 4 * dim
    if len(one) != len(empty) + vector or len(two) != len(empty) + 2 * vector:
        raise RuntimeError("this faiss writes a flat index with more than its vectors after "
                           "its header; build with faiss.write_index")  # fmt: skip
    header = bytearray(empty)
    found, at = 0, 0
    while at < len(empty) - 7:  # the counts: 8-byte little-endian, 0 / k / 2k
        v0, v1, v2 = (int.from_bytes(f[at : at + 8], "little") for f in (empty, one, two))
        if v0 == 0 and v1 in (1, dim, vector) and v2 == 2 * v1:
            header[at : at + 8] = (v1 * count).to_bytes(8, "little")
            found += 1
            at += 8  # not the same field read again from its next byte
        else:
            at += 1
    if found != 2:  # the vector count, and the vectors' size
        raise RuntimeError(f"this faiss's flat index header has {found} count fields, not 2")
    return bytes(header)


def _write_flat_file(
    path: Path, dim: int, count: int, shards: Iterator[np.ndarray], bar: Any = None
) -> None:
    """Write a flat inner-product faiss index of ``count`` vectors to ``path`` from
    ``shards`` (float32 arrays, in order): the header, then each shard's bytes as it
    comes. What ``faiss.write_index`` writes for the whole index, with one shard in
    memory at a time instead of all of them."""
    written = 0
    with open(path, "wb") as out:
        out.write(_flat_header(dim, count))
        for vectors in shards:
            out.write(memoryview(np.ascontiguousarray(vectors, dtype=np.float32)).cast("B"))
            written += len(vectors)
            if bar is not None:
                bar.update(len(vectors))
    if written != count:
        raise RuntimeError(f"{path}: {written} vectors written, {count} expected")


# ---------------------------------------------------------------------------- import
def _kind_of(index: Any) -> dict[str, Any]:
    """The IndexConfig fields of a faiss index read from a file."""
    faiss = faiss_module()
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexFlat):
        return {"kind": "flat"}
    if isinstance(index, faiss.IndexHNSWFlat):
        return {"kind": "hnsw", "hnsw_m": int(index.hnsw.nb_neighbors(1))}
    if isinstance(index, faiss.IndexIVFPQ):
        return {"kind": "ivfpq", "nlist": int(index.nlist), "pq_m": int(index.pq.M),
                "pq_nbits": int(index.pq.nbits), "nprobe": int(index.nprobe)}  # fmt: skip
    if isinstance(index, faiss.IndexIVFFlat):
        return {"kind": "ivfflat", "nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    raise InputError(
        f"the imported index is a faiss {type(index).__name__}; ray_credit serves Flat, HNSW "
        "(HNSWFlat), IVF-Flat and IVF-PQ indexes"
    )


def import_check(
    index: Any, corpus: Corpus, encoder: Encoder, *, sample: int = 64, where: str = "index"
) -> float:
    """Re-encode ``sample`` passages drawn at random (seeded) and search them: the share
    that find their own row first (or tied first: a duplicate passage). Below 0.9 the
    index, the encoder or the corpus's order do not match: InputError, with an example."""
    rows = np.sort(np.random.default_rng(0).choice(len(corpus), min(sample, len(corpus)),
                                                   replace=False))  # fmt: skip
    texts = [hit["contents"] for hit in corpus.hits(rows, [0.0] * len(rows))]
    scores, found = index.search(encoder.encode_passages(texts), 10)
    own = []
    for row, row_scores, row_found in zip(rows, scores, found, strict=True):
        hit = np.flatnonzero(row_found == row)
        own.append(bool(hit.size) and row_scores[hit[0]] >= row_scores[0] - 1e-4)
    share = float(np.mean(own))
    if share < 0.9:
        miss = int(np.flatnonzero(~np.asarray(own))[0])
        raise InputError(
            f"{where} does not match the corpus and the encoder: only {sum(own)} of "
            f"{len(own)} sampled passages find their own row first (row {rows[miss]} finds "
            f"row {found[miss][0]}). Was it built with encoder {encoder.config.name!r} "
            f"(passage prefix {encoder.passage_prefix!r}, max_length "
            f"{encoder.config.max_length}, pooling {encoder.pooling}) on this corpus, rows in "
            "the corpus file's line order?"
        )
    return share


def _import(
    path: Path,
    corpus: Corpus,
    encoder: EncoderConfig,
    config: IndexConfig,
    folder: Path,
    sample: int,
) -> dict[str, Any]:
    faiss = faiss_module()
    if not path.is_file():
        raise InputError(f"index file {path} does not exist (or is not a file)")
    try:  # mapped: a 60 GB flat index is checked without being read whole
        index = faiss.read_index(str(path), getattr(faiss, "IO_FLAG_MMAP_IFC", 0))
    except (RuntimeError, MemoryError) as err:
        first = (str(err).strip().splitlines() or ["unreadable"])[0][:200]
        raise InputError(f"{path} is not a readable faiss index (faiss: {first})") from None
    enc = Encoder(encoder)
    if index.ntotal != len(corpus) or index.d != enc.dim:
        raise InputError(
            f"{path} holds {index.ntotal} vectors of dimension {index.d}; the corpus has "
            f"{len(corpus)} passages and encoder {encoder.name!r} gives dimension {enc.dim}. "
            "Import the index built on this corpus with this encoder"
        )
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise InputError(
            f"{path} ranks by L2 distance; ray_credit serves inner-product indexes of unit "
            "vectors (as Search-R1's e5_Flat.index is): build one with metric inner product"
        )
    kind = _kind_of(index)
    set_search_params(index, IndexConfig(**{**config.manifest(), **kind}))
    share = import_check(index, corpus, enc, sample=sample, where=str(path))
    log.info(f"index: imported {path}: {share:.0%} of {min(sample, len(corpus))} sampled "
             "passages find their own row first")  # fmt: skip
    manifest = index_manifest(corpus, enc.manifest(), IndexConfig(**{**config.manifest(), **kind}))
    manifest.update(imported=True, index_path=str(path), import_check=share)
    return manifest
