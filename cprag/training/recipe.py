"""End to end: SQuAD files -> examples -> activation caches -> training -> validation -> checkpoint."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.errors import ConfigError
from cprag.evaluation.oracle_qa import evaluate_oracle, oracle_passage_ids, summarize
from cprag.evaluation.squad import SquadData, article_split, read_squad
from cprag.evaluation.squad_eval import sample_examples
from cprag.model.adapters import merge
from cprag.model.backbone import BaseReference, as_reference, load_backbone
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, cplm_on, model_fingerprint
from cprag.model.stored_weights import load_trained_tensors
from cprag.training.config import TrainConfig
from cprag.training.distill import ReaderTargets
from cprag.training.examples import Examples, activation_cache, cached_negatives, prepare_examples
from cprag.training.train import STATE_FILE, TrainData, _article_grouped_order, teacher_forced_validation, train_model


@dataclass
class Prepared:
    """A fresh CPLM for `config`, the training and validation data, and their cached activations."""

    model: object
    tokenizer: object
    train: TrainData
    validation: TrainData
    validation_data: SquadData  # the questions decoded for validation
    validation_articles: list[str]
    figures: dict
    config: TrainConfig  # the run's settings placed on this backbone's depth (what train_config.json records)


def _split(examples: Examples, articles: set[str]) -> Examples:
    return Examples({p: v for p, v in examples.passages.items() if p.rsplit("#", 1)[0] in articles},
                    [q for q in examples.questions if q.article in articles], examples.skipped)


def prepare(data_path: str | Path, config: TrainConfig, base: BaseReference | str | Path | None = None,
            validation_path: str | Path | None = None,
            on_progress: Callable[[str, int, int], None] | None = None, build: bool = True) -> Prepared:
    """Build the model and the activation caches (resuming any partial cache; `build=False` uses the chunks
    already on disk, for a screen while a build runs elsewhere). Without `validation_path`, whole articles of
    the training file are held out (`validation_fraction`). `base` is the backbone: a reference, or a GGUF file,
    model folder or Hugging Face model id (cprag.model.backbone.resolve_backbone); the default GGUF when None."""
    if config.device != "cpu" and not torch.cuda.is_available():
        raise ConfigError("--device", config.device, "this machine has no CUDA device")
    base = as_reference(base)
    torch.manual_seed(config.seed)
    backbone, tokenizer = load_backbone(base)
    config = config.for_depth(backbone.config.num_hidden_layers)
    model = cplm_on(backbone, base, **config.head)
    if config.device != "cpu":
        model.to(config.device)  # the cache is built and the steps run there
    if config.init_from:
        # the same tensors may go on to read documents another way (the attention is no tensor's shape)
        load_trained_tensors(model, config.init_from, tuple(k for k in config.head if k != "document_attention"))
    data = read_squad(data_path)
    tick = time.perf_counter()
    examples = prepare_examples(tokenizer, data)

    def progress(stage):
        return (lambda done, total, _tokens: on_progress(stage, done, total)) if on_progress else None

    cache, figures = activation_cache(model, tokenizer, examples, Path(data_path), config.cache_layer,
                                      config.cache_dtype, config.seed, build=build,
                                      on_progress=progress("activation cache: training data"))
    if validation_path is not None:
        validation_data = read_squad(validation_path)
        validation_examples = prepare_examples(tokenizer, validation_data)
        validation_cache, more = activation_cache(model, tokenizer, validation_examples, Path(validation_path),
                                                  config.cache_layer, config.cache_dtype, config.seed,
                                                  on_progress=progress("activation cache: validation data"),
                                                  build=build)
        figures = {k: figures.get(k, 0) + v for k, v in more.items()} if figures else more
        train_examples = examples
        articles = sorted({e.article for e in validation_data.examples})
    else:
        train_articles, held_out = article_split(data, config.validation_fraction, config.seed)
        train_examples, validation_examples = _split(examples, train_articles), _split(examples, held_out)
        validation_cache, validation_data, articles = cache, data, sorted(held_out)
    questions = train_examples.questions
    if config.max_questions is not None and config.max_questions < len(questions):
        questions = random.Random(config.seed).sample(questions, config.max_questions)
    if config.negatives:
        negatives, more = _negatives(model, tokenizer, config, data, cache, progress("activation cache: negatives"),
                                     build)
        trained = {q.passage_id for q in questions}
        questions = questions + [q for q in negatives.questions if q.passage_id in trained]
        figures.update({f"negatives/{k.split('/', 1)[1]}": v for k, v in more.items()})
        figures["negatives/questions"] = sum(q.impossible for q in questions)
    train = TrainData.build(model, tokenizer, train_examples, cache, config.distractors, config.seed, questions)
    if config.reader_targets:
        train.reader_targets = ReaderTargets.load(config.reader_targets)
        figures["distill/questions"] = sum(q.qid in train.reader_targets.start for q in train.examples.questions)
    validation = TrainData.build(model, tokenizer, validation_examples, validation_cache, config.distractors,
                                 config.seed)
    figures["prepare/seconds"] = round(time.perf_counter() - tick, 1)
    return Prepared(model, tokenizer, train, validation, validation_data, articles, figures, config)


def _negatives(model, tokenizer, config: TrainConfig, data: SquadData, cache, on_progress,
               build: bool) -> tuple[Examples, dict]:
    """The unanswerable questions of `config.negatives` over the training file's paragraphs, cached beside
    `cache` (`cached_negatives`). Returns them and their cache's build figures."""
    path = Path(config.negatives)
    negatives, figures = cached_negatives(model, tokenizer, path, data, cache, config.cache_layer,
                                          config.cache_dtype, config.seed, build=build, on_progress=on_progress)
    if not negatives.questions:
        raise ConfigError("--negatives", str(path), "holds no unanswerable question over the training file's "
                          f"paragraphs (skipped: {negatives.skipped})")
    return negatives, figures


