"""Decode B starts per question and record what a start reranker could read: each alternative's token
log-probabilities, its first and last memory entries' lexical features, and its EM / F1.

    python eval/rerank/collect.py ../shared/data/squad-v1.1-train.json --unseen --questions 2500 \\
        --out /tmp/cprag-rerank/train.jsonl
    python eval/rerank/collect.py ../shared/data/squad-v1.1-dev-public.json --questions 1000 \\
        --out /tmp/cprag-rerank/dev.jsonl

`--unseen` keeps training-file questions from articles the shipped checkpoint never trained on (its run saw the
first `--seen` questions of its seeded article-grouped order), so the reranker learns from answers as wrong as
unseen ones are. Without it the sample is the seeded one `cprag eval squad FILE --oracle --limit N` asks, with the
same memories (gold passage + 4 same-article distractors). Records stream to OUT; a rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from cprag.checkpoint import DEFAULT_CHECKPOINT, load_model
from cprag.evaluate import sample_examples
from cprag.generate import generate, lexical_prior, shared_memory
from cprag.metrics import squad2_question_scores
from cprag.qa_eval import OracleMemory, oracle_passage_ids
from cprag.recipe import unseen_articles
from cprag.squad import read_squad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unseen", action="store_true")
    parser.add_argument("--seen", type=int, default=32_000, help="questions the checkpoint's run trained on")
    parser.add_argument("--articles", type=int, help="with --unseen: a seeded sample of this many of those articles "
                        "(their passages are encoded once and shared by their questions: 3 times faster)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    articles = tuple(sorted(unseen_articles(args.data, tokenizer, args.seen, args.seed))) if args.unseen else None
    if articles:
        print(f"{len(articles)} unseen articles", file=sys.stderr)
        if args.articles:
            articles = tuple(sorted(random.Random(args.seed).sample(articles, args.articles)))
    examples = sample_examples(data, args.questions, args.seed, articles)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {json.loads(line)["qid"] for line in args.out.read_text().splitlines()} if args.out.is_file() else set()
    memory, all_ids = OracleMemory(model, tokenizer, data.passages), sorted(data.passages)
    rng, started = random.Random(args.seed), time.time()
    for example in examples:
        chosen = oracle_passage_ids(example, all_ids, 4, rng)  # drawn for every question: the same memories
        if example.qid in done:
            continue
        shards = memory.get(chosen)
        generation = generate(model, tokenizer, example.question, shards, "hidden", 32, start_beam=args.beam)
        entries_memory, owner, _ = shared_memory(shards)
        prior = lexical_prior(model, tokenizer, example.question, entries_memory.ids[0])[0]  # (M, F)
        gold = chosen.index(example.passage_id)
        alternatives = []
        for alternative in generation.alternatives:
            first, last = (alternative.entries[0], alternative.entries[-1]) if alternative.entries else (None, None)
            em, f1 = squad2_question_scores(alternative.answer, example.answers)
            alternatives.append({
                "answer": alternative.answer, "log_prob": alternative.log_prob,
                "token_log_probs": alternative.token_log_probs,
                "first_entry": first, "last_entry": last,
                "first_prior": None if first is None else [round(float(v), 4) for v in prior[first]],
                "last_prior": None if last is None else [round(float(v), 4) for v in prior[last]],
                "passage": None if first is None else int(owner[first]), "em": 100 * em, "f1": 100 * f1,
            })
        record = {"qid": example.qid, "question": example.question, "gold_passage": gold,
                  "confidence": generation.confidence, "stop_probability": generation.stop_probability,
                  "alternatives": alternatives}
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        done.add(example.qid)
        if len(done) % 25 == 0:
            print(f"{time.strftime('%H:%M:%S')} {len(done)}/{len(examples)} "
                  f"({(time.time() - started) / 60:.1f} min)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
