"""prompt_stream: Search-R1 question sets streamed through Ray Data on the shared cluster."""

from __future__ import annotations

import pytest

from ray_credit.data import DataFormatError, load_qa, make_world, prompt_stream

# Ray Data's internals warn about deprecated APIs of their dependencies: noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    world = make_world(num_entities=100, num_questions=300, seed=4)
    return world.write(tmp_path_factory.mktemp("world"))["train"]


def _ids(batches):
    return [q["id"] for batch in batches for q in batch]


def test_parquet_stream_yields_every_question_once_in_file_order(ray_cluster, train_file):
    expected = load_qa(train_file)
    batches = list(prompt_stream(train_file, batch_size=64))
    assert [len(b) for b in batches[:-1]] == [64] * (len(batches) - 1)
    assert 0 < len(batches[-1]) <= 64
    assert [q for batch in batches for q in batch] == expected


def test_shuffled_stream_is_a_deterministic_permutation(ray_cluster, train_file):
    expected = _ids([load_qa(train_file)])
    first = _ids(prompt_stream(train_file, batch_size=50, shuffle_seed=7))
    assert sorted(first) == sorted(expected) and len(first) == len(set(first))
    assert first != expected
    assert _ids(prompt_stream(train_file, batch_size=50, shuffle_seed=7)) == first


def test_records_and_jsonl_streams(ray_cluster, tmp_path):
    records = [{"question": f"question {i}?", "golden_answers": [f"answer {i}"]} for i in range(25)]
    batches = list(prompt_stream(records, batch_size=10, shuffle_seed=0))
    assert [len(b) for b in batches] == [10, 10, 5]
    streamed = {q["id"]: q for batch in batches for q in batch}
    assert len(streamed) == 25
    assert all(
        q["golden_answers"] == [q["question"].replace("question", "answer")[:-1]]
        for q in streamed.values()
    )

    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(f'{{"question": "q{i}?", "golden_answers": ["a{i}"]}}\n' for i in range(5))
    )
    assert _ids(prompt_stream(path, batch_size=2)) == [q["id"] for q in load_qa(path)]
    with pytest.raises(DataFormatError, match=r"qa\.jsonl: no 'id' column, so a shuffled stream"):
        next(prompt_stream(path, batch_size=2, shuffle_seed=1))


def test_a_merged_parquet_streams_with_load_qa_s_keys(ray_cluster, tmp_path):
    """Search-R1's NQ + HotpotQA file repeats each source's ids: streamed, shuffled or
    not, its questions get load_qa's data-source keys; ids that repeat within a source
    get row keys, which only an unshuffled stream can give."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"id": f"train_{i}", "question": f"{s} q{i}?", "golden_answers": ["Oslo"], "data_source": s}
        for s in ("nq", "hotpotqa")
        for i in range(4)
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    expected = _ids([load_qa(path)])
    assert expected[:2] == ["nq/train_0", "nq/train_1"] and expected[4] == "hotpotqa/train_0"
    assert _ids(prompt_stream(path, batch_size=3)) == expected
    assert sorted(_ids(prompt_stream(path, batch_size=3, shuffle_seed=2))) == sorted(expected)
    pq.write_table(pa.Table.from_pylist(rows + rows[:1]), path)
    expected = _ids([load_qa(path)])
    assert expected[0].startswith("row0-") and _ids(prompt_stream(path, batch_size=3)) == expected
    with pytest.raises(DataFormatError, match=r"repeats \(row 0 and row 8\).*shuffled stream"):
        next(prompt_stream(path, batch_size=3, shuffle_seed=1))
