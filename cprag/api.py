"""The Python API, mirroring the CLI: `Index(path).ask(question)`, `ask(question, index=path)`, `index_info`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cprag.decoding.passage_prior import PASSAGE_PRIOR_FILE, PassagePrior, check_weight
from cprag.decoding.prompt import ASK_MODES, prompt_ids
from cprag.decoding.prompt_prefix import PromptPrefix, prompt_prefix
from cprag.decoding.rerank import RERANKER_FILE, StartReranker, check_start_beam, default_start_beam
from cprag.decoding.results import Citation
from cprag.decoding.route import decode_questions
from cprag.decoding.span_read import read_passages
from cprag.decoding.verify import cited_sentence, verify
from cprag.errors import CheckpointError, ConfigError, QuestionTooLong, TooFewPassages
from cprag.index.key_cache import KEY_CACHE_DTYPE, KeyCache
from cprag.index.reader import open_snapshot
from cprag.index.retrieve import MiniLMEmbedder
from cprag.index.store import check_model, directory_bytes, read_manifest
from cprag.index.structured_passages import locate
from cprag.model.answer_verifier import VERIFIER_FILE, AnswerVerifier
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model, model_fingerprint
from cprag.model.config import check_end_bias
from cprag.model.runtime import default_device, place, resolve_dtype

# below this top-1 retrieval score (cosine, all-MiniLM-L6-v2) the corpus is taken to hold nothing on the question
# and the answer is withheld before decoding. The rule: the highest multiple of 0.05 below which at most 0.5% of
# in-corpus questions fall; on 2,818 SQuAD dev questions whose article is indexed 0.25% fall below 0.25, and 15.5%
# of 2,847 questions whose article is not (eval/scripts/retrieval_floor.py, eval/retrieval-floor/)
MIN_RETRIEVAL_SCORE = 0.25
# first tokens decoded per question (`--start-beam`): None means the checkpoint's default, the beam its start
# reranker was fitted for (cprag.decoding.rerank.default_start_beam; greedy without one, and always greedy when
# streaming)
START_BEAM = None
# questions decoded per backbone pass by `Index.ask_many` and `ask --questions` (cprag.decoding.batched)
BATCH_SIZE = 16
# whether answers are verified (`--verify`) when the checkpoint ships a verifier: the question is read beside the
# sentence its span was copied from, and an answer the verifier doubts is withheld (cprag.decoding.verify)
VERIFY = True


@dataclass
class Answer:
    question: str
    answer: str
    mode: str
    citations: list[Citation]
    passages: list[dict]  # {"doc_id", "passage_id", "score"} in retrieval order
    copy_rate: float
    # the copy path's probability of the first answer token (None in closed mode); below the threshold the
    # answer is withheld and `no_answer` says the passages hold no answer
    confidence: float | None = None
    no_answer: bool = False
    # why an answer was withheld: "retrieval" (no passage is close to the question, nothing was decoded),
    # "confidence" (the copy path was unsure) or "verifier" (the cited sentence does not answer the question, by the
    # verifier); None when answered
    no_answer_reason: str | None = None
    # the verifier's probability that the cited sentence answers the question (None: not verified)
    answerable: float | None = None
    # what the verifier withheld: the span it would have given, and its citations
    withheld_answer: str | None = None
    withheld_citations: list[Citation] = field(default_factory=list)
    timings_ms: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        payload = asdict(self)
        payload["citations"] = [asdict(c) for c in self.citations]
        payload["withheld_citations"] = [asdict(c) for c in self.withheld_citations]
        return payload


class Index:
    """An opened index with its generator, retriever and key-shard cache, reused across questions."""

    def __init__(self, path: str | Path, checkpoint: str | Path | None = None, device: str | None = None,
                 model=None, tokenizer=None, cache_bytes: int = 512 * 2**20, dtype: str | None = None,
                 fingerprint: str | None = None, reader: str | Path | None = None):
        self.path = Path(path)
        self.reader_path = None if reader is None else Path(reader)  # None: the reader shipped beside the checkpoint
        self._reader = None
        self.checkpoint = None if checkpoint is None else Path(checkpoint)  # None: the shipped one
        # the index's own files first: a damaged index fails in milliseconds, before seconds of model loading;
        # the last committed version, even while `cprag index` updates it (cprag.index.reader)
        snapshot = open_snapshot(self.path)
        self.manifest, self.store, self.passage_index = snapshot.manifest, snapshot.store, snapshot.passage_index
        self.device = device or default_device()
        model_given = model is not None
        if model is None:
            model, tokenizer = load_model(checkpoint)
            # the fingerprint of the stored (fp32) weights: an index built on a CPU opens on a GPU in bf16
            fingerprint = model_fingerprint(model)
            model = place(model, self.device, resolve_dtype(self.device, dtype))
        elif fingerprint is None:  # a model handed in: its weights as they are, unless its fingerprint comes along
            fingerprint = model_fingerprint(model)
        check_model(self.path, self.manifest, fingerprint)
        self.fingerprint = fingerprint
        self.model, self.tokenizer = model, tokenizer
        self.embedder = MiniLMEmbedder(self.device)
        self.cache = KeyCache(self.device, KEY_CACHE_DTYPE, max_bytes=cache_bytes)
        # the checkpoint's StartReranker (cprag.decoding.rerank), which chooses among start-beam answers; None: the
        # likeliest
        # (a model handed in without its checkpoint directory has none)
        self.reranker = None if model_given and checkpoint is None else load_reranker(checkpoint, model.config)
        # the checkpoint's passage prior weight (cprag.decoding.passage_prior): retrieval scores added to the copy
        # scores
        self.passage_prior = 0.0 if model_given and checkpoint is None else load_passage_prior(checkpoint)
        # the checkpoint's answer verifier (cprag.model.answer_verifier); None: answers are not verified
        self.verifier = None if model_given and checkpoint is None else load_verifier(checkpoint, model.config)
        if self.verifier is not None and self.verifier.fingerprint not in ("", fingerprint):
            raise CheckpointError(str(checkpoint or DEFAULT_CHECKPOINT), f"{VERIFIER_FILE} was fitted on another "
                                  "checkpoint's states (its model fingerprint differs)")
        self._prefix: PromptPrefix | None = None

    @property
    def prefix(self) -> PromptPrefix | None:
        """The prompts' fixed beginning, run once for this index's model (built at the first question)."""
        if self._prefix is None:
            self._prefix = prompt_prefix(self.model, self.tokenizer)
        return self._prefix

    @property
    def start_beam(self) -> int:
        """The default start beam: the one the checkpoint's start reranker was fitted for (1 without one)."""
        return default_start_beam(self.reranker)

    def __len__(self) -> int:
        return len(self.passage_index)

    def reopened(self) -> Index:
        """The same index at its latest committed version, with this one's model, reranker and device (an open
        `Index` keeps the version it opened; a long-lived server reopens when `cprag index` commits)."""
        fresh = Index(self.path, checkpoint=self.checkpoint, device=self.device, model=self.model,
                      tokenizer=self.tokenizer, cache_bytes=self.cache.max_bytes, fingerprint=self.fingerprint)
        fresh.reranker, fresh._prefix, fresh.passage_prior = self.reranker, self._prefix, self.passage_prior
        fresh.verifier, fresh.reader_path, fresh._reader = self.verifier, self.reader_path, self._reader
        return fresh

    @property
    def reader(self):
        """The span reader of mode "reader" (loaded at its first question; refused when trained on another base)."""
        if self._reader is None:
            from cprag.model.reader_checkpoint import check_reader_base, load_reader

            check_reader_base(self.reader_path, self.model.config.base_model)
            dtype = next(self.model.parameters()).dtype
            self._reader, _ = load_reader(self.reader_path, device=self.device, dtype=dtype)
        return self._reader

    def retrieve(self, questions: list[str], k: int):
        if k < 1:
            raise ConfigError("-k", k, "must be at least 1")
        if k > len(self):
            raise TooFewPassages(k, len(self))
        return self.passage_index.search(self.embedder.embed(questions), k)

    def ask(self, question: str, k: int = 5, mode: str = "hidden", max_new_tokens: int = 32,
            min_confidence: float | None = None, min_retrieval_score: float = MIN_RETRIEVAL_SCORE,
            start_beam: int | None = START_BEAM, passage_prior: float | None = None,
            end_bias: float | None = None, verify: bool | None = None) -> Answer:
        """Answer from the k retrieved passages. Withheld as "no answer": questions whose best passage scores
        below `min_retrieval_score` (nothing in the corpus is about them; not decoded), and answers below
        `min_confidence` (default: the checkpoint's, tuned on SQuAD 2.0). `start_beam` first tokens are decoded
        and the checkpoint's start reranker (`self.reranker`; without one, the likeliest) picks the answer
        (default: `self.start_beam`, the beam the reranker was fitted for; 1 is plain greedy, the fastest).
        `passage_prior` weighs the retrieval scores into the copy scores (default: the checkpoint's; 0: off);
        `end_bias` is added to ending's log-probability (default: the checkpoint's; 0: off). `verify` reads the
        question beside the cited sentence and withholds answers the checkpoint's verifier doubts (default: on when
        the checkpoint ships one; then the confidence threshold defaults to 0, as the verifier replaces it)."""
        return self.ask_many([question], k, mode, max_new_tokens, min_confidence, min_retrieval_score, start_beam,
                             batch_size=1, passage_prior=passage_prior, end_bias=end_bias, verify=verify)[0]

    def ask_many(self, questions: list[str], k: int = 5, mode: str = "hidden", max_new_tokens: int = 32,
                 min_confidence: float | None = None, min_retrieval_score: float = MIN_RETRIEVAL_SCORE,
                 start_beam: int | None = START_BEAM, batch_size: int = BATCH_SIZE,
                 on_token: Callable[[int, int, tuple[int, int] | None], None] | None = None,
                 cancelled: Callable[[int], bool] | None = None, passage_prior: float | None = None,
                 end_bias: float | None = None, verify: bool | None = None) -> list[Answer]:
        """`ask` for each question, with `batch_size` questions decoded per backbone pass (hidden mode, greedy):
        the same answers as one at a time, in fewer passes. Every question is checked before any is answered.

        In hidden greedy decoding, `on_token(i, token, source)` hears question i's tokens as they are chosen and
        `cancelled(i)` stops question i early (`cprag.decoding.batched.generate_batch`); with either, the default
        start beam is 1 (a stream must not hear the alternatives not chosen)."""
        streaming = on_token is not None or cancelled is not None
        if start_beam is None:
            start_beam = 1 if streaming else self.start_beam
        verifying = self.verifying(verify) and mode not in ("closed", "reader")
        if verifying and min_confidence is None:
            min_confidence = 0.0  # the verifier decides instead of the copy path's confidence
        threshold = self.check_questions(questions, mode, min_confidence, min_retrieval_score, start_beam, batch_size,
                                max_new_tokens)
        weight = self.passage_prior if passage_prior is None else check_weight(passage_prior)
        end_bias = None if end_bias is None else check_end_bias(end_bias)
        tick = time.perf_counter()
        hits = self.retrieve(questions, k) if mode != "closed" else [[] for _ in questions]
        retrieve_ms = (time.perf_counter() - tick) * 1000 / len(questions)
        answers: list[Answer | None] = [None] * len(questions)
        pending = []  # (question index, passages, read, timings, retrieval scores) of the questions to decode
        for number, (question, found) in enumerate(zip(questions, hits, strict=True)):
            timings = {"retrieve": retrieve_ms}
            tick = time.perf_counter()
            passages = self.cache.get([h.passage_id for h in found], self.store.fetch)
            timings["load_keys"] = (time.perf_counter() - tick) * 1000
            read = [{"doc_id": p.passage.doc_id, "passage_id": h.passage_id, "score": round(h.score, 4)}
                    for p, h in zip(passages, found, strict=True)]
            if found and found[0].score < min_retrieval_score:
                timings["total"] = sum(timings.values())
                answers[number] = Answer(question=question, answer="", mode=mode, citations=[], passages=read,
                                         copy_rate=0.0, no_answer=True, no_answer_reason="retrieval",
                                         timings_ms={name: round(ms, 1) for name, ms in timings.items()})
            else:
                pending.append((number, passages, read, timings, [h.score for h in found]))
        if mode == "reader":
            self.read_answers(answers, questions, pending)
            return answers
        # the route (cprag.decoding.route): batched, one continuous batch of at most batch_size questions (each
        # start_beam rows) refilled as answers finish, or one question at a time
        decoded = decode_questions(
            self.model, self.tokenizer, [questions[n] for n, *_ in pending], [p for _, p, *_ in pending], mode,
            max_new_tokens, batch_size=batch_size, start_beam=start_beam, min_confidence=threshold,
            reranker=self.reranker, prefix=self.prefix, passage_scores=[scores for *_, scores in pending],
            passage_prior=weight, end_bias=end_bias,
            on_token=None if on_token is None else lambda row, token, source: on_token(pending[row][0], token, source),
            cancelled=None if cancelled is None else lambda row: cancelled(pending[row][0]))
        for (number, passages, read, timings, _), (generation, generate_ms) in zip(pending, decoded, strict=True):
            timings["generate"] = generate_ms
            timings["total"] = sum(timings.values())
            answers[number] = Answer(
                question=questions[number], answer=generation.answer, mode=mode,
                citations=placed(generation.citations, passages), passages=read,
                copy_rate=round(generation.copy_rate, 3),
                confidence=None if generation.confidence is None else round(generation.confidence, 4),
                no_answer=generation.no_answer, no_answer_reason="confidence" if generation.no_answer else None,
                timings_ms={name: round(ms, 1) for name, ms in timings.items()},
            )
        if verifying:
            self.verify_answers(answers, {number: passages for number, passages, *_ in pending})
        return answers

    def read_answers(self, answers: list[Answer | None], questions: list[str], pending: list) -> None:
        """Mode "reader": the span reader reads the retrieved passages' stored text; its null entry can say the
        passages hold no answer (`no_answer_reason` "reader", with the span it would have given)."""
        if not pending:
            return
        tick = time.perf_counter()
        found = read_passages(self.reader, self.tokenizer, [questions[n] for n, *_ in pending],
                              [[p.passage.text for p in passages] for _, passages, *_ in pending])
        share = (time.perf_counter() - tick) * 1000 / len(pending)
        for (number, passages, read, timings, _), span in zip(pending, found, strict=True):
            timings["read"] = share
            timings["total"] = sum(timings.values())
            citations = []
            if span is not None:
                stored = passages[span.passage].passage
                citations = placed([Citation(doc_id=stored.doc_id, title=stored.title, text=span.text,
                                             start=stored.char_start + span.char_start,
                                             end=stored.char_start + span.char_end)], [passages[span.passage]])
            withheld = span is None or span.no_answer
            answers[number] = Answer(
                question=questions[number], answer="" if withheld else span.text, mode="reader",
                citations=[] if withheld else citations, passages=read, copy_rate=0.0 if withheld else 1.0,
                confidence=None if span is None else round(span.probability, 4), no_answer=withheld,
                no_answer_reason="reader" if withheld else None,
                answerable=None if span is None else round(span.answerable, 4),
                withheld_answer=span.text if span is not None and withheld else None,
                withheld_citations=citations if withheld else [],
                timings_ms={name: round(ms, 1) for name, ms in timings.items()})

    def verifying(self, verify: bool | None) -> bool:
        """Whether answers are verified: `verify`, or by default when the checkpoint ships a verifier."""
        return chosen_verifier(self.verifier, verify) is not None

    def verify_answers(self, answers: list[Answer], read: dict[int, list]) -> None:
        """Score each decoded answer's cited sentence against its question (one batch), and withhold the answers
        below the verifier's threshold, keeping the span they would have given."""
        chosen = [(number, cited_sentence(answers[number].citations, passages)) for number, passages in read.items()
                  if not answers[number].no_answer]
        chosen = [(number, sentence) for number, sentence in chosen if sentence is not None]
        if not chosen:
            return
        tick = time.perf_counter()
        scores = verify(self.model, self.tokenizer, self.verifier,
                        [(sentence, answers[number].question) for number, sentence in chosen])
        share = (time.perf_counter() - tick) * 1000 / len(chosen)
        for (number, _), score in zip(chosen, scores, strict=True):
            answer = answers[number]
            timings = {name: ms for name, ms in answer.timings_ms.items() if name != "total"}
            timings["verify"] = round(share, 1)
            timings["total"] = round(sum(timings.values()), 1)
            answer.answerable, answer.timings_ms = round(score, 4), timings
            if self.verifier.withholds(score, answer.confidence):
                answer.withheld_answer, answer.withheld_citations = answer.answer, answer.citations
                answer.answer, answer.citations = "", []
                answer.no_answer, answer.no_answer_reason = True, "verifier"

    def check_questions(self, questions, mode="hidden", min_confidence=None, min_retrieval_score=MIN_RETRIEVAL_SCORE,
                        start_beam: int | None = START_BEAM, batch_size=BATCH_SIZE,
                        max_new_tokens=32) -> float:
        """Bad input before any work (and before the retrieval floor could answer it "no answer"); returns the
        confidence threshold."""
        if mode not in ASK_MODES:
            raise ConfigError("--mode", mode, f"expected one of {', '.join(ASK_MODES)}")
        if not questions:
            raise ConfigError("questions", questions, "no questions to answer")
        threshold = self.model.config.min_confidence if min_confidence is None else min_confidence
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError("--min-confidence", threshold, "must be a probability in [0, 1]")
        if not -1.0 <= min_retrieval_score <= 1.0:
            raise ConfigError("--min-retrieval-score", min_retrieval_score, "must be a cosine in [-1, 1]")
        check_start_beam(start_beam)
        if batch_size < 1:
            raise ConfigError("--batch-size", batch_size, "must be at least 1")
        for question in questions:
            if not any(ch.isprintable() and not ch.isspace() for ch in question):
                raise ConfigError("question", question, "is empty (nothing but spaces or control characters)")
            needed = len(prompt_ids(self.tokenizer, question)) + max_new_tokens
            if needed > self.model.config.max_position_embeddings:
                raise QuestionTooLong(needed, self.model.config.max_position_embeddings)
        return threshold


