"""Reading with the span reader: a question's passages, the best span among them, or no answer.

The question's prompt is the hidden mode's chat prompt (`cprag.decoding.prompt.prompt_ids`) and each passage is
[BOS] + its own tokens, as `cprag index` tokenizes it, so every position has a character span. Each runs through
the lower blocks alone (`SpanReader.bottom`); then [question ; window of passage ; null] runs through the upper
blocks (`SpanReader.top`). A passage longer than a row's room is read in overlapping windows. A span starts where
a word starts and ends where a word ends, as the hidden decoder copies whole words. The question's null entry
(`cprag.model.span_reader.question_scores`) competes with the best span: when it scores higher, the reader says
the passages hold no answer, and still reports the span it would have given.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from cprag.decoding.prompt import prompt_ids
from cprag.index.encode import TokenizedPassage, length_batches, tokenize_passage
from cprag.model.span_reader import NEG, best_spans, question_scores

ROW_TOKENS = 448  # the longest joined row: a question's prompt, a window of passage and the null position
WINDOW_STRIDE = 128  # consecutive windows of a long passage overlap by all but this many tokens
BOTTOM_CACHE_BYTES = 256 * 2**20  # passages' lower-block states kept for later questions that read them again


class BottomCache:
    """Passage text -> its states entering the split, oldest dropped first past `max_bytes`: a passage read for
    several questions (same-article distractors, a popular document) runs through the lower blocks once."""

    def __init__(self, max_bytes: int = BOTTOM_CACHE_BYTES):
        self.max_bytes, self.used, self.states = max_bytes, 0, {}

    def get(self, text: str) -> torch.Tensor | None:
        return self.states.get(text)

    def put(self, text: str, states: torch.Tensor) -> None:
        size = _nbytes(states)
        if size > self.max_bytes:
            return
        while self.used + size > self.max_bytes:
            self.used -= _nbytes(self.states.pop(next(iter(self.states))))
        self.states[text] = states
        self.used += size


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_BOTTOM_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reader -> its BottomCache


@dataclass
class ReaderAnswer:
    text: str  # the best span (also when the reader says no answer: the span it would have given)
    passage: int  # index into the question's passages
    char_start: int
    char_end: int
    score: float  # start + end score of the span
    null_score: float  # start + end score of the question's null entry
    probability: float  # p(start) · p(end), each normalised over every position of the question's passages + null
    null_probability: float  # the same for the null entry

    @property
    def no_answer(self) -> bool:
        return self.null_score > self.score

    @property
    def answerable(self) -> float:
        """sigmoid(best span score - null score): above one half exactly when the reader answers."""
        return 1.0 / (1.0 + math.exp(min(self.null_score - self.score, 700.0)))


def word_bounds(text: str, offsets: list[tuple[int, int]]) -> tuple[list[bool], list[bool]]:
    """Which tokens begin a word and which end one (a token that is only whitespace does neither)."""
    starts, ends = [], []
    for a, b in offsets:
        piece = text[a:b]
        p = a + len(piece) - len(piece.lstrip())  # the first character that is not a space
        if p >= b:
            starts.append(False)
            ends.append(False)
            continue
        starts.append(p == 0 or not text[p - 1].isalnum() or not text[p].isalnum())
        ends.append(b >= len(text) or not text[b].isalnum() or not text[b - 1].isalnum())
    return starts, ends


def windows(length: int, room: int, stride: int = WINDOW_STRIDE) -> list[tuple[int, int]]:
    """[start, end) token windows of at most `room` tokens covering `length` tokens."""
    if length <= room:
        return [(0, length)]
    spans, start = [], 0
    while True:
        spans.append((start, min(start + room, length)))
        if start + room >= length:
            return spans
        start += stride


@torch.inference_mode()
def bottom_states(reader, sequences: list[list[int]], pad_id: int, max_tokens: int = 8192) -> list[torch.Tensor]:
    """Each id sequence read alone by the lower blocks -> its states entering the split, (n, H) each."""
    device = next(reader.span_head.parameters()).device
    found: list[torch.Tensor | None] = [None] * len(sequences)
    items = [TokenizedPassage(ids=s, offsets=[]) for s in sequences]
    for batch, input_ids, attention in length_batches(items, pad_id, max_tokens, prefix=False):
        states = reader.bottom(input_ids.to(device), attention.to(device))  # (B, T, H)
        for row, index in enumerate(batch):
            found[index] = states[row, : len(sequences[index])]
    return found


@dataclass
class _Window:
    question: int
    passage: int
    span: tuple[int, int]  # [start, end) passage tokens


@torch.inference_mode()
def read_passages(reader, tokenizer, questions: list[str], passages: list[list[str]], max_tokens: int = 8192,
                  ) -> list[ReaderAnswer | None]:
    """Each question's best span among its passages, with its null entry (None when it has no passage with a word
    in it)."""
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    texts = sorted({t for group in passages for t in group})
    tokens = {t: tokenize_passage(tokenizer, t) for t in texts}
    bos = tokenizer.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else bos
    asked = bottom_states(reader, prompts, pad, max_tokens)
    cache = _BOTTOM_CACHES.setdefault(reader, BottomCache())
    states = {t: cache.get(t) for t in texts}
    new = [t for t in texts if states[t] is None]
    for text, found in zip(new, bottom_states(reader, [[bos, *tokens[t].ids] for t in new], pad, max_tokens),
                           strict=True):
        states[text] = found[1:].clone()  # without the passage's own BOS
        cache.put(text, states[text])
    bounds = {t: word_bounds(t, tokens[t].offsets) for t in texts}
    found: list[_Window] = []
    for q, group in enumerate(passages):
        room = max(ROW_TOKENS - len(prompts[q]) - 1, 16)
        for p, text in enumerate(group):
            found += [_Window(q, p, w) for w in windows(len(tokens[text].ids), room) if w[1] > w[0]]
    owner_windows: list[list[int]] = [[] for _ in questions]
    for i, w in enumerate(found):
        owner_windows[w.question].append(i)
    answers: list[ReaderAnswer | None] = [None] * len(questions)
    for chunk in _question_chunks(owner_windows, found, prompts, max_tokens):
        pairs = []
        for i in chunk:
            w = found[i]
            text = passages[w.question][w.passage]
            pairs.append((asked[w.question], states[text][w.span[0]: w.span[1]]))
        joined = reader.pack(pairs, ROW_TOKENS)
        start, end = reader.top(joined)
        place = {i: k for k, i in enumerate(chunk)}
        for q in sorted({found[i].question for i in chunk}):
            mine = owner_windows[q]
            scored = question_scores(start, end, joined, [place[i] for i in mine])
            answers[q] = _best_answer(reader, passages[q], [found[i] for i in mine], tokens, bounds, *scored)
    return answers


def _question_chunks(owner_windows: list[list[int]], found: list[_Window], prompts: list[list[int]],
                     max_tokens: int):
    """Window indices in chunks of whole questions, each chunk at most about `max_tokens` joined tokens."""
    chunk: list[int] = []
    used = 0
    for q, mine in enumerate(owner_windows):
        size = sum(len(prompts[q]) + found[i].span[1] - found[i].span[0] + 1 for i in mine)
        if chunk and used + size > max_tokens:
            yield chunk
            chunk, used = [], 0
        chunk += mine
        used += size
    if chunk:
        yield chunk


def _best_answer(reader, texts: list[str], mine: list[_Window], tokens: dict, bounds: dict, start: torch.Tensor,
                 end: torch.Tensor) -> ReaderAnswer | None:
    if not mine:
        return None
    start_norm, end_norm = torch.logsumexp(start, 0), torch.logsumexp(end, 0)
    null_score = float(start[-1] + end[-1])
    best, offset = None, 0
    for w in mine:
        a, b = w.span
        text = texts[w.passage]
        starts_ok, ends_ok = bounds[text]
        s, e = start[offset: offset + b - a], end[offset: offset + b - a]
        offset += b - a
        score, first, last = best_spans(s[None], e[None], torch.tensor(starts_ok[a:b])[None],
                                        torch.tensor(ends_ok[a:b])[None], reader.config.max_answer_tokens)
        value, i, j = float(score[0]), int(first[0]), int(last[0])
        if value <= NEG or (best is not None and value <= best.score):
            continue
        offsets = tokens[text].offsets
        char_a, char_b = offsets[a + i][0], offsets[a + j][1]
        raw = text[char_a:char_b]
        char_a += len(raw) - len(raw.lstrip())
        probability = float(torch.exp(s[i] - start_norm + e[j] - end_norm))
        best = ReaderAnswer(text=text[char_a:char_b].strip(), passage=w.passage, char_start=char_a,
                            char_end=char_b, score=value, null_score=null_score, probability=probability,
                            null_probability=float(torch.exp(start[-1] - start_norm + end[-1] - end_norm)))
    return best
