"""What the default start beam costs: per-question decode time of greedy (`--start-beam 1`) against the shipped
reranker's beam (its starts decoded as rows of one batch, sharing the question's prompt pass), for one question at
a time and in batches of 8, all in one run, on the first N of the seeded 1,000 dev questions (gold passage + 4
same-article distractors, passage prior on, passages encoded before timing).

    python eval/scripts/start_beam_cost.py ../shared/data/squad-v1.1-dev-public.json --questions 96 \\
        --out eval/start-beam/cost.json

Report: `eval/start-beam/cost.json` (the start beam's cost in README.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from cprag.api import load_passage_prior, load_reranker
from cprag.decoding.batched import generate_batch
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.decoding.rerank import default_start_beam
from cprag.evaluation.oracle_qa import OracleMemory, oracle_passage_ids, retrieval_scores
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import sample_examples
from cprag.model.checkpoint import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--questions", type=int, default=96)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model, tokenizer = load_model()
    reranker, weight = load_reranker(None, model.config), load_passage_prior(None)
    beam = default_start_beam(reranker)
    data = read_squad(args.data)
    examples = sample_examples(data, 1000, 0)[: args.questions]
    memory, prefix = OracleMemory(model, tokenizer, data.passages), prompt_prefix(model, tokenizer)
    all_ids, rng = sorted(data.passages), random.Random(0)
    chosen = [oracle_passage_ids(e, all_ids, 4, rng) for e in examples]  # the draws eval squad makes
    scores = retrieval_scores([e.question for e in examples], chosen, data.passages)
    memory.get(sorted({pid for ids in chosen for pid in ids}))
    shards = [memory.get(ids) for ids in chosen]

    def run(start_beam: int, batch: int) -> tuple[list[float], list[str]]:
        times, answers = [], []
        for first in range(0, len(examples), batch):
            tick = time.perf_counter()
            generations = generate_batch(
                model, tokenizer, [e.question for e in examples[first : first + batch]], shards[first : first + batch],
                32, prefix=prefix, passage_scores=scores[first : first + batch], passage_prior=weight,
                start_beam=start_beam, reranker=reranker)
            times.append((time.perf_counter() - tick) * 1000 / len(generations))
            answers += [g.answer for g in generations]
        return times, answers

    run(1, 8), run(beam, 8)  # warm-up
    figures: dict = {"questions": len(examples), "beam": beam}
    answers = {}
    for batch in (1, 8):
        for start_beam in (1, beam):
            times, answers[start_beam, batch] = run(start_beam, batch)
            figures[f"beam{start_beam}@batch{batch}/p50_ms"] = round(statistics.median(times), 1)
            figures[f"beam{start_beam}@batch{batch}/mean_ms"] = round(statistics.fmean(times), 1)
        for stat in ("p50", "mean"):
            figures[f"beam{beam}_over_greedy@batch{batch}/{stat}"] = round(
                figures[f"beam{beam}@batch{batch}/{stat}_ms"] / figures[f"beam1@batch{batch}/{stat}_ms"], 2)
    figures["answers_identical_batch1_vs_8"] = all(answers[b, 1] == answers[b, 8] for b in (1, beam))
    print(json.dumps(figures, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
