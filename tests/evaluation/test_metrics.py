"""SQuAD metrics against hand-computed cases."""

import pytest

from cprag.evaluation.metrics import (
    best_threshold,
    exact_match,
    f1,
    normalize_answer,
    squad2_question_scores,
    threshold_within,
)


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


def test_multiple_references_take_the_best_and_empty_answers_follow_squad2_rules():
    assert squad2_question_scores("Broncos", ["Denver Broncos", "Broncos"]) == (1.0, 1.0)
    assert squad2_question_scores("", ["1871"]) == (0.0, 0.0)  # withheld, but there was an answer
    assert squad2_question_scores("", []) == (1.0, 1.0)  # withheld, and rightly: unanswerable
    assert squad2_question_scores("1871", []) == (0.0, 0.0)  # an answer where there is none
    assert squad2_question_scores("", ["the"]) == (1.0, 1.0)  # references that normalise to nothing are dropped
    assert f1("", "") == 0.0


def test_best_threshold_is_the_official_search_over_confidences():
    # four questions: two answerable (right when answered), two unanswerable (answered wrongly)
    confidences = [0.9, 0.8, 0.3, 0.1]
    answerable = [True, False, True, False]
    scores = [1.0, 0.0, 1.0, 0.0]
    answered = [True, True, True, True]
    best, threshold = best_threshold(confidences, answerable, scores, answered)
    # withholding everything scores 2 of 4; answering from 0.9 down: 3, then 2 (a wrong answer at 0.8), 3, 2.
    # The first best (the highest threshold reaching it) wins, as in the official script
    assert best == 75.0 and threshold == 0.9
    assert best_threshold([0.5], [False], [0.0], [True]) == (100.0, float("inf"))  # never answering is best


def test_threshold_within_bounds_what_abstention_costs_the_answerable_questions():
    # answerable: confidences 0.1 (wrong), 0.2 (right), 0.3 (right), 0.4 (right); one unanswerable at 0.05
    confidences, answerable = [0.1, 0.2, 0.3, 0.4, 0.05], [True, True, True, True, False]
    scores = [0.0, 1.0, 1.0, 1.0, 0.0]
    assert threshold_within(confidences, answerable, scores, 0.0) == 0.2  # withholding a wrong answer is free
    assert threshold_within(confidences, answerable, scores, 25.0) == 0.3  # one right answer of four: 25 points
    assert threshold_within(confidences, answerable, scores, 24.0) == 0.2
    assert threshold_within([0.5, 0.5], [True, True], [1.0, 1.0], 60.0) == 0.0  # ties withhold both or neither
    assert threshold_within([0.5, 0.5], [True, True], [1.0, 1.0], 100.0) > 0.5
