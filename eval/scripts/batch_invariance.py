"""Does a question's answer depend on the batch it is decoded in? The first N of the seeded 1,000 dev questions
(gold passage + 4 same-article distractors, the draws `eval squad` makes), decoded one at a time and 16 per pass,
in each dtype asked, in one run on one machine. Compares answer text, token ids, citations and confidences, and
times both ways, so the price of decoding each question alone is measured beside the differences.

    python eval/scripts/batch_invariance.py ../shared/data/squad-v1.1-dev-public.json --questions 64 \\
        --dtypes bfloat16,float32 --out eval/reproducible/batch.json

Report: `eval/reproducible/batch.json` (docs/design.md, "The same corpus gives the same index").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from cprag.decoding.batched import generate_batch
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.evaluation.oracle_qa import OracleMemory, oracle_passage_ids
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import sample_examples
from cprag.model.checkpoint import load_model
from cprag.model.cpu_features import cpu_has_bf16_units, cpu_name
from cprag.model.reproducible import blas_reproducible
from cprag.model.runtime import DTYPES, place


def compare(data: Path, questions: int, dtype: str, batch: int) -> dict:
    """One dtype: decode the sample one at a time and `batch` per pass; what differs and what each way costs."""
    model, tokenizer = load_model()
    model = place(model, "cpu", DTYPES[dtype])
    squad = read_squad(data)
    examples = sample_examples(squad, 1000, 0)[:questions]
    memory, prefix = OracleMemory(model, tokenizer, squad.passages), prompt_prefix(model, tokenizer)
    all_ids, rng = sorted(squad.passages), random.Random(0)
    chosen = [oracle_passage_ids(e, all_ids, 4, rng) for e in examples]
    shards = [memory.get(ids) for ids in chosen]  # encoded once, before timing: both ways read the same keys

    def run(size: int) -> tuple[list, float]:
        answers, tick = [], time.perf_counter()
        for first in range(0, len(examples), size):
            answers += generate_batch(model, tokenizer, [e.question for e in examples[first : first + size]],
                                      shards[first : first + size], 32, prefix=prefix)
        return answers, time.perf_counter() - tick

    run(batch)  # warm-up
    alone, alone_s = run(1)
    together, together_s = run(batch)
    differ = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a.answer != b.answer]
    tokens = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a.token_ids != b.token_ids]
    cited = [i for i, (a, b) in enumerate(zip(alone, together, strict=True)) if a.citations != b.citations]
    confidence = [abs((a.confidence or 0.0) - (b.confidence or 0.0)) for a, b in zip(alone, together, strict=True)]
    return {
        "questions": len(examples), "batch": batch,
        "answers_equal": len(examples) - len(differ), "token_ids_equal": len(examples) - len(tokens),
        "citations_equal": len(examples) - len(cited),
        "confidence_bit_equal": sum(d == 0.0 for d in confidence), "confidence_max_abs_diff": max(confidence),
        "alone_ms_per_question": round(alone_s * 1000 / len(examples), 1),
        "batched_ms_per_question": round(together_s * 1000 / len(examples), 1),
        "alone_over_batched": round(alone_s / together_s, 2),
        "differing": [{"question": examples[i].question, "alone": alone[i].answer, "batched": together[i].answer}
                      for i in differ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {"cpu": cpu_name(), "bf16_units": cpu_has_bf16_units(), "reproducible_blas": blas_reproducible()}
    for dtype in args.dtypes.split(","):
        report[dtype] = compare(args.data, args.questions, dtype, args.batch)
        print(json.dumps({dtype: {k: v for k, v in report[dtype].items() if k != "differing"}}), file=sys.stderr)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
