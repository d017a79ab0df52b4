"""The structure readers hand over: a clean text and its sections, each with offsets, heading path and location.

Every reader (PDF, HTML, Markdown, plain text) fills a `DocumentBuilder` block by block; the builder joins the
blocks with blank lines, so a section's `start:end` slice of `StructuredDocument.text` is exactly its text and a
citation's character offset can be turned back into a page or an anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SECTION_KINDS = ("prose", "code", "table", "links", "heading")
SEPARATOR = "\n\n"  # between sections: a reader of the clean text sees paragraphs, offsets stay simple


class UnreadableFile(Exception):
    """A file to skip, with a short human reason ("encrypted PDF", "empty HTML")."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True)
class Section:
    start: int  # character offsets into StructuredDocument.text
    end: int
    heading_path: tuple[str, ...]
    kind: str  # one of SECTION_KINDS
    page: int | None = None  # 1-based PDF page
    anchor: str | None = None  # HTML id / Markdown slug of the nearest heading (or finer target, e.g. a dt id)

    def to_list(self) -> list:
        """A JSON-friendly form (lists, no tuples) for carrying sections beside a Document."""
        return [self.start, self.end, list(self.heading_path), self.kind, self.page, self.anchor]

    @classmethod
    def from_list(cls, item: list) -> Section:
        start, end, path, kind, page, anchor = item
        return cls(start, end, tuple(path), kind, page, anchor)


@dataclass
class StructuredDocument:
    text: str
    title: str
    sections: list[Section]
    metadata: dict = field(default_factory=dict)

    def section_text(self, section: Section) -> str:
        return self.text[section.start:section.end]


def clean_inline(text: str) -> str:
    """Runs of whitespace (newlines from source wrapping included) become one space."""
    return " ".join(text.split())


class DocumentBuilder:
    """Collects blocks in reading order and tracks the heading path and the current anchor."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._length = 0
        self._headings: list[tuple[int, str]] = []  # (level, text), outermost first
        self.anchor: str | None = None
        self.page: int | None = None
        self.sections: list[Section] = []

    @property
    def heading_path(self) -> tuple[str, ...]:
        return tuple(text for _, text in self._headings)

    def heading(self, level: int, text: str, anchor: str | None = None) -> None:
        """A heading closes the deeper ones before it; it is a section of its own (kind "heading")."""
        text = clean_inline(text)
        if not text:
            return
        while self._headings and self._headings[-1][0] >= level:
            self._headings.pop()
        self._headings.append((level, text))
        self.anchor = anchor  # a heading without an anchor must not inherit its predecessor's
        self._add(text, "heading")

    def add(self, text: str, kind: str = "prose", anchor: str | None = None) -> None:
        """A block of `kind`; `anchor` (a definition's id, an `<a name>`) becomes the current anchor."""
        if anchor:
            self.anchor = anchor
        if kind == "code":
            text = text.strip("\n").rstrip()  # code keeps its indentation, only the ends are trimmed
        else:
            text = text.strip()
        if text:
            self._add(text, kind)

    def _add(self, text: str, kind: str) -> None:
        assert kind in SECTION_KINDS, kind
        start = self._length + (len(SEPARATOR) if self._pieces else 0)
        self._pieces.append(text)
        self._length = start + len(text)
        self.sections.append(Section(start, self._length, self.heading_path, kind, self.page, self.anchor))

    def build(self, title: str, metadata: dict) -> StructuredDocument:
        text = SEPARATOR.join(self._pieces)
        if not title:
            first_heading = next((s for s in self.sections if s.kind == "heading"), None)
            title = text[first_heading.start:first_heading.end] if first_heading else ""
        return StructuredDocument(text=text, title=clean_inline(title)[:200], sections=self.sections,
                                  metadata=metadata)

    @property
    def has_text(self) -> bool:
        return bool(self.sections)
