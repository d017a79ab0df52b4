"""Plain text: decoding shared by the text-based readers, and .txt files as paragraphs split at blank lines."""

from __future__ import annotations

import re
from pathlib import Path

from cprag.index.readers.sections import DocumentBuilder, StructuredDocument, UnreadableFile

_BLANK_LINES = re.compile(r"\n\s*\n")
# bytes that never occur in text files: NUL and the C0 controls other than tab, newline, form feed, carriage return
_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 12, 13))


def looks_binary(raw: bytes) -> bool:
    """A NUL anywhere, or more than 1% control bytes in the first 8 KB: an image or archive, not text."""
    if b"\x00" in raw:
        return True
    head = raw[:8192]
    return sum(head.count(bytes([b])) for b in _CONTROL) > len(head) // 100


def decode_utf8(raw: bytes) -> str:
    """The text of a UTF-8 file (a BOM dropped), or UnreadableFile as the folder walk has always reported it."""
    if looks_binary(raw):
        raise UnreadableFile("binary or not UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UnreadableFile("binary or not UTF-8") from None


def read_plain(path: Path) -> StructuredDocument:
    """Paragraphs (blank-line separated) as prose sections; the title is the first non-empty line."""
    text = decode_utf8(path.read_bytes())
    builder = DocumentBuilder()
    for paragraph in _BLANK_LINES.split(text):
        builder.add(paragraph)
    if not builder.has_text:
        raise UnreadableFile("empty")
    title = next((line.strip() for line in text.splitlines() if line.strip()), path.stem)
    return builder.build(title, {"format": "txt"})