def placed(citations: list[Citation], passages: list) -> list[Citation]:
    """The citations with the page and anchor of the original file where each copied span starts, from the
    read passages (`DevicePassage`s) of its document: the one holding the span's first character."""
    by_doc: dict[str, list] = {}
    for entry in passages:
        by_doc.setdefault(entry.passage.doc_id, []).append(entry.passage)
    result = []
    for citation in citations:
        stored = sorted(by_doc.get(citation.doc_id, []), key=lambda p: p.char_start)
        page, anchor = locate(stored, citation.start)
        result.append(replace(citation, page=page, anchor=anchor))
    return result


def load_reranker(checkpoint: str | Path | None, model_config) -> StartReranker | None:
    """The start reranker shipped beside a checkpoint (default: the shipped one's), or None."""
    directory = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    try:
        reranker = StartReranker.load(directory)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        raise CheckpointError(str(directory), f"unreadable {RERANKER_FILE}: {error}") from None
    if reranker is not None and not reranker.fits(model_config):
        raise CheckpointError(str(directory), f"{RERANKER_FILE} reads {reranker.features} features, not what "
                              "this checkpoint's lexical features give: it belongs to another checkpoint")
    return reranker


def load_passage_prior(checkpoint: str | Path | None) -> float:
    """The passage prior weight shipped beside a checkpoint (default: the shipped one's); 0 without one."""
    directory = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    try:
        prior = PassagePrior.load(directory)
    except (ValueError, TypeError, json.JSONDecodeError) as error:
        raise CheckpointError(str(directory), f"unreadable {PASSAGE_PRIOR_FILE}: {error}") from None
    return 0.0 if prior is None else prior.weight


