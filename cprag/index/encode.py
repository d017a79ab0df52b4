"""Passages to CP keys: each passage is tokenised with character offsets and encoded on its own.

A passage of n tokens is run as [BOS, t_1 .. t_n]; the key at position j pastes t_{j+1}, so every passage token,
the first included, can be copied, and each key knows the character span of the token it pastes. The key of the
last token pastes the end-of-turn token, with an empty span at the passage's end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TokenizedPassage:
    ids: list[int]  # the passage's own tokens
    offsets: list[tuple[int, int]]  # character span of each token in the passage text


@dataclass
class PassageKeys:
    keys: np.ndarray  # (n + 1, D) float16: key j pastes ids[j]
    ids: np.ndarray  # (n + 1,) int32: the passage tokens, then the end-of-turn token
    offsets: np.ndarray  # (n + 1, 2) int32 character spans of the pasted tokens


def tokenize_passage(tokenizer, text: str) -> TokenizedPassage:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return TokenizedPassage(ids=list(encoded["input_ids"]), offsets=[tuple(o) for o in encoded["offset_mapping"]])


def length_batches(passages: list[TokenizedPassage], bos_id: int, max_tokens: int = 4096, prefix: bool = True):
    """Yield (indices, input_ids, attention_mask): [BOS] + tokens (or the tokens alone, `prefix=False`), right
    padded with BOS, longest first, each batch at most `max_tokens` padded tokens. Key encoding, the activation
    cache and the bare-forward benchmark use exactly these batches."""
    first = int(prefix)
    lengths = [len(p.ids) + first for p in passages]
    order = sorted(range(len(passages)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for index in order + [None]:
        if index is not None and not (batch and lengths[batch[0]] * (len(batch) + 1) > max_tokens):
            batch.append(index)
            continue
        if batch:
            width = lengths[batch[0]]
            input_ids = torch.full((len(batch), width), bos_id, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, first : lengths[i]] = torch.tensor(passages[i].ids, dtype=torch.long)
                attention[row, : lengths[i]] = 1
            yield batch, input_ids, attention
        batch = [index] if index is not None else []


@torch.inference_mode()
def encode_passages(
    model,
    passages: list[TokenizedPassage],
    bos_id: int,
    max_tokens: int = 4096,
    on_batch: Callable[[int], None] | None = None,
) -> Iterable[tuple[int, PassageKeys]]:
    """Yield (index, keys) for each passage, batched by length (longest first) for throughput.

    `max_tokens` bounds a batch's padded size; `on_batch` is told how many passages each batch finished.
    """
    device = next(model.parameters()).device
    for batch, input_ids, attention in length_batches(passages, bos_id, max_tokens):
        lengths = attention.sum(-1).tolist()
        memory = model.document_keys(input_ids.to(device), attention.to(device))
        keys = memory.keys.to(torch.float16).cpu().numpy()
        paste_ids = memory.ids.cpu().numpy().astype(np.int32)
        for row, index in enumerate(batch):
            n = lengths[row]
            offsets = np.asarray(passages[index].offsets, dtype=np.int32).reshape(n - 1, 2)
            end = offsets[-1, 1] if n > 1 else 0
            yield index, PassageKeys(
                keys=keys[row, :n], ids=paste_ids[row, :n],
                offsets=np.concatenate([offsets, np.array([[end, end]], dtype=np.int32)]),
            )
        if on_batch is not None:
            on_batch(len(batch))
