"""Loaders for real data: FlashRAG corpora, Search-R1 question sets, and a Ray Data stream.

* :func:`load_corpus` / :func:`iter_corpus`: a FlashRAG ``.jsonl`` corpus (one
  ``{"id", "contents"}`` object per line, ``contents`` = title line + text; lines with
  ``title`` and ``text`` instead are accepted), optionally gzipped; or a ``.tsv`` with a
  header row naming ``id``, ``text`` and ``title``, as DPR ships ``psgs_w100.tsv``.
* :func:`load_qa`: a Search-R1 ``.parquet`` dataset (``question``, ``golden_answers``,
  ``data_source``; optional ``id``, ``supporting_doc_ids``, ``hops``) or a ``.jsonl`` file
  with the same keys. Golds nested as ``reward_model.ground_truth.target`` (Search-R1's
  verl-style files) are accepted.
* :func:`prompt_stream`: the same records in batches from Ray Data, for sets too large to
  hold in the driver.

Every error is a :class:`DataFormatError` that names the file, the line (jsonl, from 1) or
row (parquet, from 0) and what is wrong. Only :func:`prompt_stream` imports Ray.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ray_credit.config import InputError, InputFileNotFoundError
from ray_credit.log import log
from ray_credit.qa import check_gold_answers

__all__ = ["QA_KEYS", "DataFormatError", "iter_corpus", "load_corpus", "load_qa", "prompt_stream"]

QA_KEYS = (
    "id",
    "question",
    "golden_answers",
    "data_source",
    "supporting_doc_ids",
    "hops",
    "reference_plan",
    "prompt",
)
"""The keys of every question record the loaders return (``None`` where a file has none)."""

PROMPT_ROLES = ("system", "user", "assistant")
"""The roles a question file's own ``prompt`` messages may take."""


class DataFormatError(InputError):
    """A corpus or dataset file is malformed; the message names the file, line/row and fix."""


# ---------------------------------------------------------------------------- corpus
def _open_bytes(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def _is_tsv(path: Path) -> bool:
    return path.name.endswith((".tsv", ".tsv.gz"))


def _gzip_damaged(path: Path, err: Exception, after: str) -> DataFormatError:
    return DataFormatError(
        f"{path}: the gzip data is damaged or cut off {after} ({err}); fetch the file again "
        f"(`gzip -t {path.name}` tests it)"
    )


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))


