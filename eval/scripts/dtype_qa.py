"""The shipped checkpoint in fp32 against bf16 weights on this CPU, in one run: answers, latency and key encoding.
Decides `cprag.model.runtime.CPU_BF16_DEFAULT` (bf16 ships as the CPU default only if hidden EM moves
by at most 1 point).

    python eval/scripts/dtype_qa.py ../shared/data/squad-v1.1-dev-public.json [--questions 300] \\
        [--out eval/dtype/qa.json]

Answers: the first N of the seeded sample `cprag eval squad DEV --oracle --limit 1000` asks (hidden mode, gold
passage + 4 same-article distractors, keys encoded by the model in the same dtype, one question at a time as `ask`
decodes). Encoding: `encode_passages` over 64 seeded passages, after a warm-up pass. (Batched throughput is
`cprag eval bench --dtype ...`'s batch/qps@B.) Keys: dtype/{float32,bfloat16}/..., dtype/em_delta.

Report: `eval/dtype/qa.json` (the fp32 / bf16 row of README.md's results).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cprag.evaluation.metrics import paired_interval
from cprag.evaluation.oracle_qa import evaluate_oracle
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import sample_examples
from cprag.index.encode import encode_passages, tokenize_passage
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model
from cprag.model.runtime import place

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "dtype" / "qa.json")
    args = parser.parse_args(argv)
    data = read_squad(args.data)
    examples = sample_examples(data, 1000, 0)[: args.questions]
    model, tokenizer = load_model(args.checkpoint)
    texts = [data.passages[p][1] for p in random.Random(0).sample(sorted(data.passages), 64)]
    passages = [tokenize_passage(tokenizer, t) for t in texts]
    tokens = sum(len(p.ids) + 1 for p in passages)
    figures: dict = {"dtype/questions": len(examples), "dtype/encode_tokens": tokens}
    scores = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = place(model, "cpu", dtype)  # as `cprag ask` runs it: the CP head stays fp32
        list(encode_passages(model, passages[:8], tokenizer.bos_token_id))  # warm-up
        tick = time.perf_counter()
        list(encode_passages(model, passages, tokenizer.bos_token_id))
        figures[f"dtype/{name}/encode_tokens_per_s"] = round(tokens / (time.perf_counter() - tick), 1)
        results = evaluate_oracle(model, tokenizer, examples, data.passages, ["hidden"])
        scores[name] = (np.array([r.em for r in results]), np.array([r.f1 for r in results]))
        figures[f"dtype/{name}/em"] = round(float(scores[name][0].mean()), 2)
        figures[f"dtype/{name}/f1"] = round(float(scores[name][1].mean()), 2)
        figures[f"dtype/{name}/ask_p50_ms"] = round(float(np.median([r.latency_ms for r in results])), 1)
        print(json.dumps({k: v for k, v in figures.items() if name in k}), file=sys.stderr, flush=True)
    figures["dtype/em_delta"] = round(figures["dtype/bfloat16/em"] - figures["dtype/float32/em"], 2)
    figures["dtype/em_delta_ci95"] = paired_interval(scores["bfloat16"][0], scores["float32"][0])
    figures["dtype/f1_delta"] = round(figures["dtype/bfloat16/f1"] - figures["dtype/float32/f1"], 2)
    figures["dtype/changed_answers"] = int(sum(scores["bfloat16"][1] != scores["float32"][1]))
    figures["dtype/encode_speedup"] = round(figures["dtype/bfloat16/encode_tokens_per_s"]
                                            / figures["dtype/float32/encode_tokens_per_s"], 2)
    figures["dtype/ask_p50_ratio"] = round(figures["dtype/bfloat16/ask_p50_ms"] / figures["dtype/float32/ask_p50_ms"],
                                           3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
