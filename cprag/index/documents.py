"""What a corpus is made of: documents as read, the files skipped and why, and the passages documents are cut into
(`cprag.index.corpus` reads and cuts them; `cprag.index.structured_corpus` does so for PDF, HTML and Markdown)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass
class Document:
    id: str
    text: str
    title: str = ""
    metadata: dict = field(default_factory=dict)
    source: str = field(default="", compare=False, repr=False)  # FILE:LINE, for messages
    # cprag.index.readers Sections of a PDF/HTML/Markdown file; kept out of `metadata`, which every stored
    # passage row copies
    sections: list | None = field(default=None, compare=False, repr=False)

    @property
    def content_hash(self) -> str:
        fields = [self.title, self.text, self.metadata]
        if self.sections:  # a new cut of the same text is a new document; sectionless hashes stay as they were
            fields.append([section.to_list() for section in self.sections])
        payload = json.dumps(fields, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Skipped:
    source: str
    reason: str


@dataclass
class Corpus:
    documents: list[Document]
    skipped: list[Skipped]


@dataclass
class Passage:
    passage_id: str  # DOC_ID, or DOC_ID@N when a document is split
    doc_id: str
    title: str
    text: str
    char_start: int  # offset of the passage in its document's text
    doc_hash: str
    kind: str = "prose"  # "prose", "code", "table" or "links" (structured documents)
    page: int | None = None  # 1-based PDF page where the passage starts
    anchor: str | None = None  # HTML id or Markdown slug of the passage's nearest heading
