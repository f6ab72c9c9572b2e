import io

import numpy as np
import pyarrow as pa
import pytest

from ray_credit.batch import COLUMNS, BatchValidationError, TrajectoryBatch
from ray_credit.testing import make_batch, random_batch


def record(traj_id="t0", group_id="g0", turns=2, **extra):
    rec = {
        "group_id": group_id,
        "traj_id": traj_id,
        "question": "Who founded Velmora?",
        "gold_answers": ["Ada Quill"],
        "turns": [
            {"text": f"turn {k}", "action": "search", "policy_version": 3} for k in range(turns - 1)
        ]
        + [{"text": "answer", "action": "answer", "policy_version": 3}],
        "outcome_reward": 1.0,
    }
    rec.update(extra)
    return rec


def with_tokens(rec, prompt=3, per_turn=(2, 1)):
    """Token columns for a record: prompt tokens, then per turn: generated + observation ids."""
    ids, mask, turn, logp = list(range(prompt)), [0] * prompt, [-1] * prompt, [0.0] * prompt
    for k, _ in enumerate(rec["turns"]):
        gen, obs = per_turn
        ids += [100 + k] * (gen + obs)
        mask += [1] * gen + [0] * obs
        turn += [k] * (gen + obs)
        logp += [-0.5] * gen + [0.0] * obs
    return {
        **rec,
        "input_ids": ids,
        "loss_mask": mask,
        "token_turn": turn,
        "behavior_logprobs": logp,
    }


def test_schema_documents_every_column():
    for name, spec in COLUMNS.items():
        assert spec.doc and spec.align in {"traj", "turn", "token"}, name
        if spec.align != "traj":
            assert pa.types.is_list(spec.type), name


@pytest.mark.parametrize(
    "records, message",
    [
        (
            [{**record(), "turns": [{"text": "x", "acton": "search"}]}],
            "record 0: turn 0 has the field 'acton' (did you mean 'action'?)",
        ),
        ([record(gold_answers="Bob")], "column 'gold_answers' is a list (list<item: string>), "
         "got the string 'Bob'; wrap it in a list: ['Bob']"),
        ([record(), tuple(record().items())], "record 1 is a tuple, not a dict"),
        ([{**record(), "turns": ["search Velmora"]}], "record 0: turn 0 is a str, not a dict"),
        (record(), "got one dict; wrap it in a list"),
        ([{**record(), "turns": {"text": "x"}}], "column 'turns' is a list (list<item: struct"),
        ([record(turn_doc_ids=["d1", "d2"])], "column 'turn_doc_ids' holds one list per turn "
         "(list<item: list<item: string>>); turn 0 has the string 'd1': wrap it in a list"),
    ],
)  # fmt: skip
def test_from_records_refuses_what_arrow_would_take_wrongly(records, message):
    """A typo in a turn field, a string for a list, records that are not dicts: Arrow
    would build each silently (null fields, ['B', 'o', 'b'], an AttributeError inside)."""
    with pytest.raises(BatchValidationError) as err:
        TrajectoryBatch.from_records(records)
    assert message in str(err.value)


def test_records_round_trip_and_types():
    recs = [record("t0"), record("t1", turns=3, answer="Ada Quill")]
    batch = TrajectoryBatch.from_records(recs)
    assert batch.table.schema.field("outcome_reward").type == pa.float64()
    assert batch.table.schema.field("turns").type == COLUMNS["turns"].type
    out = batch.to_records()
    assert out[1]["answer"] == "Ada Quill" and out[0]["answer"] is None
    assert [t["action"] for t in out[1]["turns"]] == ["search", "search", "answer"]
    assert out[0]["turns"][0]["query"] is None  # omitted struct fields become null


@pytest.mark.parametrize("fmt", ["ipc", "parquet"])
def test_serialization_round_trip_keeps_data_and_metrics(tmp_path, fmt):
    batch = random_batch(1, num_groups=5).with_metrics({"judge/failures": 2})
    if fmt == "ipc":
        back = TrajectoryBatch.from_ipc(batch.to_ipc())
    else:
        path = tmp_path / "b.parquet"
        batch.write_parquet(path)
        back = TrajectoryBatch.read_parquet(path)
    assert back.table.equals(batch.table)
    assert back.metrics == {"judge/failures": 2.0}


