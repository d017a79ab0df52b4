"""Split a SQuAD-format file into folds of whole articles, so a model can train on one fold and be scored on the other.

    python pipelines/squad_folds.py ../shared/data/squad-v2.0-dev-public.json --folds 2 --out runs/squad2-folds

The public SQuAD 2.0 half is the only in-domain source of human-written unanswerable questions here, and it is also
where abstention is scored. Trained on, it must be used out of fold: train on `fold-0.json`, score on the questions
of `fold-1.json` (`eval/scripts/reader_verifier.py --held-out FOLD`), and the other way round. Articles are dealt to
the folds in a seeded order, so that each fold holds about the same number of questions; paragraphs and questions are
unchanged. It prints each fold's articles, questions and unanswerable questions.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path


def article_questions(article: dict) -> list[dict]:
    return [q for p in article["paragraphs"] for q in p["qas"]]


def deal(articles: list[dict], folds: int, seed: int) -> list[list[dict]]:
    """Articles dealt in a seeded order, each to the fold with the fewest questions so far."""
    order = list(range(len(articles)))
    random.Random(seed).shuffle(order)
    dealt: list[list[dict]] = [[] for _ in range(folds)]
    sizes = [0] * folds
    for i in order:
        fold = min(range(folds), key=lambda f: (sizes[f], f))
        dealt[fold].append(articles[i])
        sizes[fold] += len(article_questions(articles[i]))
    return dealt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="SQuAD-format file (v1.1 or 2.0)")
    parser.add_argument("--out", type=Path, required=True, help="folder for fold-0.json, fold-1.json, ...")
    parser.add_argument("--folds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        raw = json.loads(args.data.read_text())
        articles = raw["data"]
        if not isinstance(articles, list) or not articles or any(not article_questions(a) for a in articles[:1]):
            raise ValueError("no articles with questions")
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: {args.data}: not a readable SQuAD file ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    if not 2 <= args.folds <= len(articles):
        print(f"error: --folds must be between 2 and the file's {len(articles)} articles", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for i, kept in enumerate(deal(articles, args.folds, args.seed)):
        (args.out / f"fold-{i}.json").write_text(json.dumps({**raw, "data": kept}))
        questions = [q for a in kept for q in article_questions(a)]
        report.append({"fold": i, "articles": len(kept), "questions": len(questions),
                       "unanswerable": sum(bool(q.get("is_impossible")) for q in questions)})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
