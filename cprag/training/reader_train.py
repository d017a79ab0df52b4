"""Training the visible span reader on SQuAD-format data: resumable, with a progress file.

Each step reads `questions_per_step` questions. A question's rows are its own passage (a window holding the
answer, when the passage is longer than a row) and `distractors` other passages of the same article, and its
start and end are trained by cross-entropy normalised over all of those rows (`shared_span_loss`). Only the
adapters and the head train; blocks below the first adapted one run without autograd, so they cost a forward.

The run folder holds `state.pt` (weights, optimiser, step: written atomically every `save_every` steps, and the
run resumes from it), `progress.jsonl` (one line per logged step) and, at the end, the reader itself.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cprag.decoding.span_read import (
    ReaderRow,
    pad_rows,
    question_prefix,
    windows,
    word_bounds,
)
from cprag.evaluation.squad import SquadData, answer_token_span, article_of
from cprag.index.encode import tokenize_passage
from cprag.model.reader_checkpoint import save_reader
from cprag.model.span_reader import SpanReader, shared_span_loss

STATE = "state.pt"
PROGRESS = "progress.jsonl"


@dataclass
class ReaderTrainConfig:
    max_steps: int = 2000
    questions_per_step: int = 8
    distractors: int = 1  # other passages of the same article read beside the gold one
    lr: float = 3e-4  # adapters
    head_lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    row_tokens: int = 320  # the longest training row (a long passage is cut to a window holding the answer)
    max_questions: int | None = None  # the first N of the seeded order (None: all)
    save_every: int = 50
    log_every: int = 10
    seed: int = 0
    dtype: str = "bfloat16"  # autocast dtype of the backbone's passes
    reader: dict = field(default_factory=dict)  # SpanReaderConfig overrides (adapter_layers, rank, lookahead)


@dataclass
class ReaderExample:
    qid: str
    question: str
    passage_id: str
    span: tuple[int, int]  # inclusive token range of the first answer in its passage


@dataclass
class ReaderData:
    tokens: dict[str, tuple[list[int], list[tuple[int, int]], list[bool], list[bool]]]  # pid -> ids, offsets, bounds
    by_article: dict[str, list[str]]
    examples: list[ReaderExample]
    skipped: int


def prepare_reader_data(tokenizer, data: SquadData, max_answer_tokens: int = 30) -> ReaderData:
    tokens = {}
    for pid, (_, text) in data.passages.items():
        t = tokenize_passage(tokenizer, text)
        starts, ends = word_bounds(text, t.offsets)
        tokens[pid] = (t.ids, t.offsets, starts, ends)
    by_article: dict[str, list[str]] = {}
    for pid in data.passages:
        by_article.setdefault(article_of(pid), []).append(pid)
    examples, skipped = [], 0
    for e in data.examples:
        if not e.answers:
            skipped += 1
            continue
        offsets = tokens[e.passage_id][1]
        span = answer_token_span(offsets, e.answer_start, e.answer_start + len(e.answers[0]))
        if span is None or span[1] - span[0] + 1 > max_answer_tokens:
            skipped += 1
            continue
        examples.append(ReaderExample(e.qid, e.question, e.passage_id, span))
    return ReaderData(tokens, by_article, examples, skipped)


def _row(prefix: list[int], passage, window: tuple[int, int]) -> ReaderRow:
    ids, offsets, starts, ends = passage
    a, b = window
    return ReaderRow(ids=prefix + ids[a:b], first=len(prefix), passage=0, offsets=offsets[a:b],
                     starts_ok=starts[a:b], ends_ok=ends[a:b])


def question_rows(tokenizer, data: ReaderData, example: ReaderExample, distractors: int, row_tokens: int,
                  rng: random.Random) -> tuple[list[ReaderRow], tuple[int, int]]:
    """The gold row first, then the distractor rows, and the answer's (start, end) row positions."""
    prefix = question_prefix(tokenizer, example.question)
    room = max(row_tokens - len(prefix), 16)
    gold = data.tokens[example.passage_id]
    first, last = example.span
    length = len(gold[0])
    lo, hi = max(0, last + 1 - room), min(first, max(length - room, 0))
    begin = rng.randint(lo, hi) if length > room and hi >= lo else 0
    window = (begin, min(begin + room, length))
    rows = [_row(prefix, gold, window)]
    others = [p for p in data.by_article[article_of(example.passage_id)] if p != example.passage_id]
    for pid in rng.sample(others, min(distractors, len(others))):
        rows.append(_row(prefix, data.tokens[pid], windows(len(data.tokens[pid][0]), room)[0]))
    while len(rows) < 1 + distractors:  # an article of one passage: the gold row again keeps the shapes equal
        rows.append(rows[0])
    return rows, (len(prefix) + first - begin, len(prefix) + last - begin)


