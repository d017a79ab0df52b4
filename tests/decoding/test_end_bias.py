"""The end bias: one number added to ending's log-probability at every greedy choice, checked wherever it enters."""

import math

import pytest
import torch

from cprag.decoding.step import Step, with_end_bias
from cprag.errors import ConfigError
from cprag.evaluation.squad_eval import SquadEvalConfig
from cprag.model.config import check_end_bias


def test_the_bias_moves_only_the_ways_to_end():
    log_probs = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.5]), -1)
    attention = torch.log_softmax(torch.tensor([0.3, 0.1, 0.2, 0.4, 0.0]), -1)
    step = Step(log_probs, torch.tensor(-0.1), attention)
    assert with_end_bias(step, {3}, 0.0) is step and with_end_bias(step, set(), 5.0) is step
    biased = with_end_bias(step, {3}, 2.0)
    assert torch.allclose(biased.log_probs[:3], log_probs[:3]) and biased.log_probs[3] == pytest.approx(
        float(log_probs[3]) + 2.0)
    assert int(step.log_probs.argmax()) == 2 and int(biased.log_probs.argmax()) == 3  # ending now wins
    assert torch.equal(biased.copy_log_attention, attention)  # without entry ids the copy entries stay
    entry_ids = torch.tensor([1, 3, 2, 3, 0])  # entries 1 and 3 paste the end
    with_entries = with_end_bias(step, {3}, -1.0, entry_ids)
    assert torch.allclose(with_entries.copy_log_attention - attention, torch.tensor([0.0, -1.0, 0.0, -1.0, 0.0]))
    barred = Step(log_probs.index_fill(0, torch.tensor([3]), -math.inf), step.log_gate, attention)
    assert with_end_bias(barred, {3}, 4.0).log_probs[3] == -math.inf  # a barred end stays barred


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_bias_is_refused_naming_where_it_came_from(bad):
    with pytest.raises(ConfigError, match="--end-bias"):
        check_end_bias(bad)
    with pytest.raises(ConfigError, match="--end-bias"):
        SquadEvalConfig(end_bias=bad)
    assert SquadEvalConfig(end_bias=-2).end_bias == -2.0 and SquadEvalConfig().end_bias is None


def test_the_config_keeps_its_bias_and_refuses_a_nan_one(tmp_path):
    from cprag.model.config import CPLMConfig

    config = CPLMConfig(end_bias=-1.5)
    config.save_pretrained(tmp_path)
    assert CPLMConfig.from_pretrained(tmp_path).end_bias == -1.5
    assert CPLMConfig().end_bias == 0.0
    with pytest.raises(ConfigError, match="end_bias"):
        CPLMConfig(end_bias=math.nan)
