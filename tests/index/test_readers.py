"""Readers for PDF, HTML and Markdown on real files (tests/data/ingest, see SOURCES.md), their passages, and the
folder walk that skips damaged files with a reason. Model-free: tokens are counted as whitespace-separated words."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pypdf
import pytest

from cprag.errors import CorpusError
from cprag.index.corpus import Document, read_corpus, split_document
from cprag.index.readers import UnreadableFile, read_structured
from cprag.index.structured_passages import locate, structured_passages

DATA = Path(__file__).parents[1] / "data" / "ingest"
SPHINX_PAGE = DATA / "tomllib.html"
PDF = DATA / "shared-mime-info-spec.pdf"
README = DATA / "selectolax-README.md"


def count_words(text: str) -> int:
    return len(text.split())


def word_tokenizer(text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
    """The slice of a Hugging Face tokenizer's interface split_document uses, one token per word."""
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    return {"input_ids": list(range(len(spans))), "offset_mapping": spans}


def kinds_and_text(document):
    return [(s.kind, document.section_text(s)) for s in document.sections]


def test_sphinx_page_keeps_the_body_with_heading_paths_anchors_code_and_tables():
    document = read_structured(SPHINX_PAGE)
    assert document.title.startswith("tomllib — Parse TOML files")
    assert document.metadata["format"] == "html"
    text = document.text
    assert "¶" not in text and "Navigation" not in text and "documentationOptions" not in text  # chrome gone
    headings = [(s.heading_path, s.anchor) for s in document.sections if s.kind == "heading"]
    assert headings == [
        (("tomllib — Parse TOML files",), "module-tomllib"),
        (("tomllib — Parse TOML files", "Examples"), "examples"),
        (("tomllib — Parse TOML files", "Conversion Table"), "conversion-table"),
    ]
    code = [document.section_text(s) for s in document.sections if s.kind == "code"]
    assert len(code) == 2 and code[0].startswith("import tomllib\n\nwith open(\"pyproject.toml\", \"rb\") as f:")
    assert all(s.heading_path[-1] == "Examples" for s in document.sections if s.kind == "code")
    (table,) = [s for s in document.sections if s.kind == "table"]
    assert document.section_text(table).splitlines()[:3] == ["TOML | Python", "table | dict", "string | str"]
    # an API entry's <dt id> is the anchor of the text that documents it
    load = next(s for s in document.sections if document.section_text(s).startswith("Read a TOML file."))
    assert load.anchor == "tomllib.load"


def test_markdown_readme_slugs_fences_tables_and_links_without_badges_or_urls():
    document = read_structured(README)
    assert document.metadata["format"] == "markdown"
    assert "img.shields.io" not in document.text and "](" not in document.text  # badges and URLs dropped
    assert "A fast HTML5 parser with CSS selectors, written in Cython, using the Lexbor engine." in document.text
    anchors = {s.heading_path[-1]: s.anchor for s in document.sections if s.kind == "heading"}
    assert anchors["Installation"] == "installation"
    assert anchors["Using lexbor-contains CSS pseudo-class to match text"] == (
        "using-lexbor-contains-css-pseudo-class-to-match-text")
    nested = next(s for s in document.sections if s.heading_path[-1:] == ("Using advanced CSS selectors",))
    assert nested.heading_path == ("Basic examples", "Using advanced CSS selectors")  # ### under ##
    assert ("code", "pip install selectolax") in kinds_and_text(document)
    tables = [text for kind, text in kinds_and_text(document) if kind == "table"]
    assert tables and tables[0].startswith("Package | Time\n")
    links = [s for s in document.sections if s.kind == "links"]
    assert len(links) >= 5 and all(s.heading_path[-1] in {"Links", "Using lexbor-contains CSS pseudo-class to "
                                                          "match text"} for s in links)
    assert document.title == "selectolax-README"  # no `# Title`: the file's name, not its first heading


def test_pdf_pages_headings_and_clean_paragraphs():
    document = read_structured(PDF)
    assert document.metadata == {"format": "pdf", "pages": 17}
    assert document.title == "Shared MIME-info Database"
    assert {s.page for s in document.sections} == set(range(1, 18))
    version = next(s for s in document.sections if s.kind == "heading" and s.heading_path[-1] == "1.1. Version")
    assert version.page == 1 and version.heading_path == ("1. Introduction", "1.1. Version")
    layout = next(s for s in document.sections if s.heading_path[-1:] == ("2.1. Directory layout",))
    assert layout.page == 2 and layout.heading_path[0] == "2. Unified system"
    # running head and page numbers are gone from the text; paragraphs are whole lines joined
    body = [document.section_text(s) for s in document.sections if s.kind == "prose"]
    assert "Shared MIME-info Database" not in body[3] and not any(text.strip().isdigit() for text in body)
    assert any(text.startswith("Many programs and desktops use the MIME system[MIME] to represent the types of "
                               "files. Frequently, it is necessary") for text in body)


