"""The prompt's fixed beginning, run through the backbone once.

Every hidden-mode and closed-book prompt starts with the same tokens: the system turn and the user turn's header
(18 of a typical question's 29 tokens with the default chat template). Their KV cache and own-context keys do not
depend on the question, so an `Index` computes them once and each question's prompt pass reads only its own
tokens: a shorter pass for one question, and for a batch a pass over the questions alone rather than over
16 copies of the system turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from cprag.decoding.prompt import prompt_ids
from cprag.model.copy_head import ContextState

# questions unlike each other at their first token, so their prompts share exactly the fixed beginning
_PROBES = ("What?", "1", "x y", "Who is it?")


@dataclass
class PromptPrefix:
    """The fixed beginning's token ids, own-context keys (1, P, D) and per-layer KV (1, heads, P, head dim)."""

    ids: list[int]
    keys: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return len(self.ids)

    def fits(self, prompt: list[int]) -> bool:
        """Whether `prompt` starts with the prefix and has at least one token of its own after it."""
        return len(prompt) > self.length and prompt[: self.length] == self.ids

    def context(self, batch: int = 1) -> ContextState:
        """A running context holding the prefix for `batch` rows: a fresh cache over the shared tensors (cache
        updates concatenate or index, so the prefix's own tensors are never written)."""
        cache = DynamicCache([(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in self.layers])
        ids = torch.tensor([self.ids], device=self.keys.device).expand(batch, -1)
        return ContextState(keys=self.keys.expand(batch, -1, -1), ids=ids,
                            mask=torch.ones_like(ids, dtype=torch.bool), cache=cache)


def fixed_prompt_start(tokenizer) -> list[int]:
    """The token ids every question's prompt starts with (the longest common beginning of unlike questions)."""
    prompts = [prompt_ids(tokenizer, q) for q in _PROBES]
    length = 0
    while all(len(p) > length for p in prompts) and len({p[length] for p in prompts}) == 1:
        length += 1
    return prompts[0][:length]


@torch.inference_mode()
def prompt_prefix(model, tokenizer) -> PromptPrefix | None:
    """The prefix for `model` as it is now (its device, dtype and weights); None when prompts share nothing."""
    ids = fixed_prompt_start(tokenizer)
    if not ids:
        return None
    device = next(model.parameters()).device
    tensor = torch.tensor([ids], device=device)
    out = model(tensor, use_cache=True, query_positions=torch.tensor([[len(ids) - 1]], device=device))
    layers = [(layer.keys, layer.values) for layer in out.context.cache.layers]
    return PromptPrefix(ids=ids, keys=out.context.keys, layers=layers)