def _existing(path: str | os.PathLike, what: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise InputFileNotFoundError(f"{what} file {str(path)!r} does not exist (or is not a file)")
    return path


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a jsonl file (UTF-8, a BOM
    allowed; lines end in \\n, \\r\\n or \\r)."""
    with _open_bytes(path) as stream:
        try:
            head = stream.peek(4)[:4] if hasattr(stream, "peek") else b""
        except gzip.BadGzipFile as err:
            raise DataFormatError(f"{path}: named .gz but not gzip data ({err})") from None
        if head[:2] == b"\x1f\x8b":
            raise DataFormatError(
                f"{path}: gzip-compressed data in a file not named .gz; rename it "
                f"{path.name}.gz (or decompress it)"
            )
        if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise DataFormatError(
                f"{path}: UTF-16 text; save it as UTF-8, e.g. `iconv -f utf-16 -t utf-8 "
                f"{path.name}`"
            )
        number = 0
        try:
            for raw in stream:  # decoded line by line: an error names its line
                for part in raw.splitlines():  # a file with bare \r endings is one raw line
                    number += 1
                    obj = _json_line(path, number, part)
                    if obj is not None:
                        yield number, obj
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise _gzip_damaged(path, err, f"after line {number}") from None


def _tsv_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """``(line number, row)`` for each row of a tab-separated corpus whose first line names
    its columns (DPR's ``psgs_w100.tsv``: ``id``, ``text``, ``title``), read as DPR reads
    it: csv quoting, ``""`` for a quote inside a quoted field. A file without that header
    is refused: its column order cannot be told."""
    import csv
    import io

    with _open_bytes(path) as raw, io.TextIOWrapper(raw, "utf-8-sig", newline="") as text:
        reader = csv.reader(text, delimiter="\t")
        try:
            names = [name.strip() for name in next(reader, [])]
            if names and not {"id", "text"} <= set(names):
                raise DataFormatError(
                    f"{path}:1: a .tsv corpus needs a header row naming its columns (id, text "
                    f"and title, as DPR's psgs_w100.tsv starts), and its first row is "
                    f"{_preview_row(names)}; add a header line such as "
                    "`id<TAB>text<TAB>title`, in the file's column order"
                )
            for row in reader:
                if not row:
                    continue
                if len(row) != len(names):
                    raise DataFormatError(
                        f"{path}:{reader.line_num}: {len(row)} tab-separated fields, and the "
                        f"header names {len(names)} ({names}); a tab in a passage must be "
                        "inside a quoted field"
                    )
                yield reader.line_num, dict(zip(names, row, strict=True))
        except UnicodeDecodeError as err:
            raise DataFormatError(
                f"{path}: not UTF-8 after line {reader.line_num} (byte "
                f"{err.object[err.start]:#04x}); save the file as UTF-8"
            ) from None
        except csv.Error as err:
            raise DataFormatError(f"{path}:{reader.line_num}: not readable TSV ({err})") from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise _gzip_damaged(path, err, f"after line {reader.line_num}") from None


def _preview_row(fields: Sequence[str]) -> str:
    return repr([f if len(f) <= 30 else f[:30] + "..." for f in fields[:3]])


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """``(row number from 0, row)`` for each row of a parquet corpus, read batch by batch."""
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors vary by version; one line either way
        raise DataFormatError(f"{path}: not a readable parquet file ({err})") from None
    number = 0
    for batch in reader.iter_batches(batch_size=10_000):
        for row in batch.to_pylist():
            yield number, row
            number += 1


class _RepeatedKey(ValueError):
    """A JSON object that names one key twice (``json`` keeps the last, without a word)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def repeated_key_error(where: str, err: _RepeatedKey) -> DataFormatError:
    """The refusal of an object that names the key ``err`` holds twice, at ``where``."""
    return DataFormatError(
        f"{where}: the key {err.args[0]!r} appears twice in one object, and JSON keeps only "
        "the last; keep the one you mean"
    )


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
"""Every JSON line's decoder: as fast as ``json.loads``, and a repeated key is refused."""


def _json_line(path: Path, number: int, raw: bytes) -> dict | None:
    """One line's object, None for a blank line."""
    try:
        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        convert = f"iconv -f latin1 -t utf-8 {path.name}"
        if path.suffix == ".gz":
            convert = f"zcat {path.name} | iconv -f latin1 -t utf-8 | gzip"
        raise DataFormatError(
            f"{path}:{number}: not UTF-8 (byte {raw[err.start]:#04x} at column "
            f"{err.start + 1}); save the file as UTF-8, e.g. `{convert}` if it is Latin-1"
        ) from None
    if not line.strip():
        return None
    try:
        obj = _DECODER.decode(line)
    except json.JSONDecodeError as err:
        raise DataFormatError(
            f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno}); each "
            "line must be one JSON object"
        ) from None
    except _RepeatedKey as err:
        raise repeated_key_error(f"{path}:{number}", err) from None
    if not isinstance(obj, dict):
        raise DataFormatError(
            f"{path}:{number}: expected a JSON object ({{...}}), got {_kind(obj)}; each line "
            "of a JSON lines file is one object, one row"
        )
    return obj


