"""Training the span reader on the activation cache: resumable, with a progress file.

The lower blocks never run: a question's prompt states and its passages' states entering the split are read from
the activation cache the CPLM's training builds (`cprag.training.examples.activation_cache`: `q/<qid>` holds the
prompt, then the answer, and its first `prompt_len` states are the prompt's alone; `p/<pid>` holds [BOS] +
passage). Each step joins them and runs the upper blocks with autograd.

Each step reads `questions_per_step` questions. An answerable question's rows are its own passage (a window
holding the answer, when the passage is longer than a row) and `distractors` other passages of the same article;
its start and end are trained by cross-entropy normalised over all of those rows and the null entry. A share
`no_answer_fraction` of the questions is asked with distractors alone (1 + `distractors` of them) and trained to
answer null. An unanswerable question (SubjQA's, say) is asked with its own passage and `distractors` others, and
trained to answer null. Several training files train together (`ReaderData.build_many`), each from its own cache;
rewritten questions over a file's own paragraphs join through `ReaderData.add_negatives`.

The run folder holds `state.pt` (weights, optimiser, step: written atomically every `save_every` steps, and the
run resumes from it), `progress.jsonl` (one line per logged step), `reader-q<N>/` snapshots after N questions
(`snapshot_questions`, for a learning curve) and, at the end, the reader itself in `reader/`.
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

from cprag.decoding.span_read import ROW_TOKENS, windows, word_bounds
from cprag.errors import CacheMismatch
from cprag.model.reader_checkpoint import save_reader
from cprag.model.span_reader import SpanReader, question_scores, span_loss
from cprag.training.activations import ActivationCache
from cprag.training.examples import Examples, TrainQuestion

STATE = "state.pt"
PROGRESS = "progress.jsonl"


@dataclass
class ReaderTrainConfig:
    max_steps: int = 1000
    questions_per_step: int = 16
    distractors: int = 1  # other passages of the same article read beside the gold one
    no_answer_fraction: float = 0.125  # questions asked with distractors alone, trained to answer null
    lr: float = 5e-4  # adapters
    head_lr: float = 3e-3  # span head and null state
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_questions: int | None = None  # the first N questions of the cache's plan (None: every cached one)
    first_question: int = 0  # where in the seeded question order step 0 starts (go on past what a run read)
    save_every: int = 25
    log_every: int = 5
    snapshot_questions: list[int] = field(default_factory=list)  # save reader-q<N>/ after N questions
    seed: int = 0
    dtype: str = "float32"  # the upper blocks' compute: "bfloat16" (autocast) or "float32"
    warm_from: str | None = None  # a CPLM checkpoint whose adapters on the same blocks start the reader's


@dataclass
class ReaderData:
    """Cached questions and passages the reader trains on, and each passage's text (for word bounds)."""

    cache: ActivationCache
    layer: int  # index of the split's states in the cache's layers
    questions: list[TrainQuestion]
    by_article: dict[str, list[str]]  # cached passage ids per article
    texts: dict[str, str]
    offsets: dict[str, list[tuple[int, int]]]

    @classmethod
    def build(cls, examples: Examples, cache: ActivationCache, split: int, texts: dict[str, str],
              max_questions: int | None = None) -> ReaderData:
        return cls.build_many([(examples, cache)], split, texts, max_questions)

    @classmethod
    def build_many(cls, sources: list[tuple[Examples, ActivationCache]], split: int, texts: dict[str, str],
                   max_questions: int | None = None) -> ReaderData:
        """The questions of several training files, each with its own cache: the first `max_questions` of each
        file's cache plan (None: every cached one), unanswerable ones included (read with their own passage)."""
        cache, questions, by_article, offsets = sources[0][1], [], {}, {}
        for examples, source_cache in sources:
            if split not in source_cache.layers:
                raise CacheMismatch(str(source_cache.directory), f"it holds layers {source_cache.layers}, not "
                                    f"the reader's split {split}")
            # a passage id an earlier file already holds (Natural Questions and SQuAD share Wikipedia titles) is
            # another paragraph: the earlier file keeps it, the later one leaves it and its questions out
            shared = set(offsets) & set(examples.passages)
            if source_cache is not cache:
                cache.include(source_cache, keep_own=True)
            questions += [q for q in cls._cached_questions(examples, source_cache, max_questions)
                          if q.passage_id not in shared]
            for pid in examples.passages:
                if f"p/{pid}" in source_cache and pid not in shared:
                    by_article.setdefault(pid.rsplit("#", 1)[0], []).append(pid)
            offsets |= {pid: p.offsets for pid, p in examples.passages.items() if pid not in shared}
        return cls(cache, cache.layers.index(split), questions, by_article, texts, offsets)

    @staticmethod
    def _cached_questions(examples: Examples, cache: ActivationCache, max_questions: int | None
                          ) -> list[TrainQuestion]:
        order = {key: i for i, key in enumerate(k for chunk in cache.plan["chunks"] for k in chunk)}
        questions = sorted(examples.questions, key=lambda q: order.get(f"q/{q.qid}", len(order)))
        if max_questions is not None:
            questions = questions[:max_questions]
        questions = [q for q in questions if f"q/{q.qid}" in cache and f"p/{q.passage_id}" in cache]
        if max_questions is not None and len(questions) < min(max_questions, len(examples.questions)):
            raise CacheMismatch(str(cache.directory), f"it holds {len(questions)} of the first {max_questions} "
                                "questions: build more of it first")
        return questions

    def add_negatives(self, negatives: list[TrainQuestion]) -> int:
        """Add unanswerable questions over passages the data's questions already read (`cached_negatives`: their
        prompts must be in the cache); the rest are left out. Returns how many were added."""
        trained = {q.passage_id for q in self.questions}
        kept = [q for q in negatives if q.passage_id in trained and f"q/{q.qid}" in self.cache]
        self.questions += kept
        return len(kept)

    def passage(self, pid: str) -> torch.Tensor:
        """(n, H) float32 states of the passage's own tokens entering the split (its BOS dropped)."""
        return torch.from_numpy(self.cache.get(f"p/{pid}")[1:, self.layer].astype("float32"))

    def prompt(self, question: TrainQuestion) -> torch.Tensor:
        return torch.from_numpy(self.cache.get(f"q/{question.qid}")[: question.prompt_len, self.layer]
                                .astype("float32"))

    def bounds(self, pid: str) -> tuple[list[bool], list[bool]]:
        return word_bounds(self.texts[pid], self.offsets[pid])


