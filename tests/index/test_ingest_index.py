"""Indexing folders of real PDF, HTML and Markdown files (tests/data/ingest, see SOURCES.md) beside damaged ones:
what is stored per passage (kind, page, anchor), citations that point into the original file, an index written
before passages had a location, and the same through `cprag index` with and without `--glob`."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pypdf
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import cprag.index.store as store_module
from cprag.api import Index
from cprag.cli import app
from cprag.index.store import LOCATION_COLUMNS, PassageStore
from cprag.index.structured_passages import locate
from cprag.serve import create_app
from tests.index_helpers import index_corpus, stored_rows

DATA = Path(__file__).parents[1] / "data" / "ingest"
PDF = DATA / "shared-mime-info-spec.pdf"
GOOD = ["docs/selectolax-README.md", "docs/spec-pages.pdf", "docs/tomllib.html"]
BAD = {"truncated.pdf": "damaged PDF", "empty.html": "empty HTML", "x.md": "binary or not UTF-8"}
QUESTIONS = ["What does tomllib.load read from a binary file?", "Where are the source XML files installed?"]


def write_folder(root: Path, with_pdf: bool = True) -> Path:
    """The three real files (the PDF cut to three of its pages, so a test encodes tens of passages, not hundreds)
    beside a truncated PDF, an empty page and random bytes named .md."""
    (root / "docs").mkdir(parents=True)
    shutil.copy(DATA / "tomllib.html", root / "docs" / "tomllib.html")
    shutil.copy(DATA / "selectolax-README.md", root / "docs" / "selectolax-README.md")
    if with_pdf:
        source, pages = pypdf.PdfReader(PDF), pypdf.PdfWriter()
        for number in (3, 4, 5):  # "2.2. The source XML files" onwards: numbered headings on each page
            pages.add_page(source.pages[number])
        with open(root / "docs" / "spec-pages.pdf", "wb") as handle:
            pages.write(handle)
    raw = PDF.read_bytes()
    (root / "truncated.pdf").write_bytes(raw[: len(raw) // 3])
    (root / "empty.html").write_text("")
    (root / "x.md").write_bytes(random.Random(3).randbytes(3000))
    return root


def rows_of(index_dir: Path) -> list[dict]:
    return PassageStore(index_dir, 384).table.to_arrow().select(["passage_id", "doc_id", *LOCATION_COLUMNS]
                                                               ).to_pylist()


def skipped_reasons(skipped) -> dict[str, str]:
    return {Path(s["source"] if isinstance(s, dict) else s.source).name:
            s["reason"] if isinstance(s, dict) else s.reason for s in skipped}


@pytest.fixture(scope="module")
def built(tmp_path_factory, copying_checkpoint, embedder):
    root = tmp_path_factory.mktemp("ingest")
    folder = write_folder(root / "corpus")
    report = index_corpus(folder, root / "idx", copying_checkpoint, embedder)
    return folder, root / "idx", report


def test_one_run_stores_the_good_files_with_locations_and_skips_each_bad_one(built):
    _, index_dir, report = built
    reasons = skipped_reasons(report.skipped)
    assert set(reasons) == set(BAD)
    assert all(reasons[name].startswith(start) for name, start in BAD.items())
    assert all("\n" not in reason and len(reason) < 200 for reason in reasons.values())
    rows = rows_of(index_dir)
    assert sorted({row["doc_id"] for row in rows}) == GOOD and report.documents == 3
    by_doc = {doc: [row for row in rows if row["doc_id"] == doc] for doc in GOOD}
    markdown, pdf, html = (by_doc[doc] for doc in GOOD)
    assert {row["page"] for row in pdf} == {1, 2, 3} and all(row["anchor"] is None for row in pdf)
    assert all(row["page"] is None for row in html + markdown)
    assert {"tomllib.load", "tomllib.loads"} <= {row["anchor"] for row in html}
    assert "installation" in {row["anchor"] for row in markdown}
    assert {row["kind"] for row in rows} <= {"prose", "code", "table", "links"}
    assert "code" in {row["kind"] for row in html + markdown}  # the examples on both pages


def test_citations_point_into_the_original_file_in_the_api_and_the_server(built, copying_checkpoint):
    _, index_dir, _ = built
    index = Index(index_dir, checkpoint=copying_checkpoint)
    places = set()
    for question in QUESTIONS:
        answer = index.ask(question, k=2, min_confidence=0.0, min_retrieval_score=-1.0)
        assert answer.citations, question  # the checkpoint copies every token it can
        read = index.store.fetch([p["passage_id"] for p in answer.passages])
        for citation in answer.citations:
            passages = sorted((p for p in read.values() if p.doc_id == citation.doc_id), key=lambda p: p.char_start)
            assert (citation.page, citation.anchor) == locate(passages, citation.start)
            places.add((citation.doc_id, citation.page is not None, citation.anchor is not None))
        assert all({"page", "anchor"} <= set(c) for c in answer.to_json()["citations"])
    assert ("docs/spec-pages.pdf", True, False) in places and ("docs/tomllib.html", False, True) in places

    with TestClient(create_app(index_dir, lambda: index)) as client:
        body = client.post("/v1/ask", json={"question": QUESTIONS[0], "k": 2, "min_confidence": 0.0}).json()
        html = [c for c in body["citations"] if c["doc_id"] == "docs/tomllib.html"]
        assert html and all(c["href"] == f"docs/tomllib.html#{c['anchor']}" for c in html)
        assert "citedPlaces" in client.get("/").text


def test_a_later_run_that_meets_bad_files_leaves_the_stored_index_alone(built, copying_checkpoint, embedder,
                                                                         tmp_path):
    folder, index_dir, _ = built
    shutil.copytree(folder, tmp_path / "corpus")
    shutil.copytree(index_dir, tmp_path / "idx")
    before = stored_rows(tmp_path / "idx")
    # a file indexed before is damaged now, and a new damaged one joins it
    (tmp_path / "corpus" / "docs" / "selectolax-README.md").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "corpus" / "docs" / "later.pdf").write_bytes(PDF.read_bytes()[:4000])

    report = index_corpus(tmp_path / "corpus", tmp_path / "idx", copying_checkpoint, embedder)

    reasons = skipped_reasons(report.skipped)
    assert set(reasons) == set(BAD) | {"selectolax-README.md", "later.pdf"}
    assert report.encoded == 0 and report.removed == 0
    assert stored_rows(tmp_path / "idx") == before  # the damaged file's passages stay as they were
    assert len(Index(tmp_path / "idx", checkpoint=copying_checkpoint)) == len(before)


def test_an_index_written_before_passages_had_locations_opens_reads_and_updates(tmp_path, checkpoint, embedder,
                                                                                  monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(DATA / "selectolax-README.md", corpus / "readme.md")
    with monkeypatch.context() as old_code:  # the table as cprag wrote it before: no kind, page or anchor
        old_code.setattr(store_module, "LOCATION_FIELDS", ())
        index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)
    assert not set(LOCATION_COLUMNS) & set(PassageStore(tmp_path / "idx", 384).table.schema.names)

    index = Index(tmp_path / "idx", checkpoint=checkpoint)
    old_ids = [row["passage_id"] for row in stored_rows(tmp_path / "idx")]
    fetched = index.store.fetch(old_ids)
    assert len(fetched) == len(old_ids)
    assert {(p.kind, p.page, p.anchor) for p in fetched.values()} == {("prose", None, None)}
    answer = index.ask(QUESTIONS[0], k=1, min_confidence=0.0, min_retrieval_score=-1.0)
    assert all(c.page is None and c.anchor is None for c in answer.citations)

    shutil.copy(DATA / "tomllib.html", corpus / "tomllib.html")
    report = index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)  # today's code: the columns are added

    assert report.unchanged == len(old_ids) and report.encoded > 0
    rows = rows_of(tmp_path / "idx")
    assert {row["anchor"] for row in rows if row["doc_id"] == "readme.md"} == {None}  # stored before: no location
    assert "tomllib.load" in {row["anchor"] for row in rows if row["doc_id"] == "tomllib.html"}
    reopened = Index(tmp_path / "idx", checkpoint=checkpoint)
    assert {p.kind for p in reopened.store.fetch(old_ids).values()} == {"prose"}


def test_cprag_index_skips_bad_files_and_glob_selects_only_html(tmp_path, checkpoint, embedder):
    folder = write_folder(tmp_path / "corpus", with_pdf=False)
    base = ["--checkpoint", str(checkpoint), "--max-passage-tokens", "120", "--json"]

    result = CliRunner().invoke(app, ["index", str(folder), "--index", str(tmp_path / "all"), *base])

    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    reasons = skipped_reasons(summary["skipped"])
    assert set(reasons) == set(BAD) and all(reasons[name].startswith(start) for name, start in BAD.items())
    assert sorted({row["doc_id"] for row in rows_of(tmp_path / "all")}) == GOOD[::2]

    result = CliRunner().invoke(app, ["index", str(folder), "--index", str(tmp_path / "html"), "--glob", "**/*.html",
                                      *base])

    assert result.exit_code == 0, result.output
    assert set(skipped_reasons(json.loads(result.stdout)["skipped"])) == {"empty.html"}
    assert {row["doc_id"] for row in rows_of(tmp_path / "html")} == {"docs/tomllib.html"}
    # the library's IndexConfig(glob=...) selects the same
    report = index_corpus(folder, tmp_path / "lib", checkpoint, embedder, glob="**/*.html")
    assert [Path(s.source).name for s in report.skipped] == ["empty.html"]
    assert rows_of(tmp_path / "lib") == rows_of(tmp_path / "html")
