"""The passage prior's bias: each passage's retrieval score below the best one's, times the weight."""

import math

import pytest

from cprag.decoding.passage_prior import PassagePrior, passage_bias


def test_the_passage_bias_is_each_passages_score_below_the_best_and_round_trips_with_its_checkpoint(tmp_path):
    bias = passage_bias([0.5, 0.75, 0.25], [2, 1, 3], weight=4.0)
    assert bias.shape == (1, 6)
    assert bias[0].tolist() == pytest.approx([-1.0, -1.0, 0.0, -2.0, -2.0, -2.0])
    assert passage_bias([0.5, 0.7], [2, 1], weight=0.0) is None and passage_bias(None, [2, 1], 3.0) is None
    with pytest.raises(ValueError, match="2 passage scores for 3 passages"):
        passage_bias([0.5, 0.7], [2, 1, 1], weight=1.0)
    prior = PassagePrior(weight=6.0, fitted_on="a test")
    prior.save(tmp_path)
    assert PassagePrior.load(tmp_path) == prior and PassagePrior.load(tmp_path / "elsewhere") is None
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="--passage-prior"):
            PassagePrior(weight=bad)
