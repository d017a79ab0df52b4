"""Mode "reader" wherever a user meets it: `Index.ask`, `cprag ask --reader` and `serve`'s "mode": "reader". The
span reader reads the retrieved passages' stored text and cites the span it read, or says no answer."""

import json

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.model.backbone import gguf_reference
from cprag.model.reader_checkpoint import new_reader, save_reader
from cprag.serve import ServeConfig, create_app
from tests.index_helpers import index_corpus, stored_rows
from tests.tiny_models import DOCS, write_jsonl, write_tiny_gguf


@pytest.fixture(scope="module")
def built(tmp_path_factory, checkpoint, embedder):
    root = tmp_path_factory.mktemp("reader-ask")
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    reader, _ = new_reader(gguf_reference(checkpoint.parent / "base.gguf"), adapter_rank=4, lookahead=1)
    save_reader(reader, root / "reader")
    write_tiny_gguf(root / "other.gguf", seed=1)  # another base: another sha256
    other, _ = new_reader(gguf_reference(root / "other.gguf"), adapter_rank=4, lookahead=1)
    save_reader(other, root / "other-reader")
    return root


def _check_cited(answer: dict) -> None:
    citations = answer["citations"] or answer["withheld_citations"]
    assert len(citations) == 1
    citation = citations[0]
    document = next(d for d in DOCS if d["id"] == citation["doc_id"])
    assert document["text"][citation["start"]: citation["end"]] == citation["text"]
    assert citation["doc_id"] in {p["doc_id"] for p in answer["passages"]}
    if answer["no_answer"]:
        assert answer["no_answer_reason"] == "reader" and answer["withheld_answer"] == citation["text"]
        assert answer["answerable"] < 0.5
    else:
        assert answer["answer"] == citation["text"] and answer["answerable"] >= 0.5


def test_the_reader_reads_the_retrieved_passages_and_cites_its_span(built, checkpoint):
    index = Index(built / "idx", checkpoint=checkpoint, reader=built / "reader")
    answers = index.ask_many(["When was the lighthouse built?", "When do geese arrive?"], k=3, mode="reader")
    for answer in answers:
        payload = answer.to_json()
        assert payload["mode"] == "reader" and "read" in payload["timings_ms"]
        _check_cited(payload)
    alone = index.ask("When do geese arrive?", k=3, mode="reader")
    assert (alone.answer, alone.withheld_answer) == (answers[1].answer, answers[1].withheld_answer)


def test_ask_reader_on_the_command_line_and_its_one_line_errors(built, checkpoint):
    runner = CliRunner()
    base = ["--index", str(built / "idx"), "--checkpoint", str(checkpoint), "-k", "2"]
    before = stored_rows(built / "idx")
    result = runner.invoke(app, ["ask", "When was the lighthouse built?", "--reader", "--reader-path",
                                 str(built / "reader"), "--json", *base])
    assert result.exit_code == 0, result.output
    _check_cited(json.loads(result.stdout))
    shown = runner.invoke(app, ["ask", "When was the lighthouse built?", "--reader", "--reader-path",
                                str(built / "reader"), *base])
    assert shown.exit_code == 0 and "reader" in shown.stdout
    cases = [
        (["--reader", "--reader-path", str(built / "other-reader")], "trained on base"),
        (["--reader", "--reader-path", str(built / "nowhere")], "no span reader here"),
        (["--reader-path", str(built / "reader")], "goes with --reader"),
        (["--reader", "--visible"], "choose one"),
    ]
    for extra, words in cases:
        failed = runner.invoke(app, ["ask", "When?", *extra, *base])
        assert failed.exit_code != 0 and words in failed.stderr, (extra, failed.output)
        assert len(failed.stderr.strip().splitlines()) == 1
    assert stored_rows(built / "idx") == before  # nothing stored was touched


def test_serve_answers_in_reader_mode_and_refuses_a_reader_of_another_base(built, checkpoint):
    index = Index(built / "idx", checkpoint=checkpoint, reader=built / "reader")
    expected = index.ask("When was the lighthouse built?", k=2, mode="reader")
    with TestClient(create_app(index.path, lambda: index, ServeConfig())) as client:
        response = client.post("/v1/ask", json={"question": "When was the lighthouse built?", "k": 2,
                                                "mode": "reader"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["mode"] == "reader" and body["answer"] == expected.answer
        streamed = client.post("/v1/ask?stream=true", json={"question": "When was the lighthouse built?", "k": 2,
                                                            "mode": "reader"})
        assert '"mode": "reader"' in streamed.text or '"mode":"reader"' in streamed.text
        bad = client.post("/v1/ask", json={"question": "When?", "mode": "raeder"})
        assert bad.status_code == 422 and "reader" in bad.json()["error"]["message"]
    wrong = Index(built / "idx", checkpoint=checkpoint, reader=built / "other-reader")
    with TestClient(create_app(wrong.path, lambda: wrong, ServeConfig())) as client:
        refused = client.post("/v1/ask", json={"question": "When?", "k": 2, "mode": "reader"})
        assert refused.status_code == 422 and "trained on base" in refused.json()["error"]["message"]
