"""What decoding gives back: each answer decoded (`Alternative`), the chosen one with its confidence
(`Generation`), and the citations that trace copied tokens to characters of their documents."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cprag.decoding.rerank import SpanCandidate
from cprag.index.key_cache import DevicePassage


@dataclass
class Citation:
    doc_id: str
    title: str
    start: int  # character offsets in the document's text
    end: int
    text: str
    # where the copied span sits in the original file: its 1-based PDF page, and the HTML id or Markdown slug of its
    # heading (None for plain text, JSONL and SQuAD documents)
    page: int | None = None
    anchor: str | None = None


@dataclass
class Alternative:
    """One greedy continuation of a first token: its answer and log p(its tokens, then the end)."""

    answer: str
    token_ids: list[int]
    sources: list[tuple[int, int] | None]
    log_prob: float
    token_log_probs: list[float] = field(default_factory=list)  # log p of each token; log_prob adds the end's
    entries: list[int | None] = field(default_factory=list)  # the memory entry each token was copied from

    def score(self, length_penalty: float = 0.0) -> float:
        return self.log_prob / max(len(self.token_ids), 1) ** length_penalty


@dataclass
class Generation:
    answer: str
    token_ids: list[int]
    sources: list[tuple[int, int] | None]  # per token: (passage index, token position) when copied
    citations: list[Citation] = field(default_factory=list)
    prompt_tokens: int = 0
    # with passages: the copy path's probability of the first answer token, g · Σ a_j over the passage entries
    # that paste it (None without passages); below `min_confidence` the answer is withheld (`no_answer`)
    confidence: float | None = None
    no_answer: bool = False
    # the probability of ending at once, before ending is barred: what no-answer training teaches (None
    # without passages)
    stop_probability: float | None = None

    # every answer decoded (one per first token tried with `start_beam`; the chosen one among them)
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def copy_rate(self) -> float:
        return sum(s is not None for s in self.sources) / len(self.sources) if self.sources else 0.0


def citations(generation: Generation, passages: list[DevicePassage]) -> list[Citation]:
    """Group runs of tokens copied from consecutive positions of one passage into character spans."""
    spans: list[tuple[int, int, int]] = []  # (passage, first position, last position)
    for source in generation.sources:
        if source is None:
            continue
        passage, position = source
        if spans and spans[-1][0] == passage and spans[-1][2] + 1 == position:
            spans[-1] = (passage, spans[-1][1], position)
        else:
            spans.append((passage, position, position))
    result = []
    for passage_index, first, last in spans:
        stored = passages[passage_index].passage
        if last >= len(stored.keys.offsets):  # a passage without offsets (the needle's visible haystack)
            continue
        start, end = int(stored.keys.offsets[first][0]), int(stored.keys.offsets[last][1])
        result.append(Citation(
            doc_id=stored.doc_id, title=stored.title, start=stored.char_start + start, end=stored.char_start + end,
            text=stored.text[start:end],
        ))
    return result


def span_candidates(alternatives: list[Alternative], prior: torch.Tensor | None, owner: torch.Tensor
                    ) -> list[SpanCandidate]:
    """What the reranker reads of each alternative: its probabilities, and the lexical features (`prior`, (M, F)
    over the memory's entries) at its ends."""
    candidates = []
    for a in alternatives:
        first, last = (a.entries[0], a.entries[-1]) if a.entries else (None, None)
        candidates.append(SpanCandidate(
            a.answer, a.token_log_probs, a.log_prob,
            None if first is None or prior is None else prior[first].tolist(),
            None if last is None or prior is None else prior[last].tolist(),
            None if first is None else int(owner[first])))
    return candidates
