"""The CPLM output distribution as pure functions in log space.

Notation (see docs/cplm-design.md): for a position t with LM logits `l` (V), `<copy>` logit `c`,
copy scores `s_j` over a memory of M entries each pasting token `tok_j`, and a sink score `s_0`:

    q = softmax([l ; c]),  g = q[<copy>],  p_gen = softmax(l)
    a = softmax([s_0 ; s_1..s_M])                              (a_0 is the sink)
    p(x) = (1 - g + g·a_0)·p_gen(x) + g·Σ_{j: tok_j = x} a_j

Every function works on arbitrary leading dimensions (written `...`) and never leaves log space.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def safe_logsumexp(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """logsumexp that returns -inf for an all -inf slice with zero (not NaN) gradients.

    torch.logsumexp's backward computes exp(-inf - -inf) = NaN on such slices, and a masked copy memory produces
    them whenever a target token is absent from memory.
    """
    peak = values.amax(dim=dim, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = (values - peak).exp().sum(dim=dim)
    nonzero = total > 0
    return torch.where(nonzero, torch.where(nonzero, total, 1.0).log() + peak.squeeze(dim), NEG_INF)


@dataclass
class GateLogProbs:
    log_g: torch.Tensor  # (...)    log of the copy gate g
    log_1mg: torch.Tensor  # (...)  log(1 - g)
    log_p_gen: torch.Tensor | None  # (..., V); None when built from LM statistics only


@dataclass
class CopyLogProbs:
    log_a: torch.Tensor  # (..., M)  log attention on each memory entry (-inf where masked)
    log_a_sink: torch.Tensor  # (...)


def gate_log_probs(lm_logits: torch.Tensor, copy_logit: torch.Tensor, in_place: bool = False) -> GateLogProbs:
    """Split the (V+1)-way LM head softmax into the gate and the generator distribution.

    `in_place`: `lm_logits` becomes log_p_gen (same values): at inference a fresh (..., V) buffer per step is a
    measurable share of a batch's step, most of it the memory's first touch."""
    lse_vocab = torch.logsumexp(lm_logits, dim=-1)  # (...)
    lse_all = torch.logaddexp(lse_vocab, copy_logit)  # (...)
    shift = lse_vocab.unsqueeze(-1)
    return GateLogProbs(
        log_g=copy_logit - lse_all,
        log_1mg=lse_vocab - lse_all,
        log_p_gen=lm_logits.sub_(shift) if in_place else lm_logits - shift,
    )


def gate_log_probs_from_stats(lse_vocab: torch.Tensor, copy_logit: torch.Tensor) -> GateLogProbs:
    """The gate from the LM logits' logsumexp alone (no (..., V) tensor); log_p_gen is left empty."""
    lse_all = torch.logaddexp(lse_vocab, copy_logit)
    return GateLogProbs(log_g=copy_logit - lse_all, log_1mg=lse_vocab - lse_all, log_p_gen=None)