def load_verifier(checkpoint: str | Path | None, model_config) -> AnswerVerifier | None:
    """The answer verifier shipped beside a checkpoint (default: the shipped one's), or None."""
    directory = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    try:
        verifier = AnswerVerifier.load(directory)
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
        raise CheckpointError(str(directory), f"unreadable {VERIFIER_FILE}: {error}") from None
    if verifier is not None and not verifier.fits(model_config):
        raise CheckpointError(str(directory), f"{VERIFIER_FILE} reads states of width {verifier.hidden_size}, not "
                              "this checkpoint's: it belongs to another checkpoint")
    return verifier


def chosen_verifier(verifier: AnswerVerifier | None, verify: bool | None) -> AnswerVerifier | None:
    """The verifier that checks answers: the checkpoint's `verifier` when `verify` asks for it (None: by default,
    when there is one); None when answers go unverified. Asking for one the checkpoint lacks is an error."""
    if verify and verifier is None:
        raise ConfigError("--verify", True, f"this checkpoint ships no verifier ({VERIFIER_FILE})")
    return verifier if (VERIFY if verify is None else verify) else None


def ask(question: str, index: str | Path, k: int = 5, mode: str = "hidden", **kwargs) -> Answer:
    """One question against an index (opens it; keep an `Index` to reuse its cache across questions)."""
    return Index(index, **kwargs).ask(question, k=k, mode=mode)


def index_info(path: str | Path) -> dict:
    """The manifest plus on-disk sizes, without loading any model."""
    path = Path(path)
    manifest = read_manifest(path)
    manifest["disk_bytes"] = directory_bytes(path)
    manifest["key_store_bytes"] = directory_bytes(path / "lancedb") if (path / "lancedb").is_dir() else 0
    return manifest
