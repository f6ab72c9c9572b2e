"""The retriever's corpus: passages in an Arrow file, memory-mapped, read by row.

A FlashRAG / Search-R1 corpus (``.jsonl``, ``.jsonl.gz`` or ``.parquet``; one ``{"id",
"contents"}`` per document, contents = title line + text; or DPR's ``.tsv``) is converted
once into an Arrow IPC file with two columns, ``id`` and ``contents``, beside a small
``corpus.json`` holding its fingerprint, document count and the source file it came from.
Every process that opens it maps the same file: the pages are shared by all processes of a
node, a start takes milliseconds, and a hit reads its row from the page cache.

* :func:`convert_corpus`: source file -> ``corpus.arrow`` + ``corpus.json`` (every format
  check of :func:`ray_credit.data.iter_corpus`, with its file:line messages; duplicate
  ids named), written atomically.
* :func:`cached_corpus`: the converted copy of a source file in the shared cache
  (``$RAY_CREDIT_CACHE/corpora``), converted on first use and keyed by the file's path,
  size and modification time.
* :class:`Corpus`: an Arrow table of the documents (mapped from a file, or built in memory
  from a list of dicts), its fingerprint, and ``hits(rows, scores)``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from ray_credit.config import InputError

__all__ = [
    "CORPUS_FILE",
    "CORPUS_INFO",
    "Corpus",
    "CorpusSource",
    "cache_folder",
    "cached_corpus",
    "convert_corpus",
    "corpus_fingerprint",
    "count_docs",
    "read_json",
    "rebuild_hint",
    "require_fields",
    "sample_digest",
    "source_stamp",
]

CORPUS_FILE = "corpus.arrow"
CORPUS_INFO = "corpus.json"
_CHUNK = 10_000  # documents per record batch, and per step of the fingerprint
_INFO_VERSION = 2
"""2: ``corpus.json`` records a digest of sampled rows (:func:`sample_digest`), checked
whenever the file is opened. A version-1 record (no sample) is opened with its row count
checked only."""
_SAMPLE_ROWS = 32

Hit = dict[str, Any]
"""One retrieved document: ``{"id", "contents", "title", "text", "score"}``."""
CorpusSource = Union["Corpus", Sequence[Mapping[str, Any]], str, os.PathLike]
"""A :class:`Corpus`, a list of document dicts, or the path of a corpus file (``.jsonl``,
``.jsonl.gz``, ``.parquet``, or a converted ``corpus.arrow``)."""


def _pa() -> Any:
    import pyarrow as pa

    return pa


def corpus_fingerprint(ids: Sequence[str], contents: Sequence[str]) -> str:
    """blake2b over every id and contents, in order, then the count (hex, 32 chars).

    Hashed 10,000 documents at a time (NUL-joined strings: one C call per chunk, not per
    document), so a 21 M passage corpus fingerprints in well under a minute; the same
    function runs while a corpus file is converted, chunk by chunk, never holding it whole.
    """
    fingerprint = _Fingerprint()
    for start in range(0, len(ids), _CHUNK):
        fingerprint.update(ids[start : start + _CHUNK], contents[start : start + _CHUNK])
    return fingerprint.hexdigest()


class _Fingerprint:
    def __init__(self) -> None:
        self._digest = hashlib.blake2b(digest_size=16)
        self.count = 0

    def update(self, ids: Sequence[str], contents: Sequence[str]) -> None:
        """One chunk of exactly ``_CHUNK`` documents (the last may be shorter)."""
        digest = self._digest
        digest.update("\0".join(ids).encode("utf-8", "surrogatepass"))
        digest.update(b"\1")
        digest.update("\0".join(contents).encode("utf-8", "surrogatepass"))
        digest.update(b"\2")
        self.count += len(ids)

    def hexdigest(self) -> str:
        digest = self._digest.copy()
        digest.update(f"\3{self.count}".encode())
        return digest.hexdigest()


def source_stamp(path: str | os.PathLike) -> dict[str, Any]:
    """What identifies a corpus file without reading it: absolute path, size, mtime."""
    path = Path(path).absolute()
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _preview(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


def _schema() -> Any:
    pa = _pa()
    return pa.schema([("id", pa.string()), ("contents", pa.string())])


def _write(batches: Iterable[tuple[list[str], list[str]]], folder: Path, source: Any) -> dict:
    """Write ``corpus.arrow`` and ``corpus.json`` into ``folder`` (an existing, empty
    temporary folder) from chunks of exactly ``_CHUNK`` documents; the info dict."""
    pa = _pa()
    fingerprint = _Fingerprint()
    schema = _schema()
    with pa.OSFile(str(folder / CORPUS_FILE), "wb") as sink, pa.ipc.new_file(sink, schema) as out:
        for ids, contents in batches:
            fingerprint.update(ids, contents)
            columns = [pa.array(ids, pa.string()), pa.array(contents, pa.string())]
            out.write_batch(pa.record_batch(columns, schema=schema))
    info = {
        "format_version": _INFO_VERSION,
        "fingerprint": fingerprint.hexdigest(),
        "num_docs": fingerprint.count,
        "sample": sample_digest(_map(folder / CORPUS_FILE)),
        "source": source,
    }
    (folder / CORPUS_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def sample_digest(table: Any) -> str:
    """A digest of a corpus table's row count and of ``_SAMPLE_ROWS`` rows spread evenly
    over it (the first and the last among them), id and contents: what tells, in a
    millisecond and without reading the passages, that a ``corpus.arrow`` is the one its
    ``corpus.json`` describes (the fingerprint covers every row, so it is computed only
    when a corpus is converted). Evenly spaced rows, not a random draw: the rows picked
    depend on the count alone, in every version of every library."""
    count = table.num_rows
    picked = min(count, _SAMPLE_ROWS)
    rows = sorted({i * (count - 1) // max(picked - 1, 1) for i in range(picked)})
    digest = hashlib.blake2b(f"{count}".encode(), digest_size=16)
    ids, contents = table.column("id"), table.column("contents")
    for row in rows:
        for value in (ids[row].as_py(), contents[row].as_py()):
            digest.update(b"\0" + value.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _rechunk(docs: Iterable[Mapping[str, Any]]) -> Iterator[tuple[list[str], list[str]]]:
    ids: list[str] = []
    contents: list[str] = []
    for doc in docs:
        ids.append(doc["id"])
        contents.append(doc["contents"])
        if len(ids) == _CHUNK:
            yield ids, contents
            ids, contents = [], []
    if ids:
        yield ids, contents


def _check_unique(table: Any, source: str) -> None:
    import pyarrow.compute as pc

    column = table.column("id")
    if pc.count_distinct(column).as_py() == len(column):
        return
    counts = pc.value_counts(column)
    repeated = pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
    raise InputError(
        f"{source}: duplicate document ids {_preview(sorted(repeated.to_pylist()))}; ids must "
        "be unique"
    )


def convert_corpus(source: str | os.PathLike, folder: str | os.PathLike) -> dict[str, Any]:
    """Convert a corpus file into ``folder/corpus.arrow`` + ``folder/corpus.json``.

    The source is streamed through :func:`ray_credit.data.iter_corpus` (its format checks
    and ``file:line`` messages), written 10,000 documents per record batch and fingerprinted
    on the way; duplicate ids are then found by Arrow over the written column and named.
    Both files appear at once (written in a temporary folder, moved into ``folder``), so a
    killed conversion leaves nothing half-written. ``folder`` may exist (an index folder
    being built); files of those two names in it are replaced. Returns ``corpus.json``'s
    content: ``fingerprint``, ``num_docs``, ``source`` (:func:`source_stamp`).
    """
    from ray_credit.data.loaders import iter_corpus

    source = Path(source)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = source_stamp(source)
    docs = (doc for chunk in iter_corpus(source, check_duplicates=False) for doc in chunk)
    tmp = Path(tempfile.mkdtemp(prefix=".corpus.", suffix=".tmp", dir=folder))
    try:
        info = _write(_rechunk(docs), tmp, stamp)
        if info["num_docs"] == 0:
            raise InputError(f"{source} holds no document; a retriever needs at least one")
        _check_unique(_map(tmp / CORPUS_FILE), str(source))
        os.replace(tmp / CORPUS_FILE, folder / CORPUS_FILE)
        os.replace(tmp / CORPUS_INFO, folder / CORPUS_INFO)  # last: it marks the pair whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _map(path: Path) -> Any:
    """The table of an Arrow IPC file, memory-mapped (no copy: columns point into the map)."""
    pa = _pa()
    try:
        return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise InputError(
            f"{path} is not a readable Arrow corpus ({err}); delete it and convert the corpus again"
        ) from None


def rebuild_hint(folder: str | os.PathLike) -> str:
    """What to do about a damaged or foreign file the library wrote into ``folder``: an
    index folder (or one being built) is built anew, a converted corpus converted again."""
    folder = Path(folder)
    if any((folder / name).exists() for name in ("manifest.json", "build.json", "index.faiss",
                                                  "embeddings")):  # fmt: skip
        return (
            f"delete {folder} and build it again, or build it anew there with "
            "`python -m ray_credit.index build ... --overwrite`"
        )
    return f"delete {folder / CORPUS_FILE} and {folder / CORPUS_INFO} to have it converted again"


def read_json(path: str | os.PathLike, fix: str, fields: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON object of ``path``, a record the library wrote into an index, build or
    corpus folder (``manifest.json``, ``build.json``, ``corpus.json``, ...). Every such
    record is read here, so a file cut off while written, edited, or lacking one of
    ``fields`` fails with one line naming it and ``fix`` (what to do), never with a bare
    ``JSONDecodeError`` or ``KeyError`` from deep inside."""
    path = Path(path)
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise InputError(f"{path} cannot be read ({err.strerror or err}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        where = (
            f"{err.msg} at line {err.lineno} column {err.colno}"
            if isinstance(err, json.JSONDecodeError)
            else f"not UTF-8 at byte {err.start}"
        )
        raise InputError(
            f"{path} is not readable JSON ({where}: cut off while written, or edited); {fix}"
        ) from None
    if not isinstance(record, dict):
        raise InputError(
            f"{path} holds a JSON {type(record).__name__}, not the object the library wrote; {fix}"
        )
    require_fields(record, path, fix, fields)
    return record


