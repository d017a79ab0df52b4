"""End to end: SQuAD file -> article split -> cached features -> CP-head training -> validation -> checkpoint."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.backbone import BaseReference, cache_root, default_reference
from cprag.checkpoint import model_fingerprint, new_cplm
from cprag.evaluate import sample_examples
from cprag.features import extract_features, features_key, load_or_extract
from cprag.qa_eval import evaluate_oracle, summarize
from cprag.squad import article_of, article_split, read_squad
from cprag.train import STATE_FILE, teacher_forced_validation, train_head
from cprag.train_config import TrainConfig


@dataclass
class Prepared:
    """A fresh CPLM for `config`, the article split, and the cached features of the training file."""

    model: object
    tokenizer: object
    data: object
    train_articles: set[str]
    validation_articles: set[str]
    passages: dict
    questions: list
    skipped: dict
    feature_seconds: float

    def split(self, articles: set[str]) -> list:
        return [q for q in self.questions if article_of(q.passage_id) in articles]

    @property
    def question_text(self) -> dict[str, str]:
        return {e.qid: e.question for e in self.data.examples}


def prepare(data_path: str | Path, config: TrainConfig, base: BaseReference | None = None,
            on_progress: Callable[[str, int, int], None] | None = None) -> Prepared:
    base = base or default_reference()
    torch.manual_seed(config.seed)
    model, tokenizer = new_cplm(base, **config.head)
    data = read_squad(data_path)
    train_articles, validation_articles = article_split(data, config.validation_fraction, config.seed)
    tick = time.perf_counter()
    key = features_key(Path(data_path), base.sha256, model.config.cp_layers)
    passages, questions, skipped = load_or_extract(
        cache_root() / "features", key,
        lambda: extract_features(model, tokenizer, data,
                                 on_progress=(lambda s, d, t: on_progress(f"features: {s}", d, t)) if on_progress
                                 else None),
    )
    return Prepared(model, tokenizer, data, train_articles, validation_articles, passages, questions, skipped,
                    time.perf_counter() - tick)


def screen_variant(prepared: Prepared, config: TrainConfig) -> dict:
    """A quick lever screen: train on cached features, then teacher-forced metrics (no decoding) on the held-out
    articles (`validation/tf/...`) and on 400 training questions (`train/tf/...`, to tell under- from overfitting)."""
    text = prepared.question_text
    training = prepared.split(prepared.train_articles)
    report = train_head(prepared.model, prepared.tokenizer, training, prepared.passages, text, config)
    held_out = prepared.split(prepared.validation_articles)
    metrics = {f"validation/{k}": v for k, v in teacher_forced_validation(
        prepared.model, prepared.tokenizer, held_out, prepared.passages, text, config.distractors, config.seed).items()}
    seen = random.Random(config.seed).sample(training, min(400, len(training)))
    metrics.update({f"train/{k}": v for k, v in teacher_forced_validation(
        prepared.model, prepared.tokenizer, seen, prepared.passages, text, config.distractors, config.seed).items()})
    metrics.update({"train/steps": report.steps, "train/seconds": round(report.seconds, 1),
                    "train/final_loss": _tail_mean(report.losses)})
    return metrics


def train_checkpoint(
    data_path: str | Path, out_dir: str | Path, config: TrainConfig, base: BaseReference | None = None,
    validation_questions: int = 300, validation_modes: tuple[str, ...] = ("hidden",),
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Train, validate on held-out articles, and save a checkpoint with its config and model card. Returns the
    flat metrics dict (qa/hidden/f1, ...) also written to `out_dir/metrics.json`."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepared = prepare(data_path, config, base, on_progress)
    model, tokenizer, data = prepared.model, prepared.tokenizer, prepared.data
    passages, skipped, feature_seconds = prepared.passages, prepared.skipped, prepared.feature_seconds
    train_articles, validation_articles = prepared.train_articles, prepared.validation_articles

    def report(stage):
        return (lambda done, total, *_: on_progress(stage, done, total)) if on_progress else None

    text = prepared.question_text
    report_train = train_head(model, tokenizer, prepared.split(train_articles), passages, text, config, out_dir,
                              report("train"))

    held_out = prepared.split(validation_articles)
    teacher_forced = teacher_forced_validation(model, tokenizer, held_out, passages, text, config.distractors,
                                               config.seed)
    # the questions `cprag eval squad --held-out --limit N` asks too
    validation = sample_examples(data, validation_questions, config.seed, tuple(sorted(validation_articles)))
    tick = time.perf_counter()
    results = evaluate_oracle(model, tokenizer, validation, data.passages, list(validation_modes),
                              distractors=config.distractors, seed=config.seed)
    metrics = summarize(results)
    metrics.update({f"validation/{k}": v for k, v in teacher_forced.items()})
    metrics.update({
        "train/steps": report_train.steps, "train/examples": report_train.examples,
        "train/seconds": round(report_train.seconds, 1), "train/final_loss": _tail_mean(report_train.losses),
        "features/seconds": round(feature_seconds, 1), "validation/seconds": round(time.perf_counter() - tick, 1),
        "total/seconds": round(time.perf_counter() - started, 1),
    })
    model.save_pretrained(out_dir)
    (out_dir / "train_config.json").write_text(json.dumps({
        "train": asdict(config), "data": Path(data_path).name, "train_articles": sorted(train_articles),
        "validation_articles": sorted(validation_articles), "skipped": {**data.skipped, **skipped},
        "fingerprint": model_fingerprint(model),
    }, indent=2))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    with open(out_dir / "validation.jsonl", "w") as handle:
        for result in results:
            handle.write(json.dumps(asdict(result)) + "\n")
    (out_dir / STATE_FILE).unlink(missing_ok=True)  # finished: a rerun trains afresh instead of resuming
    return metrics


def _tail_mean(values: list[float], n: int = 50) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4) if tail else float("nan")
