"""The copy memory a question decodes against: its passages' stored keys as one memory (or, for a batch, one
padded memory per row), a visible prompt's passages keyed from the prompt itself, and the query-time lexical
features of every entry.

Shapes: B rows, M memory entries, D key dim, F lexical features.
"""

from __future__ import annotations

import torch

from cprag.decoding.passage_prior import passage_bias
from cprag.index.key_cache import DevicePassage
from cprag.model.copy_head import CopyMemory
from cprag.model.lexical import lexical_features, memory_lexicon, question_type, question_words


def shared_memory(passages: list[DevicePassage], dtype: torch.dtype | None = None
                  ) -> tuple[CopyMemory | None, torch.Tensor, torch.Tensor]:
    """One memory over all passages (keys in `dtype`, the CP head's; default: as cached), plus per entry its
    passage index and token position."""
    if not passages:
        return None, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    keys = torch.cat([p.keys for p in passages]).unsqueeze(0).to(dtype)  # (1, M, D)
    ids = torch.cat([p.ids for p in passages]).unsqueeze(0)  # (1, M)
    owner = torch.cat([torch.full((len(p.ids),), i, dtype=torch.long) for i, p in enumerate(passages)])
    position = torch.cat([torch.arange(len(p.ids)) for p in passages])
    return CopyMemory(keys=keys, ids=ids), owner, position


def lexical_prior(model, tokenizer, question: str, ids: torch.Tensor) -> torch.Tensor | None:
    """(1, M, F) query-time lexical features of memory entries pasting `ids` (M,), or None without a prior."""
    if not model.config.lexical_prior:
        return None
    config = model.config
    words, sentences, types = memory_lexicon(tokenizer, ids, config.lexical_sentence_starts)
    return lexical_features(question_words(tokenizer, question), words, config.lexical_window_sizes,
                            sentences if config.lexical_sentences else None, question_type(question),
                            types if config.lexical_types else None,
                            config.lexical_sentence_starts).unsqueeze(0).to(ids.device)


def prompt_passage_memory(model, features: torch.Tensor, prompt: torch.Tensor, spans: list[tuple[int, int]],
                          bodies: list[list[int]]) -> tuple[CopyMemory, torch.Tensor, torch.Tensor]:
    """One memory over the passages of a visible prompt, keyed from the prompt's CP features (1, L, C).

    A passage whose tokens t_1..t_n start at prompt position s is keyed as `document_keys` keys [BOS, t_1..t_n],
    with the label token at s - 1 in BOS's place: entry j pastes t_{j+1}, and a whole passage's last entry pastes
    the end. A passage cut to fit the window has no end entry.
    """
    keys, ids, owner, position = [], [], [], []
    for index, (start, kept) in enumerate(spans):
        window = slice(start - 1, start + kept)
        encoded = model.document_keys_from_hidden(features[:, window], prompt[:, window],
                                                  torch.ones_like(prompt[:, window]))
        entries = kept + 1 if kept == len(bodies[index]) else kept
        keys.append(encoded.keys[0, :entries])
        ids.append(encoded.ids[0, :entries])
        owner.append(torch.full((entries,), index, dtype=torch.long))
        position.append(torch.arange(entries))
    memory = CopyMemory(keys=torch.cat(keys).unsqueeze(0), ids=torch.cat(ids).unsqueeze(0))
    return memory, torch.cat(owner), torch.cat(position)


def batch_memory(model, tokenizer, questions, passages, rows: list, device, passage_prior: float = 0.0
                  ) -> tuple[CopyMemory | None, list[int]]:
    """(B, M, ...) memory: each row's passages, padded to the longest row and masked; and each row's size."""
    sizes = [sum(len(p.ids) for p in shards) for shards in passages]
    if not any(sizes):
        return None, sizes
    size, batch = max(sizes), len(rows)
    first = next(p for shards in passages for p in shards)
    keys = torch.zeros((batch, size, first.keys.shape[-1]), dtype=model.head_dtype, device=device)
    ids = torch.zeros((batch, size), dtype=torch.long, device=device)
    mask = torch.zeros((batch, size), dtype=torch.bool, device=device)
    end_allowed = torch.zeros((batch, size), dtype=torch.bool, device=device)
    prior, bias = None, None
    computed: dict[int, torch.Tensor | None] = {}  # a question's lexical features, shared by its start-beam rows
    for i, (question, shards, row) in enumerate(zip(questions, passages, rows, strict=True)):
        if not shards:
            continue
        n = sizes[i]
        keys[i, :n] = torch.cat([p.keys for p in shards])
        ids[i, :n] = torch.cat([p.ids for p in shards])
        mask[i, :n] = True
        end_allowed[i, :n] = True if row.continues is None else ~row.continues.to(device)
        if row.index not in computed:
            computed[row.index] = lexical_prior(model, tokenizer, question, ids[i, :n])
        features = computed[row.index]
        row.prior = None if features is None else features[0]
        if features is not None:
            if prior is None:
                prior = torch.zeros((batch, size, features.shape[-1]), dtype=features.dtype, device=device)
            prior[i, :n] = features[0]
        row_bias = passage_bias(row.passage_scores, [len(p.ids) for p in shards], passage_prior, device, keys.dtype)
        if row_bias is not None:
            if bias is None:
                bias = torch.zeros((batch, size), dtype=row_bias.dtype, device=device)
            bias[i, :n] = row_bias[0]
    return CopyMemory(keys=keys, ids=ids, mask=mask, prior=prior, end_allowed=end_allowed, bias=bias), sizes


def joined_memory(a: CopyMemory | None, b: CopyMemory | None, rows_a: int, rows_b: int) -> CopyMemory | None:
    """Two batches' memories (of `rows_a` and `rows_b` rows), one after the other, right padded (masked) to the
    larger size."""
    if a is None and b is None:
        return None
    size = max(m.size for m in (a, b) if m is not None)

    def padded(memory: CopyMemory | None, batch: int, field: str, like: torch.Tensor):
        value = None if memory is None else getattr(memory, field)
        if value is None:  # rows without passages (every entry masked), or without this field (a bias of 0)
            return like.new_zeros((batch, size, *like.shape[2:]))
        return torch.cat([value, value.new_zeros((value.shape[0], size - value.shape[1], *value.shape[2:]))], 1)

    fields = {}
    for field in ("keys", "ids", "mask", "prior", "end_allowed", "bias"):
        like = next((getattr(m, field) for m in (a, b) if m is not None and getattr(m, field) is not None), None)
        if like is not None:
            fields[field] = torch.cat([padded(a, rows_a, field, like), padded(b, rows_b, field, like)])
    return CopyMemory(**fields)
