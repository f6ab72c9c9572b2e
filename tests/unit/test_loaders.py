"""Corpus and question-set loaders: the formats they accept and every error they report."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_credit.data import (
    QA_KEYS,
    DataFormatError,
    iter_corpus,
    load_corpus,
    load_qa,
    make_world,
)


def _jsonl(path, lines):
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


# ---------------------------------------------------------------------------- corpus
def test_world_round_trips_through_files(tmp_path):
    world = make_world(num_entities=60, num_questions=100, seed=2)
    paths = world.write(tmp_path / "world")
    assert sorted(paths) == ["corpus", "test", "train"]
    assert load_corpus(paths["corpus"]) == world.corpus
    train, test = world.split()
    assert load_qa(paths["train"]) == [{**q, "prompt": None} for q in train]
    assert load_qa(paths["test"]) == [{**q, "prompt": None} for q in test]
    assert pq.read_schema(paths["train"]).names == [k for k in QA_KEYS if k != "prompt"]


def test_corpus_accepts_title_text_int_ids_blank_lines_and_gzip(tmp_path):
    lines = [
        {"id": 7, "contents": "Alpha\nfirst doc"},
        "   ",
        {"id": "b", "title": "Beta", "text": "second doc", "extra": 1},
    ]
    expected = [
        {"id": "7", "contents": "Alpha\nfirst doc"},
        {"id": "b", "contents": "Beta\nsecond doc"},
    ]
    assert load_corpus(_jsonl(tmp_path / "c.jsonl", lines)) == expected
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "c.jsonl").read_bytes()))
    assert load_corpus(gz) == expected


def test_iter_corpus_streams_in_batches(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"id": i, "contents": f"T{i}\nx"} for i in range(7)])
    batches = list(iter_corpus(path, batch_size=3))
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [d["id"] for b in batches for d in b] == [str(i) for i in range(7)]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(iter_corpus(path, batch_size=0))


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "x", "contents": ', r"c\.jsonl:3: invalid JSON"),
        (
            "[1, 2]",
            r"c\.jsonl:3: expected a JSON object \(\{\.\.\.\}\), got \[1, 2\] \(list\); "
            "each line of a JSON lines file is one object",
        ),
        (
            '{"id": "x", "contents": "T\\nfirst", "contents": "T\\nsecond"}',
            r"c\.jsonl:3: the key "
            "'contents' appears twice in one object, and JSON keeps only the last; keep the one",
        ),
        ({"contents": "T\ntext"}, r"c\.jsonl:3: missing 'id'"),
        ({"id": 1.5, "contents": "T\ntext"}, r"c\.jsonl:3: 'id' must be a str or int"),
        (
            {"id": "x", "body": "T"},
            r"c\.jsonl:3: missing 'contents'.*keys present: \['body', 'id'\]",
        ),
        ({"id": "x", "contents": " \n "}, r"c\.jsonl:3 \(id 'x'\): empty contents"),
        ({"id": "x", "title": "", "text": ""}, r"c\.jsonl:3 \(id 'x'\): empty contents"),
        ({"id": "x", "contents": ["T"]}, r"c\.jsonl:3: 'contents' must be a str, got list"),
        ({"id": "1", "contents": "T\ndup"}, r"c\.jsonl:3: duplicate id '1' \(first on line 2\)"),
        ({"id": "", "contents": "T\ntext"}, r"c\.jsonl:3: blank 'id' ''; every document"),
        ({"id": "  ", "contents": "T\ntext"}, r"c\.jsonl:3: blank 'id' '  '; every document"),
    ],
)
def test_corpus_errors_name_file_line_and_problem(tmp_path, bad_line, message):
    lines = [{"id": "0", "contents": "A\na"}, {"id": 1, "contents": "B\nb"}, bad_line]
    path = _jsonl(tmp_path / "c.jsonl", lines)
    with pytest.raises(DataFormatError, match=message):
        load_corpus(path)


def test_corpus_file_problems(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus file .*missing.jsonl"):
        load_corpus(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="empty.jsonl: the corpus has no documents"):
        load_corpus(tmp_path / "empty.jsonl")
    dup = _jsonl(tmp_path / "d.jsonl", [{"id": "a", "contents": "A"}] * 2)
    assert len([d for b in iter_corpus(dup, check_duplicates=False) for d in b]) == 2


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    """Not a bare UnicodeDecodeError: the file, the line, the byte and how to convert it,
    for the corpus and the question set alike, plain or gzipped."""
    good = json.dumps({"id": "1", "contents": "Paris\nA city."}).encode() + b"\n"
    bad = '{"id": "2", "contents": "Caf\u00e9\\nA place."}\n'.encode("latin-1")
    (tmp_path / "c.jsonl").write_bytes(good + bad)
    with pytest.raises(DataFormatError, match=r"c\.jsonl:2: not UTF-8 \(byte 0xe9 at column 29\)"):
        load_corpus(tmp_path / "c.jsonl")
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(good + bad)
    with pytest.raises(DataFormatError, match=r"c\.jsonl\.gz:2: not UTF-8.*iconv"):
        load_corpus(tmp_path / "c.jsonl.gz")
    (tmp_path / "q.jsonl").write_bytes(
        '{"question": "Qui\u00e9n?", "golden_answers": ["a"]}\n'.encode("cp1252")
    )
    with pytest.raises(DataFormatError, match=r"q\.jsonl:1: not UTF-8"):
        load_qa(tmp_path / "q.jsonl")


def test_bom_bare_cr_and_misnamed_or_damaged_gzip(tmp_path):
    line = json.dumps({"id": "1", "contents": "Paris\nA city."}).encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + line + b"\n")
    (tmp_path / "cr.jsonl").write_bytes(line + b"\r" + line.replace(b'"1"', b'"2"') + b"\r")
    assert [len(load_corpus(tmp_path / n)) for n in ("bom.jsonl", "cr.jsonl")] == [1, 2]
    (tmp_path / "z.jsonl").write_bytes(gzip.compress(line))
    with pytest.raises(
        DataFormatError, match="gzip-compressed data in a file not named .gz; rename"
    ):
        load_corpus(tmp_path / "z.jsonl")
    (tmp_path / "not.jsonl.gz").write_bytes(line)
    with pytest.raises(DataFormatError, match="named .gz but not gzip data"):
        load_corpus(tmp_path / "not.jsonl.gz")
    many = b"".join(line.replace(b'"1"', f'"{i}"'.encode()) + b"\n" for i in range(3000))
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(many)[:2000])
    with pytest.raises(
        DataFormatError, match=r"cut\.jsonl\.gz: the gzip data is damaged or cut off"
    ):
        load_corpus(tmp_path / "cut.jsonl.gz")
    (tmp_path / "u16.jsonl").write_bytes(line.decode().encode("utf-16"))
    with pytest.raises(DataFormatError, match="UTF-16 text; save it as UTF-8"):
        load_corpus(tmp_path / "u16.jsonl")


# -------------------------------------------------------------------------- questions
def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_search_r1_parquet_with_nested_golds_and_no_ids(tmp_path):
    # The layout of Search-R1's processed nq/hotpotqa files (verl style), without ids.
    rows = [
        {
            "data_source": "nq",
            "question": "who wrote the book?",
            "prompt": [{"role": "user", "content": "..."}],
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Ann Lee", "Lee"]}},
        },
        {
            "data_source": "hotpotqa",
            "question": "which city?",
            "prompt": [{"role": "user", "content": "..."}],
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Oslo"]}},
        },
    ]
    path = _parquet(tmp_path / "nq_train.parquet", rows)
    records = load_qa(path)
    assert [r["golden_answers"] for r in records] == [["Ann Lee", "Lee"], ["Oslo"]]
    assert [r["data_source"] for r in records] == ["nq", "hotpotqa"]
    assert all(set(r) == set(QA_KEYS) for r in records)
    assert records[0]["supporting_doc_ids"] is None and records[0]["hops"] is None
    ids = [r["id"] for r in records]
    assert ids[0].startswith("row0-") and ids[1].startswith("row1-") and ids[0] != ids[1]
    assert [r["id"] for r in load_qa(path)] == ids  # stable across loads
    rows[0]["question"] = "who wrote the other book?"
    assert load_qa(_parquet(path, rows))[0]["id"] != ids[0]  # the text is part of the id


def test_golden_answers_column_wins_and_source_defaults_to_file_stem(tmp_path):
    rows = [{"id": 5, "question": "q?", "golden_answers": ["a1"], "reward_model": None}]
    (record,) = load_qa(_parquet(tmp_path / "my_set.parquet", rows))
    assert record == {
        "id": "5",
        "question": "q?",
        "golden_answers": ["a1"],
        "data_source": "my_set",
        "supporting_doc_ids": None,
        "hops": None,
        "reference_plan": None,
        "prompt": None,
    }


def test_jsonl_question_set(tmp_path):
    lines = [
        {"question": "q1?", "golden_answers": "one", "supporting_doc_ids": ["3"], "hops": 1},
        "",
        {"id": "b", "question": "q2?", "golden_answers": ["two", "2"], "data_source": "x"},
    ]
    records = load_qa(_jsonl(tmp_path / "qa.jsonl", lines))
    assert records[0]["golden_answers"] == ["one"] and records[0]["supporting_doc_ids"] == ["3"]
    assert records[0]["id"].startswith("row0-") and records[0]["data_source"] == "qa"
    assert records[1]["id"] == "b" and records[1]["golden_answers"] == ["two", "2"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "  ", "golden_answers": ["ok"]}, r"row 1: empty question '  '"),
        ({"question": None, "golden_answers": ["ok"]}, r"row 1: missing 'question'"),
        ({"question": "q?", "golden_answers": []}, r"row 1: gold_answers is empty"),
        ({"question": "q?", "golden_answers": ["The"]}, r"row 1: gold answer 'The' normalizes"),
        ({"question": "q?", "golden_answers": None}, r"row 1: no gold answers"),
        (
            {"question": "q?", "golden_answers": ["ok"], "supporting_doc_ids": [1]},
            r"row 1: 'supporting_doc_ids' must be a list of str",
        ),
    ],
)
def test_qa_row_errors_name_file_row_and_problem(tmp_path, row, message):
    good = {"question": "fine?", "golden_answers": ["yes"], "supporting_doc_ids": None}
    row = {**good, **row}
    path = _parquet(tmp_path / "set.parquet", [good, row])
    with pytest.raises(DataFormatError, match=r"set\.parquet, " + message):
        load_qa(path)
    jsonl = _jsonl(tmp_path / "set.jsonl", [good, row])
    with pytest.raises(DataFormatError, match=r"set\.jsonl:2: " + message.split(": ", 1)[1]):
        load_qa(jsonl)


def test_qa_file_errors(tmp_path):
    path = _parquet(tmp_path / "noq.parquet", [{"query": "q?", "golden_answers": ["ok"]}])
    with pytest.raises(DataFormatError, match=r"noq\.parquet: no 'question' column \(columns: \["):
        load_qa(path)
    path = _parquet(tmp_path / "nog.parquet", [{"question": "q?", "answer": "a"}])
    with pytest.raises(DataFormatError, match=r"nog\.parquet: no 'golden_answers' column"):
        load_qa(path)
    (tmp_path / "qa.csv").write_text("question,answer\n")
    with pytest.raises(DataFormatError, match=r"unsupported question file type '\.csv'"):
        load_qa(tmp_path / "qa.csv")
    _jsonl(tmp_path / "bad.jsonl", [{"question": "q?", "golden_answers": ["ok"]}, "{oops"])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: invalid JSON"):
        load_qa(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="question set file"):
        load_qa(tmp_path / "nope.parquet")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": 5}, r"'question' must be a str \(the question text\), got 5 \(int\)"),
        ({"question": ["who?"]}, r"'question' must be a str .*got \['who\?'\] \(list\)"),
        ({"supporting_doc_ids": 5}, r"'supporting_doc_ids' must be a list of str .*got 5 \(int\)"),
        ({"supporting_doc_ids": {"d1": 1}}, r"'supporting_doc_ids' must be a list of str .*dict"),
        ({"supporting_doc_ids": [""]}, r"'supporting_doc_ids' must be a list of str .*none blank"),
        ({"reference_plan": 5}, r"'reference_plan' must be a list of str .*got 5 \(int\)"),
        ({"golden_answers": {"Bob": 1}}, r"'golden_answers' must be a list of str .*\(dict\)"),
        (
            {"golden_answers": None, "reward_model": [1]},
            r"'reward_model' must be an object like .*got \[1\] \(list\)",
        ),
        (
            {"golden_answers": None, "reward_model": {"ground_truth": {"target": 5}}},
            r"'reward_model\.ground_truth\.target' must be a list of str .*got 5 \(int\)",
        ),
        ({"id": ""}, r"'id' must be a non-blank str or an int, got '' \(str\)"),
        ({"id": True}, r"'id' must be a non-blank str or an int, got True \(bool\)"),
        ({"id": 1.5}, r"'id' must be a non-blank str or an int, got 1\.5 \(float\)"),
        ({"data_source": 5}, r"'data_source' must be a non-blank str .*got 5 \(int\)"),
        ({"data_source": " "}, r"'data_source' must be a non-blank str .*file name 'set'"),
        ({"hops": "two"}, r"'hops' must be a positive int .*got 'two' \(str\)"),
        ({"hops": 0}, r"'hops' must be a positive int .*got 0 \(int\)"),
        ({"hops": True}, r"'hops' must be a positive int .*got True \(bool\)"),
        ({"hops": 1.5}, r"'hops' must be a positive int .*got 1\.5 \(float\)"),
    ],
)
def test_qa_fields_of_the_wrong_type_name_file_line_and_field(tmp_path, row, message):
    """Not a bare TypeError / AttributeError, and nothing taken silently (a dict's keys as
    golds, ``True`` as the id ``'True'``, an int data_source)."""
    good = {"question": "fine?", "golden_answers": ["Bob"]}
    path = _jsonl(tmp_path / "set.jsonl", [good, {**good, **row}])
    with pytest.raises(DataFormatError, match=r"set\.jsonl:2: " + message):
        load_qa(path)


def test_hop_counts_written_by_pandas_with_gaps_are_counts(tmp_path):
    """A table's int column with a missing value is float64 (pandas writes [2, None] as
    2.0 and null): 2.0 is 2 hops, and null or NaN no count, not an error."""
    import pyarrow as pa

    path = tmp_path / "set.parquet"
    table = pa.table(
        {
            "question": ["a?", "b?", "c?"],
            "golden_answers": [["x"], ["y"], ["z"]],
            "hops": pa.array([2.0, None, float("nan")], pa.float64()),
        }
    )
    pq.write_table(table, path)
    assert [q["hops"] for q in load_qa(path)] == [2, None, None]


def _search_r1_row(source, i, question, answers):
    """A row as Search-R1's qa_search_train_merge.py writes it: FlashRAG's columns (its
    per-source ``id``), and verl's (prompt, ability, reward_model, extra_info)."""
    return {
        "id": f"train_{i}",
        "question": question,
        "golden_answers": answers,
        "data_source": source,
        "prompt": [
            {"role": "user", "content": f"Answer the given question. Question: {question}\n"}
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": i},
    }


def test_a_merged_search_r1_parquet_is_keyed_by_source_and_id_said_once(tmp_path, caplog):
    rows = [_search_r1_row("nq", i, f"nq question {i}?", ["Oslo"]) for i in range(3)]
    rows += [_search_r1_row("hotpotqa", i, f"hotpot question {i}?", ["Bergen"]) for i in range(2)]
    path = _parquet(tmp_path / "train.parquet", rows)
    with caplog.at_level("INFO", logger="ray_credit"):
        records = load_qa(path)
    assert [r["id"] for r in records] == [
        "nq/train_0", "nq/train_1", "nq/train_2", "hotpotqa/train_0", "hotpotqa/train_1"
    ]  # fmt: skip
    notes = [r.message for r in caplog.records if "keyed" in r.message]
    assert len(notes) == 1
    assert "ids repeat across data sources ('train_0' at row 0 and row 3" in notes[0]
    assert "keyed by data source and id, e.g. 'hotpotqa/train_0'" in notes[0]
    assert records[3]["prompt"] == [
        {"role": "user", "content": "Answer the given question. Question: hotpot question 0?\n"}
    ]
    assert records[3]["golden_answers"] == ["Bergen"] and set(records[0]) == set(QA_KEYS)
    caplog.clear()
    with caplog.at_level("INFO", logger="ray_credit"):  # unique ids: kept, nothing said
        assert [r["id"] for r in load_qa(_parquet(tmp_path / "nq.parquet", rows[:3]))] == [
            "train_0", "train_1", "train_2"
        ]  # fmt: skip
    assert not [r for r in caplog.records if "keyed" in r.message]


def test_ids_repeating_within_a_source_key_questions_by_row(tmp_path, caplog):
    rows = [{"id": i, "question": f"q{i}?", "golden_answers": ["Oslo"]} for i in ("a", "b", "a")]
    for path in (_jsonl(tmp_path / "set.jsonl", rows), _parquet(tmp_path / "set.parquet", rows)):
        caplog.clear()
        with caplog.at_level("INFO", logger="ray_credit"):
            records = load_qa(path)
        ids = [r["id"] for r in records]
        assert [i.split("-")[0] for i in ids] == ["row0", "row1", "row2"]
        (note,) = [r.message for r in caplog.records if "keyed" in r.message]
        assert ids == [r["id"] for r in load_qa(path)]  # stable
        first, second = ("line 1", "line 3") if path.suffix == ".jsonl" else ("row 0", "row 2")
        assert f"id 'a' of data source 'set' repeats ({first} and {second})" in note
    rows = [{"id": 1, "question": "q?", "golden_answers": ["Oslo"]}, {**rows[0], "id": "1"}]
    assert [r["id"][:5] for r in load_qa(_jsonl(tmp_path / "set.jsonl", rows))] == [
        "row0-", "row1-"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("Answer: q?", r"'prompt' must be a list of chat messages like"),
        ([], r"'prompt' must be a list of chat messages"),
        (["q?"], r"'prompt' message 0 must be an object with 'role' and 'content'"),
        ([{"role": "human", "content": "q?"}], r"'prompt' message 0 has role 'human'"),
        ([{"role": "user", "content": " "}], r"'prompt' message 0 \(user\) has content ' '"),
        ([{"role": "user"}], r"'prompt' message 0 \(user\) has content None"),
        (
            [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}],
            r"'prompt' ends with a message of role 'assistant'; the policy answers the last",
        ),
    ],
)
def test_a_malformed_prompt_column_is_refused_with_its_line(tmp_path, prompt, message):
    rows = [
        {"question": "q?", "golden_answers": ["Oslo"]},
        {"question": "r?", "golden_answers": ["Bergen"], "prompt": prompt},
    ]
    with pytest.raises(DataFormatError, match=r"p\.jsonl:2: " + message):
        load_qa(_jsonl(tmp_path / "p.jsonl", rows))


