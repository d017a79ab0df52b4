"""Requests decoded together: one worker thread owns the model and answers queued questions in batches.

Concurrent requests wait at most `max_wait_s` for company, then up to `max_batch` questions that share their
settings (k, mode, max_new_tokens, min_confidence) go through `Index.ask_many` as one batch: one backbone pass per
step for all of them, and one device copy of every key shard they share (the index's key-shard cache). A request
that is cancelled (its client went away) stops decoding at the next step and frees its place.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field


@dataclass
class Job:
    """One question and how to answer it; `future` gets its `Answer` (or the error)."""

    question: str
    k: int
    mode: str
    max_new_tokens: int
    min_confidence: float | None
    verify: bool | None = None  # None: the index's default (cprag.api.Index.verifying)
    on_token: Callable[[int, tuple[int, int] | None], None] | None = None  # (token id, source) as decoded
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def settings(self) -> tuple:
        return self.k, self.mode, self.max_new_tokens, self.min_confidence, self.verify


class Batcher:
    """Queue questions from any thread; one worker answers them in batches with `index.ask_many`."""

    def __init__(self, index, max_batch: int = 16, max_wait_s: float = 0.01):
        self.index, self.max_batch, self.max_wait_s = index, max_batch, max_wait_s
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.batches: list[int] = []  # the size of every batch decoded (for /v1/info and tests)
        self.worker = threading.Thread(target=self._run, name="cprag-batcher", daemon=True)
        self.worker.start()

    def submit(self, job: Job) -> Future:
        self.jobs.put(job)
        return job.future

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=30)

    def _run(self) -> None:
        waiting: list[Job] = []
        while True:
            if not waiting:
                job = self.jobs.get()
                if job is None:
                    return
                waiting.append(job)
            deadline = time.monotonic() + self.max_wait_s
            while len(waiting) < self.max_batch:
                try:
                    job = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)  # finish what is waiting, then stop
                    break
                waiting.append(job)
            first = waiting[0].settings  # the oldest job's settings go first; others wait for their turn
            batch = [j for j in waiting if j.settings == first and not j.cancelled.is_set()][: self.max_batch]
            for job in waiting:
                if job.cancelled.is_set() and not job.future.done():
                    job.future.cancel()
            waiting = [j for j in waiting if j not in batch and not j.future.done()]
            if batch:
                self._answer(batch)

    def _answer(self, batch: list[Job]) -> None:
        for job in batch:
            job.future.set_running_or_notify_cancel()
        k, mode, max_new_tokens, min_confidence, verify = batch[0].settings
        streaming = any(job.on_token is not None for job in batch)
        try:
            answers = self.index.ask_many(
                [job.question for job in batch], k=k, mode=mode, max_new_tokens=max_new_tokens,
                min_confidence=min_confidence, batch_size=len(batch), start_beam=1,  # streams: greedy
                on_token=(lambda i, token, source: batch[i].on_token and batch[i].on_token(token, source))
                if streaming else None,
                cancelled=lambda i: batch[i].cancelled.is_set(), verify=verify)
        except Exception as error:  # noqa: BLE001 - every waiting request hears of it
            for job in batch:
                job.future.set_exception(error)
            return
        self.batches.append(len(batch))
        for job, answer in zip(batch, answers, strict=True):
            job.future.set_result(answer)
