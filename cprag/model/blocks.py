"""Running a slice of the backbone's blocks on given states: causal, packed, or with documents read both ways.

The activation cache (cprag.training.activations) holds the states entering a block; training, indexing and the
span reader run the blocks above it from there. Shapes: B rows, T positions, H hidden size.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask


def run_blocks(backbone: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None, start: int, stop: int,
               keep: set[int] | frozenset = frozenset(), position_ids: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Backbone blocks start..stop-1 on the hidden states entering block `start` (B, T, H), right padded, no cache.

    Returns the hidden states leaving block stop-1 (not normed) and {i: hidden states entering block i} for every
    i in `keep` with start <= i <= stop, indexed like the backbone's `output_hidden_states` (0 = embeddings).
    Packed sequences: several sequences in one row, `attention_mask` None and `position_ids` (1, T) restarting at
    0 for each, attend within their own sequence only (no padding to compute). A `mask` (B, 1, T, T), True where a
    position reads another, replaces the causal one.
    """
    positions = position_ids if position_ids is not None else \
        torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
    if mask is None:
        mask = create_causal_mask(config=backbone.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=None, position_ids=positions)
    rotary = backbone.rotary_emb(hidden, position_ids=positions)
    saved = {start: hidden} if start in keep else {}
    for index in range(start, stop):
        hidden = backbone.layers[index](hidden, attention_mask=mask, position_embeddings=rotary,
                                        position_ids=positions)
        if index + 1 in keep:
            saved[index + 1] = hidden
    return hidden, saved


def both_ways_mask(attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """(B, 1, T, T) True where a position reads another, for documents read both ways: every real token of a
    sequence reads every other one of the same sequence. From right-padded (B, T) `attention_mask` (a padding
    position reads only itself), or from packed `position_ids` (B, T) (a sequence starts where its position is 0)."""
    if position_ids is not None:
        sequence = (position_ids == 0).long().cumsum(-1)  # (B, T) which packed sequence a column belongs to
        return (sequence[:, :, None] == sequence[:, None, :])[:, None]
    real = attention_mask.bool()  # (B, T)
    mask = real[:, None, :] & real[:, :, None]  # (B, T, T)
    return (mask | torch.eye(real.shape[1], dtype=torch.bool, device=real.device))[:, None]
