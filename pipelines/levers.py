"""The lever table: variants of the default recipe at equal steps, each decoded on the same seeded sample of
validation questions (hidden mode, gold passage + 4 same-article distractors, official SQuAD EM / F1).

    python pipelines/levers.py TRAIN --validation DEV --out /tmp/levers [--only NAME ...] [--steps 1500]

Each variant changes one setting of cprag.training.config.TrainConfig and trains a checkpoint into OUT/<variant>
(resumable: a variant whose metrics.json exists is not run again, a half-trained one resumes). Results are
appended to OUT/levers.jsonl as each finishes, and the markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cprag.model.depth import AUTO
from cprag.training.config import TrainConfig
from cprag.training.recipe import train_checkpoint

BASE = TrainConfig()


def six_blocks(**change) -> dict:
    """The previous default recipe (adapters on blocks 24-29 over a cache of blocks 0-23), which the table's
    other rows changed one setting of."""
    return {"cache_layer": 24, "head": {**BASE.head, "adapter_layers": AUTO, **change}}  # AUTO: every block above


VARIANTS: dict[str, dict] = {
    "default: adapters on blocks 18-29, all training questions, bf16": {},
    "adapters on blocks 24-29 (the previous default)": six_blocks(),
    "frozen backbone (no adapters: the stop-gradient ablation)": six_blocks(adapter_layers=None),
    # capacity: 4 times the rank at the same per-component scale (alpha / rank = 2)
    "adapters rank 64 on blocks 24-29": six_blocks(adapter_rank=64, adapter_alpha=128.0),
    "no lexical features": six_blocks(lexical_prior=False),
    "4.6k training questions": {**six_blocks(), "max_questions": 4571},
    "20k training questions": {**six_blocks(), "max_questions": 20000},
    "fp32 training steps instead of bf16 (same bf16 cache)": {**six_blocks(), "dtype": "float32"},
}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:48]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--validation", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--questions", type=int, default=1000, help="validation questions decoded per variant")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "levers.jsonl"
    for name, change in VARIANTS.items():
        if args.only and name not in args.only and slug(name) not in args.only:
            continue
        directory = args.out / slug(name)
        if (directory / "metrics.json").is_file():
            continue
        config = replace(BASE, max_steps=args.steps, **change)
        metrics = train_checkpoint(args.data, directory, config, validation_path=args.validation,
                                   validation_questions=args.questions, on_progress=progress_printer(name))
        with open(log, "a") as handle:
            handle.write(json.dumps({"variant": name, "change": change, "config": asdict(config), **metrics}) + "\n")
    print(table(log))
    return 0


def progress_printer(label: str, every: float = 60.0):
    """A progress callback that prints a line to stderr at most every `every` seconds (and at each stage's end)."""
    last = [0.0]

    def progress(stage: str, done: int, total: int) -> None:
        if time.time() - last[0] > every or done == total:
            print(f"{time.strftime('%H:%M:%S')} {label} · {stage}: {done}/{total}", file=sys.stderr, flush=True)
            last[0] = time.time()

    return progress


def table(log: Path) -> str:
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    keys = ["qa/hidden/n", "qa/hidden/em", "qa/hidden/f1", "validation/tf/start", "validation/tf/exact",
            "train/questions", "train/steps", "train/seconds"]
    header = ["variant", "n", "EM", "F1", "tf start", "tf exact", "training questions", "steps", "train s",
              "s / step"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        per_step = row["train/seconds"] / max(1, row["train/steps"])
        lines.append(f"| {row['variant']} | " + " | ".join(str(row.get(k, "")) for k in keys) + f" | {per_step:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