def unseen_articles(data_path: str | Path, tokenizer, seen: int, seed: int = 0) -> set[str]:
    """Articles of a training file none of whose questions are among the first `seen` of a run's first epoch
    order (the run with this seed trained on those first)."""
    questions = prepare_examples(tokenizer, read_squad(data_path)).questions
    order = _article_grouped_order(questions, random.Random(seed))  # the run's first draw from its seeded rng
    trained = {questions[i].article for i in order[:seen]}
    return {q.article for q in questions} - trained


def add_fit_question_arguments(parser, questions: int) -> None:
    """The flags an inference-time fit script passes to `fit_questions`: DATA, --checkpoint, --unseen, --seen,
    --articles, --questions (default `questions`) and --seed."""
    parser.add_argument("data", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--unseen", action="store_true", help="only articles the checkpoint never trained on")
    parser.add_argument("--seen", type=int, default=32_000, help="questions the checkpoint's run trained on")
    parser.add_argument("--articles", type=int, help="with --unseen: a seeded sample of this many of them (their "
                        "passages are encoded once and shared by their questions)")
    parser.add_argument("--questions", type=int, default=questions)
    parser.add_argument("--seed", type=int, default=0)


def fit_questions(data_path: str | Path, data: SquadData, tokenizer, questions: int, seed: int = 0,
                  seen: int | None = None, articles: int | None = None) -> tuple[list, list[list[str]]]:
    """The seeded questions an inference-time fit reads (`eval/passage-prior/`, `eval/end-bias/`,
    `eval/rerank/`), each with the memory `cprag eval squad --oracle` draws for it (its passage and 4 same-article
    distractors): from the articles a run that trained on its first `seen` questions never saw (a seeded sample
    of `articles` of them), or from every article when `seen` is None. Returns (examples, passage ids of each)."""
    chosen = None
    if seen is not None:
        chosen = sorted(unseen_articles(data_path, tokenizer, seen, seed))
        if articles:
            chosen = sorted(random.Random(seed).sample(chosen, articles))
    examples = sample_examples(data, questions, seed, tuple(chosen) if chosen else None)
    ids, rng = sorted(data.passages), random.Random(seed)
    return examples, [oracle_passage_ids(e, ids, 4, rng) for e in examples]


def resume_records(path: Path, examples) -> tuple[dict[str, dict], list[int]]:
    """What a fit script collected into `path` before (JSON lines keyed by "qid"), and the indices of `examples`
    it has still to collect: the scripts append one record per question, so an interrupted run resumes."""
    done = {r["qid"]: r for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
    return done, [i for i, e in enumerate(examples) if e.qid not in done]


def screen_variant(prepared: Prepared, config: TrainConfig, validation_limit: int = 2000) -> dict:
    """A quick lever screen: train, then teacher-forced metrics (no decoding) on validation questions
    (`validation/tf/...`) and on 400 training questions (`train/tf/...`, to tell under- from overfitting)."""
    config = config.for_depth(prepared.model.config.backbone_config.num_hidden_layers)
    report = train_model(prepared.model, prepared.tokenizer, prepared.train, config)
    metrics = {f"validation/{k}": v for k, v in teacher_forced_validation(
        prepared.model, prepared.tokenizer, prepared.validation, config, validation_limit, config.seed).items()}
    metrics.update({f"train/{k}": v for k, v in teacher_forced_validation(
        prepared.model, prepared.tokenizer, prepared.train, config, 400, config.seed).items()})
    metrics.update({"train/steps": report.steps, "train/seconds": round(report.seconds, 1),
                    "train/final_loss": _tail_mean(report.losses)})
    return metrics


def train_checkpoint(
    data_path: str | Path, out_dir: str | Path, config: TrainConfig, base: BaseReference | str | Path | None = None,
    validation_path: str | Path | None = None, validation_questions: int = 1000,
    validation_modes: tuple[str, ...] = ("hidden",), teacher_forced_questions: int | None = 2000,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict:
    """Train, validate, and save a checkpoint with its config. Returns the flat metrics dict (qa/hidden/f1, ...)
    also written to `out_dir/metrics.json`; decoded answers go to `out_dir/validation.jsonl`."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prepared = prepare(data_path, config, base, validation_path, on_progress)
    model, tokenizer, config = prepared.model, prepared.tokenizer, prepared.config

    def report(stage):
        return (lambda done, total, *_: on_progress(stage, done, total)) if on_progress else None

    trained = train_model(model, tokenizer, prepared.train, config, out_dir, report("train"))
    teacher_forced = teacher_forced_validation(model, tokenizer, prepared.validation, config,
                                               teacher_forced_questions, config.seed)
    model.save_pretrained(out_dir)
    fingerprint = model_fingerprint(model)
    if model.adapters is not None:
        merge(model.backbone, model.adapters)  # decoding speed; the saved adapters are unchanged
    # the questions `cprag eval squad VALIDATION --oracle --limit N --seed S` asks too
    validation = sample_examples(prepared.validation_data, validation_questions, config.seed,
                                 tuple(prepared.validation_articles) if validation_path is None else None)
    tick = time.perf_counter()
    results = evaluate_oracle(model, tokenizer, validation, prepared.validation_data.passages,
                              list(validation_modes), distractors=config.distractors, seed=config.seed)
    metrics = summarize(results)
    metrics.update({f"validation/{k}": v for k, v in teacher_forced.items()})
    metrics.update({f"cache/{k.split('/', 1)[1]}": v for k, v in prepared.figures.items() if k.startswith("cache/")})
    metrics.update({k: v for k, v in prepared.figures.items() if k.startswith("negatives/")})
    metrics.update({
        "train/steps": trained.steps, "train/questions": trained.examples,
        "train/visible_examples": trained.visible_examples, "train/seconds": round(trained.seconds, 1),
        "train/final_loss": _tail_mean(trained.losses), "prepare/seconds": prepared.figures["prepare/seconds"],
        "validation/seconds": round(time.perf_counter() - tick, 1),
        "total/seconds": round(time.perf_counter() - started, 1),
    })
    (out_dir / "train_config.json").write_text(json.dumps({
        "train": asdict(config), "data": Path(data_path).name,
        "validation_data": Path(validation_path).name if validation_path else Path(data_path).name,
        "validation_articles": prepared.validation_articles,
        "skipped": {**prepared.train.examples.skipped}, "fingerprint": fingerprint,
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