@dataclass
class _Asked:
    sequences: list[int]  # indices into the step's pairs, gold window first
    starts_ok: torch.Tensor  # (N + 1,) bool over the question's positions, then null
    ends_ok: torch.Tensor
    gold: tuple[int, int] | None  # (start, end) in the question's positions; None: the answer is null


def _question_rows(data: ReaderData, question: TrainQuestion, negative: bool, distractors: int,
                   rng: random.Random, pairs: list) -> _Asked:
    asked = data.prompt(question)
    room = max(ROW_TOKENS - len(asked) - 1, 16)
    article = question.passage_id.rsplit("#", 1)[0]
    others = [p for p in data.by_article.get(article, []) if p != question.passage_id]
    if not others:  # an article of one passage: distractors from another article
        pool = sorted(data.by_article)
        others = [p for a in rng.sample(pool, min(3, len(pool))) for p in data.by_article[a]
                  if p != question.passage_id]
    chosen = rng.sample(others, min(distractors + int(negative), len(others)))
    rows: list[tuple[str, tuple[int, int]]] = []
    gold = None
    if question.impossible and not negative:  # its own passage, which does not answer it: the hardest negative
        rows.append((question.passage_id, windows(len(data.offsets[question.passage_id]), room)[0]))
    elif not negative:
        length = len(data.offsets[question.passage_id])
        first, last = question.span
        lo, hi = max(0, last + 1 - room), min(first, max(length - room, 0))
        begin = rng.randint(lo, hi) if length > room and hi >= lo else 0
        rows.append((question.passage_id, (begin, min(begin + room, length))))
        gold = (first - begin, last - begin)
    rows += [(pid, windows(len(data.offsets[pid]), room)[0]) for pid in chosen]
    sequences, starts, ends = [], [], []
    for pid, (a, b) in rows:
        sequences.append(len(pairs))
        pairs.append((asked, data.passage(pid)[a:b]))
        s, e = data.bounds(pid)
        starts += s[a:b]
        ends += e[a:b]
    if gold is not None:  # an answer that starts or ends inside a word is still its gold span
        starts[gold[0]] = ends[gold[1]] = True
    return _Asked(sequences, torch.tensor([*starts, True]), torch.tensor([*ends, True]), gold)