def test_a_pdf_table_of_contents_is_one_links_block_without_dot_leaders():
    from cprag.index.readers.pdf import _blocks

    # the lines pypdf gives for page iii of GNU Libtasn1's manual (4.19.0)
    lines = ["Table of Contents",
             "1 Introduction . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . 1",
             "2 ASN.1 structure handling . . . . . . . . . . . . . . . . . . . . . . 2",
             "2.1 ASN.1 syntax. . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . . 2",
             "Concept Index.........................................32",
             "This manual is for GNU Libtasn1.", "2.2 Naming"]
    blocks = _blocks(lines)
    assert [kind for kind, _, _ in blocks] == ["prose", "links", "prose", "heading"]
    assert blocks[1][1] == ("1 Introduction (p. 1); 2 ASN.1 structure handling (p. 2); 2.1 ASN.1 syntax (p. 2); "
                            "Concept Index (p. 32)")


def test_offsets_of_sections_and_passages_slice_the_document_text():
    for path in (SPHINX_PAGE, README, PDF):
        document = read_structured(path)
        for passage in structured_passages(document, count_words, max_tokens=40):
            assert document.text[passage.char_start:passage.char_start + len(passage.text)] == passage.text
            assert count_words(passage.text) <= 40
            assert locate(document.sections, passage.char_start) == (passage.page, passage.anchor)


def test_passages_never_cross_headings_and_keep_code_tables_and_links_apart():
    document = read_structured(README)
    passages = structured_passages(document, count_words, max_tokens=120)
    for passage in passages:
        inside = [s for s in document.sections if passage.char_start <= s.start < passage.char_end]
        assert {s.heading_path for s in inside} == {passage.heading_path}
        assert {s.kind for s in inside} == {passage.kind}  # one kind a passage, headings only in the title
        assert passage.title == " › ".join(passage.heading_path) or passage.title == document.title
    assert {p.kind for p in passages} == {"prose", "code", "table", "links"}
    links = [p for p in passages if p.heading_path == ("Links",)]
    assert len(links) == 1 and links[0].kind == "links"  # the list of links is merged into one passage
    first = next(p for p in passages if p.heading_path == ("Installation",))
    assert first.title == "Installation" and first.anchor == "installation"


def test_budget_merges_short_paragraphs_and_cuts_long_ones_at_sentence_ends(tmp_path):
    sentences = " ".join(f"Sentence {i} has five words." for i in range(30))  # 150 words, one paragraph
    (tmp_path / "doc.md").write_text(f"# Guide\n\n## Setup\n\nOne two three.\n\nFour five six.\n\n- seven eight\n"
                                     f"- nine ten\n\n## Long\n\n{sentences}\n\n```\n{'x ' * 30}\n```\n")
    document = read_structured(tmp_path / "doc.md")
    passages = structured_passages(document, count_words, max_tokens=20)
    setup = [p for p in passages if p.heading_path == ("Guide", "Setup")]
    assert [p.text for p in setup] == ["One two three.\n\nFour five six.\n\n- seven eight\n\n- nine ten"]
    assert setup[0].title == "Guide › Setup" and setup[0].anchor == "setup"
    long = [p for p in passages if p.heading_path == ("Guide", "Long") and p.kind == "prose"]
    assert len(long) == 8 and all(p.text.endswith("words.") and count_words(p.text) <= 20 for p in long)
    code = [p for p in passages if p.kind == "code"]
    assert [count_words(p.text) for p in code] == [20, 10]
    # a word longer than the budget (no spaces to cut at) is cut by characters and nothing is lost
    (tmp_path / "blob.md").write_text("# Blob\n\n" + "a" * 50)
    structured = read_structured(tmp_path / "blob.md")
    pieces = structured_passages(structured, lambda text: len(text), max_tokens=16)
    assert "".join(p.text for p in pieces) == "a" * 50 and all(len(p.text) <= 16 for p in pieces)


