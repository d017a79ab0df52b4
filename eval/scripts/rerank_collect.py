"""Decode B starts per question and record what a start reranker could read: each alternative's token
log-probabilities, its first and last memory entries' lexical features, and its EM / F1.

    python eval/scripts/rerank_collect.py ../shared/data/squad-v1.1-train.json --unseen --questions 2500 \\
        --out /tmp/cprag-rerank/train.jsonl
    python eval/scripts/rerank_collect.py ../shared/data/squad-v1.1-dev-public.json --questions 1000 \\
        --out /tmp/cprag-rerank/dev.jsonl

`--unseen` keeps training-file questions from articles the shipped checkpoint never trained on (its run saw the
first `--seen` questions of its seeded article-grouped order), so the reranker learns from answers as wrong as
unseen ones are. Without it the sample is the seeded one `cprag eval squad FILE --oracle --limit N` asks, with the
same memories (gold passage + 4 same-article distractors). The checkpoint's passage prior is on, as in `eval squad`
(`--passage-prior 0` turns it off). Questions are decoded `--batch-size` at a time, each start a row of the batch
(`generate_batch`, the same alternatives as `generate`). Records stream to OUT; a rerun resumes.

Report: none of its own; its records feed `eval/scripts/rerank_fit.py` and `eval/scripts/rerank_variants.py`
(`eval/rerank/report.md`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cprag.api import load_passage_prior
from cprag.decoding.batched import generate_batch
from cprag.decoding.memory import lexical_prior, shared_memory
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.evaluation.metrics import squad2_question_scores
from cprag.evaluation.oracle_qa import OracleMemory, retrieval_scores
from cprag.evaluation.squad import article_of, read_squad
from cprag.model.checkpoint import load_model
from cprag.training.recipe import add_fit_question_arguments, fit_questions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_question_arguments(parser, questions=1000)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--passage-prior", type=float, help="default: the checkpoint's weight")
    parser.add_argument("--batch-size", type=int, default=8, help="questions decoded together")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    examples, drawn = fit_questions(args.data, data, tokenizer, args.questions, args.seed,
                                    args.seen if args.unseen else None, args.articles)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["qid"] for line in args.out.read_text().splitlines()} if args.out.is_file() else set()
    memory = OracleMemory(model, tokenizer, data.passages)
    weight = load_passage_prior(args.checkpoint) if args.passage_prior is None else args.passage_prior
    todo = [i for i, e in enumerate(examples) if e.qid not in done]
    scores = retrieval_scores([examples[i].question for i in todo], [drawn[i] for i in todo], data.passages)
    memory.get(sorted({pid for i in todo for pid in drawn[i]}))  # every passage at once, in full batches
    prefix, started = prompt_prefix(model, tokenizer), time.time()
    for first in range(0, len(todo), args.batch_size):
        group = todo[first : first + args.batch_size]
        generations = generate_batch(model, tokenizer, [examples[i].question for i in group],
                                     [memory.get(drawn[i]) for i in group], 32, prefix=prefix,
                                     passage_scores=scores[first : first + len(group)], passage_prior=weight,
                                     start_beam=args.beam)
        for j, (i, generation) in enumerate(zip(group, generations, strict=True)):
            record(args.out, examples[i], drawn[i], memory.get(drawn[i]), generation, model, tokenizer,
                   scores[first + j])
            done.add(examples[i].qid)
        print(f"{time.strftime('%H:%M:%S')} {len(done)}/{len(examples)} ({(time.time() - started) / 60:.1f} min)",
              file=sys.stderr, flush=True)
    return 0


def record(out: Path, example, chosen: list[str], shards, generation, model, tokenizer,
           passage_scores: list[float] | None = None) -> None:
    """One question's alternatives, as the reranker's fit reads them, appended to `out` (with every copied entry,
    the mean lexical features over the span, and the retriever's scores, for features yet to be tried)."""
    entries_memory, owner, _ = shared_memory(shards)
    prior = lexical_prior(model, tokenizer, example.question, entries_memory.ids[0])[0]  # (M, F)
    gold = chosen.index(example.passage_id)
    alternatives = []
    for alternative in generation.alternatives:
        first, last = (alternative.entries[0], alternative.entries[-1]) if alternative.entries else (None, None)
        em, f1 = squad2_question_scores(alternative.answer, example.answers)
        copied = [e for e in alternative.entries if e is not None]
        alternatives.append({
            "entries": alternative.entries,
            "span_prior_mean": [round(float(v), 4) for v in prior[copied].mean(0)] if copied else None,
            "answer": alternative.answer, "log_prob": alternative.log_prob,
            "token_log_probs": alternative.token_log_probs,
            "first_entry": first, "last_entry": last,
            "first_prior": None if first is None else [round(float(v), 4) for v in prior[first]],
            "last_prior": None if last is None else [round(float(v), 4) for v in prior[last]],
            "passage": None if first is None else int(owner[first]), "em": 100 * em, "f1": 100 * f1,
        })
    row = {"qid": example.qid, "article": article_of(example.passage_id), "question": example.question,
           "gold_passage": gold, "passage_scores": passage_scores,
           "confidence": generation.confidence, "stop_probability": generation.stop_probability,
           "alternatives": alternatives}
    with open(out, "a") as handle:
        handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