def require_fields(record: dict[str, Any], path: str | os.PathLike, fix: str,
                   fields: Sequence[str]) -> None:  # fmt: skip
    """Refuse a record read from ``path`` that lacks one of ``fields`` (:func:`read_json`)."""
    missing = [name for name in fields if name not in record]
    if missing:
        raise InputError(f"{path} lacks the field(s) {missing}; {fix}")


def read_info(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``corpus.json`` of a folder, or None when the folder holds no converted corpus."""
    folder = Path(folder)
    path = folder / CORPUS_INFO
    if not path.is_file() or not (folder / CORPUS_FILE).is_file():
        return None
    return read_json(path, rebuild_hint(folder), ("fingerprint", "num_docs"))


def _cache_root() -> Path:
    from ray_credit.models import cache_dir

    return cache_dir().parent / "corpora"


def cache_folder(source: str | os.PathLike) -> Path:
    """Where the converted copy of corpus file ``source`` lives in the shared cache (it may
    not be there yet): named by the file's path, size and modification time."""
    from ray_credit.data.loaders import _existing

    stamp = source_stamp(_existing(source, "corpus"))
    key = hashlib.blake2b(json.dumps(stamp, sort_keys=True).encode(), digest_size=10)
    name = Path(stamp["path"]).name.split(".")[0][-40:] or "corpus"
    return _cache_root() / f"{name}-{key.hexdigest()}"


def cached_corpus(source: str | os.PathLike) -> Path:
    """The folder of the converted copy of corpus file ``source`` in the shared cache,
    converted now when there is none. Keyed by the file's absolute path, size and
    modification time: an edited file is converted again, an unchanged one costs a stat."""
    folder = cache_folder(source)
    if read_info(folder) is None:
        from ray_credit.log import log

        log.info(f"corpus: converting {source} to Arrow in {folder} (once)")
        convert_corpus(source, folder)
    return folder


def count_docs(source: CorpusSource) -> int:
    """How many documents a corpus holds, as cheaply as it can be told: a converted or
    cached copy's record, a parquet file's metadata, else the non-blank lines of a jsonl
    file (read in 16 MB blocks, not parsed; a tsv file's less its header row)."""
    if isinstance(source, Corpus):
        return len(source)
    if not isinstance(source, (str, os.PathLike)):
        return len(source)
    path = Path(source)
    if path.is_dir() or path.name.endswith(".arrow"):
        info = read_info(path if path.is_dir() else path.parent)
        if info is None:
            raise InputError(
                f"{path} holds no converted corpus ({CORPUS_INFO} missing); give the corpus "
                "file (.jsonl, .jsonl.gz, .tsv or .parquet), or a folder a build converted it into"
            )
        return int(info["num_docs"])
    from ray_credit.data.loaders import DataFormatError, _gzip_damaged, _is_tsv, _open_bytes

    cached = read_info(cache_folder(path))
    if cached is not None:
        return int(cached["num_docs"])
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as err:  # pyarrow's errors vary by version; one line either way
            raise DataFormatError(f"{path}: not a readable parquet file ({err})") from None
    count, tail = 0, b""
    try:
        with _open_bytes(path) as stream:
            while block := stream.read(1 << 24):
                lines = (tail + block).split(b"\n")
                tail = lines.pop()  # the line the next block goes on with
                count += sum(1 for line in lines if line.strip())
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise _gzip_damaged(path, err, f"after {count} lines") from None
    count += bool(tail.strip())
    return max(count - 1, 0) if _is_tsv(path) else count


class Corpus:
    """Documents in the FlashRAG / Search-R1 format: ``{"id": ..., "contents": "title\\ntext"}``.

    ``Corpus(docs)`` validates a list of dicts and holds them as an Arrow table in memory;
    :meth:`open` maps a converted ``corpus.arrow``; :meth:`from_file` converts a corpus file
    once (:func:`cached_corpus`) and maps the copy. Ids may be str or int and are kept (and
    returned in hits) as str. Construction fails on an empty corpus, a document without an
    id or without non-blank ``contents``, and duplicate ids (the error names them).
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
        pa = _pa()
        table = pa.table({"id": pa.array(ids, pa.string()), "contents": contents}, _schema())
        self._set(table, corpus_fingerprint(ids, contents), source=source, path=None)

    def _set(self, table: Any, fingerprint: str, *, source: Any, path: str | None) -> None:
        self.table = table
        self.fingerprint = fingerprint
        self.source = source
        self.path = path  # the mapped corpus.arrow, None when in memory
        self._ids = table.column("id")
        self._contents = table.column("contents")
        # where each record batch starts: a row is found in its chunk, never by a take over
        # the chunked column (Arrow would first concatenate the whole column: a copy)
        self._starts = np.cumsum([0] + [len(c) for c in self._contents.chunks])

    @classmethod
    def open(cls, folder: str | os.PathLike) -> Corpus:
        """Map the converted corpus in ``folder`` (``corpus.arrow`` + ``corpus.json``, as
        :func:`convert_corpus` writes them): the fingerprint is ``corpus.json``'s, and the
        file is checked against it cheaply (its row count and :func:`sample_digest`'s
        sampled rows; a millisecond on wiki-18's 21 M rows), so a ``corpus.arrow`` swapped
        for another corpus's is refused rather than served under this one's index."""
        folder = Path(folder)
        info = read_info(folder)
        if info is None:
            raise FileNotFoundError(
                f"{folder} holds no converted corpus ({CORPUS_FILE} and {CORPUS_INFO}); "
                "convert one with `python -m ray_credit.index build --corpus FILE --out "
                f"{folder}`"
            )
        table = _map(folder / CORPUS_FILE)
        if table.num_rows != info["num_docs"]:
            raise InputError(
                f"{folder / CORPUS_FILE} has {table.num_rows} documents but {CORPUS_INFO} "
                f"says {info['num_docs']}: it is not the corpus recorded there (replaced, "
                f"or cut off); {rebuild_hint(folder)}"
            )
        if "sample" in info and sample_digest(table) != info["sample"]:
            raise InputError(
                f"{folder / CORPUS_FILE} is not the corpus {CORPUS_INFO} records: its "
                f"{table.num_rows} rows differ in the rows sampled when it was converted "
                f"(the file was replaced or edited since); {rebuild_hint(folder)}"
            )
        corpus = cls.__new__(cls)
        corpus._set(table, info["fingerprint"], source=info.get("source"),
                    path=str(folder / CORPUS_FILE))  # fmt: skip
        return corpus

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Corpus:
        """A corpus file (``.jsonl``, ``.jsonl.gz``, ``.parquet``; converted once into the
        shared cache, then mapped), a converted ``corpus.arrow``, or a folder holding one."""
        path = Path(path)
        if path.is_dir():
            return cls.open(path)
        if path.name.endswith(".arrow"):
            return cls.open(path.parent)
        return cls.open(cached_corpus(path))

    from_jsonl = from_file  # the name older code calls

    @classmethod
    def coerce(cls, source: CorpusSource) -> Corpus:
        """A :class:`Corpus` from itself, a list of document dicts or a corpus path."""
        if isinstance(source, Corpus):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_file(source)
        return cls(source)

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def ids(self) -> list[str]:
        """Every id, in order, as a list (a full copy: use on small corpora)."""
        return self._ids.to_pylist()

    @property
    def contents(self) -> list[str]:
        """Every document's contents, in order, as a list (a full copy: small corpora)."""
        return self._contents.to_pylist()

    def texts(self, start: int, stop: int) -> list[str]:
        """The contents of rows ``start`` to ``stop`` (exclusive)."""
        return self._contents.slice(start, max(stop - start, 0)).to_pylist()

    def rows_of(self, ids: Iterable[str]) -> dict[str, int]:
        """Row of each id found (ids not in the corpus are left out): one vectorized scan."""
        import pyarrow.compute as pc

        wanted = _pa().array(sorted(set(map(str, ids))), _pa().string())
        mask = pc.is_in(self._ids, value_set=wanted)
        rows = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        return {hit["id"]: int(r) for r, hit in zip(rows, self.hits(rows, [0.0] * len(rows)),
                                                      strict=True)}  # fmt: skip

    def hits(self, rows: Sequence[int], scores: Sequence[float]) -> list[Hit]:
        """Documents ``rows`` as hits (one gather over the table), in the order given."""
        if not len(rows):
            return []
        rows = np.asarray(rows, dtype=np.int64)
        if rows.min() < 0 or rows.max() >= len(self):
            raise IndexError(f"rows out of range [0, {len(self)}): {rows.tolist()[:5]}")
        chunk_of = np.searchsorted(self._starts, rows, side="right") - 1
        ids_chunks, contents_chunks = self._ids.chunks, self._contents.chunks
        out = []
        for row, chunk, score in zip(rows.tolist(), chunk_of.tolist(), scores, strict=True):
            local = row - int(self._starts[chunk])
            doc_id = ids_chunks[chunk][local].as_py()
            contents = contents_chunks[chunk][local].as_py()
            title, _, text = contents.partition("\n")
            out.append(
                {"id": doc_id, "contents": contents, "title": title, "text": text, "score": score}
            )
        return out

    def hit(self, row: int, score: float) -> Hit:
        """Document ``row`` as a hit: id, contents, title (first line), text (the rest), score."""
        return self.hits([row], [score])[0]