def copy_log_probs(scores: torch.Tensor, sink_score: torch.Tensor, mask: torch.Tensor | None) -> CopyLogProbs:
    """Softmax over the sink and the memory entries that `mask` allows.

    scores: (..., M), sink_score: (...), mask: broadcastable to (..., M), True where an entry may be attended.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    lse = torch.logaddexp(safe_logsumexp(scores, dim=-1), sink_score)  # (...)
    return CopyLogProbs(log_a=scores - lse.unsqueeze(-1), log_a_sink=sink_score - lse)


def bucket_logsumexp(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """For each entry j, log Σ_{k: index[..., k] = index[..., j]} exp(values[..., k]): the logsumexp of its bucket,
    at the entry. values: (..., M), index: (..., M) or (M,) int64 in [0, size). Returns (..., M).

    Exact in log space: each bucket is shifted by its own max. Two (..., size) buffers are written once each
    (the buckets' maxima and sums); everything else is (..., M).
    """
    index = index.expand_as(values)
    out_shape = values.shape[:-1] + (size,)
    bucket_max = torch.full(out_shape, NEG_INF, dtype=values.dtype, device=values.device)
    bucket_max = bucket_max.scatter_reduce(-1, index, values, reduce="amax", include_self=True)
    shift = bucket_max.gather(-1, index)  # (..., M)
    # entries that are -inf (masked) contribute exp(-inf) = 0; a bucket whose max is -inf stays empty
    filled = torch.isfinite(shift)
    shifted = torch.where(filled, values - shift, torch.full_like(values, NEG_INF))
    sums = torch.zeros(out_shape, dtype=values.dtype, device=values.device).scatter_add(-1, index, shifted.exp())
    sums = sums.gather(-1, index)  # (..., M)
    # log of an empty bucket's zero sum would poison gradients with 0/0, so it never reaches the log
    return torch.where(filled, torch.where(filled, sums, 1.0).log() + shift, shift)


def dense_ranks(index: torch.Tensor) -> torch.Tensor:
    """(..., M) int64 -> (..., M) int64 in [0, M): equal exactly where `index` is equal along the last dim. Buckets
    keyed by these need M slots, not the vocabulary's."""
    ordered, order = index.sort(-1)
    starts = torch.ones_like(ordered)
    starts[..., 1:] = (ordered[..., 1:] != ordered[..., :-1]).long()
    return torch.empty_like(ordered).scatter_(-1, order, starts.cumsum(-1) - 1)


def scatter_logsumexp(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """out[..., v] = log Σ_{j: index[..., j] = v} exp(values[..., j]); -inf where no j maps to v.

    values: (..., M), index: (..., M) or (M,) int64. Exact in log space (`bucket_logsumexp`).
    """
    index = index.expand_as(values)
    out = torch.full(values.shape[:-1] + (size,), NEG_INF, dtype=values.dtype, device=values.device)
    return out.scatter(-1, index, bucket_logsumexp(values, index, size))


def generator_weight_log(gate: GateLogProbs, copy: CopyLogProbs) -> torch.Tensor:
    """log(1 - g + g·a_sink): the total weight p_gen receives, sink mass included. Shape (...)."""
    return torch.logaddexp(gate.log_1mg, gate.log_g + copy.log_a_sink)


def mixture_log_probs(gate: GateLogProbs, copy: CopyLogProbs, copy_ids: torch.Tensor, in_place: bool = False
                      ) -> torch.Tensor:
    """Full mixture log p(x) over the vocabulary. copy_ids: (..., M) or (M,), the token each entry pastes.

    Returns (..., V); with `in_place`, in gate.log_p_gen's buffer (same values, no fresh (..., V) tensor).
    """
    weight = generator_weight_log(gate, copy).unsqueeze(-1)  # (..., 1)
    generated = gate.log_p_gen.add_(weight) if in_place else weight + gate.log_p_gen  # (..., V)
    # only the M tokens in memory get copy mass: mix at those, and leave every other token's generated value (a
    # vocabulary-wide logaddexp with -inf would give the same numbers, at several passes over (..., V) per step)
    index = copy_ids.expand_as(copy.log_a)  # (..., M)
    # buckets by token, numbered within each row (copy_ids is usually one row per batch item, broadcast over T)
    buckets = dense_ranks(copy_ids).expand_as(copy.log_a)
    copied = gate.log_g.unsqueeze(-1) + bucket_logsumexp(copy.log_a, buckets, buckets.shape[-1])  # (..., M)
    mixed = torch.logaddexp(generated.gather(-1, index), copied)  # equal for entries pasting the same token
    return generated.scatter(-1, index, mixed) if generated.requires_grad else generated.scatter_(-1, index, mixed)


def mixture_target_log_probs(
    gate: GateLogProbs, copy: CopyLogProbs, copy_ids: torch.Tensor, targets: torch.Tensor,
    log_p_gen_target: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(target) without building the (..., V) copy distribution. targets: (...) int64. Returns (...).

    `log_p_gen_target` (...) may be given instead of gate.log_p_gen (training from cached LM statistics).
    """
    if log_p_gen_target is None:
        log_p_gen_target = gate.log_p_gen.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    generated = generator_weight_log(gate, copy) + log_p_gen_target
    same_token = copy_ids.expand_as(copy.log_a) == targets.unsqueeze(-1)  # (..., M)
    copied = gate.log_g + safe_logsumexp(copy.log_a.masked_fill(~same_token, NEG_INF), dim=-1)
    return torch.logaddexp(generated, copied)


def weighted_loss(target_log_probs: torch.Tensor, targets: torch.Tensor, target_weights: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """Mean negative log-likelihood of the targets (B, Q), ignored ones (-100) left out, weighted per target."""
    weights = (targets != -100).to(dtype)
    if target_weights is not None:
        weights = weights * target_weights
    return -(target_log_probs * weights).sum() / weights.sum().clamp(min=1e-9)
