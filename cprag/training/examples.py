"""Training examples from SQuAD-format data, and the token sequences whose frozen activations are cached.

A question trains on the chat prompt followed by its answer as the passage's own tokens (the tokens a hidden
passage can paste), then the end-of-turn token. Two kinds of sequence are cached (cprag.training.activations):

    p/<passage id>   [BOS, t_1 .. t_n]                   a passage, encoded on its own as `cprag index` does
    q/<qid>          prompt + answer tokens               a question, teacher-forced through its answer

The plan orders whole articles in a seeded random order, each article's passages before its questions, so
any finished prefix of the cache holds complete articles: training can start on a part of a large file.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cprag.decoding.prompt import end_of_turn_id, prompt_ids
from cprag.evaluation.squad import SquadData, answer_token_span, article_of, read_squad
from cprag.index.encode import tokenize_passage
from cprag.model.backbone import cache_root
from cprag.training.activations import ActivationCache, CachePlan, build_cache, cache_key, plan_chunks


@dataclass
class PassageTokens:
    ids: list[int]  # the passage's own tokens
    offsets: list[tuple[int, int]]  # character span of each


@dataclass
class TrainQuestion:
    qid: str
    passage_id: str
    question: str
    prompt_len: int
    span: tuple[int, int]  # inclusive passage-token range of the first reference answer
    answer_ids: list[int]  # those passage tokens
    end_id: int
    impossible: bool = False  # written so that its own passage does not answer it (cprag.training.negatives)

    @property
    def targets(self) -> list[int]:
        return self.answer_ids + [self.end_id]

    @property
    def article(self) -> str:
        return article_of(self.passage_id)


@dataclass
class Examples:
    passages: dict[str, PassageTokens]
    questions: list[TrainQuestion]
    skipped: dict[str, int]

    def sequences(self, bos_id: int, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The cached sequences by key (see the module docstring)."""
        seqs = {f"p/{pid}": [bos_id] + p.ids for pid, p in self.passages.items()}
        seqs.update({f"q/{q.qid}": prompts[q.qid] + q.answer_ids for q in self.questions})
        return seqs

    def plan_order(self, seed: int) -> list[str]:
        """Sequence keys, article by article in a seeded order: passages, then questions."""
        articles: dict[str, tuple[list[str], list[str]]] = {}
        for pid in self.passages:
            articles.setdefault(article_of(pid), ([], []))[0].append(f"p/{pid}")
        for q in self.questions:
            articles.setdefault(q.article, ([], []))[1].append(f"q/{q.qid}")
        names = sorted(articles)
        random.Random(seed).shuffle(names)
        return [key for name in names for key in articles[name][0] + articles[name][1]]


def prepare_examples(tokenizer, data: SquadData, max_answer_tokens: int = 24) -> Examples:
    """Tokenize every passage and align each question's first answer to passage tokens. Answers longer than
    `max_answer_tokens` tokens (mostly clauses) or covering no token are skipped and counted."""
    end = end_of_turn_id(tokenizer)
    passages = {}
    for pid, (_, text) in data.passages.items():
        tokens = tokenize_passage(tokenizer, text)
        passages[pid] = PassageTokens(tokens.ids, tokens.offsets)
    questions, skipped = [], {}
    for example in data.examples:
        tokens = passages[example.passage_id]
        answer = example.answers[0]
        span = answer_token_span(tokens.offsets, example.answer_start, example.answer_start + len(answer))
        if span is None or span[1] - span[0] + 1 > max_answer_tokens:
            reason = "answer has no passage tokens" if span is None else "answer longer than max_answer_tokens"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        questions.append(TrainQuestion(
            qid=example.qid, passage_id=example.passage_id, question=example.question,
            prompt_len=len(prompt_ids(tokenizer, example.question)), span=span,
            answer_ids=tokens.ids[span[0] : span[1] + 1], end_id=end,
        ))
    return Examples(passages, questions, skipped)


def prepare_negatives(tokenizer, data: SquadData, training: SquadData) -> Examples:
    """The unanswerable questions of a SQuAD 2.0 file (`read_squad(..., unanswerable=True)`) over paragraphs of
    the training file, as questions that see their own passage and are trained to stop at once. A question whose
    passage id the training file lacks, or whose paragraph text differs there, is skipped and counted."""
    end = end_of_turn_id(tokenizer)
    questions, skipped = [], {}
    for example in data.examples:
        if example.answerable:
            skipped["answerable"] = skipped.get("answerable", 0) + 1
            continue
        if training.passages.get(example.passage_id, ("", None))[1] != example.context:
            skipped["paragraph not in the training file"] = skipped.get("paragraph not in the training file", 0) + 1
            continue
        questions.append(TrainQuestion(
            qid=example.qid, passage_id=example.passage_id, question=example.question,
            prompt_len=len(prompt_ids(tokenizer, example.question)), span=(0, -1), answer_ids=[], end_id=end,
            impossible=True,
        ))
    return Examples({}, questions, skipped)


def activation_cache(model, tokenizer, examples: Examples, data_path: Path, start: int, dtype: str = "bfloat16",
                     seed: int = 0, chunk_size: int = 512, directory: Path | None = None,
                     on_progress: Callable[[int, int, int], None] | None = None,
                     build: bool = True) -> tuple[ActivationCache, dict]:
    """The activation cache of `examples` for blocks below `start`, built (or resumed) first unless `build` is
    False. Returns the cache (every finished chunk) and the build figures."""
    layers = model.cached_layers(start)
    base = (model.config.base_model or {}).get("sha256", "")
    directory = directory or cache_root() / "activations" / cache_key([data_path], base, layers, dtype, str(seed))
    prompts = {q.qid: prompt_ids(tokenizer, q.question) for q in examples.questions}
    plan = CachePlan(layers=layers, hidden_size=model.config.hidden_size, fingerprint=base, dtype=dtype,
                     chunks=plan_chunks(examples.plan_order(seed), chunk_size))
    figures = {}
    if build:
        figures = build_cache(model, examples.sequences(tokenizer.bos_token_id, prompts), directory, plan, start,
                              tokenizer.bos_token_id, on_progress=on_progress)
    return ActivationCache(directory), figures


def cached_negatives(model, tokenizer, path: Path, training: SquadData, cache: ActivationCache, start: int,
                     dtype: str = "bfloat16", seed: int = 0, build: bool = True,
                     on_progress: Callable[[int, int, int], None] | None = None) -> tuple[Examples, dict]:
    """The unanswerable questions of a SQuAD 2.0 file over the training file's paragraphs
    (`pipelines/squad_negatives.py` writes one), their prompts cached in an activation cache of their own that
    `cache`, the training file's, then serves too (their passages are the training file's). Returns them and that
    cache's build figures."""
    negatives = prepare_negatives(tokenizer, read_squad(path, unanswerable=True), training)
    if not negatives.questions:
        return negatives, {}
    extra, figures = activation_cache(model, tokenizer, negatives, Path(path), start, dtype, seed,
                                      on_progress=on_progress, build=build)
    cache.include(extra)
    return negatives, figures
