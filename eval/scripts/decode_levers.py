"""Decoding levers on one checkpoint, on the validation articles of its training run:
the learned successor bias, no successor bias (plain argmax), and a fixed decoding-time boost.

    python eval/scripts/decode_levers.py DATA [--checkpoint DIR] [--questions 100]

Report: prints a markdown table; the decoding-time successor boost row of `eval/levers.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from cprag.evaluation.oracle_qa import evaluate_oracle, summarize
from cprag.evaluation.squad import read_squad
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--questions", type=int, default=100)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.checkpoint)
    split = json.loads((args.checkpoint / "train_config.json").read_text())
    data = read_squad(args.data)
    examples = [e for e in data.examples if e.article in set(split["validation_articles"])]
    random.Random(1).shuffle(examples)
    examples = examples[: args.questions]
    learned = model.cp_head.successor.detach().clone()
    rows = []
    for name, successor in [("learned successor bias", learned), ("plain argmax (no successor bias)",
                            torch.zeros(2)), ("fixed boost +4 continue, learned end", torch.tensor([4.0,
                                                                                                 learned[1]]))]:
        with torch.no_grad():
            model.cp_head.successor.copy_(successor)
        tick = time.perf_counter()
        summary = summarize(evaluate_oracle(model, tokenizer, examples, data.passages, ["hidden"]))
        rows.append((name, summary, time.perf_counter() - tick))
        print(f"{name}: EM {summary['qa/hidden/em']:.1f} F1 {summary['qa/hidden/f1']:.1f}", flush=True)
    print("| decoding | n | EM | F1 | copy rate | seconds |\n|---|---|---|---|---|---|")
    for name, summary, seconds in rows:
        print(f"| {name} | {summary['qa/hidden/n']} | {summary['qa/hidden/em']:.1f} | {summary['qa/hidden/f1']:.1f} "
              f"| {summary['qa/hidden/copy_rate']:.2f} | {seconds:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
