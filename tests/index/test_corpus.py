"""Corpus readers and passage splitting, bad files included."""

import json
from pathlib import Path

import pytest

from cprag.errors import CorpusError
from cprag.index.corpus import Document, read_corpus, split_document
from tests.tiny_models import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_jsonl_with_titles_metadata_and_bad_lines(tmp_path):
    lines = [
        json.dumps({"id": "a", "text": "Alpha text.", "title": "Alpha", "year": 1999}),
        "{not json",
        json.dumps({"id": "b", "text": "   "}),
        json.dumps({"text": "no id"}),
        json.dumps({"id": 7, "text": "Numeric id."}),
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    corpus = read_corpus(tmp_path / "c.jsonl")
    assert [d.id for d in corpus.documents] == ["a", "7"]
    assert corpus.documents[0].title == "Alpha" and corpus.documents[0].metadata == {"year": 1999}
    reasons = sorted(s.reason.split(" (")[0] for s in corpus.skipped)
    assert reasons == ['empty text', 'expected an object with "id" and "text"', "invalid JSON"]


def test_folder_of_text_and_markdown_skips_empty_binary_and_non_utf8(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.txt").write_text("First document.")
    (tmp_path / "sub" / "two.md").write_text("# Second\n\nBody of the second.")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "ignored.docx").write_bytes(b"PK\x03\x04")
    corpus = read_corpus(tmp_path)
    assert sorted(d.id for d in corpus.documents) == ["one.txt", "sub/two.md"]
    assert next(d for d in corpus.documents if d.id == "sub/two.md").title == "Second"
    assert sorted(s.reason for s in corpus.skipped) == ["binary or not UTF-8", "binary or not UTF-8", "empty"]


def test_squad_json_paragraphs_become_title_hash_index_documents(tmp_path):
    data = {"data": [{"title": "Moon", "paragraphs": [{"context": "The Moon orbits.", "qas": []},
                                                      {"context": "It has phases.", "qas": []}]}]}
    (tmp_path / "s.json").write_text(json.dumps(data))
    corpus = read_corpus(tmp_path / "s.json")
    assert [(d.id, d.title, d.text) for d in corpus.documents] == [
        ("Moon#0", "Moon", "The Moon orbits."), ("Moon#1", "Moon", "It has phases.")]


def test_unreadable_corpora_raise_one_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.json").write_text("{oops")
    (tmp_path / "notsquad.json").write_text('{"rows": []}')
    for name, message in [("empty.jsonl", "empty"), ("bad.json", "not valid JSON"), ("notsquad.json", "SQuAD"),
                          ("missing.jsonl", "no such file")]:
        with pytest.raises(CorpusError, match=message):
            read_corpus(tmp_path / name)


def test_widened_bad_input_is_skipped_or_refused_with_a_reason(tmp_path, monkeypatch):
    import cprag.index.corpus

    monkeypatch.setattr(cprag.index.corpus, "MAX_DOCUMENT_CHARS", 1000)  # the 10M-character cap, scaled down
    nested = "[" * 100_000 + "]" * 100_000
    lines = [
        json.dumps({"id": "ok", "text": "Fine."}),
        json.dumps({"id": 1.5, "text": "Float id."}),
        json.dumps({"id": ["a"], "text": "List id."}),
        json.dumps({"id": True, "text": "Bool id."}),
        json.dumps({"id": " ", "text": "Blank id."}),
        json.dumps({"id": "nul", "text": "Has a \x00 NUL."}),
        json.dumps({"id": "big", "text": "x" * 1001}),
        nested,
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    corpus = read_corpus(tmp_path / "c.jsonl")
    assert [d.id for d in corpus.documents] == ["ok"]
    reasons = [s.reason for s in corpus.skipped]
    assert sum("is not a non-empty string or an integer" in r for r in reasons) == 4
    assert any("NUL" in r for r in reasons) and any("1,001 characters" in r for r in reasons)
    assert "invalid JSON (nested too deeply)" in reasons
    # a folder file with a NUL past the first 8 KB is binary too; an oversized one is skipped
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "late.txt").write_bytes(b"a" * 9000 + b"\x00")
    (tmp_path / "folder" / "big.md").write_text("y" * 1001)
    assert sorted(s.reason.split(",")[0] for s in read_corpus(tmp_path / "folder").skipped) == [
        "1", "binary or not UTF-8"]
    (tmp_path / "deep.json").write_text(nested)
    with pytest.raises(CorpusError, match="nested too deeply"):
        read_corpus(tmp_path / "deep.json")


def test_repeated_ids_refuse_the_corpus_naming_both_places(tmp_path):
    lines = [json.dumps({"id": "7", "text": "Seven."}), json.dumps({"id": "a", "text": "A."}),
             json.dumps({"id": 7, "text": "Seven again, as a number."})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=r"id '7' is used twice, at .*c.jsonl:1 and .*c.jsonl:3"):
        read_corpus(tmp_path / "c.jsonl")


def test_a_json_array_of_documents_reads_like_jsonl(tmp_path):
    records = [{"id": f"d{i}", "text": f"Document {i}."} for i in range(3000)] + [{"id": "x"}]
    (tmp_path / "array.json").write_text(json.dumps(records))
    corpus = read_corpus(tmp_path / "array.json")
    assert len(corpus.documents) == 3000 and corpus.documents[-1].text == "Document 2999."
    assert [s.source for s in corpus.skipped] == [f"{tmp_path / 'array.json'}[3000]"]
    (tmp_path / "numbers.json").write_text(json.dumps(list(range(10))))
    with pytest.raises(CorpusError, match="JSON array without one usable"):
        read_corpus(tmp_path / "numbers.json")


def test_a_long_single_line_document_splits_in_linear_time(tokenizer):
    # sentence cuts scan back from each candidate token instead of copying the prefix: quadratic before
    text = "word " * 200_000  # 1 MB, one line, no sentence ends
    passages = split_document(Document(id="line", text=text), tokenizer, max_tokens=256)
    assert "".join(p.text for p in passages) == text and len(passages) > 100


def test_long_documents_split_into_fitting_passages_with_exact_offsets(tokenizer):
    text = " ".join(f"Sentence number {i} says something." for i in range(40))
    document = Document(id="long", text=text, title="Long")
    passages = split_document(document, tokenizer, max_tokens=100)
    assert len(passages) > 1
    assert [p.passage_id for p in passages] == [f"long@{i}" for i in range(len(passages))]
    for passage in passages:
        assert len(tokenizer(passage.text, add_special_tokens=False)["input_ids"]) <= 100
        assert text[passage.char_start : passage.char_start + len(passage.text)] == passage.text
    assert "".join(p.text for p in passages) == text  # nothing lost or repeated
    assert split_document(Document(id="s", text="Short."), tokenizer, 100)[0].passage_id == "s"


@pytest.mark.parametrize("name, min_words, max_words", [("corpus.jsonl", 20, 120), ("long-corpus.jsonl", 200, 280)])
def test_shipped_corpora_read_cleanly_at_their_stated_sizes(name, min_words, max_words):
    """The demo corpus holds short facts; the bench's default corpus holds RAG-sized passages (~300 tokens, one
    passage per document at the indexer's 384-token limit), which the bench's latency ratio depends on."""
    corpus = read_corpus(Path(__file__).parents[2] / "examples" / name)
    assert not corpus.skipped
    assert len(corpus.documents) >= 10  # the bench asks at k = 10
    assert len({d.id for d in corpus.documents}) == len(corpus.documents)
    for document in corpus.documents:
        assert document.title
        assert min_words <= len(document.text.split()) <= max_words, document.id


def test_an_ivf_index_finds_most_of_the_exact_top_5_and_keeps_its_layout(tmp_path):
    import numpy as np

    from cprag.index.retrieve import PassageIndex, faiss_layout

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(40, 32))
    points = centres[rng.integers(0, 40, size=4000)] + 0.3 * rng.normal(size=(4000, 32))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    ids = [f"p{i}" for i in range(len(points))]
    assert faiss_layout(3999, 4000) == {"kind": "flat"}
    index = PassageIndex.build(ids, points, approximate_above=1000)
    assert index.layout["kind"] == "ivf" and index.layout["nlist"] == 4000 // 39 and index.layout["nprobe"] == 16
    queries = points[rng.integers(0, 4000, size=200)] + 0.05 * rng.normal(size=(200, 32))
    assert index.recall_against_exact(ids, points, queries) >= 0.9
    index.save(tmp_path, {"index": "f.index", "ids": "f.ids.json"}, 3)
    again = PassageIndex.load(tmp_path, {"index": "f.index", "ids": "f.ids.json"}, use_gpu=False,
                              layout={**index.layout, "nprobe": 1})
    assert again.index.nprobe == 1 and again.layout["nprobe"] == 1  # the manifest's nprobe wins
    fewer = again.recall_against_exact(ids, points, queries)
    assert fewer < index.recall_against_exact(ids, points, queries)
    rebuilt = PassageIndex.build(ids, points, approximate_above=1000)  # seeded: the same table, the same index
    assert [[h.passage_id for h in row] for row in rebuilt.search(queries[:20], 5)] == \
        [[h.passage_id for h in row] for row in index.search(queries[:20], 5)]
    # above `compressed_above` the vectors are 8-bit: a quarter of the bytes, nearly the same neighbours
    assert faiss_layout(4000, 1000, 4001)["kind"] == "ivf" and faiss_layout(4000, 1000, 4000)["kind"] == "ivf-sq8"
    small = PassageIndex.build(ids, points, approximate_above=1000, compressed_above=1000)
    assert small.layout["kind"] == "ivf-sq8" and small.recall_against_exact(ids, points, queries) >= 0.9
    small.save(tmp_path, {"index": "s.index", "ids": "s.ids.json"}, 3)
    index.save(tmp_path, {"index": "f2.index", "ids": "f2.ids.json"}, 3)
    assert (tmp_path / "s.index").stat().st_size < 0.5 * (tmp_path / "f2.index").stat().st_size
    reopened = PassageIndex.load(tmp_path, {"index": "s.index", "ids": "s.ids.json"}, use_gpu=False,
                                 layout={**small.layout, "nprobe": 2})
    assert reopened.index.nprobe == 2