def test_pickle_goes_through_ipc():
    import pickle

    batch = random_batch(2, num_groups=3)
    back = pickle.loads(pickle.dumps(batch))
    assert back.table.equals(batch.table)


def test_flat_views_are_zero_copy_and_indexed():
    batch = make_batch(
        [
            {"group": "a", "turns": 3, "turn_info_gain": [0.1, 0.2, 0.3]},
            {"group": "b", "turns": 1, "turn_info_gain": [0.4]},
            {"group": "a", "turns": 2, "turn_info_gain": [0.5, 0.6]},
        ]
    )
    np.testing.assert_array_equal(batch.turn_offsets, [0, 3, 4, 6])
    np.testing.assert_array_equal(batch.turn_traj_index, [0, 0, 0, 1, 2, 2])
    np.testing.assert_array_equal(batch.turn_position, [0, 1, 2, 0, 0, 1])
    np.testing.assert_array_equal(batch.is_last_turn, [0, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(batch.group_index, [0, 1, 0])
    values = batch.turn_values("turn_info_gain")
    np.testing.assert_allclose(values, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], rtol=1e-6)
    buffer_address = batch.table.column("turn_info_gain").chunk(0).values.buffers()[1].address
    assert values.ctypes.data == buffer_address  # a view, not a copy
    assert list(batch.turn_values("turns.action")) == [
        "search",
        "search",
        "answer",
        "answer",
        "search",
        "answer",
    ]


def test_trajectory_views_with_nulls():
    batch = make_batch([{"sp1_planner_score": 1.2}, {"sp1_planner_score": None}])
    np.testing.assert_array_equal(batch.traj_valid("sp1_planner_score"), [True, False])
    np.testing.assert_allclose(
        batch.traj_values("sp1_planner_score", null=-1), [1.2, -1], rtol=1e-6
    )
    with pytest.raises(BatchValidationError, match="null"):
        batch.traj_values("sp1_planner_score")


def test_nulls_need_an_explicit_fill():
    batch = make_batch([{"turns": 2, "judge_utility": [1, None]}])
    with pytest.raises(BatchValidationError, match="null"):
        batch.turn_values("judge_utility")
    np.testing.assert_array_equal(batch.turn_values("judge_utility", null=-1), [1, -1])
    np.testing.assert_array_equal(batch.turn_valid("judge_utility"), [True, False])


def test_with_turn_columns_does_not_touch_input():
    batch = make_batch([{"turns": 2}, {"turns": 1}])
    before = batch.table
    out = batch.with_turn_columns({"turn_advantages": np.array([1.0, 2.0, 3.0])}, metrics={"x": 1})
    assert "turn_advantages" not in batch and batch.table is before and batch.metrics == {}
    assert out.table.column("turn_advantages").to_pylist() == [[1.0, 2.0], [3.0]]
    assert out.table.schema.field("turn_advantages").type == pa.list_(pa.float32())
    assert out.metrics == {"x": 1.0}
    with pytest.raises(BatchValidationError, match="one value per turn"):
        batch.with_turn_columns({"turn_advantages": np.zeros(2)})


def test_to_torch_expands_turn_advantages_through_token_turn():
    torch = pytest.importorskip("torch")
    recs = [with_tokens(record("t0", turns=2)), with_tokens(record("t1", turns=1), prompt=2)]
    batch = TrajectoryBatch.from_records(recs)
    batch = batch.with_turn_columns(
        {
            "turn_advantages": np.array([0.5, -1.0, 2.0]),
            "turn_clip_scale": np.array([1.1, 0.9, 1.2]),
        }
    )
    t = batch.to_torch(pad_token_id=-7)
    assert t["input_ids"].shape == (2, 9) and t["input_ids"].dtype == torch.int64
    assert t["input_ids"][1, 5:].tolist() == [-7] * 4
    assert t["attention_mask"].sum(1).tolist() == [9, 5]
    assert t["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 0]
    assert t["advantages"][0].tolist() == [0, 0, 0, 0.5, 0.5, 0.5, -1, -1, -1]
    assert t["advantages"][1].tolist() == [0, 0, 2, 2, 2, 0, 0, 0, 0]
    assert t["clip_scale"][1].tolist() == pytest.approx([1, 1, 1.2, 1.2, 1.2, 1, 1, 1, 1])
    assert t["token_turn"][1].tolist() == [-1, -1, 0, 0, 0, -1, -1, -1, -1]
    assert t["behavior_logprobs"][0, 3].item() == -0.5


# ---------------------------------------------------------------------- validation errors
def bad(recs, match):
    with pytest.raises(BatchValidationError, match=match):
        TrajectoryBatch.from_records(recs)


def test_missing_required_column_is_named():
    rec = record()
    del rec["outcome_reward"]
    bad([rec], r"missing required column\(s\) \['outcome_reward'\]")


def test_ragged_turn_column_names_row_and_column():
    bad(
        [record("t0", turn_contains_gold=[True, False]), record("t1", turn_contains_gold=[True])],
        r"row 1 \(traj_id='t1'\).*'turn_contains_gold' has 1 entries.*2 turns",
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_reward(value):
    bad(
        [record("t0"), record("t1", outcome_reward=value)], r"row 1 .*'outcome_reward' is (nan|inf)"
    )


def test_non_finite_info_gain_must_be_null():
    bad([record(turn_info_gain=[float("nan"), None])], "store a missing gain as null")


def test_empty_group_id_and_empty_trajectory():
    bad([record(group_id="")], "'group_id' is null or empty")
    rec = record()
    rec["turns"] = []
    bad([rec], "'turns' is empty")


def test_duplicate_traj_id():
    bad([record("t0"), record("t0")], "traj_id 't0' appears 2 times")


@pytest.mark.parametrize("gold", ["The", "  a ", "!!!"])
def test_gold_normalizing_to_empty_is_rejected(gold):
    bad(
        [record("t0"), record("t1", gold_answers=["ok", gold])],
        rf"row 1 .*gold answer {gold!r} normalizes to the empty string",
    )


def test_null_turn_list_is_named():
    bad([record("t0"), record("t1", judge_utility=[1, 0])], r"row 0 .*'judge_utility' is null")


def test_no_gold_answers():
    bad([record(gold_answers=[])], "'gold_answers' is empty")


def test_token_columns_of_unequal_length():
    rec = with_tokens(record())
    rec["loss_mask"] = rec["loss_mask"][:-1]
    bad([rec], r"'loss_mask' has 8 entries but 'input_ids' has 9")


def test_partial_token_columns_and_bad_token_turn():
    rec = with_tokens(record())
    del rec["behavior_logprobs"]
    bad([rec], "give all four or none")
    rec = with_tokens(record())
    rec["token_turn"][-1] = 5
    bad([rec], r"token_turn 5 .* outside \[-1, 1\]")
    rec = with_tokens(record())
    rec["loss_mask"][0] = 1
    bad([rec], "only turn tokens")


def test_unknown_action_and_wrong_type():
    rec = record()
    rec["turns"][0]["action"] = "browse"
    bad([rec], "action 'browse' is not one of")
    bad([record(outcome_reward="high")], "column 'outcome_reward' cannot be built")


def test_from_table_casts_and_require_names_producer():
    table = pa.table(
        {
            "group_id": ["g"],
            "traj_id": ["t"],
            "question": ["q"],
            "gold_answers": [["x"]],
            "turns": [[{"action": "answer"}]],
            "outcome_reward": pa.array([1], pa.int64()),
        }
    )
    batch = TrajectoryBatch.from_table(table)
    assert batch.table.schema.field("outcome_reward").type == pa.float64()
    with pytest.raises(BatchValidationError, match="InfoGainScorer"):
        batch.require(["turn_info_gain"], by="igpo")


def test_group_id_is_dictionary_encoded_and_reencoded_on_the_way_in():
    groups = pa.DictionaryArray.from_arrays(
        pa.array([0, 1, 2, 0], pa.int8()), pa.array(["a", "b", "a"])
    )
    table = pa.table(
        {
            "group_id": groups,
            "traj_id": ["t0", "t1", "t2", "t3"],
            "question": ["q"] * 4,
            "gold_answers": [["x"]] * 4,
            "turns": [[{"action": "answer"}]] * 4,
            "outcome_reward": [1.0, 0, 1, 0],
        }
    )
    batch = TrajectoryBatch.from_table(table)  # "a" had two codes; now one
    assert batch.table.schema.field("group_id").type == COLUMNS["group_id"].type
    np.testing.assert_array_equal(batch.group_index, [0, 1, 0, 0])
    assert batch.group_order is not None  # group "a" is not one contiguous run
    np.testing.assert_array_equal(batch.group_sizes, [3, 1])
    with pytest.raises(BatchValidationError, match="dictionary repeats a value"):
        TrajectoryBatch(
            batch.table.set_column(0, "group_id", groups.cast(COLUMNS["group_id"].type))
        )
    assert [r["group_id"] for r in batch.to_records()] == ["a", "b", "a", "a"]


def test_group_layout_after_select_numbers_groups_by_first_appearance():
    batch = make_batch([{"group": g} for g in ["x", "x", "y", "y", "z"]])
    picked = batch.select([4, 2, 0, 3, 1])  # z y x y x
    np.testing.assert_array_equal(picked.group_index, [0, 1, 2, 1, 2])
    np.testing.assert_array_equal(picked.group_sizes, [1, 2, 2])
    np.testing.assert_array_equal(picked.group_order, [0, 1, 3, 2, 4])


def test_empty_batch_is_rejected():
    table = TrajectoryBatch.from_records([record()]).table.slice(0, 0)
    with pytest.raises(BatchValidationError, match="no rows"):
        TrajectoryBatch(table)


def test_concat_and_select():
    a, b = random_batch(3, num_groups=2), random_batch(4, num_groups=2)
    b = TrajectoryBatch.from_table(
        b.table.set_column(1, "traj_id", pa.array([f"b{i}" for i in range(len(b))]))
    )
    both = TrajectoryBatch.concat([a, b])
    assert len(both) == len(a) + len(b)
    picked = both.select([len(a), 0])
    assert picked.to_records()[0]["traj_id"] == "b0"
    assert io  # parquet accepts file objects too


@pytest.mark.parametrize("start", [0, 3, 8, 11])
def test_bitmap_readers_match_arrow_on_sliced_arrays_with_nulls(start):
    from ray_credit.batch import bool_values, numeric_view, valid_mask

    rng = np.random.default_rng(start)
    raw = [None if rng.random() < 0.3 else bool(rng.random() < 0.5) for _ in range(40)]
    array = pa.array(raw).slice(start, 21)
    expected = array.to_pylist()
    assert valid_mask(array).tolist() == [v is not None for v in expected]
    for fill in (False, True):
        assert bool_values(array, null=fill).tolist() == [
            fill if v is None else v for v in expected
        ]
    with pytest.raises(ValueError, match="has nulls"):
        bool_values(array)
    numbers = pa.array([None if v is None else float(v) for v in raw]).slice(start, 21)
    values, valid = numeric_view(numbers)
    assert [float(x) for x, ok in zip(values, valid, strict=True) if ok] == [
        v for v in numbers.to_pylist() if v is not None
    ]


def test_random_batch_token_columns_line_up_with_turns():
    from ray_credit.testing import random_batch

    batch = random_batch(
        4,
        num_groups=3,
        group_size=2,
        max_turns=3,
        singleton_frac=0.0,
        id_prefix="c7-",
        policy_version=5,
        prompt_tokens=6,
        tokens_per_turn=4,
    ).validate()
    assert all(g.startswith("c7-g") for g in batch.column("group_id").to_pylist())
    assert {t["policy_version"] for ts in batch.column("turns").to_pylist() for t in ts} == {5}
    lengths = np.diff(batch.token_offsets)
    np.testing.assert_array_equal(lengths, 6 + 4 * batch.turn_counts)
    turn = batch.token_values("token_turn")
    mask = batch.token_values("loss_mask")
    assert (turn[:6] == -1).all() and (mask[:6] == 0).all()
    # each turn: two generated tokens (with logprobs), then two observation tokens
    np.testing.assert_array_equal(mask[6:10], [1, 1, 0, 0])
    logprobs = batch.token_values("behavior_logprobs")
    assert (logprobs[mask == 1] < 0).all() and (logprobs[mask == 0] == 0).all()
    assert turn.max() == batch.turn_counts.max() - 1


# ------------------------------------------------------- bad input: refused, never changed
def core_table(**extra):
    columns = {
        "group_id": ["g", "g"],
        "traj_id": ["t0", "t1"],
        "question": ["q", "q"],
        "gold_answers": [["Ada"], ["Ada"]],
        "turns": [[{"action": "search"}, {"action": "answer"}], [{"action": "answer"}]],
        "outcome_reward": [1.0, 0.0],
    }
    return pa.table({**columns, **extra})


def test_from_table_refuses_casts_that_would_change_data():
    """Arrow's cast drops a struct field the schema lacks, reads 2 as True and makes 1e40
    inf in float32; from_records refuses the first two already, from_table must too."""
    turns = pa.array([[{"text": "x", "acton": "search"}, {"action": "answer"}], [{}]])
    with pytest.raises(
        BatchValidationError, match=r"struct field 'acton' \(did you mean 'action'\?\)"
    ):
        TrajectoryBatch.from_table(core_table(turns=turns))
    gold = pa.array([[0, 2], [1]], pa.list_(pa.int64()))
    with pytest.raises(
        BatchValidationError, match=r"row 0: column 'turn_contains_gold' .* holds 2"
    ):
        TrajectoryBatch.from_table(core_table(turn_contains_gold=gold))
    version = pa.array([[{"policy_version": 1.5}, {}], [{}]])
    with pytest.raises(BatchValidationError, match=r"field 'policy_version'.* holds 1.5"):
        TrajectoryBatch.from_table(core_table(turns=version))
    rewards = pa.array([[0.0, 0.0], [1e40]], pa.list_(pa.float64()))
    with pytest.raises(
        BatchValidationError, match=r"row 1: column 'turn_rewards'.*float32's range"
    ):
        TrajectoryBatch.from_table(core_table(turn_rewards=rewards))
    # lossless casts still go through: 0/1 integers as booleans, whole floats as integers
    ok = TrajectoryBatch.from_table(
        core_table(turn_contains_gold=pa.array([[0, 1], [1]], pa.list_(pa.int64())))
    )
    assert ok.column("turn_contains_gold").to_pylist() == [[False, True], [True]]
    with pytest.raises(TypeError, match="from_table takes a pyarrow.Table, got dict"):
        TrajectoryBatch.from_table(core_table().to_pydict())


def test_from_records_refuses_a_fraction_for_an_integer():
    rec = record()
    rec["turns"][0]["policy_version"] = 1.7
    bad([rec], r"record 0: column 'turns', field 'policy_version', .* holds 1.7")
    rec = with_tokens(record())
    rec["input_ids"][4] = 2.5
    bad([rec], r"column 'input_ids' .* holds 2.5")
    rec = record()
    rec["turns"][0]["policy_version"] = 2.0  # a whole float is kept as the integer it is
    assert TrajectoryBatch.from_records([rec]).to_records()[0]["turns"][0]["policy_version"] == 2


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"turn_advantages": [float("nan"), 1.0]}, r"turn 0: 'turn_advantages' is nan"),
        ({"turn_rewards": [1.0, float("inf")]}, r"turn 1: 'turn_rewards' is inf"),
        ({"turn_rewards": [1e40, 1.0]}, r"'turn_rewards' is inf.*float32"),
        (
            {"turn_clip_scale": [-1.0, 1.0]},
            r"'turn_clip_scale' is -1.0; a clip-range scale is >= 0",
        ),
    ],
)
def test_non_finite_turn_columns_and_negative_clip_scale(extra, match):
    bad([record(**extra)], match)


