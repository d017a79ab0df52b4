"""Unanswerable questions over a SQuAD v1.1 training file's own paragraphs, for `cprag train --negatives`.

    python pipelines/squad_negatives.py ../shared/data/squad-v1.1-train.json --out runs/negatives.json

A seeded share (`--share`) of the questions is rewritten by the rules of `cprag.training.negatives` (entity, number,
antonym, negation) so that their paragraph no longer answers them. The output is SQuAD 2.0 format: every article
and paragraph of the input in the same order (so passage ids match the training file's and its activation cache
serves their passages), each paragraph holding only its rewritten questions, marked `is_impossible`, with the
original answer as `plausible_answers` and ids `neg-KIND-ORIGINAL_ID`. It prints the count of each kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cprag.training.negatives import KINDS, negatives_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="SQuAD v1.1 training file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--share", type=float, default=0.35, help="share of questions rewritten (default 0.35)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"rules to use (default {','.join(KINDS)})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not 0 < args.share <= 1 or not kinds or set(kinds) - set(KINDS):
        print(f"error: --share must be in (0, 1] and --kinds among {','.join(KINDS)}", file=sys.stderr)
        return 2
    try:
        raw = json.loads(args.data.read_text())
        written, counts = negatives_file(raw, args.share, args.seed, kinds)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: {args.data}: not a readable SQuAD file ({type(error).__name__}: {error})", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(written))
    print(json.dumps({"out": str(args.out), "negatives": sum(v for k, v in counts.items() if k in KINDS),
                      **dict(counts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
