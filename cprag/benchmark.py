"""Load time and forward throughput of a model: the figures `cprag model --bench` prints."""

from __future__ import annotations

import time

import torch


@torch.inference_mode()
def forward_tokens_per_second(model, batch: int = 8, length: int = 128, repeats: int = 3, seed: int = 0) -> float:
    """Tokens per second of a batched backbone forward pass on random ids (one warm-up pass first)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, length), generator=generator).to(next(model.parameters()).device)
    model.backbone(ids)
    start = time.perf_counter()
    for _ in range(repeats):
        model.backbone(ids)
    return batch * length * repeats / (time.perf_counter() - start)