def _schedule(step: int, config: ReaderTrainConfig) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(reader: SpanReader, config: ReaderTrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW([
        {"params": list(reader.adapters.parameters()), "lr": config.lr},
        {"params": [*reader.span_head.parameters(), reader.null], "lr": config.head_lr},
    ], weight_decay=config.weight_decay)


def _save_state(run: Path, reader: SpanReader, optimizer, step: int) -> None:
    staging = run / f".{STATE}.tmp"
    torch.save({"step": step, "trained": reader.trained_state(), "optimizer": optimizer.state_dict()}, staging)
    os.replace(staging, run / STATE)


def reader_step_loss(reader: SpanReader, data: ReaderData, chosen: list[TrainQuestion], negatives: list[bool],
                     config: ReaderTrainConfig, rng: random.Random) -> tuple[torch.Tensor, int]:
    """The mean span loss of one step's questions, and the joined tokens it read."""
    pairs: list = []
    asked = [_question_rows(data, q, neg, config.distractors, rng, pairs) for q, neg in zip(chosen, negatives,
                                                                                           strict=True)]
    joined = reader.pack(pairs, ROW_TOKENS)
    cast = getattr(torch, config.dtype)
    with torch.autocast(joined.hidden.device.type, dtype=cast, enabled=cast != torch.float32):
        start, end = reader.top(joined)
    losses = []
    for a in asked:
        s, e = question_scores(start, end, joined, a.sequences)
        losses.append(span_loss(s, e, a.starts_ok, a.ends_ok, *(a.gold if a.gold else (None, None))))
    return torch.stack(losses).mean(), sum(len(q) + len(p) + 1 for q, p in pairs)


def train_reader(reader: SpanReader, data: ReaderData, config: ReaderTrainConfig, run: str | Path,
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
    order = list(range(len(data.questions)))
    random.Random(config.seed).shuffle(order)
    reader.train()
    started, tokens, losses, first_step = time.perf_counter(), 0, [], step
    per_step = config.questions_per_step
    while step < config.max_steps:
        rng = random.Random(f"{config.seed}:{step}")  # a resumed step draws exactly what it would have
        begin = (config.first_question + step * per_step) % len(order)
        chosen = [data.questions[order[(begin + i) % len(order)]] for i in range(per_step)]
        negatives = [rng.random() < config.no_answer_fraction for _ in chosen]
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * _schedule(step, config)
        loss, read = reader_step_loss(reader, data, chosen, negatives, config, rng)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        step += 1
        tokens += read
        losses.append(float(loss.detach()))
        if step % config.log_every == 0 or step == config.max_steps:
            elapsed = time.perf_counter() - started
            line = {"step": step, "questions": step * per_step, "loss": round(sum(losses) / len(losses), 4),
                    "seconds_per_step": round(elapsed / (step - first_step), 2),
                    "tokens_per_second": round(tokens / elapsed, 1), "elapsed_s": round(elapsed, 1),
                    "eta_s": round(elapsed / (step - first_step) * (config.max_steps - step), 1)}
            losses = []
            with open(run / PROGRESS, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            if on_step:
                on_step(line)
        if step % config.save_every == 0 or step == config.max_steps:
            _save_state(run, reader, optimizer, step)
        seen = step * per_step
        for mark in config.snapshot_questions:
            if seen - per_step < mark <= seen:
                save_reader(reader, run / f"reader-q{mark}", extra={"training": asdict(config) | {
                    "steps": step, "questions_seen": seen}})
    reader.eval()
    figures = {"steps": step, "questions_seen": step * per_step, "questions_available": len(data.questions),
               "train_seconds_this_run": round(time.perf_counter() - started, 1)}
    save_reader(reader, run / "reader", extra={"training": asdict(config) | figures})
    return figures
