"""SQuAD metrics against hand-computed cases."""

import pytest

from cprag.metrics import exact_match, f1, normalize_answer, squad_scores


def test_normalisation_drops_case_punctuation_articles_and_extra_space():
    assert normalize_answer("  The  Eiffel-Tower, in Paris! ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_exact_match_and_f1_by_hand():
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    assert exact_match("Denver", "Denver Broncos") == 0.0
    # prediction "denver broncos won", gold "denver broncos": P = 2/3, R = 1, F1 = 0.8
    assert f1("Denver Broncos won", "Denver Broncos") == pytest.approx(0.8)
    assert f1("Carolina", "Denver Broncos") == 0.0


def test_multiple_references_take_the_best_and_empty_predictions_score_zero():
    scores = squad_scores(["Broncos", ""], [["Denver Broncos", "Broncos"], ["1871"]])
    assert scores == {"em": 50.0, "f1": 50.0}
    assert squad_scores([], []) == {"em": 0.0, "f1": 0.0}
    assert f1("", "") == 0.0
