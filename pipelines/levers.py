"""Train and validate variants of the default recipe, one lever at a time, and write a table.

    python pipelines/levers.py DATA --out /tmp/levers [--only NAME ...] [--validation-questions 200]

Each variant changes one setting of cprag.train_config.TrainConfig; features are cached once and shared.
Results go to OUT/levers.jsonl (appended as each finishes) and are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from cprag.recipe import train_checkpoint
from cprag.train_config import TrainConfig

BASE = TrainConfig()
VARIANTS: dict[str, dict] = {
    "default": {},
    "no refiner (causal document keys)": {"head": {**BASE.head, "doc_refine_layers": 0}},
    "keys that also see their paste token": {"head": {**BASE.head, "key_sees_token": True}},
    "no end entries": {"head": {**BASE.head, "end_entries": False}},
    "no successor bias": {"head": {**BASE.head, "successor_bias": False}},
    "no end entries, no successor (plain CP head)": {"head": {**BASE.head, "end_entries": False,
                                                              "successor_bias": False}},
    "0 distractors": {"distractors": 0},
    "end weight 1": {"end_weight": 1.0},
    "2 epochs": {"epochs": BASE.epochs / 2},
    "lr 5e-4": {"lr": 5e-4},
    "refiner 2 layers x 256": {"head": {**BASE.head, "doc_refine_layers": 2, "doc_refine_dim": 256}},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--validation-questions", type=int, default=200)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "levers.jsonl"
    for name, change in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        config = TrainConfig(**{**asdict(BASE), **change})
        slug = "".join(c if c.isalnum() else "-" for c in name)[:40]
        metrics = train_checkpoint(args.data, args.out / slug, config, validation_questions=args.validation_questions)
        with open(log, "a") as handle:
            handle.write(json.dumps({"variant": name, "change": change, **metrics}) + "\n")
        print(f"{name}: EM {metrics['qa/hidden/em']:.1f} F1 {metrics['qa/hidden/f1']:.1f} "
              f"({metrics['train/seconds']:.0f}s training)", flush=True)
    print(table(log))
    return 0


def table(log: Path) -> str:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    lines = ["| variant | hidden EM | hidden F1 | copy rate | train s | final loss |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['variant']} | {row['qa/hidden/em']:.1f} | {row['qa/hidden/f1']:.1f} | "
                     f"{row['qa/hidden/copy_rate']:.2f} | {row['train/seconds']:.0f} | {row['train/final_loss']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
