"""One decoding step, read: the next token's distribution and the copy attention behind it, and what a step says
about a token (which memory entry it was copied from, how sure the copy path is of it) for both decoders.

A row's memory is read as `memory_ids` (M,), the token each external entry pastes (a batch row's padded to the
batch's memory, its padding masked so it never wins); copy attention is ordered [external ; "end here" twins ;
own context]."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cprag.model.mixture import NEG_INF

LOG_HALF = math.log(0.5)


@dataclass
class Step:
    """One position's outputs: what the next token is chosen from."""

    log_probs: torch.Tensor  # (V,)
    log_gate: torch.Tensor  # ()
    copy_log_attention: torch.Tensor  # (E + P,)

    @classmethod
    def at(cls, out, position: int) -> Step:
        return cls(out.log_probs[0, position], out.log_gate[0, position], out.copy_log_attention[0, position])


def best_derivation(step: Step, entry_ids: torch.Tensor, external: int) -> tuple[int, int | None]:
    """The single most probable way to produce the next token: one copy entry (mass g * a_j), or the generator's
    best token (its share of the mixture). Returns (token, external entry or None).

    The mixture sums the mass of every entry that pastes the same token, which favours tokens that occur often
    (" the") over the one entry the head is surest of; choosing a derivation keeps to that entry.
    entry_ids (E + P,): the token each copy entry pastes, in `copy_log_attention` order; `external`: how many of
    them are memory entries (the rest are "end here" twins and the own context, never a source).
    """
    log_copy = step.log_gate + step.copy_log_attention  # (E + P,)
    copy_mass = torch.zeros_like(step.log_probs).index_add_(0, entry_ids, log_copy.exp())
    generator = (step.log_probs.exp() - copy_mass).clamp(min=0)  # (V,)
    entry = int(log_copy.argmax())
    if float(log_copy[entry].exp()) < float(generator.max()):
        return int(generator.argmax()), None
    return int(entry_ids[entry]), entry if entry < external else None


def step_entry_ids(model, memory_ids: torch.Tensor | None, context_ids: torch.Tensor, width: int) -> torch.Tensor:
    """(E + P,) the token each entry of a step's copy attention pastes: external entries (then their "end here"
    twins) followed by the own context (`context_ids` (P,), the tokens seen so far), whose entry j pastes token
    j + 1."""
    parts = []
    if memory_ids is not None:
        parts.append(memory_ids)
        if model.cp_head.end_q_proj is not None:
            parts.append(torch.full_like(memory_ids, model.config.end_id))
    own = context_ids
    parts.append(torch.cat([own[1:], own.new_zeros(1)]))
    ids = torch.cat(parts)[:width]
    # positions a rewind dropped are later than the step, so masked: any id will do
    return torch.cat([ids, ids.new_zeros(width - ids.shape[0])])


def without_stops(step: Step, stop: set[int], entry_ids: torch.Tensor) -> Step:
    """The step with every way to end barred: the stop tokens' mixture mass, and the copy entries pasting them
    ("end here" twins, own-context ends)."""
    barred = torch.tensor(sorted(stop), device=step.log_probs.device)
    ends = torch.isin(entry_ids, barred)
    return Step(step.log_probs.index_fill(0, barred, NEG_INF), step.log_gate,
                step.copy_log_attention.masked_fill(ends, NEG_INF))


def with_end_bias(step: Step, stop: set[int], bias: float, entry_ids: torch.Tensor | None = None) -> Step:
    """The step as greedy decoding weighs it: `bias` (nats) added to every way to end, the stop tokens' mixture
    log-probability and (given `entry_ids`, for single-derivation choices) the copy entries pasting them. Below 0
    a copied span runs on where the model is unsure it is over. Log-probabilities reported stay unbiased."""
    if bias == 0 or not stop:
        return step
    barred = torch.tensor(sorted(stop), device=step.log_probs.device)
    log_probs = step.log_probs.index_add(0, barred, torch.full((len(barred),), bias, dtype=step.log_probs.dtype,
                                                                device=barred.device))
    attention = step.copy_log_attention
    if entry_ids is not None:
        attention = attention + bias * torch.isin(entry_ids, barred).to(attention.dtype)
    return Step(log_probs, step.log_gate, attention)


def first_token_confidence(step: Step, memory_ids: torch.Tensor, token: int) -> float:
    """g · Σ a_j over the passage entries that paste `token` (not their "end here" twins): how much of the first
    answer token's probability the copy path gives from the passages."""
    log_a = step.copy_log_attention[: len(memory_ids)].masked_fill(memory_ids != token, NEG_INF)
    return float((step.log_gate + torch.logsumexp(log_a, -1)).exp())


def copied_source(step: Step, token: int, memory_ids: torch.Tensor | None) -> int | None:
    """The memory entry a token was copied from, when the copy path gave it more mass than the generator."""
    if memory_ids is None:
        return None
    log_a = step.copy_log_attention[: len(memory_ids)]
    same = memory_ids == token
    if not bool(same.any()):
        return None
    masked = log_a.masked_fill(~same, NEG_INF)
    copied = step.log_gate + torch.logsumexp(masked, -1)
    total = step.log_probs[token]
    # copied mass above half of p(token): the copy path, not the generator, chose it
    if copied - total < LOG_HALF:
        return None
    return int(masked.argmax())


def successor_entries(entry: int | None, owner: torch.Tensor | None, count: int) -> list[int]:
    """Entries entry+1 .. entry+count that belong to the same passage (nothing for a generated token)."""
    if entry is None or count <= 0:
        return []
    last = min(entry + count, len(owner) - 1)
    return [e for e in range(entry + 1, last + 1) if owner[e] == owner[entry]]