def _check_unicode(text: str, what: str, where: str) -> None:
    """Refuse a lone surrogate (JSON's ``"\\udcff"``): no UTF-8 holds it, so the first
    trajectory batch that carried it would fail far from here."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DataFormatError(
            f"{where}: {what} holds {text[err.start]!r} at character {err.start + 1}, a lone "
            "surrogate that is not valid Unicode (often a JSON \\udcxx escape of raw bytes); "
            "fix the text or replace the character"
        ) from None


def _corpus_doc(obj: Mapping[str, Any], where: str) -> dict:
    doc_id = obj.get("id")
    if doc_id is None:
        raise DataFormatError(f"{where}: missing 'id'; every document needs a unique id")
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        raise DataFormatError(f"{where}: 'id' must be a str or int, got {doc_id!r}")
    if isinstance(doc_id, str) and not doc_id.strip():
        raise DataFormatError(
            f"{where}: blank 'id' {doc_id!r}; every document needs a unique, non-blank id"
        )
    if "contents" in obj:
        contents = obj["contents"]
        if not isinstance(contents, str):
            raise DataFormatError(
                f"{where}: 'contents' must be a str, got {type(contents).__name__}"
            )
    elif "text" in obj:
        title, text = obj.get("title", ""), obj["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise DataFormatError(f"{where}: 'title' and 'text' must be str")
        contents = f"{title}\n{text}"
    else:
        raise DataFormatError(
            f"{where}: missing 'contents' (title line + text), and no 'title'/'text' to build "
            f"it from; keys present: {sorted(obj)}"
        )
    if not contents.strip():
        raise DataFormatError(
            f"{where} (id {str(doc_id)!r}): empty contents; give the passage text, or drop it"
        )
    _check_unicode(contents, "'contents'", where)
    return {"id": str(doc_id), "contents": contents}


def iter_corpus(
    path: str | os.PathLike, batch_size: int = 10_000, *, check_duplicates: bool = True
) -> Iterator[list[dict]]:
    """Stream a FlashRAG ``.jsonl`` (or ``.jsonl.gz``, or ``.parquet`` with the same
    columns, or a ``.tsv`` / ``.tsv.gz`` with a header row naming ``id``, ``text`` and
    ``title``, as DPR ships its passages) corpus in lists of ``batch_size`` docs.

    Each document comes out as ``{"id": str, "contents": str}``: int ids become str, a
    line with ``title`` and ``text`` becomes ``contents = title + "\\n" + text``, other keys
    are dropped, blank lines are skipped.

    Args:
        path: the corpus file.
        batch_size: documents per yielded list.
        check_duplicates: keep every id seen to reject duplicates (a 21 M passage corpus
            costs a few GB of driver memory for this; turn it off once a corpus is known good).

    Raises:
        DataFormatError: invalid JSON, a missing or non-str/int id, missing or empty
            contents, or a duplicate id (both line numbers); the message names ``path:line``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    path = _existing(path, "corpus")
    first_line: dict[str, int] = {}
    batch: list[dict] = []
    parquet = path.suffix == ".parquet"
    if parquet:
        rows = _parquet_rows(path)
    else:
        rows = _tsv_rows(path) if _is_tsv(path) else _json_lines(path)
    for number, obj in rows:
        doc = _corpus_doc(obj, f"{path}: row {number}" if parquet else f"{path}:{number}")
        if check_duplicates:
            seen = first_line.setdefault(doc["id"], number)
            if seen != number:
                raise DataFormatError(
                    f"{path}:{number}: duplicate id {doc['id']!r} (first on line {seen}); "
                    "document ids must be unique"
                )
        batch.append(doc)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def load_corpus(path: str | os.PathLike) -> list[dict]:
    """Read a whole FlashRAG corpus: :func:`iter_corpus` in one list (same checks).

    Raises:
        DataFormatError: as :func:`iter_corpus`, or the file has no document.
    """
    docs = [doc for batch in iter_corpus(path) for doc in batch]
    if not docs:
        raise DataFormatError(f"{path}: the corpus has no documents")
    return docs


# -------------------------------------------------------------------------- questions
def _golds_of(row: Mapping[str, Any], where: str) -> tuple[Any, str]:
    """``golden_answers``, else Search-R1's ``reward_model.ground_truth.target``; and the
    key it came from."""
    if row.get("golden_answers") is not None:
        return row["golden_answers"], "'golden_answers'"
    reward_model = row.get("reward_model")
    if reward_model is None:
        return None, ""
    if not isinstance(reward_model, Mapping):
        raise DataFormatError(
            f"{where}: 'reward_model' must be an object like {{'ground_truth': {{'target': "
            f"[...]}}}}, got {_kind(reward_model)}"
        )
    truth = reward_model.get("ground_truth")
    if isinstance(truth, Mapping):
        return truth.get("target"), "'reward_model.ground_truth.target'"
    return truth, "'reward_model.ground_truth'"