@pytest.mark.parametrize(
    "logprob, match",
    [(float("nan"), "behavior_logprobs is nan at token 3"), (0.5, "a log-probability is <= 0")],
)
def test_bad_behavior_logprobs(logprob, match):
    rec = with_tokens(record())
    rec["behavior_logprobs"][3] = logprob
    bad([rec], match)


def test_estimator_output_must_be_finite():
    batch = TrajectoryBatch.from_records([record("t0"), record("t1")])
    with pytest.raises(
        BatchValidationError, match=r"row 1 \(traj_id='t1'\), turn 0: 'turn_advantages' is nan"
    ):
        batch.with_turn_columns({"turn_advantages": np.array([0.0, 1.0, np.nan, 1.0])})
    with pytest.raises(BatchValidationError, match="'outcome_reward' is inf"):
        batch.with_traj_columns({"outcome_reward": [1.0, np.inf]})


@pytest.mark.parametrize(
    "name, meant",
    [
        ("turn_contain_gold", "turn_contains_gold"),
        ("data_sorce", "data_source"),
        ("supporting_doc_id", "supporting_doc_ids"),
    ],
)
def test_near_miss_of_a_column_name_is_refused(name, meant):
    value = {"turn_contain_gold": [True, False], "data_sorce": "nq", "supporting_doc_id": ["d"]}
    bad(
        [record(**{name: value[name]})],
        rf"column '{name}' is not in the schema; did you mean '{meant}'\?",
    )


