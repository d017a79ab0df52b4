"""Readers that turn PDF, HTML, Markdown and text files into a clean text with located sections.

`read_structured(path)` picks the reader by suffix; a file to skip raises `UnreadableFile` with a one-line reason.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cprag.index.readers.sections import Section, StructuredDocument, UnreadableFile

__all__ = ["READERS", "STRUCTURED_SUFFIXES", "Section", "StructuredDocument", "UnreadableFile", "read_structured"]


def _read_pdf(path: Path) -> StructuredDocument:
    from cprag.index.readers.pdf import read_pdf  # pypdf is imported only when a PDF is read

    return read_pdf(path)


def _read_html(path: Path) -> StructuredDocument:
    from cprag.index.readers.html import read_html

    return read_html(path)


def _read_markdown(path: Path) -> StructuredDocument:
    from cprag.index.readers.markdown import read_markdown

    return read_markdown(path)


def _read_plain(path: Path) -> StructuredDocument:
    from cprag.index.readers.plain import read_plain

    return read_plain(path)


READERS: dict[str, Callable[[Path], StructuredDocument]] = {
    ".pdf": _read_pdf, ".html": _read_html, ".htm": _read_html, ".md": _read_markdown, ".markdown": _read_markdown,
    ".txt": _read_plain,
}
STRUCTURED_SUFFIXES = frozenset(READERS)


def read_structured(path: Path) -> StructuredDocument:
    """The document in `path`, its format told by the suffix; UnreadableFile for files to skip."""
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise UnreadableFile(f"unsupported file type {path.suffix or '(no suffix)'}")
    try:
        document = reader(path)
    except OSError as error:  # unreadable on disk (permissions, a dangling link): skip it like a bad file
        raise UnreadableFile(f"cannot read: {error.strerror or error}") from None
    except RecursionError:  # pathologically nested HTML or Markdown
        raise UnreadableFile("nested too deeply to read") from None
    document.metadata.setdefault("format", path.suffix.lower().lstrip("."))
    return document