def test_folder_walk_reads_good_files_and_skips_each_bad_one_with_one_line_reason(tmp_path):
    corpus_dir = tmp_path / "corpus"
    (corpus_dir / "docs").mkdir(parents=True)
    for source in (SPHINX_PAGE, PDF, README):
        shutil.copy(source, corpus_dir / "docs" / source.name)
    (corpus_dir / "notes.txt").write_text("Plain notes.\n\nStill plain.")
    raw = PDF.read_bytes()
    (corpus_dir / "truncated.pdf").write_bytes(raw[: len(raw) // 3])
    (corpus_dir / "not-really.pdf").write_bytes(b"%PDF-1.4\n" + bytes(random.Random(1).randrange(256)
                                                                      for _ in range(2000)))
    writer = pypdf.PdfWriter(clone_from=PDF)
    writer.encrypt(user_password="secret", algorithm="RC4-128")
    with open(corpus_dir / "locked.pdf", "wb") as handle:
        writer.write(handle)
    owner_only = pypdf.PdfWriter(clone_from=PDF)  # an empty user password: restrictions, not a lock
    owner_only.encrypt(user_password="", owner_password="owner", algorithm="RC4-128")
    with open(corpus_dir / "docs" / "owner-only.pdf", "wb") as handle:
        owner_only.write(handle)
    blank = pypdf.PdfWriter()
    blank.add_blank_page(width=612, height=792)
    with open(corpus_dir / "scanned.pdf", "wb") as handle:
        blank.write(handle)
    (corpus_dir / "empty.html").write_text("")
    (corpus_dir / "chrome-only.html").write_text("<html><body><nav><a href='/'>Home</a></nav><script>x=1</script>"
                                                 "</body></html>")
    (corpus_dir / "random.md").write_bytes(bytes(random.Random(2).randrange(256) for _ in range(4000)))
    (corpus_dir / "image.html").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))

    corpus = read_corpus(corpus_dir)

    ids = sorted(d.id for d in corpus.documents)
    assert ids == ["docs/owner-only.pdf", "docs/selectolax-README.md", "docs/shared-mime-info-spec.pdf",
                   "docs/tomllib.html", "notes.txt"]
    reasons = {Path(s.source).name: s.reason for s in corpus.skipped}
    assert set(reasons) == {"truncated.pdf", "not-really.pdf", "locked.pdf", "scanned.pdf", "empty.html",
                            "chrome-only.html", "random.md", "image.html"}
    assert reasons["locked.pdf"] == "encrypted PDF"
    assert reasons["scanned.pdf"] == "no text layer (scanned PDF?)"
    assert reasons["truncated.pdf"].startswith("damaged PDF") and reasons["not-really.pdf"].startswith("damaged PDF")
    assert reasons["empty.html"].startswith("empty HTML") and reasons["chrome-only.html"].startswith("empty HTML")
    assert reasons["random.md"] == "binary or not UTF-8" and reasons["image.html"] == "binary, not HTML"
    assert all("\n" not in reason and len(reason) < 200 for reason in reasons.values())

    # .txt keeps today's document exactly; structured ones carry sections, format and a PDF's page count
    notes = next(d for d in corpus.documents if d.id == "notes.txt")
    assert (notes.title, notes.metadata, notes.sections) == ("Plain notes.", {"path": "notes.txt"}, None)
    pdf = next(d for d in corpus.documents if d.id.endswith("spec.pdf"))
    assert pdf.metadata == {"path": "docs/shared-mime-info-spec.pdf", "format": "pdf", "pages": 17}

    only_html = read_corpus(corpus_dir, glob="**/*.html")
    assert [d.id for d in only_html.documents] == ["docs/tomllib.html"]
    assert sorted(Path(s.source).name for s in only_html.skipped) == ["chrome-only.html", "empty.html", "image.html"]
    assert [d.id for d in read_corpus(corpus_dir / "docs" / "tomllib.html").documents] == ["tomllib.html"]
    with pytest.raises(CorpusError, match="unusable glob"):
        read_corpus(corpus_dir, glob="/etc/*.html")


def test_split_document_cuts_structured_documents_into_located_passages(tmp_path):
    shutil.copy(PDF, tmp_path / PDF.name)
    shutil.copy(SPHINX_PAGE, tmp_path / SPHINX_PAGE.name)
    documents = {d.id: d for d in read_corpus(tmp_path).documents}
    pdf_passages = split_document(documents[PDF.name], word_tokenizer, max_tokens=64)
    assert [p.passage_id for p in pdf_passages] == [f"{PDF.name}@{n}" for n in range(len(pdf_passages))]
    assert {p.page for p in pdf_passages} == set(range(1, 18))
    text = documents[PDF.name].text
    assert all(text[p.char_start:p.char_start + len(p.text)] == p.text for p in pdf_passages)
    assert all(len(p.text.split()) <= 64 for p in pdf_passages)
    assert any(p.title == "2. Unified system › 2.1. Directory layout" for p in pdf_passages)
    html_passages = split_document(documents[SPHINX_PAGE.name], word_tokenizer, max_tokens=64)
    assert {p.kind for p in html_passages} == {"prose", "code", "table"}
    examples = [p for p in html_passages if p.anchor == "examples"]
    assert examples and all(p.title == "tomllib — Parse TOML files › Examples" for p in examples)
    # a sectionless document is cut as before
    plain = split_document(Document(id="p", text="Short."), word_tokenizer, 10)
    assert [(p.passage_id, p.kind, p.page, p.anchor) for p in plain] == [("p", "prose", None, None)]


def test_read_structured_refuses_unknown_suffixes_with_a_reason(tmp_path):
    (tmp_path / "slides.pptx").write_bytes(b"PK")
    with pytest.raises(UnreadableFile, match="unsupported file type .pptx"):
        read_structured(tmp_path / "slides.pptx")