def test_a_question_set_without_questions_says_so(tmp_path):
    """Not ``[]``, which a pipeline would blame on its eval_questions setting."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    for name in ("empty.jsonl", "blank.jsonl"):
        with pytest.raises(DataFormatError, match=name + r": no questions in the file \(empty"):
            load_qa(tmp_path / name)
    schema = pa.schema([("question", pa.string()), ("golden_answers", pa.list_(pa.string()))])
    pq.write_table(schema.empty_table(), tmp_path / "none.parquet")
    with pytest.raises(
        DataFormatError, match=r"none\.parquet: no questions in the file \(0 rows\)"
    ):
        load_qa(tmp_path / "none.parquet")


def test_a_parquet_name_on_other_data_names_the_file(tmp_path):
    (tmp_path / "x.parquet").write_text('{"question": "q?", "golden_answers": ["a"]}\n')
    (tmp_path / "zero.parquet").write_bytes(b"")
    for name in ("x.parquet", "zero.parquet"):
        with pytest.raises(
            DataFormatError, match=name + r": not a readable Parquet file \(.*\.jsonl"
        ):
            load_qa(tmp_path / name)


def test_a_lone_surrogate_in_a_question_gold_or_document_names_its_line(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        '{"question": "fine?", "golden_answers": ["x"]}\n'
        '{"question": "who \\udcff founded it?", "golden_answers": ["x"]}\n'
    )
    with pytest.raises(DataFormatError, match=r"q.jsonl:2: the question holds '\\udcff'"):
        load_qa(questions)
    questions.write_text('{"question": "fine?", "golden_answers": ["\\ud800"]}\n')
    with pytest.raises(DataFormatError, match=r"q.jsonl:1: the gold answer .*lone surrogate"):
        load_qa(questions)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "contents": "Title\\nbad \\udcff text"}\n')
    with pytest.raises(DataFormatError, match=r"c.jsonl:1: 'contents' holds"):
        load_corpus(corpus)
