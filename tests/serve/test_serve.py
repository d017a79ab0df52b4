"""`cprag serve`: the API through FastAPI's test client and a real uvicorn process on 127.0.0.1, and the page in
headless Chromium."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from cprag.api import Index
from cprag.serve import ServeConfig, create_app
from tests.index_helpers import index_corpus
from tests.tiny_models import DOCS, tiny_checkpoint, write_jsonl

QUESTIONS = ["When was the lighthouse built?", "Who designed the glass bridge?", "When does the night ferry leave?",
             "What rings every hour?"]
ASK = dict(k=2, min_confidence=0.0)


@pytest.fixture(scope="module")
def built(tmp_path_factory, embedder):  # noqa: F811
    root = tmp_path_factory.mktemp("serve")
    checkpoint = tiny_checkpoint(root / "model", copy_everything=True, successor=(6.0, 0.0))
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    return root / "idx", checkpoint


@pytest.fixture(scope="module")
def index(built):
    return Index(built[0], checkpoint=built[1])


def client_for(index, **config) -> TestClient:
    return TestClient(create_app(index.path, lambda: index, ServeConfig(**config)))


def events(text: str) -> list[tuple[str, dict]]:
    found = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        found.append((lines["event"], json.loads(lines["data"])))
    return found


def test_ask_answers_as_the_library_does_and_streams_the_same_answer(index):
    with client_for(index) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        for question in QUESTIONS:
            expected = index.ask(question, min_retrieval_score=0.25, **ASK)
            response = client.post("/v1/ask", json={"question": question, "k": 2, "min_confidence": 0.0})
            assert response.status_code == 200, response.text
            body = response.json()
            assert (body["answer"], body["no_answer"]) == (expected.answer, expected.no_answer)
            assert [c["text"] for c in body["citations"]] == [c.text for c in expected.citations]
            assert all("text" in p and "char_start" in p for p in body["passages"])
            streamed = client.post("/v1/ask?stream=true", json={"question": question, "k": 2, "min_confidence": 0.0})
            assert streamed.headers["content-type"].startswith("text/event-stream")
            found = events(streamed.text)
            assert found[-1][0] == "answer" and found[-1][1]["answer"] == expected.answer
            tokens = [data for kind, data in found if kind == "token"]
            assert "".join(t["text"] for t in tokens).strip() == expected.answer
            if expected.citations:
                assert any(t["copied"] for t in tokens)
        info = client.get("/v1/info").json()
        assert info["index"]["counts"]["passages"] == len(DOCS) and info["batches"]["count"] >= 1
        assert "/v1/ask" in client.get("/openapi.json").json()["paths"]
        assert "<form" in client.get("/").text and client.get("/docs").status_code == 200


def test_concurrent_requests_are_decoded_together_with_the_answers_of_one_at_a_time(index):
    expected = {q: index.ask(q, min_retrieval_score=0.25, **ASK).answer for q in QUESTIONS}
    with client_for(index, max_batch=8, max_wait_ms=200) as client:
        results = {}

        def ask(question):
            results[question] = client.post("/v1/ask", json={"question": question, "k": 2, "min_confidence": 0.0})

        threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS * 2]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {q: r.json()["answer"] for q, r in results.items()} == expected
        batches = client.app.state.served.batcher.batches
        assert max(batches) > 1  # some requests shared a backbone pass
        batch = client.post("/v1/ask_batch", json={"questions": QUESTIONS, "k": 2, "min_confidence": 0.0})
        assert [a["answer"] for a in batch.json()["answers"]] == [expected[q] for q in QUESTIONS]


@pytest.mark.parametrize("body,status,words", [
    ({"question": "   "}, 422, "empty"),
    ({"question": "x" * 3000}, 413, "characters"),
    ({"question": "Who?", "k": 0}, 422, "k"),
    ({"question": "Who?", "k": 50}, 422, "k"),
    ({"question": "Who?", "mode": "loud"}, 422, "mode"),
    ({"question": "Who?", "max_new_tokens": 500}, 422, "max_new_tokens"),
    ({"question": "Who?", "min_confidence": 2}, 422, "min-confidence"),
    ({"question": "Who?", "verify": True}, 422, "ships no verifier"),
    ({"k": 2}, 422, "question"),
])
def test_bad_requests_get_a_clear_4xx_json_error(index, body, status, words):
    with client_for(index) as client:
        response = client.post("/v1/ask", json=body)
        assert response.status_code == status
        assert words in response.json()["error"]["message"]
    with client_for(index, max_body_bytes=100) as client:
        big = client.post("/v1/ask", json={"question": "a" * 200})
        assert big.status_code == 413 and big.json()["error"]["type"] == "too_large"


def test_an_api_key_guards_every_route_but_healthz(index):
    with client_for(index, api_key="s3cret-key") as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/info").status_code == 401
        assert client.post("/v1/ask", json={"question": "Who?"}).status_code == 401
        wrong = client.post("/v1/ask", json={"question": "Who?"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "nope" not in wrong.text
        good = client.post("/v1/ask", json={"question": QUESTIONS[0], "k": 2},
                           headers={"Authorization": "Bearer s3cret-key"})
        assert good.status_code == 200
        assert client.get("/v1/info", headers={"X-API-Key": "s3cret-key"}).status_code == 200


def test_an_index_still_building_answers_503_with_a_retry_hint(tmp_path, built):
    from cprag.errors import IndexUnfinished

    def still_building():
        raise IndexUnfinished(str(tmp_path))

    with TestClient(create_app(tmp_path, still_building)) as client:
        response = client.post("/v1/ask", json={"question": "Who?"})
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert client.get("/healthz").status_code == 200


def test_a_stream_whose_client_went_away_frees_its_place(index):
    from cprag.serve.request_batcher import Job

    with client_for(index) as client:
        client.app.state.served.get()
        batcher = client.app.state.served.batcher
        job = Job(QUESTIONS[0], 2, "hidden", 32, 0.0, on_token=lambda *_: None)
        job.cancelled.set()  # gone before its batch started
        batcher.submit(job)
        follow = batcher.submit(Job(QUESTIONS[1], 2, "hidden", 32, 0.0)).result(timeout=60)
        assert follow.answer == index.ask(QUESTIONS[1], min_retrieval_score=0.25, **ASK).answer
        assert job.future.cancelled()
        # gone after its first token: decoding stops at the next step, the rest of its batch goes on
        heard = []
        leaving = Job(QUESTIONS[0], 2, "hidden", 32, 0.0)
        leaving.on_token = lambda token, source: heard.append(token) or leaving.cancelled.set()
        staying = Job(QUESTIONS[2], 2, "hidden", 32, 0.0)
        batcher.max_wait_s = 0.5
        first, second = batcher.submit(leaving), batcher.submit(staying)
        full = index.ask(QUESTIONS[0], min_retrieval_score=0.25, **ASK)
        assert len(first.result(timeout=60).citations) <= 1 and len(heard) == 1
        assert second.result(timeout=60).answer == index.ask(QUESTIONS[2], min_retrieval_score=0.25, **ASK).answer
        assert full.answer.startswith(first.result().answer)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(built):
    """A real `cprag serve` process on 127.0.0.1."""
    index_dir, checkpoint = built
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "cprag.cli", "serve", "--index", str(index_dir), "--port",
                                str(port), "--checkpoint", str(checkpoint)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
        assert process.poll() is None, process.stderr.read().decode()
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_a_real_uvicorn_process_answers_and_streams_the_first_token_before_the_answer(server, index):
    expected = index.ask(QUESTIONS[0], min_retrieval_score=0.25, **ASK)
    body = httpx.post(server + "/v1/ask", json={"question": QUESTIONS[0], "k": 2, "min_confidence": 0.0},
                      timeout=60).json()
    assert body["answer"] == expected.answer
    kinds = []
    with httpx.stream("POST", server + "/v1/ask?stream=true", timeout=60,
                      json={"question": QUESTIONS[0], "k": 2, "min_confidence": 0.0}) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kinds.append(line.removeprefix("event: "))
    assert kinds[-1] == "answer" and (not expected.answer or kinds[0] == "token")


def test_binding_beyond_loopback_needs_an_api_key(built):
    from typer.testing import CliRunner

    from cprag.cli import app

    result = CliRunner().invoke(app, ["serve", "--index", str(built[0]), "--host", "0.0.0.0"],
                                env={"CPRAG_API_KEY": ""})
    assert result.exit_code == 2 and "--api-key" in result.output and len(result.output.strip().splitlines()) == 1


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make install installs it as root)")
def test_the_page_streams_an_answer_and_highlights_the_copied_span(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page()
        page.goto(server + "/")
        page.fill("#question", QUESTIONS[0])
        page.fill("#k", "2")
        page.click("#go")
        page.wait_for_selector(".passage", timeout=60_000)
        answer = page.inner_text("#answer")
        marks = page.locator(".passage mark")
        assert answer.strip() and marks.count() >= 1
        assert marks.first.inner_text().strip() in answer
        page.screenshot(path=str(tmp_path / "page.png"))
        browser.close()
    assert Path(tmp_path / "page.png").stat().st_size > 5000


def test_a_running_server_picks_up_a_committed_update_of_its_index(tmp_path, built, embedder):  # noqa: F811
    import cprag.serve.app as served_app

    checkpoint = built[1]
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)
    opened = Index(tmp_path / "idx", checkpoint=checkpoint)
    question = {"question": "What does the tower of Quellmoor hold?", "k": 1, "min_confidence": 0.0}
    served_app.REOPEN_CHECK_S = 0.0
    try:
        with TestClient(create_app(tmp_path / "idx", lambda: opened)) as client:
            before = client.post("/v1/ask", json=question).json()
            assert before["passages"][0]["doc_id"] != "tower"
            write_jsonl(corpus, DOCS + [{"id": "tower", "title": "Quellmoor Tower",
                                         "text": "The tower of Quellmoor holds a brass telescope from 1902."}])
            index_corpus(corpus, tmp_path / "idx", checkpoint, embedder)
            after = client.post("/v1/ask", json=question).json()
            assert after["passages"][0]["doc_id"] == "tower" and "telescope" in after["passages"][0]["text"]
            assert client.get("/v1/info").json()["reopened"] == 1
    finally:
        served_app.REOPEN_CHECK_S = 1.0
