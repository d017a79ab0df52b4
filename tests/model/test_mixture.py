"""The mixture math, checked on random inputs and against direct probability-space formulas."""

import math

import torch

from cprag.model.mixture import (
    copy_log_probs,
    dense_ranks,
    gate_log_probs,
    generator_weight_log,
    mixture_log_probs,
    mixture_target_log_probs,
    scatter_logsumexp,
)


def random_case(seed=0, batch=3, vocab=11, memory=7):
    gen = torch.Generator().manual_seed(seed)
    lm = torch.randn(batch, vocab, generator=gen) * 3
    copy_logit = torch.randn(batch, generator=gen) * 2
    scores = torch.randn(batch, memory, generator=gen) * 2
    sink = torch.randn(batch, generator=gen)
    ids = torch.randint(0, vocab, (memory,), generator=gen)
    mask = torch.rand(batch, memory, generator=gen) > 0.3
    return lm, copy_logit, scores, sink, ids, mask


def reference_probs(lm, copy_logit, scores, sink, ids, mask):
    """p(x) = (1 - g + g a_sink) p_gen(x) + g Σ_{j: tok_j = x} a_j, computed naively in probability space."""
    q = torch.softmax(torch.cat([lm, copy_logit[:, None]], -1), -1)
    g, p_gen = q[:, -1], torch.softmax(lm, -1)
    a = torch.softmax(torch.cat([sink[:, None], scores.masked_fill(~mask, float("-inf"))], -1), -1)
    copied = torch.zeros_like(p_gen).index_add_(1, ids, a[:, 1:])
    return (1 - g + g * a[:, 0])[:, None] * p_gen + g[:, None] * copied


def test_mixture_sums_to_one_and_matches_the_formula():
    for seed in range(5):
        lm, c, s, sink, ids, mask = random_case(seed)
        log_p = mixture_log_probs(gate_log_probs(lm, c), copy_log_probs(s, sink, mask), ids)
        assert torch.allclose(log_p.exp().sum(-1), torch.ones(3), atol=1e-5)
        assert torch.allclose(log_p.exp(), reference_probs(lm, c, s, sink, ids, mask), atol=1e-6)


def test_gate_forced_shut_gives_the_base_lm():
    lm, _, s, sink, ids, mask = random_case(1)
    shut = torch.full((3,), -1e4)
    log_p = mixture_log_probs(gate_log_probs(lm, shut), copy_log_probs(s, sink, mask), ids)
    assert torch.allclose(log_p, torch.log_softmax(lm, -1), atol=1e-6)


def test_two_positions_with_the_same_token_add_up():
    lm = torch.zeros(1, 5)
    open_gate = torch.tensor([1e4])  # g = 1: only the copy path
    scores = torch.tensor([[0.0, 0.0, 0.0]])  # equal attention on three entries
    ids = torch.tensor([3, 3, 1])
    very_low_sink = torch.tensor([-1e4])
    log_p = mixture_log_probs(gate_log_probs(lm, open_gate), copy_log_probs(scores, very_low_sink, None), ids)
    p = log_p.exp()[0]
    assert torch.allclose(p[3], torch.tensor(2 / 3), atol=1e-6)
    assert torch.allclose(p[1], torch.tensor(1 / 3), atol=1e-6)
    assert p[[0, 2, 4]].sum() < 1e-6


def test_sink_mass_goes_to_the_generator():
    lm = torch.randn(1, 6)
    open_gate = torch.tensor([1e4])
    scores = torch.full((1, 4), -1e4)
    sink_only = torch.tensor([0.0])  # all attention on the sink
    log_p = mixture_log_probs(
        gate_log_probs(lm, open_gate), copy_log_probs(scores, sink_only, None), torch.tensor([0, 1, 2, 3])
    )
    assert torch.allclose(log_p, torch.log_softmax(lm, -1), atol=1e-5)


def test_target_log_probs_equal_the_gathered_full_distribution():
    lm, c, s, sink, ids, mask = random_case(2)
    gate, copy = gate_log_probs(lm, c), copy_log_probs(s, sink, mask)
    targets = torch.tensor([ids[0].item(), 4, 10])
    full = mixture_log_probs(gate, copy, ids).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(mixture_target_log_probs(gate, copy, ids, targets), full, atol=1e-6)