def _kind(value: Any) -> str:
    """A value and its type for an error message: ``5 (int)``."""
    text = repr(value)
    return f"{text if len(text) <= 80 else text[:77] + '...'} ({type(value).__name__})"


def _str_list(row: Mapping[str, Any], key: str, what: str, where: str) -> list[str] | None:
    """``row[key]`` as a list of non-blank str (None when absent)."""
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and v.strip() for v in value
    ):
        raise DataFormatError(
            f"{where}: {key!r} must be a list of str ({what}, none blank), got {_kind(value)}"
        )
    return list(value)


def _stable_id(index: int, question: str) -> str:
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=4).hexdigest()
    return f"row{index}-{digest}"


def _qa_record(row: Mapping[str, Any], *, index: int, where: str, default_source: str) -> dict:
    """One validated question record with exactly the keys :data:`QA_KEYS`."""
    question = row.get("question")
    if question is None:
        raise DataFormatError(f"{where}: missing 'question'; every row needs a non-blank question")
    if not isinstance(question, str):
        raise DataFormatError(
            f"{where}: 'question' must be a str (the question text), got {_kind(question)}"
        )
    if not question.strip():
        raise DataFormatError(
            f"{where}: empty question {question!r}; every row needs a non-blank question"
        )
    _check_unicode(question, "the question", where)
    golds, golds_key = _golds_of(row, where)
    if golds is None:
        raise DataFormatError(
            f"{where}: no gold answers: expected 'golden_answers' (a list of str) or "
            "'reward_model': {'ground_truth': {'target': [...]}}"
        )
    if not isinstance(golds, (str, list, tuple)):
        raise DataFormatError(
            f"{where}: {golds_key} must be a list of str (the accepted answers), got {_kind(golds)}"
        )
    try:
        golds = check_gold_answers(golds, where=where)
    except (TypeError, ValueError) as err:
        raise DataFormatError(str(err)) from None
    for gold in golds:
        _check_unicode(gold, f"the gold answer {gold!r}", where)
    doc_ids = _str_list(row, "supporting_doc_ids", "corpus document ids", where)
    plan = _str_list(row, "reference_plan", "Search-P1's search steps", where)
    row_id = row.get("id")
    if row_id is not None and (
        isinstance(row_id, bool)
        or not isinstance(row_id, (str, int))
        or (isinstance(row_id, str) and not row_id.strip())
    ):
        raise DataFormatError(
            f"{where}: 'id' must be a non-blank str or an int, got {_kind(row_id)}; give "
            "each question a unique id, or leave 'id' out to get row-index ids"
        )
    source = row.get("data_source")
    if source is not None and (not isinstance(source, str) or not source.strip()):
        raise DataFormatError(
            f"{where}: 'data_source' must be a non-blank str (the dataset name, e.g. 'nq'), "
            f"got {_kind(source)}; leave it out to use the file name {default_source!r}"
        )
    prompt = _prompt_of(row, where)
    hops = row.get("hops")
    if isinstance(hops, float) and (math.isnan(hops) or hops.is_integer()):
        # a table's integer column with gaps (pandas): 2.0 is 2 and NaN is no count
        hops = None if math.isnan(hops) else int(hops)
    if hops is not None and (isinstance(hops, bool) or not isinstance(hops, int) or hops < 1):
        raise DataFormatError(
            f"{where}: 'hops' must be a positive int (how many documents the answer needs), "
            f"got {_kind(hops)}"
        )
    return {
        "id": _stable_id(index, question) if row_id is None else str(row_id),
        "question": question,
        "golden_answers": golds,
        "data_source": default_source if source is None else source,
        "supporting_doc_ids": doc_ids,
        "hops": hops,
        "reference_plan": plan,
        "prompt": prompt,
    }