def test_near_miss_in_with_columns_and_new_columns_still_work():
    batch = TrajectoryBatch.from_records([record()])
    with pytest.raises(BatchValidationError, match="did you mean 'turn_advantages'"):
        batch.with_turn_columns({"turn_advantage": np.zeros(2)})
    with pytest.raises(BatchValidationError, match="did you mean 'data_source'"):
        batch.with_traj_columns({"data_sorce": ["nq"]})
    # a new name (a user's signal) is kept, from records, tables and derivations
    out = TrajectoryBatch.from_records([record(my_score=0.5)]).with_turn_columns(
        {"my_turn_flag": np.array([1, 0], np.int8)}
    )
    assert out.column("my_score").to_pylist() == [0.5]
    assert out.column("my_turn_flag").to_pylist() == [[1, 0]]


def test_a_registered_column_near_a_known_name_is_accepted():
    from ray_credit.batch import COLUMNS, ColumnSpec, register_columns

    doc = "a test column one edit away from turn_rewards"
    register_columns({"turn_reward2": ColumnSpec(pa.list_(pa.float32()), "turn", doc)})
    try:
        batch = TrajectoryBatch.from_records([record(turn_reward2=[0.5, 1.0])])
        assert batch.column("turn_reward2").to_pylist() == [[0.5, 1.0]]
    finally:
        del COLUMNS["turn_reward2"]
    bad([record(turn_reward2=[0.5, 1.0])], "did you mean 'turn_rewards'")