def test_scatter_logsumexp_is_exact_far_below_float_range_and_has_finite_gradients():
    values = torch.tensor([[-1000.0, -1000.0, float("-inf"), -5.0]], requires_grad=True)
    index = torch.tensor([2, 2, 0, 1])
    out = scatter_logsumexp(values, index, 4)
    assert torch.allclose(out[0, 2], torch.tensor(-1000.0 + math.log(2.0)))
    assert out[0, 0] == float("-inf") and out[0, 3] == float("-inf")
    out[0, 1:3].sum().backward()
    assert torch.isfinite(values.grad).all()


def test_loss_gradients_are_finite_when_the_target_is_not_in_memory():
    lm, c, s, sink, ids, mask = random_case(3)
    lm.requires_grad_(True)
    s.requires_grad_(True)
    absent = torch.tensor([v for v in range(11) if v not in ids.tolist()][:1] * 3)
    log_p = mixture_target_log_probs(gate_log_probs(lm, c), copy_log_probs(s, sink, mask), ids, absent)
    (-log_p.sum()).backward()
    assert torch.isfinite(lm.grad).all() and torch.isfinite(s.grad).all()


def vocabulary_wide_mixture(gate, copy, ids):
    """The mixture as one logaddexp over the whole vocabulary (what `mixture_log_probs` computed before it mixed
    only at the memory's tokens)."""
    generated = generator_weight_log(gate, copy).unsqueeze(-1) + gate.log_p_gen
    copied = gate.log_g.unsqueeze(-1) + scatter_logsumexp(copy.log_a, ids, gate.log_p_gen.shape[-1])
    return torch.logaddexp(generated, copied)


def test_mixing_only_at_memory_tokens_is_bit_for_bit_the_vocabulary_wide_mixture():
    gen = torch.Generator().manual_seed(7)
    batch, steps, vocab, memory = 4, 3, 500, 60
    lm = torch.randn(batch, steps, vocab, generator=gen) * 4
    copy_logit, sink = torch.randn(batch, steps, generator=gen), torch.randn(batch, steps, generator=gen)
    scores = torch.randn(batch, steps, memory, generator=gen) * 6
    mask = torch.rand(batch, steps, memory, generator=gen) > 0.2
    mask[0, :, :] = False  # a row with nothing to copy
    ids = torch.randint(0, 40, (batch, 1, memory), generator=gen)  # many repeats, per-row memories
    gate, copy = gate_log_probs(lm, copy_logit), copy_log_probs(scores, sink, mask)
    assert torch.equal(mixture_log_probs(gate, copy, ids), vocabulary_wide_mixture(gate, copy, ids))
    shared = ids[1, 0]  # (M,) ids, one memory for every row
    assert torch.equal(mixture_log_probs(gate, copy, shared), vocabulary_wide_mixture(gate, copy, shared))


def test_dense_ranks_number_each_rows_distinct_ids_from_zero():
    index = torch.tensor([[50, 7, 50, 9, 7], [3, 3, 3, 3, 3]])
    assert dense_ranks(index).tolist() == [[2, 0, 2, 1, 0], [0, 0, 0, 0, 0]]


def test_in_place_mixture_reuses_the_logits_buffer_with_the_same_values():
    """At inference the LM logits' buffer becomes log p_gen and then the mixture: bit for bit the fresh-tensor
    results, and no new (..., V) tensor."""
    lm, copy_logit, scores, sink, ids, mask = random_case(seed=3)
    copy = copy_log_probs(scores, sink, mask)
    fresh = mixture_log_probs(gate_log_probs(lm, copy_logit), copy, ids)
    buffer = lm.clone()
    gate = gate_log_probs(buffer, copy_logit, in_place=True)
    assert gate.log_p_gen.data_ptr() == buffer.data_ptr()
    mixed = mixture_log_probs(gate, copy, ids, in_place=True)
    assert mixed.data_ptr() == buffer.data_ptr() and torch.equal(mixed, fresh)