def _prompt_of(row: Mapping[str, Any], where: str) -> list[dict] | None:
    """A row's own ``prompt`` (Search-R1's: chat messages, ``[{"role": "user", "content":
    ...}]``), checked; None when the row has none."""
    prompt = row.get("prompt")
    if prompt is None:
        return None
    shape = (
        "a list of chat messages like [{'role': 'user', 'content': '...'}], as Search-R1's "
        "files hold; or leave the column out (run with --data.prompts template to render "
        "the library's template instead)"
    )
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataFormatError(f"{where}: 'prompt' must be {shape}, got {_kind(prompt)}")
    messages = []
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise DataFormatError(
                f"{where}: 'prompt' message {k} must be an object with 'role' and 'content', "
                f"got {_kind(message)}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in PROMPT_ROLES:
            raise DataFormatError(
                f"{where}: 'prompt' message {k} has role {_kind(role)}; give one of "
                f"{list(PROMPT_ROLES)}"
            )
        if not isinstance(content, str) or not content.strip():
            raise DataFormatError(
                f"{where}: 'prompt' message {k} ({role}) has content {_kind(content)}; give "
                "the message's text, a non-blank str"
            )
        _check_unicode(content, f"'prompt' message {k}", where)
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise DataFormatError(
            f"{where}: 'prompt' ends with a message of role {messages[-1]['role']!r}; the "
            "policy answers the last message, which must be the user's"
        )
    return messages


def _key_mode(
    sources: Sequence[str], raw_ids: Sequence[Any], labels: Sequence[str], name: str
) -> tuple[str, str | None]:
    """How a question file's questions are keyed, and the note that says so (None when
    the file's own ids are kept).

    A file's ids are kept when they are unique (``"id"``). Files merged from several
    datasets repeat each source's own ids (Search-R1's NQ + HotpotQA parquet has
    ``train_0`` once per source): then a question is keyed ``<data_source>/<id>`` when
    those pairs are unique (``"source/id"``), else by its row (``"row"``:
    ``row<index>-<hash of the question>``, as for a file without ids)."""
    first: dict[str, int] = {}
    repeat = None
    for i, raw in enumerate(raw_ids):
        if raw is not None and first.setdefault(str(raw), i) != i:
            repeat = (str(raw), first[str(raw)], i)
            break
    if repeat is None:
        return "id", None
    rid, j, i = repeat
    pairs: dict[tuple[str, str], int] = {}
    for k, raw in enumerate(raw_ids):
        if raw is not None and pairs.setdefault((sources[k], str(raw)), k) != k:
            m = pairs[(sources[k], str(raw))]
            return "row", (
                f"{name}: id {str(raw)!r} of data source {sources[k]!r} repeats "
                f"({labels[m]} and {labels[k]}): questions are keyed by their row instead, "
                "row<index>-<hash of the question> (the same file gives the same keys)"
            )
    return "source/id", (
        f"{name}: ids repeat across data sources ({rid!r} at {labels[j]} and "
        f"{labels[i]}; sources {', '.join(sorted(set(sources)))}): questions are keyed by "
        f"data source and id, e.g. {sources[i] + '/' + rid!r}"
    )


def _key_questions(
    records: Sequence[dict], raw_ids: Sequence[Any], start: int, mode: str
) -> None:
    """Set each record's ``id`` as :func:`_key_mode`'s ``mode`` says (``raw_ids``: the
    file's, in the records' order; ``start``: the first record's row)."""
    if mode == "id":
        return
    for i, (record, raw_id) in enumerate(zip(records, raw_ids, strict=True)):
        if mode == "row" or raw_id is None:
            record["id"] = _stable_id(start + i, record["question"])
        else:
            record["id"] = f"{record['data_source']}/{raw_id}"


def _check_unique_ids(
    records: Sequence[dict], wheres: Sequence[str], labels: Sequence[str], first: dict[str, str]
) -> None:
    """Raise on an id seen before: ``first`` maps each id to the label (``"line 2"``,
    ``"row 0"``) where it first came, and is updated."""
    for record, where, label in zip(records, wheres, labels, strict=True):
        seen = first.setdefault(record["id"], label)
        if seen != label:
            raise DataFormatError(
                f"{where}: duplicate id {record['id']!r} (first at {seen}); question ids "
                "must be unique"
            )


def _qa_columns(names: Sequence[str], path: Path) -> list[str]:
    """The columns to read from a question file; fails when question or golds are absent."""
    if "question" not in names:
        raise DataFormatError(
            f"{path}: no 'question' column (columns: {list(names)}); a question set needs "
            "'question' and 'golden_answers'"
        )
    if "golden_answers" not in names and "reward_model" not in names:
        raise DataFormatError(
            f"{path}: no 'golden_answers' column and no Search-R1 'reward_model' column to read "
            f"them from (columns: {list(names)})"
        )
    return [c for c in (*QA_KEYS, "reward_model") if c in names]


def load_qa(path: str | os.PathLike) -> list[dict]:
    """Read a question set: Search-R1 ``.parquet`` or ``.jsonl`` with the same keys.

    Returns records with the keys :data:`QA_KEYS`. ``golden_answers`` comes from that
    column, or else from ``reward_model.ground_truth.target``. A missing ``data_source``
    becomes the file's stem (``nq_test.parquet`` -> ``"nq_test"``); a missing ``id``
    becomes ``"row<index>-<hash of the question>"``, stable across loads; absent
    ``supporting_doc_ids`` / ``hops`` / ``reference_plan`` (Search-P1's) are ``None``.

    Raises:
        DataFormatError: no question column, a missing, non-str or blank question, no
            golds, golds not a str or list of str, empty or normalizing to ``""`` (see
            :func:`ray_credit.qa.check_gold_answers`), a field of the wrong type (``id``: a
            non-blank str or an int; ``data_source``: a non-blank str;
            ``supporting_doc_ids`` / ``reference_plan``: lists of non-empty str; ``hops``:
            a positive int), a duplicate id, invalid JSON, a ``.parquet`` file that is not
            Parquet, or no question at all; the message names the file and the row
            (parquet, from 0) or line (jsonl).
    """
    path = _existing(path, "question set")
    source = path.name.split(".")[0]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            columns = _qa_columns(pq.read_schema(path).names, path)
            rows = pq.read_table(path, columns=columns).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise DataFormatError(
                f"{path}: not a readable Parquet file ({err}); pass a Parquet file (e.g. "
                "written by pandas.DataFrame.to_parquet) or a question set named .jsonl"
            ) from None
        labels = [f"row {i}" for i in range(len(rows))]
        wheres = [f"{path}, {label}" for label in labels]
        records = [
            _qa_record(row, index=i, where=wheres[i], default_source=source)
            for i, row in enumerate(rows)
        ]
    elif _is_jsonl(path):
        lines = list(_json_lines(path))
        labels = [f"line {number}" for number, _ in lines]
        wheres = [f"{path}:{number}" for number, _ in lines]
        records = [
            _qa_record(obj, index=i, where=wheres[i], default_source=source)
            for i, (_, obj) in enumerate(lines)
        ]
        rows = [obj for _, obj in lines]
    else:
        raise DataFormatError(
            f"{path}: unsupported question file type {path.suffix!r}; use .parquet or .jsonl "
            "(.jsonl.gz)"
        )
    if not records:
        empty = "0 rows" if path.suffix == ".parquet" else "empty or only blank lines"
        raise DataFormatError(
            f"{path}: no questions in the file ({empty}); a question set needs at least one "
            "row with 'question' and 'golden_answers'"
        )
    raw_ids = [row.get("id") for row in rows]
    mode, note = _key_mode([r["data_source"] for r in records], raw_ids, labels, str(path))
    if note is not None:
        log.info(f"note: {note}")
    _key_questions(records, raw_ids, 0, mode)
    _check_unique_ids(records, wheres, labels, {})
    return records


# ----------------------------------------------------------------------------- stream
def prompt_stream(
    path_or_records: str | os.PathLike | Sequence[Mapping[str, Any]],
    *,
    batch_size: int,
    shuffle_seed: int | None = None,
) -> Iterator[list[dict]]:
    """Question records in lists of ``batch_size`` (the last may be shorter), via Ray Data.

    A path (``.parquet`` file or folder, or ``.jsonl``) is read by Ray Data's workers and
    only one batch at a time reaches the driver; on a multi-node cluster it must be
    readable from every node (shared filesystem or cloud URI). A list of records is
    validated in the driver, then handed to ``ray.data.from_items``. Records have the keys
    and checks of :func:`load_qa`. Unshuffled, the order is the file's; with
    ``shuffle_seed``, a full shuffle across blocks, the same for the same seed and data.

    A file without an ``id`` column gets :func:`load_qa`'s row-index ids, which exist only
    in file order: shuffling such a file raises; add ids or pass ``load_qa(path)``.
    Connects to Ray with ``ray.init()`` only if no cluster is connected yet.
    """
    import ray

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not ray.is_initialized():
        ray.init()
    if isinstance(path_or_records, (str, os.PathLike)):
        path = Path(path_or_records)
        source, where = path.name.split(".")[0], str(path)
        if _is_jsonl(path):
            dataset = ray.data.read_json(str(path), lines=True)
        else:
            dataset = ray.data.read_parquet(str(path))
        _qa_columns(dataset.schema().names, path)
        names = dataset.schema().names
        if shuffle_seed is not None and "id" not in names:
            raise DataFormatError(
                f"{path}: no 'id' column, so a shuffled stream cannot give the rows the "
                "row-index ids load_qa would; add an 'id' column, pass load_qa(path) instead "
                "of the path, or stream with shuffle_seed=None"
            )
        mode, note = "id", None
        if "id" in names:  # how load_qa would key them: the id columns alone, read first
            keys = dataset.select_columns([c for c in ("id", "data_source") if c in names])
            keys.context.execution_options.preserve_order = True
            rows = keys.take_all()
            mode, note = _key_mode(
                [r.get("data_source") or source for r in rows],
                [r["id"] for r in rows],
                [f"row {i}" for i in range(len(rows))],
                str(path),
            )
        if mode == "row" and shuffle_seed is not None:
            raise DataFormatError(
                f"{note}; such row keys exist only in file order, so a shuffled stream "
                "cannot give them: pass load_qa(path) instead of the path, or stream with "
                "shuffle_seed=None"
            )
    else:
        rows = list(path_or_records)
        records = [
            _qa_record(row, index=i, where=f"record {i}", default_source="records")
            for i, row in enumerate(rows)
        ]
        labels = [f"record {i}" for i in range(len(records))]
        mode, note = _key_mode(
            [r["data_source"] for r in records], [r.get("id") for r in rows], labels, "records"
        )
        _key_questions(records, [r.get("id") for r in rows], 0, mode)
        mode = "id"  # keyed here, once: the stream below hands them on as they are
        _check_unique_ids(records, labels, labels, {})
        dataset, source, where = ray.data.from_items(records), "records", "record"
    if note is not None:
        log.info(f"note: {note}")
    # A per-dataset copy of the context: file order without touching the global setting.
    dataset.context.execution_options.preserve_order = True
    if shuffle_seed is not None:
        dataset = dataset.random_shuffle(seed=shuffle_seed)
    index, first = 0, {}
    for table in dataset.iter_batches(batch_size=batch_size, batch_format="pyarrow"):
        rows = table.to_pylist()
        labels = [f"row {index + i}" for i in range(len(rows))]
        wheres = [f"{where}, {label}" for label in labels]
        batch = [
            _qa_record(row, index=index + i, where=wheres[i], default_source=source)
            for i, row in enumerate(rows)
        ]
        _key_questions(batch, [r.get("id") for r in rows], index, mode)
        _check_unique_ids(batch, wheres, labels, first)
        yield batch
        index += len(rows)
