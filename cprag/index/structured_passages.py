"""Passages cut at a document's structure: never across a heading, prose merged up to a token budget, code, tables
and rows of links on their own.

Heading sections are not passage text: their path is the passage's title (`Install › From source`), which the
retriever reads beside the text. A section over the budget is cut at sentence ends (prose) or line ends (code,
tables, links), then at spaces, then, for a run with no spaces, at the longest prefix that fits.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cprag.index.readers.sections import Section, StructuredDocument

TITLE_SEPARATOR = " › "
MERGED_KINDS = {"prose", "links"}  # consecutive sections of these kinds share passages; code and tables never do
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")  # a closing quote stays with its sentence
_LINE_END = re.compile(r"\n+")
_SPACES = re.compile(r"\s+")

CountTokens = Callable[[str], int]
Span = tuple[int, int]


@dataclass(frozen=True)
class StructuredPassage:
    text: str
    char_start: int  # offset of `text` in the document text
    heading_path: tuple[str, ...]
    title: str
    kind: str
    page: int | None
    anchor: str | None

    @property
    def char_end(self) -> int:
        return self.char_start + len(self.text)


def passage_title(heading_path: Sequence[str], document_title: str) -> str:
    return TITLE_SEPARATOR.join(heading_path) or document_title


def structured_passages(doc: StructuredDocument, count_tokens: CountTokens, max_tokens: int
                        ) -> list[StructuredPassage]:
    """The document's passages in reading order, each within `max_tokens` as `count_tokens` counts them."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    body = [s for s in doc.sections if s.kind != "heading"]
    if not body:  # a file of headings only still deserves to be found
        body = [Section(s.start, s.end, s.heading_path, "prose", s.page, s.anchor) for s in doc.sections]
    cutter = _Cutter(doc.text, count_tokens, max_tokens)
    passages = []
    for group in _groups(body):
        first = group[0]
        levels = (_SENTENCE_END, _SPACES) if first.kind == "prose" else (_LINE_END, _SPACES)
        for start, end in cutter.pack([(s.start, s.end) for s in group], levels):
            page, anchor = locate(group, start)
            passages.append(StructuredPassage(doc.text[start:end], start, first.heading_path,
                                              passage_title(first.heading_path, doc.title), first.kind, page, anchor))
    return passages


def locate(items: Sequence, char_offset: int) -> tuple[int | None, str | None]:
    """(page, anchor) of the section or passage holding `char_offset`, from Sections or passages in text order.

    Anything with `start` or `char_start` and `page` and `anchor` attributes works, so a citation's offset into the
    document text can be placed with the stored passages alone.
    """
    if not items:
        return None, None
    starts = [item.start if hasattr(item, "start") else item.char_start for item in items]
    at = max(bisect_right(starts, char_offset) - 1, 0)
    return items[at].page, items[at].anchor


def _groups(sections: list[Section]) -> list[list[Section]]:
    """Runs of sections that may share a passage: same heading path, same anchor, same mergeable kind."""
    groups: list[list[Section]] = []
    for section in sections:
        last = groups[-1][-1] if groups else None
        if (last is not None and section.kind in MERGED_KINDS and section.kind == last.kind
                and section.heading_path == last.heading_path and section.anchor == last.anchor):
            groups[-1].append(section)
        else:
            groups.append([section])
    return groups


class _Cutter:
    """Greedy packing of text spans into passages that fit, with token counts estimated by sums and checked."""

    def __init__(self, text: str, count_tokens: CountTokens, max_tokens: int):
        self.text, self.count, self.max_tokens = text, count_tokens, max_tokens
        self.join_tokens = max(count_tokens("\n\n"), 0)  # what a blank line between two units may add

    def tokens(self, span: Span) -> int:
        return self.count(self.text[span[0]:span[1]])

    def pack(self, units: list[Span], levels: tuple[re.Pattern, ...]) -> list[Span]:
        """Consecutive units merged while they fit; a unit over the budget is cut at the next finer level."""
        out: list[Span] = []
        current: list[Span] = []
        estimate = 0
        for unit in units:
            tokens = self.tokens(unit)
            if tokens > self.max_tokens:
                out.extend(self._close(current))
                pieces = self.cut(unit, levels)
                out.extend(pieces[:-1])
                current, estimate = [pieces[-1]], self.tokens(pieces[-1])
                continue
            if current and estimate + self.join_tokens + tokens <= self.max_tokens:
                current.append(unit)
                estimate += self.join_tokens + tokens
            else:
                out.extend(self._close(current))
                current, estimate = [unit], tokens
        out.extend(self._close(current))
        return out

    def _close(self, units: list[Span]) -> list[Span]:
        """The merged span, or, where counting the whole disagrees with the sum, an exact greedy repacking."""
        if not units:
            return []
        if len(units) == 1 or self.tokens((units[0][0], units[-1][1])) <= self.max_tokens:
            return [(units[0][0], units[-1][1])]
        spans, first = [], 0
        for i in range(1, len(units) + 1):
            if i == len(units) or self.tokens((units[first][0], units[i][1])) > self.max_tokens:
                spans.append((units[first][0], units[i - 1][1]))
                first = i
        return spans

    def cut(self, span: Span, levels: tuple[re.Pattern, ...]) -> list[Span]:
        """`span` (over the budget) as pieces that fit: at `levels[0]` boundaries, then finer ones."""
        if not levels:
            return self._cut_characters(span)
        units = _split(self.text, span, levels[0])
        if len(units) <= 1:
            return self.cut(span, levels[1:])
        return self.pack(units, levels[1:])

    def _cut_characters(self, span: Span) -> list[Span]:
        """The longest prefixes that fit, found by bisection (a run with no spaces: a hash, a base64 blob)."""
        pieces, start, end = [], span[0], span[1]
        while start < end:
            low, high = start + 1, end  # one character always goes, so the loop ends
            while low < high:
                middle = (low + high + 1) // 2
                if self.tokens((start, middle)) <= self.max_tokens:
                    low = middle
                else:
                    high = middle - 1
            pieces.append((start, low))
            start = low
            while start < end and self.text[start].isspace():
                start += 1
        return pieces


def _split(text: str, span: Span, boundary: re.Pattern) -> list[Span]:
    """The non-blank pieces of `text[span]` between matches of `boundary`, each trimmed of surrounding spaces."""
    start, end = span
    pieces, at = [], start
    for match in boundary.finditer(text, start, end):
        pieces.append((at, match.start()))
        at = match.end()
    pieces.append((at, end))
    trimmed = []
    for piece_start, piece_end in pieces:
        while piece_start < piece_end and text[piece_start].isspace() and boundary is not _LINE_END:
            piece_start += 1
        while piece_end > piece_start and text[piece_end - 1].isspace():
            piece_end -= 1
        if piece_start < piece_end:
            trimmed.append((piece_start, piece_end))
    return trimmed
