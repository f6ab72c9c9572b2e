"""The synthetic world: determinism, questions grounded in their documents, answers that
cannot be guessed, distractors, and the train/held-out split."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest

from ray_credit.data import World, WorldConfig, make_world
from ray_credit.data.synthetic import _QUESTIONS, _REAL_NAMES
from ray_credit.qa import check_gold_answers, normalize_answer


@pytest.fixture(scope="module")
def world() -> World:
    return make_world()


def _docs(world: World) -> dict[str, str]:
    return {doc["id"]: doc["contents"] for doc in world.corpus}


def _title(contents: str) -> str:
    return contents.partition("\n")[0]


def test_default_world_size_and_speed(world):
    start = time.perf_counter()
    make_world()
    assert time.perf_counter() - start < 1.0
    assert len(world.corpus) == 300 + 60  # one document per entity + event distractors
    hops = Counter(q["hops"] for q in world.questions)
    assert hops == {1: 500, 2: 500}
    assert repr(world) == "World(docs=360, questions=1000: 500 1-hop, 500 2-hop)"


def test_import_needs_neither_torch_nor_ray():
    code = "import sys, ray_credit.data; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_same_seed_same_world_byte_for_byte(world, tmp_path):
    again = make_world(WorldConfig())
    assert json.dumps(again.corpus) == json.dumps(world.corpus)
    assert again.questions == world.questions
    first = world.write(tmp_path / "a")["corpus"].read_bytes()
    assert again.write(tmp_path / "b")["corpus"].read_bytes() == first


def test_different_seeds_make_different_worlds(world):
    other = make_world(seed=1)
    titles = {_title(d["contents"]) for d in world.corpus}
    other_titles = {_title(d["contents"]) for d in other.corpus}
    assert len(titles & other_titles) < 10
    assert {q["question"] for q in world.questions}.isdisjoint(
        q["question"] for q in other.questions
    )


def test_names_unique_pronounceable_fictional(world):
    titles = [_title(doc["contents"]) for doc in world.corpus]
    assert len(set(titles)) == len(titles)
    words = {w for title in titles for w in title.split() if w != "of" and not w.isdigit()}
    for word in words:
        assert re.fullmatch(r"[A-Z][a-z]+", word), word
        assert not re.search(r"[^aeiouy]{4}", word.lower()), word  # no unsayable clusters
        assert word.lower() not in _REAL_NAMES


def test_questions_are_grounded_in_their_documents(world):
    docs = _docs(world)
    assert len({q["id"] for q in world.questions}) == len(world.questions)
    assert len({q["question"] for q in world.questions}) == len(world.questions)
    for q in world.questions:
        assert set(q) == {
            "id",
            "question",
            "golden_answers",
            "data_source",
            "supporting_doc_ids",
            "hops",
            "reference_plan",
        }
        assert check_gold_answers(q["golden_answers"]) == q["golden_answers"]
        assert q["data_source"] == f"synthetic_{q['hops']}hop"
        assert len(q["supporting_doc_ids"]) == q["hops"]
        golds = [normalize_answer(g) for g in q["golden_answers"]]
        asked = normalize_answer(q["question"])
        assert not any(g in asked for g in golds), q
        first = docs[q["supporting_doc_ids"][0]]
        last = normalize_answer(docs[q["supporting_doc_ids"][-1]])
        assert all(g in last for g in golds), q  # the answer is in the last hop's document
        assert normalize_answer(_title(first)) in asked  # the question names its subject
        if q["hops"] == 2:
            bridge = _title(docs[q["supporting_doc_ids"][1]])
            assert normalize_answer(bridge) in normalize_answer(first), q
            assert not any(g in normalize_answer(first) for g in golds), q  # hop 2 is needed


def test_answers_are_spread_within_every_template(world):
    docs = _docs(world)
    template_of = {w: (kind, path) for kind, path, wordings in _QUESTIONS for w in wordings}
    answers = defaultdict(list)
    for q in world.questions:
        wording = q["question"].replace(_title(docs[q["supporting_doc_ids"][0]]), "{x}")
        answers[template_of[wording]].append(normalize_answer(q["golden_answers"][0]))
    assert len(answers) == len(_QUESTIONS)  # every template is asked
    for template, values in answers.items():
        if len(values) >= 10:
            share = Counter(values).most_common(1)[0][1] / len(values)
            assert share < 0.2, (template, Counter(values).most_common(3))
    overall = Counter(normalize_answer(q["golden_answers"][0]) for q in world.questions)
    assert overall.most_common(1)[0][1] < 0.03 * len(world.questions)


def test_person_answers_accept_the_surname(world):
    people = [q["golden_answers"] for q in world.questions if len(q["golden_answers"]) == 2]
    assert len(people) > 50
    surnames = Counter(golds[1] for golds in people)
    for full, surname in people:
        assert full.split()[-1] == surname
    assert len(surnames) > len(people) / 3  # no person is asked for over and over


def test_distractors_make_retrieval_non_trivial(world):
    docs = _docs(world)
    people = {
        _title(docs[q["supporting_doc_ids"][0]])
        for q in world.questions
        if q["question"].startswith(("When was ", "When did ")) and q["hops"] == 1
    }
    people = {name for name in people if len(name.split()) == 2}
    given = Counter(name.split()[0] for name in people)
    assert given.most_common(1)[0][1] >= 2  # namesakes: same given name, another surname
    subjects = {sid for q in world.questions for sid in q["supporting_doc_ids"]}
    events = [c for i, c in docs.items() if i not in subjects and re.search(r" of \d{4}\n", c)]
    assert len(events) >= 30
    # Documents mention years other than their facts': a year question needs reading.
    years_per_doc = [len(set(re.findall(r"\b\d{4}\b", c))) for c in docs.values()]
    assert sum(n >= 3 for n in years_per_doc) > len(docs) / 4
    # Several wordings per fact.
    text = "\n".join(docs.values())
    assert all(text.count(w) > 3 for w in (" was a native of ", " was born and raised in "))


def test_split_is_disjoint_deterministic_and_stratified(world):
    train, test = world.split(eval_fraction=0.1, seed=0)
    ids = [q["id"] for q in train + test]
    assert len(ids) == len(set(ids)) == len(world.questions)
    assert Counter(q["hops"] for q in test) == {1: 50, 2: 50}
    assert world.split(eval_fraction=0.1, seed=0) == (train, test)
    assert world.split(eval_fraction=0.1, seed=1)[1] != test
    with pytest.raises(ValueError, match="eval_fraction"):
        world.split(eval_fraction=1.0)


def test_small_world_and_config_errors():
    small = make_world(num_entities=40, num_questions=60, seed=3)
    assert 0 < len(small.questions) <= 60
    assert {q["hops"] for q in small.questions} == {1, 2}
    with pytest.raises(ValueError, match="num_entities must be >= 20"):
        make_world(num_entities=5)
    with pytest.raises(TypeError, match=r"unknown WorldConfig field\(s\) \['entities'\]"):
        make_world(entities=10)
    with pytest.raises(ValueError, match="two_hop_fraction"):
        WorldConfig(two_hop_fraction=1.5)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            {"event_doc_fraction": float("nan")},
            TypeError,
            r"event_doc_fraction takes a number, not NaN",
        ),
        ({"event_doc_fraction": float("inf")}, ValueError, r"event_doc_fraction must be a finite"),
        (
            {"country_fraction": float("nan")},
            TypeError,
            r"country_fraction takes a number, not NaN",
        ),
        ({"two_hop_fraction": float("-inf")}, ValueError, r"two_hop_fraction must be a finite"),
        ({"num_entities": "100"}, TypeError, r"num_entities takes an integer, got '100' \(str\)"),
        ({"num_entities": 20.5}, TypeError, r"num_entities takes an integer, got 20\.5"),
        ({"seed": "x"}, TypeError, r"WorldConfig\.seed takes an integer, got 'x'"),
        ({"seed": 1.5}, TypeError, r"WorldConfig\.seed takes an integer, got 1\.5"),
        ({"seed": True}, TypeError, r"WorldConfig\.seed takes an integer, got True"),
    ],
)
def test_config_values_of_the_wrong_type_or_not_finite_name_the_field(overrides, error, message):
    """Not "cannot convert float NaN to integer" deep in make_world, nor a NaN fraction or a
    str seed accepted."""
    with pytest.raises(error, match=message):
        WorldConfig(**overrides)
    with pytest.raises(error, match=message):
        make_world(**overrides)


def test_make_world_takes_a_world_config():
    with pytest.raises(TypeError, match=r"make_world takes a WorldConfig .*got dict"):
        make_world({"seed": 3})


def test_three_hop_questions_need_every_hop_and_leave_other_worlds_unchanged():
    from ray_credit.qa import normalize_answer

    plain = make_world(num_entities=120)
    world = make_world(num_entities=120, two_hop_fraction=0.3, three_hop_fraction=0.3)
    three = [q for q in world.questions if q["hops"] == 3]
    assert three and "3-hop" in repr(world) and "3-hop" not in repr(plain)
    assert {q["data_source"] for q in three} == {"synthetic_3hop"}
    docs = {d["id"]: normalize_answer(d["contents"]) for d in world.corpus}
    for q in three:
        first, second, last = q["supporting_doc_ids"]
        golds = [normalize_answer(g) for g in q["golden_answers"]]
        assert len({first, second, last}) == 3
        assert not any(g in docs[first] or g in docs[second] for g in golds), q["question"]
        assert any(g in docs[last] for g in golds), q["question"]
    # the 1- and 2-hop questions the fraction leaves are drawn as before
    two = {q["question"] for q in world.questions if q["hops"] == 2}
    assert two <= {q["question"] for q in plain.questions if q["hops"] == 2}
    with pytest.raises(ValueError, match="two_hop_fraction \\+ three_hop_fraction"):
        make_world(two_hop_fraction=0.6, three_hop_fraction=0.5)
