"""End to end: SQuAD file -> article split -> cached features -> CP-head training -> validation -> checkpoint."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from cprag.backbone import BaseReference, cache_root, default_reference
from cprag.checkpoint import model_fingerprint, new_cplm
from cprag.features import extract_features, features_key, load_or_extract
from cprag.qa_eval import evaluate_oracle, summarize
from cprag.squad import article_split, read_squad
from cprag.train import STATE_FILE, train_head
from cprag.train_config import TrainConfig


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
    base = base or default_reference()
    torch.manual_seed(config.seed)
    model, tokenizer = new_cplm(base, **config.head)
    data = read_squad(data_path)
    train_articles, validation_articles = article_split(data, config.validation_fraction, config.seed)

    def report(stage):
        return (lambda done, total, *_: on_progress(stage, done, total)) if on_progress else None

    tick = time.perf_counter()
    key = features_key(Path(data_path), base.sha256)
    passages, questions, skipped = load_or_extract(
        cache_root() / "features", key,
        lambda: extract_features(model, tokenizer, data,
                                 on_progress=(lambda s, d, t: on_progress(f"features: {s}", d, t)) if on_progress
                                 else None),
    )
    feature_seconds = time.perf_counter() - tick
    train_questions = [q for q in questions if q.passage_id.rsplit("#", 1)[0] in train_articles]
    text = {e.qid: e.question for e in data.examples}
    report_train = train_head(model, tokenizer, train_questions, passages, text, config, out_dir,
                              report("train"))

    validation = [e for e in data.examples if e.article in validation_articles]
    random.Random(config.seed).shuffle(validation)
    validation = validation[:validation_questions]
    tick = time.perf_counter()
    results = evaluate_oracle(model, tokenizer, validation, data.passages, list(validation_modes),
                              distractors=config.distractors, seed=config.seed)
    metrics = summarize(results)
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
