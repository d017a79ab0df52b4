"""Fit the passage prior's weight (`cprag/decoding/passage_prior.py`) on training-file questions a checkpoint never saw.

For each question (gold passage + 4 same-article distractors, as `cprag eval squad --oracle` draws them) the
script records the CP head's first-step scores over every memory entry (no prior) and the retriever's cosine
similarity of the question to each passage. Offline it then asks, for each weight w: is the best entry of
`score + w * (s_p - max s)` the first token of the answer in the gold passage (teacher-forced start accuracy)?
Paired bootstrap intervals against w = 0. One model pass per question, no decoding.

    python eval/scripts/passage_prior_fit.py ../shared/data/squad-v1.1-train.json --unseen --articles 60 \\
        --questions 2000 --records /tmp/prior.jsonl --out eval/passage-prior [--save-weight]

Resumable: records already in `--records` are kept. `--save-weight` writes the best weight (the smallest one
within 0.05 points of the best accuracy) to the checkpoint's passage_prior.json.

Report: `eval/passage-prior/fit.json`, summed up by hand in `eval/passage-prior/report.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.memory import lexical_prior, shared_memory
from cprag.decoding.passage_prior import PassagePrior
from cprag.decoding.prompt import prompt_ids
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.decoding.step import Step
from cprag.evaluation.oracle_qa import OracleMemory, retrieval_scores
from cprag.evaluation.squad import read_squad
from cprag.index.encode import tokenize_passage
from cprag.model.checkpoint import load_model
from cprag.training.recipe import add_fit_question_arguments, fit_questions, resume_records

WEIGHTS = (0, 1, 2, 4, 6, 8, 10, 12, 15, 20, 25, 30, 40)


@torch.inference_mode()
def first_step_scores(model, tokenizer, prefix, question: str, shards) -> tuple[np.ndarray, np.ndarray]:
    """(M,) log-attention of every external entry at the answer's first step, and (M,) each entry's passage."""
    memory, owner, _ = shared_memory(shards)
    memory.prior = lexical_prior(model, tokenizer, question, memory.ids[0])
    prompt = prompt_ids(tokenizer, question)
    own = torch.tensor([prompt[prefix.length :]])
    out = model(own, memory=memory, context=prefix.context(), query_positions=torch.tensor([[len(prompt) - 1]]),
                position_ids=torch.arange(prefix.length, len(prompt)).unsqueeze(0))
    return Step.at(out, -1).copy_log_attention[: memory.size].float().numpy(), owner.numpy()


def answer_entries(tokenizer, text: str, answers: list[str], offset: int) -> list[int]:
    """Memory entries (passage starting at entry `offset`) whose token begins a reference answer."""
    references = [a.strip() for a in answers if a.strip()]
    tokens = tokenize_passage(tokenizer, text)
    return [offset + j for j, (start, _) in enumerate(tokens.offsets)
            if any(text[start:].lstrip().startswith(r) for r in references)]


def collect(args) -> list[dict]:
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    examples, chosen = fit_questions(args.data, data, tokenizer, args.questions, args.seed,
                                     args.seen if args.unseen else None, args.articles)
    done, todo = resume_records(args.records, examples)
    if todo:
        scores = retrieval_scores([examples[i].question for i in todo], [chosen[i] for i in todo], data.passages)
        memory, prefix = OracleMemory(model, tokenizer, data.passages), prompt_prefix(model, tokenizer)
        started = time.time()
        with args.records.open("a") as handle:
            for n, (i, similarity) in enumerate(zip(todo, scores, strict=True)):
                example = examples[i]
                attention, owner = first_step_scores(model, tokenizer, prefix, example.question, memory.get(chosen[i]))
                gold = chosen[i].index(example.passage_id)
                record = {"qid": example.qid, "scores": [round(float(x), 3) for x in attention],
                          "owner": owner.tolist(), "similarity": [round(s, 5) for s in similarity], "gold": gold,
                          "answer_entries": answer_entries(tokenizer, example.context, example.answers,
                                                           int(np.flatnonzero(owner == gold)[0]))}
                handle.write(json.dumps(record) + "\n")
                done[example.qid] = record
                if n % 100 == 0:
                    print(f"{time.strftime('%H:%M:%S')} {n}/{len(todo)} ({time.time() - started:.0f} s)",
                          file=sys.stderr, flush=True)
    return [done[e.qid] for e in examples]


def best_entries(records: list[dict], weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Per question: whether the best entry under `weight` starts the answer, and whether it is in the gold
    passage."""
    start, passage = [], []
    for r in records:
        similarity, owner = np.asarray(r["similarity"]), np.asarray(r["owner"])
        best = int((np.asarray(r["scores"]) + weight * (similarity - similarity.max())[owner]).argmax())
        start.append(best in r["answer_entries"])
        passage.append(owner[best] == r["gold"])
    return np.asarray(start), np.asarray(passage)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_question_arguments(parser, questions=2000)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save-weight", action="store_true")
    args = parser.parse_args(argv)
    records = [r for r in collect(args) if r["answer_entries"]]
    (base, _), bootstrap = best_entries(records, 0.0), np.random.default_rng(args.seed)
    rows = []
    for weight in WEIGHTS:
        right, passage = best_entries(records, weight)
        change = right.astype(float) - base
        draws = [change[bootstrap.integers(0, len(change), len(change))].mean() for _ in range(2000)]
        rows.append({"weight": weight, "start": round(100 * right.mean(), 2), "passage": round(100 * passage.mean(), 2),
                     "gained": int((right & ~base).sum()), "lost": int((base & ~right).sum()),
                     "delta_ci95": [round(100 * float(np.percentile(draws, q)), 2) for q in (2.5, 97.5)]})
    best = max(r["start"] for r in rows)
    chosen = min(r["weight"] for r in rows if r["start"] >= best - 0.05)
    summary = {"prior/questions": len(records), "prior/chosen_weight": chosen, "prior/rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fit.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in rows:
        print(json.dumps(r))
    print(f"chosen weight {chosen} on {len(records)} questions")
    if args.save_weight:
        path = PassagePrior(weight=float(chosen), fitted_on=(
            f"teacher-forced start accuracy on {len(records)} questions of {args.articles or 'all'} training-file "
            f"articles the checkpoint never trained on (eval/scripts/passage_prior_fit.py)")).save(args.checkpoint)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
