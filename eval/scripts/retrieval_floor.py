"""How close is the best passage for a question the corpus can answer, and for one it cannot?

    python eval/scripts/retrieval_floor.py ../shared/data/squad-v1.1-dev-public.json [--out eval/retrieval-floor]

A seeded half of the articles is indexed (all-MiniLM-L6-v2, exact inner product, as `cprag index` does); the
questions of those articles are in-corpus, the questions of the other half are out-of-corpus (their article is
absent, so the corpus holds no answer). For each, the top-1 retrieval score. The floor that `cprag ask` uses
(`cprag.api.MIN_RETRIEVAL_SCORE`) should sit below nearly every in-corpus score: the report gives the share of each
kind under a range of floors, the percentiles, and a histogram (PNG).

Report: `eval/retrieval-floor/summary.json` and `scores.png` (`cprag.api.MIN_RETRIEVAL_SCORE`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

from cprag.evaluation.squad import read_squad
from cprag.index.retrieve import MiniLMEmbedder, PassageIndex, passage_text_for_retrieval

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py

FLOORS = (0.15, 0.2, 0.25, 0.3, 0.35, 0.4)


def top_scores(data_path: Path, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    data = read_squad(data_path)
    articles = sorted({e.article for e in data.examples})
    random.Random(seed).shuffle(articles)
    indexed = set(articles[: len(articles) // 2])
    ids = [pid for pid in data.passages if pid.split("#")[0] in indexed]
    embedder = MiniLMEmbedder()
    vectors = embedder.embed([passage_text_for_retrieval(*data.passages[pid]) for pid in ids])
    index = PassageIndex.build(ids, vectors)
    inside = [e for e in data.examples if e.article in indexed]
    outside = [e for e in data.examples if e.article not in indexed]
    scores = []
    for group in (inside, outside):
        hits = index.search(embedder.embed([e.question for e in group]), 1)
        scores.append(np.array([h[0].score for h in hits]))
    return scores[0], scores[1], {"articles_indexed": len(indexed), "articles_held_out": len(articles) - len(indexed),
                                  "passages_indexed": len(ids)}


def plot(inside: np.ndarray, outside: np.ndarray, floor: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    bins = np.linspace(0, 1, 51)
    ax.hist(inside, bins=bins, alpha=0.6, label=f"in-corpus questions (n={len(inside)})", density=True)
    ax.hist(outside, bins=bins, alpha=0.6, label=f"out-of-corpus questions (n={len(outside)})", density=True)
    ax.axvline(floor, color="black", linestyle="--", label=f"floor {floor}")
    ax.set_xlabel("top-1 retrieval score (cosine)")
    ax.set_ylabel("density")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    from cprag.api import MIN_RETRIEVAL_SCORE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "retrieval-floor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    inside, outside, sizes = top_scores(args.data, args.seed)
    summary = {**sizes, "retrieval/in_corpus_n": len(inside), "retrieval/out_of_corpus_n": len(outside),
               "retrieval/floor": MIN_RETRIEVAL_SCORE}
    for q in (0.5, 1, 2, 5, 50):
        summary[f"retrieval/in_corpus_p{q}"] = round(float(np.percentile(inside, q)), 4)
        summary[f"retrieval/out_of_corpus_p{100 - q}"] = round(float(np.percentile(outside, 100 - q)), 4)
    for floor in sorted({*FLOORS, MIN_RETRIEVAL_SCORE}):
        summary[f"retrieval/in_corpus_below@{floor}"] = round(float((inside < floor).mean()), 4)
        summary[f"retrieval/out_of_corpus_below@{floor}"] = round(float((outside < floor).mean()), 4)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(inside, outside, MIN_RETRIEVAL_SCORE, args.out / "scores.png")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
