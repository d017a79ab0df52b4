"""Reading with the visible span reader: a question's passages, one row each, and the best span among them.

A row is [BOS] "Question: … \\nPassage:" followed by the passage's own tokens (as `cprag index` tokenizes them, so
every position has a character span). A passage longer than the row's room is read in overlapping windows. A span
starts where a word starts and ends where a word ends, as the hidden decoder copies whole words.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cprag.index.encode import tokenize_passage
from cprag.model.span_reader import NEG, best_spans

ROW_TOKENS = 448  # the longest row: a question's prefix and a window of passage
WINDOW_STRIDE = 128  # consecutive windows of a long passage overlap by all but this many tokens


@dataclass
class ReaderRow:
    ids: list[int]  # [BOS] + question prefix + the window's passage tokens
    first: int  # row position of the window's first passage token
    passage: int  # which of the question's passages
    offsets: list[tuple[int, int]]  # character span (in the passage) of each window token
    starts_ok: list[bool]  # the token can start an answer: it begins a word
    ends_ok: list[bool]  # the token can end an answer: it ends a word


@dataclass
class ReaderAnswer:
    text: str
    passage: int  # index into the question's passages
    char_start: int
    char_end: int
    score: float  # start + end score of the span
    probability: float  # p(start) · p(end), each normalised over every position of the question's passages


def question_prefix(tokenizer, question: str) -> list[int]:
    ids = tokenizer(f"Question: {question.strip()}\nPassage:", add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *ids]


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


def passage_rows(tokenizer, prefix: list[int], text: str, passage: int, row_tokens: int = ROW_TOKENS
                 ) -> list[ReaderRow]:
    tokens = tokenize_passage(tokenizer, text)
    starts, ends = word_bounds(text, tokens.offsets)
    rows = []
    for a, b in windows(len(tokens.ids), max(row_tokens - len(prefix), 16)):
        rows.append(ReaderRow(ids=prefix + tokens.ids[a:b], first=len(prefix), passage=passage,
                              offsets=tokens.offsets[a:b], starts_ok=starts[a:b], ends_ok=ends[a:b]))
    return rows


def pad_rows(rows: list[ReaderRow], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, and the start/end masks over passage positions (B, T), right padded."""
    width = max(len(r.ids) for r in rows)
    batch = {name: torch.zeros((len(rows), width), dtype=dtype) for name, dtype in
             (("input_ids", torch.long), ("attention_mask", torch.long), ("starts_ok", torch.bool),
              ("ends_ok", torch.bool))}
    batch["input_ids"].fill_(pad_id)
    for i, row in enumerate(rows):
        n, f = len(row.ids), row.first
        batch["input_ids"][i, :n] = torch.tensor(row.ids)
        batch["attention_mask"][i, :n] = 1
        batch["starts_ok"][i, f:n] = torch.tensor(row.starts_ok, dtype=torch.bool)
        batch["ends_ok"][i, f:n] = torch.tensor(row.ends_ok, dtype=torch.bool)
    return batch


def _chunks(rows: list[ReaderRow], max_tokens: int) -> Iterator[list[int]]:
    """Row indices in batches of at most `max_tokens` padded tokens, longest first."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
    batch: list[int] = []
    for i in order:
        if batch and len(rows[batch[0]].ids) * (len(batch) + 1) > max_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@torch.inference_mode()
def read_passages(reader, tokenizer, questions: list[str], passages: list[list[str]], max_tokens: int = 8192,
                  ) -> list[ReaderAnswer | None]:
    """Each question's best span among its passages (None when it has no passage with a word in it)."""
    device = next(reader.span_head.parameters()).device
    rows: list[ReaderRow] = []
    owner: list[int] = []
    for q, (question, texts) in enumerate(zip(questions, passages, strict=True)):
        prefix = question_prefix(tokenizer, question)
        for p, text in enumerate(texts):
            found = passage_rows(tokenizer, prefix, text, p)
            rows += found
            owner += [q] * len(found)
    scored: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(rows)
    for chunk in _chunks(rows, max_tokens):
        batch = pad_rows([rows[i] for i in chunk], tokenizer.pad_token_id or 0)
        start, end = reader(batch["input_ids"].to(device), batch["attention_mask"].to(device))  # (B, T)
        start = start.masked_fill(~batch["starts_ok"].to(device), NEG).cpu()
        end = end.masked_fill(~batch["ends_ok"].to(device), NEG).cpu()
        for j, i in enumerate(chunk):
            f, n = rows[i].first, len(rows[i].ids)
            scored[i] = (start[j, f:n], end[j, f:n])
    answers: list[ReaderAnswer | None] = []
    for q in range(len(questions)):
        mine = [i for i in range(len(rows)) if owner[i] == q]
        answers.append(_best_answer(reader, passages[q], [rows[i] for i in mine], [scored[i] for i in mine]))
    return answers


def _best_answer(reader, texts: list[str], rows: list[ReaderRow], scored) -> ReaderAnswer | None:
    if not rows:
        return None
    starts = torch.cat([s for s, _ in scored])
    ends = torch.cat([e for _, e in scored])
    start_norm, end_norm = torch.logsumexp(starts, 0), torch.logsumexp(ends, 0)
    best = None
    for row, (s, e) in zip(rows, scored, strict=True):
        score, first, last = best_spans(s[None], e[None], s[None] > NEG / 2, e[None] > NEG / 2,
                                        reader.config.max_answer_tokens)
        value, i, j = float(score[0]), int(first[0]), int(last[0])
        if value <= NEG or (best is not None and value <= best.score):
            continue
        a, b = row.offsets[i][0], row.offsets[j][1]
        raw = texts[row.passage][a:b]
        a += len(raw) - len(raw.lstrip())
        probability = float(torch.exp(s[i] - start_norm + e[j] - end_norm))
        best = ReaderAnswer(text=texts[row.passage][a:b].strip(), passage=row.passage, char_start=a, char_end=b,
                            score=value, probability=probability)
    return best
