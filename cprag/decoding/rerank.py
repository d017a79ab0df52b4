"""Choosing among start-beam answers: a small scorer (linear, or one hidden layer) over whole candidate spans.

`generate(..., start_beam=B)` decodes greedily from the B most probable first tokens. The model's own sequence
probability cannot tell which of those answers is right (it picks the greedy one or worse), yet one of the other
starts is exactly right on a fifth of the questions. The model scores tokens; this scores spans, from what a
span-level view adds to its probabilities:
- the model's view: log p of the first token, of the rest, of the end, each relative to the best candidate's, and
  the candidate's rank among the first tokens;
- the lexical features (`cprag.model.lexical`) at the span's first and last entries: the question's words near it and
  in its sentence, and the (question type, first token type) indicator;
- span-level facts the token-level head never sees: the share of the span's words that repeat the question (an
  answer rarely does), its length, whether it holds a digit or a capitalised word (per question type), whether it
  comes from the same passage as the greedy answer and overlaps it.

The weights are fitted on training-file questions the checkpoint never trained on (`eval/scripts/rerank_fit.py`) and
ship beside the checkpoint as `reranker.json`. Format 1 is linear; format 2 adds an optional hidden layer (GELU), which
interactions like "a digit, for a when-question, far from the question's words" need.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch

from cprag.errors import ConfigError
from cprag.model.lexical import QUESTION_TYPES, STOPWORDS, question_type

RERANKER_FILE = "reranker.json"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # format 1: linear only
MAX_RANK = 4  # ranks past this share the last rank indicator
PRIOR_WORD_FEATURES = 6  # overlap@3, @12, @40, sentence, sentence/best, in_question


@dataclass
class SpanCandidate:
    """What the reranker reads of one decoded answer."""

    answer: str
    token_log_probs: list[float]  # log p of each answer token
    log_prob: float  # log p(tokens, then the end)
    first_prior: list[float] | None  # lexical features of the first token's memory entry (None: not copied)
    last_prior: list[float] | None
    passage: int | None  # the passage the first token was copied from


def _words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 1 and w not in STOPWORDS]


def _overlap(a: list[str], b: list[str]) -> float:
    """Token F1 of two word lists (0 when either is empty)."""
    common = sum(min(a.count(w), b.count(w)) for w in set(a))
    return 0.0 if common == 0 else 2 * common / (len(a) + len(b))


def span_features(question: str, candidates: list[SpanCandidate], prior_size: int | None = None) -> torch.Tensor:
    """(B, F) features of B candidates, the greedy one first; F = `feature_count(prior_size)`, where `prior_size`
    is the length of a lexical feature vector (default: the candidates'); a candidate without one (not copied)
    reads zeros."""
    question_set = set(_words(question))
    kind = question_type(question)
    best_first = max(c.token_log_probs[0] if c.token_log_probs else -30.0 for c in candidates)
    best_total = max(c.log_prob for c in candidates)
    greedy_words = _words(candidates[0].answer)
    if prior_size is None:
        prior_size = max((len(c.first_prior) for c in candidates if c.first_prior), default=PRIOR_WORD_FEATURES)
    rows = []
    for rank, c in enumerate(candidates):
        first = c.token_log_probs[0] if c.token_log_probs else -30.0
        rest = c.token_log_probs[1:]
        end = c.log_prob - sum(c.token_log_probs)
        words = _words(c.answer)
        repeated = sum(w in question_set for w in words) / len(words) if words else 1.0
        digit, capital = any(ch.isdigit() for ch in c.answer), bool(re.search(r"\b[A-Z]", c.answer))
        shape = [float(digit), float(capital), float(not digit and not capital)]
        typed = [0.0] * (3 * (len(QUESTION_TYPES) + 1))
        for index, value in enumerate(shape):
            typed[3 * kind + index] = value
        first_prior = c.first_prior or [0.0] * prior_size
        last_prior = (c.last_prior or [0.0] * prior_size)[:PRIOR_WORD_FEATURES]
        rows.append([
            first, first - best_first, sum(rest) / len(rest) if rest else 0.0, min(rest, default=0.0), end,
            c.log_prob, c.log_prob - best_total,
            *[float(min(rank, MAX_RANK - 1) == r) for r in range(MAX_RANK)],
            math.log1p(len(c.token_log_probs)), float(len(c.token_log_probs) == 1), repeated, float(repeated == 1.0),
            float(c.passage is None), float(c.passage is not None and c.passage == candidates[0].passage),
            _overlap(words, greedy_words) if rank else 1.0,
            sum(other.passage == c.passage for other in candidates if c.passage is not None) / len(candidates),
            *typed, *first_prior, *last_prior,
        ])
    return torch.tensor(rows, dtype=torch.float32)


def feature_count(prior_size: int) -> int:
    return 19 + 3 * (len(QUESTION_TYPES) + 1) + prior_size + min(prior_size, PRIOR_WORD_FEATURES)


@dataclass
class StartReranker:
    """score = w . h((features - mean) / scale), with h the identity (linear) or GELU(W x + b) (`hidden`, H x F);
    the candidate of the highest score is the answer."""

    weights: list[float]  # (F,) linear, or (H,) over the hidden units
    mean: list[float]  # (F,)
    scale: list[float]  # (F,)
    beam: int  # the start beam it was fitted for, the default `--start-beam` with it
    fitted_on: dict  # what it was fitted on, and its validation figures
    hidden: list[list[float]] | None = None  # (H, F)
    hidden_bias: list[float] | None = None  # (H,)
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        scored = len(self.hidden) if self.hidden is not None else len(self.mean)  # what `weights` multiplies
        if len(self.mean) != len(self.scale) or len(self.weights) != scored:
            raise ValueError(f"reranker weights, mean and scale differ in length: {len(self.weights)}, "
                             f"{len(self.mean)}, {len(self.scale)}")
        if self.hidden is not None and (self.hidden_bias is None or len(self.hidden_bias) != len(self.hidden)
                                        or any(len(row) != len(self.mean) for row in self.hidden)):
            raise ValueError(f"reranker hidden layer is not {len(self.weights)} x {len(self.mean)} with a bias "
                             "per unit")

    @property
    def features(self) -> int:
        """F, the number of span features it reads."""
        return len(self.mean)

    def scores(self, features: torch.Tensor) -> torch.Tensor:
        """(B,) scores of (B, F) features."""
        if features.shape[1] != self.features:
            raise ValueError(f"the reranker reads {self.features} features, these candidates have "
                             f"{features.shape[1]}")
        weights, mean, scale, hidden, hidden_bias = self._tensors
        inputs = (features - mean) / scale  # (B, F)
        if hidden is not None:
            inputs = torch.nn.functional.gelu(inputs @ hidden.T + hidden_bias)  # (B, H)
        return inputs @ weights

    @cached_property
    def _tensors(self) -> tuple:
        """weights, mean, scale, hidden (H, F) and its bias as tensors, built once (not on every question)."""
        return tuple(None if values is None else torch.tensor(values, dtype=torch.float32)
                     for values in (self.weights, self.mean, self.scale, self.hidden, self.hidden_bias))

    def choose(self, question: str, candidates: list[SpanCandidate]) -> int:
        """The index of the chosen candidate."""
        if len(candidates) == 1:
            return 0
        return int(self.scores(span_features(question, candidates, self.prior_size)).argmax())

    @property
    def prior_size(self) -> int:
        """The length of the lexical feature vector it was fitted with (`feature_count` inverted)."""
        return next((size for size in range(self.features) if feature_count(size) == self.features), 0)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / RERANKER_FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> StartReranker | None:
        """The reranker saved in a checkpoint directory, or None when it has none."""
        path = Path(directory) / RERANKER_FILE
        if not path.is_file():
            return None
        values = json.loads(path.read_text())
        if values.get("format_version") not in READABLE_VERSIONS:
            raise ValueError(f"{path}: reranker format {values.get('format_version')}, this cprag reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
        return cls(**values)

    def fits(self, model_config) -> bool:
        """Whether it reads the lexical features `model_config`'s CP head computes (the same checkpoint's)."""
        return self.features == feature_count(prior_feature_count(model_config))


def check_start_beam(beam: int | None) -> int | None:
    """The beam as given (None: the checkpoint's default), or ConfigError naming --start-beam below 1."""
    if beam is not None and beam < 1:
        raise ConfigError("--start-beam", beam, "must be at least 1")
    return beam


def default_start_beam(reranker: StartReranker | None) -> int:
    """First tokens decoded per question by default: the beam the checkpoint's reranker was fitted for (its
    choice among them is what lifts the answers; `eval/rerank/`), greedy (1) without one."""
    return 1 if reranker is None else reranker.beam


def prior_feature_count(model_config) -> int:
    """Length of a memory entry's lexical feature vector under a CPLM config (0 without the lexical prior)."""
    from cprag.model.lexical import feature_count as lexical_feature_count

    if not model_config.lexical_prior:
        return 0
    return lexical_feature_count(model_config.lexical_window_sizes, model_config.lexical_sentences,
                                 model_config.lexical_types, model_config.lexical_sentence_starts)
