"""Structured files (PDF, HTML, Markdown) as corpus Documents, and those Documents' passages.

The glue between `cprag.index.readers` / `structured_passages` and the corpus types: a Document read here carries
its sections in `Document.sections` (not in `metadata`, which the store copies onto every passage row), and
`split_document` hands such a Document to `structured_passages`.
"""

from __future__ import annotations

from pathlib import Path

from cprag.index.documents import Document, Passage, Skipped
from cprag.index.readers import StructuredDocument, UnreadableFile, read_structured
from cprag.index.structured_passages import structured_passages

# markup, PDF objects and base64 images make a file far larger than its text; past this many bytes per allowed
# character the file is refused before parsing, so one giant dump cannot take the walk's memory
MAX_BYTES_PER_CHAR = 20


def read_structured_file(file: Path, root: Path, skipped: list[Skipped], max_chars: int) -> Document | None:
    try:
        size = file.stat().st_size
        if size > MAX_BYTES_PER_CHAR * max_chars:
            skipped.append(Skipped(str(file), f"{size:,} bytes, too large to hold at most {max_chars:,} characters "
                                   "of text: split it into several"))
            return None
        structured = read_structured(file)
    except UnreadableFile as error:
        skipped.append(Skipped(str(file), error.reason))
        return None
    except OSError as error:
        skipped.append(Skipped(str(file), f"cannot read: {error.strerror or error}"))
        return None
    if len(structured.text) > max_chars:
        skipped.append(Skipped(str(file), f"{len(structured.text):,} characters, over the {max_chars:,} a document "
                               "may hold: split it into several"))
        return None
    doc_id = file.relative_to(root).as_posix()
    metadata = {"path": doc_id, **structured.metadata}
    return Document(id=doc_id, text=structured.text, title=structured.title or file.stem, metadata=metadata,
                    source=str(file), sections=structured.sections)


def structured_split(document: Document, tokenizer, max_tokens: int) -> list[Passage]:
    """Passages cut at the document's sections, `DOC_ID@N`, titled by heading path, with kind, page and anchor."""

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    structured = StructuredDocument(document.text, document.title, list(document.sections or []),
                                    dict(document.metadata))
    doc_hash = document.content_hash
    return [
        Passage(f"{document.id}@{n}", document.id, passage.title, passage.text, passage.char_start, doc_hash,
                kind=passage.kind, page=passage.page, anchor=passage.anchor)
        for n, passage in enumerate(structured_passages(structured, count_tokens, max_tokens))
    ]
