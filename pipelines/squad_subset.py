"""A SQuAD-format file of whole articles a checkpoint never trained on, for continuing its training cheaply.

    python pipelines/squad_subset.py ../shared/data/squad-v1.1-train.json --seen 32000 --articles 50 \\
        --out runs/train-unseen50.json

The activation cache covers every question of its training file (for SQuAD v1.1 train: 22 GB, about 95 minutes
here), so a short continuation trains on a file of its own. `--seen N`: the shipped run trained on the first N
questions of its seeded article-grouped order (`cprag.training.train`); the articles none of whose questions are among
them
are unseen, and a seeded sample of `--articles` of them is written, paragraphs and questions unchanged.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model
from cprag.training.recipe import unseen_articles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seen", type=int, default=32_000, help="questions the checkpoint's run trained on")
    parser.add_argument("--articles", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="for its tokenizer")
    args = parser.parse_args(argv)
    _, tokenizer = load_model(args.checkpoint)
    unseen = sorted(unseen_articles(args.data, tokenizer, args.seen, args.seed))
    chosen = set(random.Random(args.seed).sample(unseen, min(args.articles, len(unseen))))
    raw = json.loads(args.data.read_text())
    kept = [a for a in raw["data"] if a["title"] in chosen]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**raw, "data": kept}))
    questions = sum(len(p["qas"]) for a in kept for p in a["paragraphs"])
    print(json.dumps({"unseen_articles": len(unseen), "articles": len(kept), "questions": questions,
                      "paragraphs": sum(len(a["paragraphs"]) for a in kept)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
