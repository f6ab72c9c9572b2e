"""Answer normalization, EM / substring EM / F1, extraction and "contains gold" checks."""

import pytest

from ray_credit.qa import (
    ANSWER_SPLIT,
    check_gold_answers,
    contains_gold,
    em_check,
    extract_answer,
    f1_score,
    normalize_answer,
    subem_check,
    turn_contains_gold,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("an apple a day", "apple day"),
        ("Theatre", "theatre"),  # articles are whole words only
        ("U.S.A.!", "usa"),  # punctuation is deleted, not replaced by a space
        ("rock-and-roll", "rockandroll"),
        ("  New \t York\n City  ", "new york city"),
        ("1914—1918", "1914—1918"),  # the unicode em dash is not ASCII punctuation
        ("“Quoted”", "“quoted”"),
        ("The", ""),
        ("!!!", ""),
        ("a, an; the.", ""),
        ("", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_answer_removes_punctuation_before_articles():
    # "a." only becomes the article "a" once the dot is gone.
    assert normalize_answer("plan a.") == "plan"
    # Deleting the apostrophe joins the words, so "the" is no longer a whole word.
    assert normalize_answer("the'cat") == "thecat"


def test_normalize_answer_rejects_non_str():
    with pytest.raises(TypeError, match="expects a str"):
        normalize_answer(None)


def test_em_check_basic_and_multiple_golds():
    assert em_check("The Eiffel Tower.", "eiffel tower") == 1.0
    assert em_check("Paris", ["London", "paris"]) == 1.0  # OR over golds
    assert em_check("Paris, France", ["Paris"]) == 0.0
    assert em_check(None, ["Paris"]) == 0.0
    assert isinstance(em_check("x", "x"), float)


def test_subem_is_a_character_substring_test():
    assert subem_check("category", "cat") == 1.0
    assert subem_check("Paris, France", ["London", "paris"]) == 1.0
    assert subem_check("Lyon", ["Paris", "London"]) == 0.0
    assert subem_check("cat", "category") == 0.0
    assert subem_check(None, "cat") == 0.0


def test_gold_that_normalizes_to_empty_matches_everything():
    # The reference behaviour: "" is a substring of every prediction, and equals any
    # prediction that also normalizes to "". check_gold_answers rejects such golds.
    assert subem_check("anything at all", "The") == 1.0
    assert em_check("a", "The") == 1.0
    assert em_check("Paris", "The") == 0.0
    with pytest.raises(ValueError, match="'The' normalizes to an empty string"):
        check_gold_answers(["Paris", "The"])


@pytest.mark.parametrize("check", [em_check, subem_check, f1_score])
def test_scores_reject_bad_golds(check):
    with pytest.raises(ValueError, match="empty"):
        check("Paris", [])
    with pytest.raises(TypeError, match="must be a str"):
        check("Paris", ["Paris", 3])
    with pytest.raises(TypeError):
        check("Paris", None)
    with pytest.raises(TypeError, match="prediction"):
        check(3, ["Paris"])


def test_f1_over_word_sets_without_article_removal():
    # Sets: {"the", "cat"} vs {"cat"}: P = 1/2, R = 1, F1 = 2/3.
    assert f1_score("the the cat", "cat") == pytest.approx(2 / 3)
    # No article removal: "the" counts as a word.
    assert f1_score("The Beatles", "Beatles") == pytest.approx(2 / 3)
    # Punctuation becomes a space (EM normalization would delete it instead).
    assert f1_score("rock-and-roll", "rock and roll") == 1.0
    assert f1_score("ROCK", "rock") == 1.0
    assert f1_score("paris france", "lyon") == 0.0
    # {"new", "york", "city"} vs {"york", "state"}: P = 1/3, R = 1/2, F1 = 0.4.
    assert f1_score("New York City", "York State") == pytest.approx(0.4)


def test_f1_max_over_golds_and_answer_split():
    assert f1_score("new york", ["york state", "new york"]) == 1.0
    assert f1_score("new york", f"york state{ANSWER_SPLIT}new york") == 1.0
    assert f1_score("new york", [f"lyon{ANSWER_SPLIT}york"]) == pytest.approx(2 / 3)


def test_f1_empty_sides_score_zero():
    assert f1_score(None, "cat") == 0.0
    assert f1_score("", "cat") == 0.0
    assert f1_score("...", "cat") == 0.0
    assert f1_score("cat", "!!!") == 0.0
    assert f1_score("", "") == 0.0  # both empty: 0.0, as IGPO skips empty golds
    assert f1_score("cat", ["", "cat"]) == 1.0


def test_extract_answer_last_match_and_min_matches():
    response = "<think>x</think><answer> Paris </answer>"
    assert extract_answer(response) == "Paris"
    assert extract_answer(response, min_matches=2) is None
    prompt = "For example, <answer> Beijing </answer>.\n"
    assert extract_answer(prompt + response, min_matches=2) == "Paris"
    # Last match wins.
    assert extract_answer("<answer>a</answer> then <answer> b </answer>") == "b"
    # Content may span lines.
    assert extract_answer("<answer>New\nYork</answer>") == "New\nYork"
    assert extract_answer("no answer here") is None
    assert extract_answer("<answer>unclosed") is None
    assert extract_answer("<answer></answer>") == ""


def test_extract_answer_rejects_bad_min_matches():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="min_matches"):
            extract_answer("<answer>a</answer>", min_matches=bad)


def test_contains_gold():
    doc = "Doc 1(Title: Paris) Paris is the capital of France."
    assert contains_gold(doc, ["capital of France"])
    assert contains_gold(doc, ["Berlin", "PARIS"])
    assert not contains_gold(doc, "Berlin")
    assert contains_gold("the category list", "cat")  # character substring
    assert not contains_gold(None, "Paris")
    assert not contains_gold("", "Paris")


def test_turn_contains_gold_across_blocks():
    observations = [
        "Doc 1(Title: Lyon) A city in France.",
        None,
        "Doc 1(Title: France) Its capital is Paris.",
        "",
    ]
    assert turn_contains_gold(observations, ["paris"]) == [False, False, True, False]
    assert turn_contains_gold([], "paris") == []
    with pytest.raises(TypeError, match="one entry per turn"):
        turn_contains_gold("Paris", "paris")


def test_check_gold_answers():
    assert check_gold_answers("Paris") == ["Paris"]
    assert check_gold_answers(("Paris", "City of Light")) == ["Paris", "City of Light"]
    for bad in ("The", "a", "!!!", "  "):
        with pytest.raises(ValueError, match="substring EM") as info:
            check_gold_answers(["Paris", bad], where="row 3 (traj_id='t3')")
        message = str(info.value)
        assert message.startswith("row 3 (traj_id='t3'): ")
        assert repr(bad) in message
        assert "Remove it" in message
    with pytest.raises(ValueError, match="row 0: gold_answers is empty"):
        check_gold_answers([], where="row 0")
    with pytest.raises(TypeError, match="row 1: every gold answer must be a str"):
        check_gold_answers(["Paris", None], where="row 1")
    with pytest.raises(TypeError) as info:  # a year in a JSON file, written as a number
        check_gold_answers([1984], where="q.jsonl:1")
    assert str(info.value).endswith(
        'got int (1984) in gold_answers; write it as text ("1984", not 1984)'
    )
