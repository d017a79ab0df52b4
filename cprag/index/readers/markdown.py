"""Markdown (READMEs, docs folders) as sections, from markdown-it-py's CommonMark token stream (tables enabled).

The clean text drops what a reader does not read: image badges, raw HTML tags and link URLs (the link text
stays). Headings get GitHub's anchor slugs, so a passage can point at `README.md#from-source`.
"""

from __future__ import annotations

import re
from pathlib import Path

from markdown_it import MarkdownIt
from markdown_it.token import Token

from cprag.index.readers.plain import decode_utf8
from cprag.index.readers.sections import DocumentBuilder, StructuredDocument, UnreadableFile, clean_inline

_LINK_SHARE = 0.9  # as for HTML: a paragraph that is nearly all link text is a row of links
_TAG = re.compile(r"<[^>]*>")
_NOT_SLUG = re.compile(r"[^\w\- ]", re.UNICODE)


def _parser() -> MarkdownIt:
    # html on: raw HTML blocks become html_block tokens we can strip, rather than paragraphs full of tags
    return MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])


def read_markdown(path: Path) -> StructuredDocument:
    text = decode_utf8(path.read_bytes())
    if not text.strip():
        raise UnreadableFile("empty")
    document = markdown_document(text)
    if not document.sections:
        raise UnreadableFile("no text (only images or markup)")
    document.title = document.title or path.stem  # without a `# Title`, its first heading ("Installation") misleads
    return document


def markdown_document(source: str) -> StructuredDocument:
    """Sections of a Markdown string (a README's long description, a .md file's text)."""
    builder = DocumentBuilder()
    slugs = _Slugger()
    tokens = _parser().parse(source)
    list_stack: list[list[int]] = []  # per open list: [next number] for ordered lists, [] for bullets
    item_prefix = ""
    title = ""
    index = 0
    while index < len(tokens):
        token = tokens[index]
        kind = token.type
        if kind == "heading_open":
            heading = _inline_text(tokens[index + 1])[0]
            title = title or (heading if token.tag == "h1" else "")
            builder.heading(int(token.tag[1]), heading, anchor=slugs.slug(heading))
            index += 3
            continue
        if kind in {"bullet_list_open", "ordered_list_open"}:
            list_stack.append([int(token.attrs.get("start", 1))] if kind == "ordered_list_open" else [])
        elif kind in {"bullet_list_close", "ordered_list_close"}:
            list_stack.pop()
        elif kind == "list_item_open" and list_stack:
            counter = list_stack[-1]
            item_prefix = f"{counter[0]}. " if counter else "- "
            if counter:
                counter[0] += 1
        elif kind == "inline" and tokens[index - 1].type == "paragraph_open":
            text, link_chars = _inline_text(token)
            letters = len(text.replace(" ", ""))
            section_kind = "links" if letters and link_chars >= _LINK_SHARE * letters else "prose"
            if text:
                builder.add(item_prefix + text, section_kind)
            item_prefix = ""  # a list item's later paragraphs carry no marker
        elif kind in {"fence", "code_block"}:
            builder.add(token.content, "code")
        elif kind == "html_block":
            builder.add(clean_inline(_TAG.sub(" ", token.content)))
        elif kind == "table_open":
            index = _table(tokens, index, builder)
        index += 1
    document = builder.build("", {"format": "markdown"})
    document.title = title[:200]  # the first `# Title`, or "" for the caller to name
    return document


def _inline_text(token: Token) -> tuple[str, int]:
    """The readable text of an inline token and how many of its letters are link text."""
    parts: list[str] = []
    link_chars, in_link = 0, 0
    for child in token.children or []:
        if child.type == "link_open":
            in_link += 1
        elif child.type == "link_close":
            in_link -= 1
        elif child.type in {"text", "code_inline"}:
            parts.append(child.content)
            if in_link:
                link_chars += len(child.content.replace(" ", ""))
        elif child.type in {"softbreak", "hardbreak"}:
            parts.append(" ")
        # images (badges), raw inline HTML and emphasis markers add nothing a reader reads
    return clean_inline("".join(parts)), link_chars


def _table(tokens: list[Token], index: int, builder: DocumentBuilder) -> int:
    """Rows as `a | b` lines; returns the index of table_close."""
    rows: list[str] = []
    cells: list[str] = []
    while tokens[index].type != "table_close":
        token = tokens[index]
        if token.type == "tr_open":
            cells = []
        elif token.type == "inline":
            cells.append(_inline_text(token)[0])
        elif token.type == "tr_close":
            rows.append(" | ".join(cells))
        index += 1
    builder.add("\n".join(rows), "table")
    return index


class _Slugger:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered -1, -2."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def slug(self, heading: str) -> str:
        base = _NOT_SLUG.sub("", heading.strip().lower()).replace(" ", "-")
        count = self.seen.get(base, 0)
        self.seen[base] = count + 1
        return base if count == 0 else f"{base}-{count}"
