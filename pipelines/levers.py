"""Screen training levers one at a time against the default recipe, and write a table.

    python pipelines/levers.py DATA --out /tmp/levers [--only NAME ...] [--steps 300]

Each variant changes one setting of cprag.train_config.TrainConfig, trains for `--steps` steps on cached features,
and is scored without decoding: teacher-forced metrics on the held-out articles (gold + same-article distractors),
where `tf/start` is the first answer token, `tf/end` the stop decision and `tf/exact` every step of the answer
(greedy decoding reproduces an answer exactly when every step is right), plus the same on 400 training questions.
Results are appended to OUT/levers.jsonl as each finishes and printed as a markdown table. The full recipe with
decoded EM/F1 is `pipelines/train_default.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cprag.recipe import prepare, screen_variant
from cprag.train_config import TrainConfig

BASE = TrainConfig()


def head(**change) -> dict:
    return {"head": {**BASE.head, **change}}


VARIANTS: dict[str, dict] = {
    "default": {},
    "no lexical prior": head(lexical_prior=False),
    "lexical prior: one window (12 tokens)": head(lexical_windows=[12]),
    "lexical prior: no sentence features": head(lexical_sentences=False),
    "lexical prior: no answer types": head(lexical_types=False),
    "answer types: sentence-opening capitals as their own type": head(lexical_sentence_starts=True),
    "query refiner 1 x 128": head(query_refine_layers=1),
    "no own-context end entries": head(own_context_ends=False),
    "final layer only (no middle-layer features)": head(cp_layers=None),
    "lookahead 2 (document keys also see the next 2 tokens)": head(doc_lookahead=2),
    "keys that also see their paste token": head(key_sees_token=True),
    "key dim 128": head(key_dim=128),
    "no refiner": head(doc_refine_layers=0),
    "refiner 2 layers x 256": head(doc_refine_layers=2, doc_refine_dim=256),
    "MLP query/key projections (width 256)": head(head_mlp_dim=256),
    "no end entries": head(end_entries=False),
    "no successor bias": head(successor_bias=False),
    "0 distractors": {"distractors": 0},
    "8 distractors": {"distractors": 8},
    "end weight 1": {"end_weight": 1.0},
    "scalars at the base learning rate": {"scalar_lr_scale": 1.0},
    "lr 1e-3": {"lr": 1e-3},
    "lr 4e-3": {"lr": 4e-3},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "levers.jsonl"
    for name, change in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        config = TrainConfig(**{**asdict(BASE), **change, "max_steps": args.steps})
        metrics = screen_variant(prepare(args.data, config), config)
        with open(log, "a") as handle:
            handle.write(json.dumps({"variant": name, "change": change, **metrics}) + "\n")
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in metrics.items()), flush=True)
    print(table(log))
    return 0


def table(log: Path) -> str:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    keys = ["validation/tf/start", "validation/tf/end", "validation/tf/exact", "validation/tf/token",
            "train/tf/start", "train/tf/exact", "train/steps", "train/seconds"]
    lines = ["| variant | " + " | ".join(k.replace("validation/", "val ").replace("train/", "train ") for k in keys)
             + " |", "|---" * (len(keys) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['variant']} | " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