def _schedule(step: int, config: ReaderTrainConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(reader: SpanReader, config: ReaderTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW([
        {"params": list(reader.adapters.parameters()), "lr": config.lr},
        {"params": list(reader.span_head.parameters()), "lr": config.head_lr},
    ], weight_decay=config.weight_decay)


def _save_state(run: Path, reader: SpanReader, optimizer, step: int) -> None:
    staging = run / f".{STATE}.tmp"
    torch.save({"step": step, "trained": reader.trained_state(), "optimizer": optimizer.state_dict()}, staging)
    os.replace(staging, run / STATE)


def train_reader(reader: SpanReader, tokenizer, data: ReaderData, config: ReaderTrainConfig, run: str | Path,
                 on_step: Callable[[dict], None] | None = None) -> dict:
    """Train (or resume) in `run`; the finished reader is saved to `run`/reader. Returns the run's figures."""
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    (run / "reader_train_config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    optimizer = _optimizer(reader, config)
    step = 0
    if (run / STATE).is_file():
        state = torch.load(run / STATE, weights_only=False)
        reader.load_state_dict(state["trained"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    order = list(range(len(data.examples)))
    random.Random(config.seed).shuffle(order)
    if config.max_questions:
        order = order[: config.max_questions]
    device = next(reader.span_head.parameters()).device
    cast = getattr(torch, config.dtype)
    reader.train()
    started, tokens, losses = time.perf_counter(), 0, []
    first_step = step
    while step < config.max_steps:
        rng = random.Random(f"{config.seed}:{step}")  # a resumed step draws exactly what it would have
        begin = (step * config.questions_per_step) % len(order)
        chosen = [data.examples[order[(begin + i) % len(order)]] for i in range(config.questions_per_step)]
        rows, golds = [], []
        for example in chosen:
            found, gold = question_rows(tokenizer, data, example, config.distractors, config.row_tokens, rng)
            rows += found
            golds.append(gold)
        batch = pad_rows(rows, tokenizer.pad_token_id or 0)
        candidates = torch.zeros_like(batch["starts_ok"])
        for i, row in enumerate(rows):
            candidates[i, row.first: len(row.ids)] = True
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * _schedule(step, config)
        with torch.autocast(device.type, dtype=cast, enabled=cast != torch.float32):
            start, end = reader(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        loss = shared_span_loss(start, end, candidates.to(device), torch.zeros(len(chosen), dtype=torch.long,
                                device=device), torch.tensor([g[0] for g in golds], device=device),
                                torch.tensor([g[1] for g in golds], device=device), 1 + config.distractors)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        step += 1
        tokens += int(batch["attention_mask"].sum())
        losses.append(float(loss.detach()))
        if step % config.log_every == 0 or step == config.max_steps:
            elapsed = time.perf_counter() - started
            line = {"step": step, "loss": round(sum(losses) / len(losses), 4), "tokens_per_second":
                    round(tokens / elapsed, 1), "elapsed_s": round(elapsed, 1), "eta_s":
                    round(elapsed / (step - first_step) * (config.max_steps - step), 1)}
            losses = []
            with open(run / PROGRESS, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            if on_step:
                on_step(line)
        if step % config.save_every == 0 or step == config.max_steps:
            _save_state(run, reader, optimizer, step)
    reader.eval()
    figures = {"steps": step, "questions_seen": step * config.questions_per_step,
               "train_seconds_this_run": round(time.perf_counter() - started, 1)}
    save_reader(reader, run / "reader", extra={"training": asdict(config) | figures})
    return figures