def test_null_in_a_required_column():
    bad([record("t0"), record("t1", question=None)], r"row 1 \(traj_id='t1'\): 'question' is null")
    bad([record(gold_answers=None)], r"'gold_answers' is null")


def test_to_torch_metrics_and_select_check_their_arguments():
    batch = TrajectoryBatch.from_records([with_tokens(record("t0")), with_tokens(record("t1"))])
    for pad in ("x", 2.7, True, None):
        with pytest.raises(TypeError, match=r"pad_token_id is a token id, an integer"):
            batch.to_torch(pad_token_id=pad)
    with pytest.raises(TypeError, match=r"metric 'a' is 'x' \(str\); a metric is a number"):
        batch.with_metrics({"a": "x"})
    with pytest.raises(TypeError, match="metrics are a dict"):
        batch.with_metrics([("a", 1.0)])
    with pytest.raises(TypeError, match="metric names are str"):
        batch.with_metrics({1: 1.0})
    with pytest.raises(IndexError, match=r"row 5 is out of range for a batch of 2 trajectories"):
        batch.select([5])
    with pytest.raises(IndexError, match="row -1 is out of range"):
        batch.select([-1])
    with pytest.raises(TypeError, match=r"boolean mask: pass np.flatnonzero\(mask\)"):
        batch.select(np.array([True, False]))
    with pytest.raises(TypeError, match="integer row numbers, got float64"):
        batch.select([0.5])
    assert batch.select(np.array([1], np.int32)).column("traj_id").to_pylist() == ["t1"]
    assert batch.select(range(2)).num_trajectories == 2


@pytest.mark.parametrize("where", ["question", "observation", "gold"])
def test_a_lone_surrogate_is_named_not_a_bare_unicode_error(where):
    records = make_batch([{"reward": 1.0, "turns": 2}]).to_records()
    bad = "Who founded \udcffVelmora?"
    if where == "question":
        records[0]["question"] = bad
    elif where == "observation":
        records[0]["turns"][0]["observation"] = bad
    else:
        records[0]["gold_answers"] = ["Ada", bad]
    column = {"question": "question", "observation": "turns", "gold": "gold_answers"}[where]
    with pytest.raises(BatchValidationError, match=rf"column '{column}', record 0.*lone surrogate"):
        TrajectoryBatch.from_records(records)
