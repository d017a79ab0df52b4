"""HTML pages (saved sites, generated docs) as sections, with selectolax's Lexbor parser.

Lexbor parses any byte soup the way a browser would, never raising, and at C speed; the walk keeps the page's main
body (Sphinx `div[role=main]`, `<main>`, `<article>`), drops scripts, styles and navigation, and turns headings,
paragraphs, list items, `<pre>` and `<table>` into sections. Anchors come from heading ids, their enclosing
section's id, `<a name>` targets and definition-term ids (Sphinx API entries).
"""

from __future__ import annotations

import re
from pathlib import Path

from selectolax.lexbor import LexborHTMLParser, LexborNode

from cprag.index.readers.plain import looks_binary
from cprag.index.readers.sections import DocumentBuilder, StructuredDocument, UnreadableFile, clean_inline

# the first that matches is the page's content; the rest of the page is site chrome
MAIN_SELECTORS = ("div[role=main]", "[role=main]", "div.body", "main", "article", "#content", "body")
DROP_EVERYWHERE = ("script", "style", "noscript", "template", "nav", "[role=navigation]", "form", "button", "svg",
                   "iframe", "object", "embed", "canvas", "select", "textarea", "div.sphinxsidebar", "div.related",
                   "div.footer", "footer", "a.headerlink")
HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
# elements that start a new block: anything else (text, <a>, <code>, <span>, <b>...) is part of a paragraph
BLOCKS = {
    "p", "div", "section", "article", "main", "aside", "blockquote", "ul", "ol", "li", "dl", "dt", "dd", "pre",
    "table", "figure", "figcaption", "hr", "details", "summary", "fieldset", "address", "center", "header",
    "body", "caption", "thead", "tbody", "tr", "td", "th", *HEADINGS,
}
_LINK_SHARE = 0.9  # a paragraph whose text is this much link text is a list of links (badges, "see also" rows)
_CHARSET = re.compile(rb"""<meta[^>]+charset=["']?([\w-]+)""", re.IGNORECASE)
_PILCROW = re.compile(r"[¶#]\s*$")  # permalink marks some themes leave in headings


def read_html(path: Path) -> StructuredDocument:
    raw = path.read_bytes()
    if looks_binary(raw):
        raise UnreadableFile("binary, not HTML")
    tree = LexborHTMLParser(_decode(raw))
    title_node = tree.css_first("title")
    title = clean_inline(title_node.text()) if title_node is not None else ""
    root = next((node for node in map(tree.css_first, MAIN_SELECTORS) if node is not None), None)
    if root is None:
        raise UnreadableFile("empty HTML (no body)")
    for selector in DROP_EVERYWHERE:
        for node in root.css(selector):
            node.decompose()
    walk = _Walk()
    walk.block(root)
    if not walk.builder.has_text:
        raise UnreadableFile("empty HTML (no text)")
    return walk.builder.build(title, {"format": "html"})


def _decode(raw: bytes) -> str:
    """UTF-8 when it is; else the charset a <meta> declares; else cp1252, as browsers fall back."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        pass
    declared = _CHARSET.search(raw[:4096])
    for encoding in ([declared.group(1).decode("ascii", "replace")] if declared else []) + ["cp1252"]:
        try:
            return raw.decode(encoding, errors="replace")
        except LookupError:  # an unknown charset name
            continue
    return raw.decode("latin-1")


class _Walk:
    """One pass over the body in document order, emitting blocks into a DocumentBuilder."""

    def __init__(self) -> None:
        self.builder = DocumentBuilder()
        self.pending_anchor: str | None = None  # an empty <span id> / <a name> just before a heading

    def block(self, node: LexborNode) -> None:
        run: list[LexborNode] = []
        for child in node.iter(include_text=True):
            tag = child.tag
            if tag == "-comment":
                continue
            if tag not in BLOCKS:
                run.append(child)
                continue
            self.paragraph(run)
            run = []
            if tag in HEADINGS:
                self.heading(child, HEADINGS[tag])
            elif tag == "pre":
                self.builder.add(child.text(deep=True, separator=""), "code")
            elif tag == "table":
                self.table(child)
            elif tag == "li" and not _has_block(child):
                self.paragraph(list(child.iter(include_text=True)), prefix="- ")
            elif tag == "dt" and child.id and not _has_block(child):
                # a Sphinx API entry (`base64.b64encode`): its id is the finest target a citation can point to
                self.paragraph(list(child.iter(include_text=True)), anchor=child.id)
            elif tag != "hr":
                self.block(child)
        self.paragraph(run)

    def paragraph(self, run: list[LexborNode], prefix: str = "", anchor: str | None = None) -> None:
        if not run:
            return
        text = clean_inline("".join(n.text(deep=True, separator="") for n in run))
        if not text:
            # an empty target (`<span id=...></span>`, `<a name=...>`) names whatever follows it
            self.pending_anchor = next(filter(None, map(_target_of, run)), self.pending_anchor)
            return
        link_chars = sum(len(clean_inline(a.text(deep=True))) for a in _links_in(run))
        kind = "links" if link_chars >= _LINK_SHARE * len(text.replace(" ", "")) else "prose"
        # targets inside a paragraph (Sphinx's `index-N` spans) are index entries, too fine to cite and they would
        # cut every paragraph from the next: only headings and definition terms move the anchor
        self.builder.add(prefix + text, kind, anchor=anchor)
        self.pending_anchor = None

    def heading(self, node: LexborNode, level: int) -> None:
        text = _PILCROW.sub("", clean_inline(node.text(deep=True, separator="")))
        self.builder.heading(level, text, anchor=self._heading_anchor(node))
        self.pending_anchor = None

    def _heading_anchor(self, node: LexborNode) -> str | None:
        if node.id:
            return node.id
        parent = node.parent
        # <section id=x><h2>: the section's id is the heading's (Sphinx, many static-site generators)
        if parent is not None and parent.id and parent.tag in {"section", "div", "article"}:
            first = next((c for c in parent.iter() if c.tag in HEADINGS), None)
            if first is not None and first.mem_id == node.mem_id:
                return parent.id
        inner = node.css_first("a[name], [id]")
        if inner is not None:
            return _target_of(inner)
        return self.pending_anchor

    def table(self, node: LexborNode) -> None:
        rows = []
        for row in node.css("tr"):
            cells = [clean_inline(cell.text(deep=True, separator=" ")) for cell in row.iter() if cell.tag in
                     {"td", "th"}]
            if any(cells):
                rows.append(" | ".join(cells))
        caption = node.css_first("caption")
        if caption is not None and clean_inline(caption.text()):
            rows.insert(0, clean_inline(caption.text()))
        self.builder.add("\n".join(rows), "table")


def _has_block(node: LexborNode) -> bool:
    return any(child.tag in BLOCKS for child in node.traverse() if child.mem_id != node.mem_id)


def _links_in(run: list[LexborNode]) -> list[LexborNode]:
    return [n for n in run if n.tag == "a"] + [a for n in run if n.tag not in {"a", "-text"} for a in n.css("a")]


def _target_of(node: LexborNode) -> str | None:
    if node.tag == "-text":
        return None
    attributes = node.attributes
    return attributes.get("id") or (attributes.get("name") if node.tag == "a" else None)
