"""Does the confidence drop when the passage no longer holds the answer? Each question is asked twice, with the
same distractors: its gold passage whole, and with the answer's sentence cut out of the text (re-encoded, as an
index of that text would store it). Prints the AUC of whole against cut confidences (0.5: no difference).

    python eval/scripts/abstention_cut_check.py ../shared/data/squad-v1.1-dev-public.json --questions 150 \\
        [--checkpoint DIR] [--seed 1]

Questions whose answer also occurs in the rest of the passage are skipped (cutting one sentence would not
remove it).

Report: prints its figures (no file); the in-passage no-answer lever in `eval/levers.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

from cprag.decoding.generate import generate
from cprag.evaluation.oracle_qa import OracleMemory, oracle_passage_ids
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import sample_examples
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model

POOL = 3000  # a seeded sample of the file, read in order
SENTENCE = re.compile(r"[^.!?]*[.!?]+\s*|[^.!?]+$")


def without_answer_sentence(context: str, start: int, end: int) -> str:
    """`context` less the sentences that overlap characters start..end."""
    return "".join(m.group() for m in SENTENCE.finditer(context) if m.end() <= start or m.start() >= end).strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--questions", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    passages = dict(data.passages)
    memory = OracleMemory(model, tokenizer, passages)
    ids, rng, rows = sorted(data.passages), random.Random(0), []
    for example in sample_examples(data, POOL, args.seed):  # seeded order; usable ones until --questions
        if len(rows) >= args.questions:
            break
        cut = without_answer_sentence(example.context, example.answer_start,
                                      example.answer_start + len(example.answers[0]))
        if not cut or any(a.lower() in cut.lower() for a in example.answers):
            continue
        cut_id = f"{example.passage_id}-cut-{example.qid}"
        passages[cut_id] = (example.article, cut)
        chosen = oracle_passage_ids(example, ids, 4, rng)
        whole = generate(model, tokenizer, example.question, memory.get(chosen)).confidence
        without = generate(model, tokenizer, example.question,
                           memory.get([cut_id if p == example.passage_id else p for p in chosen])).confidence
        rows.append((whole, without))
    whole, without = np.array(rows).T
    print(json.dumps({"checkpoint": str(args.checkpoint), "n": len(rows), "mean_confidence_whole": float(whole.mean()),
                      "mean_confidence_cut": float(without.mean()),
                      "auc_whole_vs_cut": float((whole[:, None] > without[None, :]).mean()),
                      "cut_lower_share": float((without < whole).mean())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
