"""`cprag serve`: the index over HTTP. One model, retriever and key-shard cache shared by every request; concurrent
questions decoded together (`cprag.serve.request_batcher`); answers streamed token by token as server-sent events.

Routes: POST /v1/ask (`?stream=true` for events), POST /v1/ask_batch, GET /v1/info, GET /healthz, GET / (the
page), /docs (OpenAPI). Every route but /healthz asks for the API key when one is set (`Authorization: Bearer
KEY` or `X-API-Key: KEY`, compared in constant time, never logged). Nothing a request does writes to the index.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from cprag.decoding.prompt import ASK_MODES
from cprag.errors import (
    CheckpointError,
    ConfigError,
    CpragError,
    IndexBusy,
    IndexUnfinished,
    QuestionTooLong,
    TooFewPassages,
)
from cprag.index.reader import manifest_stamp
from cprag.serve.request_batcher import Batcher, Job

RETRY_AFTER_S = 5
REOPEN_CHECK_S = 1.0  # how often a request may look for a newer committed version of the index


@dataclass
class ServeConfig:
    """Limits and batching of a server; validated here, with the flag named in errors."""

    max_batch: int = 16  # questions decoded per backbone pass
    max_wait_ms: float = 10.0  # how long a request waits for others to batch with
    max_question_chars: int = 2000
    max_k: int = 20
    max_new_tokens: int = 64
    max_batch_questions: int = 64  # per /v1/ask_batch request
    max_body_bytes: int = 256 * 1024
    timeout_s: float = 120.0  # a request not answered by then gets 504
    api_key: str | None = None

    def __post_init__(self):
        for name, flag in (("max_batch", "--max-batch"), ("max_k", "--max-k"), ("max_new_tokens", "--max-new-tokens"),
                           ("max_question_chars", "--max-question-chars"), ("max_body_bytes", "--max-body-bytes")):
            if getattr(self, name) < 1:
                raise ConfigError(flag, getattr(self, name), "must be at least 1")
        if self.max_wait_ms < 0:
            raise ConfigError("--max-wait-ms", self.max_wait_ms, "must be 0 or more")
        if self.timeout_s <= 0:
            raise ConfigError("--timeout", self.timeout_s, "must be positive")
        if self.api_key is not None and len(self.api_key) < 8:
            raise ConfigError("--api-key", "(hidden)", "must be at least 8 characters")


class AskRequest(BaseModel):
    question: str = Field(..., description="The question.", examples=["When was the lighthouse built?"])
    k: int = Field(5, description="Passages to retrieve.")
    mode: str = Field("hidden", description="hidden (keys), visible (passages in the prompt), closed, or reader "
                      "(the span reader reads the passages' text).")
    max_new_tokens: int = Field(32, description="Most tokens in the answer.")
    min_confidence: float | None = Field(None, description="Withhold answers below this (default: the model's).")
    verify: bool | None = Field(None, description="Withhold answers the verifier doubts (default: on when the "
                                "checkpoint ships one).")


class AskBatchRequest(BaseModel):
    questions: list[str]
    k: int = 5
    mode: str = "hidden"
    max_new_tokens: int = 32
    min_confidence: float | None = None
    verify: bool | None = None


class ServeState:
    """What every route shares, held on `app.state.served`: the limits, and the opened index with its batcher.
    The index is opened on first use (503 while `cprag index` is still building it), and reopened at the latest
    committed version when `cprag index` commits one (checked at most once a second): requests then see the updated
    documents, with the same model."""

    def __init__(self, path: Path, open_index, config: ServeConfig):
        self.path, self.open_index, self.config = path, open_index, config
        self.lock = threading.Lock()
        self.index = None
        self.batcher: Batcher | None = None
        self.stamp, self.checked = None, 0.0
        self.reopened = 0  # versions picked up since start

    def get(self):
        with self.lock:
            if self.index is None:
                stamp = manifest_stamp(self.path)
                self.index = self.open_index()  # IndexBusy / IndexUnfinished while a first build runs
                self.stamp, self.checked = stamp, time.monotonic()
                self.batcher = Batcher(self.index, self.config.max_batch, self.config.max_wait_ms / 1000)
            elif time.monotonic() - self.checked >= REOPEN_CHECK_S:
                self.checked = time.monotonic()
                stamp = manifest_stamp(self.path)
                if stamp != self.stamp:
                    try:
                        fresh = self.index.reopened()
                    except CpragError:
                        pass  # a commit mid-way or a damaged update: keep answering from the version we have
                    else:
                        self.index, self.stamp, self.batcher.index = fresh, stamp, fresh
                        self.reopened += 1
            return self.index

    def index_or_503(self):
        """(the opened index, None), or (None, the error response saying why there is none)."""
        try:
            return self.get(), None
        except (IndexBusy, IndexUnfinished) as failure:
            return None, error(503, "index_not_ready", str(failure), {"Retry-After": str(RETRY_AFTER_S)})
        except CpragError as failure:
            return None, error(500, "index_unusable", str(failure))

    async def answer(self, job: Job):
        return await asyncio.wait_for(asyncio.wrap_future(self.batcher.submit(job)), timeout=self.config.timeout_s)

    def payload(self, index, answer) -> dict:
        """The `ask --json` object, with each passage's text and offset for highlighting the copied spans, and each
        citation's `href` (`SOURCE#ANCHOR`) when its document's file or URL is known and the span has an anchor."""
        result = answer.to_json()
        cache = self.index.cache if self.index is not None else index.cache  # the version that answered
        sources = {}
        for passage in result["passages"]:
            entry = cache.entries.get(passage["passage_id"])
            if entry is not None:
                passage["text"], passage["char_start"] = entry.passage.text, entry.passage.char_start
                sources[entry.passage.doc_id] = entry.passage.source
        for citation in result["citations"]:
            source = sources.get(citation["doc_id"])
            citation["href"] = f"{source}#{citation['anchor']}" if source and citation.get("anchor") else None
        return result

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


def error(status: int, kind: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message}}, status_code=status, headers=headers)


def create_app(path: str | Path, open_index, config: ServeConfig | None = None) -> FastAPI:
    """The app over the index at `path`; `open_index()` returns an opened `cprag.Index` (called on first use)."""
    app = FastAPI(title="cprag", description="Answers copied from documents the language model never reads.",
                  version="1", lifespan=_lifespan)
    app.state.served = ServeState(Path(path), open_index, config or ServeConfig())
    app.middleware("http")(_guard)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.include_router(routes)
    return app


def _state(request: Request) -> ServeState:
    return request.app.state.served


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.served.close()


async def _guard(request: Request, call_next):
    config = _state(request).config
    if config.api_key is not None and request.url.path != "/healthz":
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix(
            "Bearer ").strip()
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            return error(401, "unauthorized", "a valid API key is required (Authorization: Bearer KEY)")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
        return error(413, "too_large", f"the body is over {config.max_body_bytes} bytes")
    return await call_next(request)


async def _invalid(_request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", [])[1:]) or "body"
    return error(422, "invalid", f"{where}: {first.get('msg', 'invalid request')}")


def _check(config: ServeConfig, index, questions: list[str], k: int, mode: str, max_new_tokens: int,
           min_confidence, verify: bool | None = None):
    """None, or the 4xx response for the first bad value."""
    if mode not in ASK_MODES:
        return error(422, "invalid", f"mode: expected one of {', '.join(ASK_MODES)}, not {mode!r}")
    if not 1 <= k <= min(config.max_k, len(index)):
        return error(422, "invalid", f"k: must be between 1 and {min(config.max_k, len(index))}, not {k}")
    if not 1 <= max_new_tokens <= config.max_new_tokens:
        return error(422, "invalid", f"max_new_tokens: must be between 1 and {config.max_new_tokens}")
    for question in questions:
        if len(question) > config.max_question_chars:
            return error(413, "too_large", f"question: over {config.max_question_chars} characters")
    try:
        index.check_questions(questions, mode, min_confidence, max_new_tokens=max_new_tokens)
        index.verifying(verify)
    except QuestionTooLong as failure:
        return error(413, "too_large", str(failure))
    except (ConfigError, TooFewPassages) as failure:
        return error(422, "invalid", str(failure))
    if mode == "reader":
        try:
            index.reader  # noqa: B018 - loaded once; a missing reader or one on another base is refused here
        except CheckpointError as failure:
            return error(422, "invalid", f"mode: {failure}")
    return None


routes = APIRouter()


@routes.get("/healthz")
async def healthz():
    return {"status": "ok"}


@routes.get("/v1/info")
async def info(request: Request):
    from cprag.api import index_info

    served = _state(request)
    index, failure = served.index_or_503()
    if failure:
        return failure
    return {"index": index_info(served.path), "model": {"device": index.device,
            "dtype": str(next(index.model.parameters()).dtype).removeprefix("torch.")},
            "cache": index.cache.stats(), "reopened": served.reopened,
            "batches": {"count": len(served.batcher.batches), "largest": max(served.batcher.batches, default=0)}}


@routes.post("/v1/ask")
async def ask(request: Request, body: AskRequest, stream: bool = Query(False)):
    served = _state(request)
    index, failure = served.index_or_503()
    if failure:
        return failure
    bad = _check(served.config, index, [body.question], body.k, body.mode, body.max_new_tokens, body.min_confidence,
                 body.verify)
    if bad:
        return bad
    if not stream:
        job = Job(body.question, body.k, body.mode, body.max_new_tokens, body.min_confidence, body.verify)
        try:
            return served.payload(index, await served.answer(job))
        except TimeoutError:
            job.cancelled.set()
            return error(504, "timeout", f"no answer within {served.config.timeout_s:g} s")
    return StreamingResponse(_stream_events(request, served, index, body), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream_events(request: Request, served: ServeState, index, body: AskRequest):
    """`token` events ({"text", "citation"}) as the answer is decoded, then one `answer` event."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    tokens: list[int] = []
    shown = [""]

    def on_token(token: int, source) -> None:  # the batcher's thread
        tokens.append(token)
        text = index.tokenizer.decode(tokens, skip_special_tokens=True).lstrip()
        delta, shown[0] = text[len(shown[0]):], text
        loop.call_soon_threadsafe(events.put_nowait, ("token", {"text": delta, "copied": source is not None}))

    job = Job(body.question, body.k, body.mode, body.max_new_tokens, body.min_confidence, body.verify,
              on_token)
    future = asyncio.wrap_future(served.batcher.submit(job))
    timeout_s = served.config.timeout_s
    deadline = loop.time() + timeout_s
    while True:
        if await request.is_disconnected():
            job.cancelled.set()  # frees its place in the batch at the next step
            return
        if future.done() and events.empty():
            break
        if loop.time() > deadline:
            job.cancelled.set()
            yield _event("error", {"type": "timeout", "message": f"no answer within {timeout_s:g} s"})
            return
        try:
            kind, data = await asyncio.wait_for(events.get(), timeout=0.05)
        except TimeoutError:
            continue
        yield _event(kind, data)
    try:
        yield _event("answer", served.payload(index, future.result()))
    except Exception as failure:  # noqa: BLE001 - the stream ends with what went wrong
        yield _event("error", {"type": "failed", "message": str(failure)})


@routes.post("/v1/ask_batch")
async def ask_batch(request: Request, body: AskBatchRequest):
    served = _state(request)
    config = served.config
    index, failure = served.index_or_503()
    if failure:
        return failure
    if not 1 <= len(body.questions) <= config.max_batch_questions:
        return error(422, "invalid", f"questions: give 1 to {config.max_batch_questions} questions")
    bad = _check(config, index, body.questions, body.k, body.mode, body.max_new_tokens, body.min_confidence,
                 body.verify)
    if bad:
        return bad
    jobs = [Job(q, body.k, body.mode, body.max_new_tokens, body.min_confidence, body.verify) for q in body.questions]
    try:
        answers = await asyncio.gather(*(served.answer(job) for job in jobs))
    except TimeoutError:
        for job in jobs:
            job.cancelled.set()
        return error(504, "timeout", f"no answer within {config.timeout_s:g} s")
    return {"answers": [served.payload(index, a) for a in answers]}


@routes.get("/", response_class=HTMLResponse)
async def page():
    return resources.files("cprag.serve").joinpath("page.html").read_text(encoding="utf-8")


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"
