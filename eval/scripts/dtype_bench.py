"""bf16 autocast against fp32 on this CPU, in one run: the activation cache's frozen blocks, and training steps.

    python eval/scripts/dtype_bench.py SQUAD.json [--passages 64] [--steps 6] [--out eval/dtype/summary.json]

Cache: the default backbone runs blocks 0..23 over the same seeded passages in both dtypes (tokens per second,
and the cosine between the cached states and between the final CP features they lead to). Training: the same
batches of the default recipe (adapters on blocks 24-29) forward and backward in both dtypes, on activations
computed here (seconds per step, after one warm-up step). Keys: dtype/...

Report: `eval/dtype/summary.json` (the bf16 lever in `eval/levers.md`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from cprag.evaluation.squad import read_squad
from cprag.index.encode import length_batches, tokenize_passage
from cprag.model.checkpoint import new_cplm
from cprag.training.config import TrainConfig
from cprag.training.train import compute_context, trainable_parameters


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--passages", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    config = TrainConfig()
    torch.manual_seed(0)
    model, tokenizer = new_cplm(**config.head)
    data = read_squad(args.data)
    chosen = random.Random(0).sample(sorted(data.passages), args.passages)
    passages = [tokenize_passage(tokenizer, data.passages[p][1]) for p in chosen]
    batches = list(length_batches(passages, tokenizer.bos_token_id, 2048))
    figures: dict[str, float] = {"dtype/passages": len(passages),
                                 "dtype/tokens": sum(len(p.ids) + 1 for p in passages)}
    states: dict[str, list] = {}
    for dtype in ("float32", "bfloat16", "float32", "bfloat16"):  # twice each, interleaved; the second counts
        tick = time.perf_counter()
        with torch.no_grad(), compute_context(dtype):
            states[dtype] = [model.frozen_states(ids, mask, config.cache_layer) for _, ids, mask in batches]
        figures[f"dtype/cache_tokens_per_second/{dtype}"] = round(
            figures["dtype/tokens"] / (time.perf_counter() - tick), 1)
    figures["dtype/cache_speedup"] = round(figures["dtype/cache_tokens_per_second/bfloat16"]
                                           / figures["dtype/cache_tokens_per_second/float32"], 2)
    with torch.no_grad():
        same = [cosine(a[i].float(), b[i].float()) for a, b in zip(states["float32"], states["bfloat16"], strict=True)
                for i in model.cached_layers(config.cache_layer)]
        figures["dtype/cache_cosine"] = round(min(same), 6)
        finals = [cosine(model.trained_states({k: v.float() for k, v in a.items()}, mask, config.cache_layer)[1],
                         model.trained_states({k: v.float() for k, v in b.items()}, mask, config.cache_layer)[1])
                  for a, b, (_, _, mask) in zip(states["float32"], states["bfloat16"], batches, strict=True)]
        figures["dtype/cp_features_cosine"] = round(min(finals), 6)
    params = trainable_parameters(model)
    model.train()
    for dtype in ("float32", "bfloat16"):
        seconds = []
        for step, (_, _ids, mask) in enumerate(batches[: args.steps + 1]):
            tick = time.perf_counter()
            with compute_context(dtype):
                _, features = model.trained_states({k: v.float() for k, v in states["float32"][step].items()}, mask,
                                                   config.cache_layer)
            features.float().pow(2).mean().backward()
            seconds.append(time.perf_counter() - tick)
            for p in params:
                p.grad = None
        figures[f"dtype/train_step_seconds/{dtype}"] = round(sum(seconds[1:]) / max(1, len(seconds) - 1), 3)
    figures["dtype/train_speedup"] = round(figures["dtype/train_step_seconds/float32"]
                                           / figures["dtype/train_step_seconds/bfloat16"], 2)
    text = json.dumps(figures, indent=2, sort_keys=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

