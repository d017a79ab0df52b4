"""PDF manuals and papers as sections, one page at a time, with pypdf (pure Python, BSD licence).

pypdf gives a page's text as lines without paragraph marks, so paragraphs are rebuilt from line shapes: a short
line that ends a sentence closes its paragraph, a bullet or a numbered heading opens one. Headings are only the
cheap kind, numbered lines like `2.3. The MEDIA/SUBTYPE.xml files`; running heads and page numbers repeated on
every page are dropped. A table of contents (`2.1 ASN.1 syntax . . . . 2`) is kept as a "links" block without its
dot leaders, so that retrieval does not read a passage of dots as prose.
Encrypted, text-less (scanned) and damaged files raise UnreadableFile.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import pypdf
from pypdf.errors import DependencyError, FileNotDecryptedError

from cprag.index.readers.sections import DocumentBuilder, StructuredDocument, UnreadableFile, clean_inline

# `1.`, `2.3.`, `4.1.2 ` then a capitalised title of at most 80 characters not ending like a sentence
_NUMBERED_HEADING = re.compile(r"^(\d{1,2}(?:\.\d{1,2}){0,4})\.?\s+([A-Z][^\n]{0,79})$")
_BULLET = re.compile(r"^(?:[•●▪◦‣∙·*–-]\s|\(?\d{1,2}[.)]\s|\(?[a-z][.)]\s)")
_PAGE_NUMBER = re.compile(r"^(?:page\s+)?(?:\d{1,4}|[ivxlc]{1,6})(?:\s*(?:/|of)\s*\d{1,4})?$", re.IGNORECASE)
# a table-of-contents line: a title, a dot leader (`. . . .` or `....`), a page number
_CONTENTS_ENTRY = re.compile(r"^(.*?\S)\s*(?:\.\s?){4,}\s*(\d{1,4}|[ivxlc]{1,6})$", re.IGNORECASE)
_SENTENCE_END = (".", "!", "?", ":", ";")
_SHORT_LINE = 0.8  # a line under this share of the page's usual width ends a paragraph when it ends a sentence


def read_pdf(path: Path) -> StructuredDocument:
    pages, declared_title = _page_texts(path)
    if not any(text.strip() for text in pages):
        raise UnreadableFile("no text layer (scanned PDF?)")
    page_lines = [[line.strip() for line in text.splitlines()] for text in pages]
    running = _running_lines(page_lines)
    builder = DocumentBuilder()
    for number, lines in enumerate(page_lines, start=1):
        builder.page = number
        kept = [line for line in lines if line and line not in running and not _PAGE_NUMBER.match(line)]
        for kind, text, level in _blocks(kept):
            if kind == "heading":
                builder.heading(level, text)  # a PDF's location is its page; it has no anchors to link
            else:
                builder.add(text, kind)
    title = declared_title or next((line for line in page_lines[0] if line), "") or path.stem
    return builder.build(title, {"format": "pdf", "pages": len(pages)})


def _page_texts(path: Path) -> tuple[list[str], str]:
    """Each page's text and the title the file declares ("" when none)."""
    # pypdf logs "incorrect startxref" and the like for every repair it makes: the reason we report is enough
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = pypdf.PdfReader(path, strict=False)
        if reader.is_encrypted:
            # an empty user password (print/copy restrictions only) opens; anything else is locked
            try:
                if not reader.decrypt(""):
                    raise UnreadableFile("encrypted PDF")
            except (DependencyError, FileNotDecryptedError, NotImplementedError):
                raise UnreadableFile("encrypted PDF") from None
        texts = [page.extract_text() or "" for page in reader.pages]
        declared = reader.metadata.title if reader.metadata is not None else None
        return texts, clean_inline(declared) if isinstance(declared, str) else ""
    except (UnreadableFile, OSError):  # OSError: the file itself cannot be opened, read_structured reports it
        raise
    except FileNotDecryptedError:
        raise UnreadableFile("encrypted PDF") from None
    except Exception as error:  # malformed files raise anything from KeyError to zlib.error, not only PyPdfError
        reason = clean_inline(str(error)) or type(error).__name__
        raise UnreadableFile(f"damaged PDF: {reason[:120]}") from None


def _running_lines(page_lines: list[list[str]]) -> set[str]:
    """Running heads and feet: a first or last line repeated on at least half of the pages (three or more)."""
    if len(page_lines) < 3:
        return set()
    ends = Counter()
    for lines in page_lines:
        nonempty = [line for line in lines if line]
        ends.update({*nonempty[:1], *nonempty[-1:]})
    return {line for line, count in ends.items() if count >= max(3, len(page_lines) // 2)}


def _blocks(lines: list[str]) -> list[tuple[str, str, int]]:
    """(kind, text, heading level) for the paragraphs and numbered headings of one page's lines."""
    if not lines:
        return []
    widths = sorted(len(line) for line in lines)
    usual = widths[int(len(widths) * 0.9)]
    blocks: list[tuple[str, str, int]] = []
    paragraph: list[str] = []
    contents: list[str] = []  # table-of-contents entries: one "links" block, without their dot leaders

    def close() -> None:
        if paragraph:
            blocks.append(("prose", _join_lines(paragraph), 0))
            paragraph.clear()
        if contents:
            blocks.append(("links", "; ".join(contents), 0))
            contents.clear()

    for line in lines:
        entry = _CONTENTS_ENTRY.match(line)
        if entry:  # before headings: `2.1 ASN.1 syntax. . . . 2` is shaped like a numbered heading
            if paragraph:
                close()
            contents.append(f"{entry.group(1).rstrip('. ')} (p. {entry.group(2)})")
            continue
        if contents:
            close()
        heading = _NUMBERED_HEADING.match(line)
        if heading and not line.endswith((".", ",", ";", ":")):
            close()
            blocks.append(("heading", line, heading.group(1).count(".") + 1))
            continue
        if _BULLET.match(line):
            close()
        paragraph.append(line)
        if line.endswith(_SENTENCE_END) and len(line) < _SHORT_LINE * usual:
            close()
    close()
    return blocks


def _join_lines(lines: list[str]) -> str:
    """Lines of one paragraph as one line, undoing end-of-line hyphenation (`manip-` + `ulation`)."""
    text = lines[0]
    for line in lines[1:]:
        if text.endswith("-") and len(text) > 1 and text[-2].isalpha() and line[:1].islower():
            text = text[:-1] + line
        else:
            text = f"{text} {line}"
    return text
