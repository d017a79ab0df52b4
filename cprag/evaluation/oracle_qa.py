"""Oracle-memory QA evaluation: each question with its gold passage plus distractors, in hidden, visible or
closed mode, scored with the official SQuAD EM/F1. Shared by training (validation) and `cprag eval`."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.decoding.route import decode_questions
from cprag.decoding.span_read import read_passages
from cprag.evaluation.metrics import squad2_question_scores
from cprag.evaluation.squad import QAExample, article_of
from cprag.index.encode import PassageKeys, encode_passages, tokenize_passage
from cprag.index.key_cache import KEY_CACHE_DTYPE, DevicePassage
from cprag.index.key_codec import PQ_TRAIN_KEYS, PQCodebook, round_trip
from cprag.index.retrieve import MiniLMEmbedder, passage_text_for_retrieval
from cprag.index.store import StoredPassage


@dataclass
class QAResult:
    qid: str
    mode: str
    question: str
    prediction: str
    references: list[str]
    em: float
    f1: float
    copy_rate: float
    latency_ms: float
    passages: list[str]
    confidence: float | None = None  # the copy path's probability of the first answer token (with passages)
    no_answer: bool = False  # withheld: confidence below the threshold
    stop_probability: float | None = None  # the probability of ending at once (with passages)
    answerable: float | None = None  # the verifier's p(answerable) (cprag.evaluation.verified; None: not verified)
    withheld_answer: str | None = None  # the span a reader gave up for "no answer" (mode reader)


def oracle_passage_ids(example: QAExample, all_ids: list[str], distractors: int, rng: random.Random) -> list[str]:
    """The gold passage and `distractors` others (same article first), in a seeded random order; all the others
    when the data holds fewer (the draws are the same as before whenever it holds enough)."""
    article = article_of(example.passage_id)
    same = [p for p in all_ids if article_of(p) == article and p != example.passage_id]
    others = [p for p in all_ids if article_of(p) != article]
    chosen = rng.sample(same, min(distractors, len(same)))
    chosen += rng.sample(others, min(distractors - len(chosen), len(others)))
    chosen.insert(rng.randrange(len(chosen) + 1), example.passage_id)
    return chosen


PREFETCH_QUESTIONS = 64  # evaluation encodes the passages of this many questions ahead at once (full batches)


class OracleMemory:
    """Encodes passages on first use (as `cprag index` would) and keeps them on the model's device."""

    def __init__(self, model, tokenizer, passages: dict[str, tuple[str, str]], key_codec: str = "float16"):
        self.model, self.tokenizer, self.passages = model, tokenizer, passages
        self.key_codec = key_codec  # keys as an index storing them this way gives them back
        self.encoded: dict[str, DevicePassage] = {}
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, KEY_CACHE_DTYPE

    def get(self, passage_ids: list[str]) -> list[DevicePassage]:
        missing = [p for p in passage_ids if p not in self.encoded]
        if missing:
            tokenized = [tokenize_passage(self.tokenizer, self.passages[p][1]) for p in missing]
            for index, keys in encode_passages(self.model, tokenized, bos_id=self.tokenizer.bos_token_id):
                self.encoded[missing[index]] = self._device_passage(missing[index], keys)
        return [self.encoded[p] for p in passage_ids]

    def _device_passage(self, pid: str, keys: PassageKeys) -> DevicePassage:
        title, text = self.passages[pid]
        keys = replace(keys, keys=round_trip(keys.keys, self.key_codec))
        stored = StoredPassage(passage_id=pid, doc_id=pid, title=title, text=text, char_start=0, keys=keys)
        return DevicePassage.from_stored(stored, self.device, self.dtype)


def oracle_pq_codebook(model, tokenizer, passages: dict[str, tuple[str, str]], subvectors: int | None = None
                       ) -> PQCodebook:
    """A PQ codebook learned, as `cprag index --keys pq` learns one, from the keys of the first passages (in id
    order) until PQ_TRAIN_KEYS keys."""
    sample, keys = [], 0
    for pid in sorted(passages):
        if keys >= PQ_TRAIN_KEYS:
            break
        sample.append(tokenize_passage(tokenizer, passages[pid][1]))
        keys += len(sample[-1].ids) + 1
    encoded = [k.keys for _, k in encode_passages(model, sample, bos_id=tokenizer.bos_token_id)]
    return PQCodebook.train(np.concatenate([np.asarray(k, dtype=np.float32) for k in encoded]), subvectors)


def evaluate_oracle(
    model, tokenizer, examples: list[QAExample], passages: dict[str, tuple[str, str]], modes: list[str],
    distractors: int = 4, seed: int = 0, max_new_tokens: int = 32,
    on_result: Callable[[QAResult], None] | None = None, choose: str = "token", min_confidence: float = 0.0,
    start_beam: int = 1, batch_size: int = 1, reranker=None, key_codec: str = "float16",
    pq_subvectors: int | None = None, passage_prior: float = 0.0, end_bias: float | None = None, reader=None,
) -> list[QAResult]:
    """Each example in each mode with its gold passage plus `distractors` others (seeded), scored against its
    references (SQuAD 2.0 rules, so an unanswerable question's right answer is the empty one). With
    `batch_size` > 1, hidden-mode questions are decoded that many per backbone pass (the same answers; each
    question's latency is then its share of its batch's time). `passage_prior` > 0 weighs each passage's
    retrieval score (as an index's retriever would give it) into the copy scores (`cprag.decoding.passage_prior`);
    `end_bias` (default the checkpoint's): see `cprag.decoding.generate.generate`. Mode "reader" reads the same
    passages with the visible span `reader` (`cprag.model.span_reader`); the CPLM `model` may then be None when
    no other mode is asked for."""
    if "reader" in modes and reader is None:
        raise ValueError("mode 'reader' needs a span reader")
    if model is None:
        return _reader_only(reader, tokenizer, examples, passages, distractors, seed, batch_size, on_result)
    if key_codec == "pq":  # the codebook an index of these articles would learn: from their first passages' keys
        key_codec = oracle_pq_codebook(model, tokenizer, passages, pq_subvectors)
    memory = OracleMemory(model, tokenizer, passages, key_codec)
    prefix = prompt_prefix(model, tokenizer)
    all_ids = sorted(passages)
    rng = random.Random(seed)
    chosen = [oracle_passage_ids(example, all_ids, distractors, rng) for example in examples]  # the seeded draws
    scores = (retrieval_scores([e.question for e in examples], chosen, passages, memory.device)
              if passage_prior > 0 else [None] * len(examples))
    results, ahead, step = [], 0, max(batch_size, 1)
    for first in range(0, len(examples), step):
        group = list(range(first, min(first + step, len(examples))))
        if first >= ahead:  # the next questions' passages in full encoding batches, not a few at a time
            ahead = first + PREFETCH_QUESTIONS
            memory.get(sorted({pid for ids in chosen[first:ahead] for pid in ids}))
        shards = {i: memory.get(chosen[i]) for i in group}
        by_mode: dict[str, list[tuple[object, float]]] = {}
        for mode in modes:  # the route decides: hidden questions batched, the baselines one at a time
            if mode == "reader":
                by_mode[mode] = _read(reader, tokenizer, [examples[i].question for i in group],
                                      [[passages[p][1] for p in chosen[i]] for i in group])
                continue
            by_mode[mode] = decode_questions(
                model, tokenizer, [examples[i].question for i in group],
                [shards[i] if mode != "closed" else [] for i in group], mode, max_new_tokens,
                batch_size=batch_size, start_beam=start_beam, choose=choose, min_confidence=min_confidence,
                prefix=prefix, passage_scores=[scores[i] for i in group], passage_prior=passage_prior,
                end_bias=end_bias, reranker=reranker)
        for position, i in enumerate(group):
            example = examples[i]
            for mode in modes:
                generation, latency = by_mode[mode][position]
                em, f1 = squad2_question_scores(generation.answer, example.answers)
                result = QAResult(
                    qid=example.qid, mode=mode, question=example.question, prediction=generation.answer,
                    references=example.answers, em=100 * em, f1=100 * f1, copy_rate=generation.copy_rate,
                    latency_ms=latency, passages=chosen[i], confidence=generation.confidence,
                    stop_probability=generation.stop_probability, no_answer=generation.no_answer,
                    withheld_answer=getattr(generation, "withheld_answer", None),
                )
                results.append(result)
                if on_result:
                    on_result(result)
    return results


@dataclass
class ReaderGeneration:
    """A span reader's answer in the fields a result reads from a generation."""

    answer: str
    copy_rate: float  # 1: every answer is a span of a passage
    confidence: float | None  # the span's probability
    stop_probability: float | None = None  # the null entry's probability
    no_answer: bool = False
    withheld_answer: str | None = None  # the span given up for "no answer"


def _read(reader, tokenizer, questions: list[str], texts: list[list[str]]
          ) -> list[tuple[ReaderGeneration, float]]:
    """The span reader's answers ("" where it says the passages hold none), with each question's share of the
    batch's time."""
    started = time.perf_counter()
    answers = read_passages(reader, tokenizer, questions, texts)
    share = 1000 * (time.perf_counter() - started) / max(len(questions), 1)
    found = []
    for a in answers:
        withheld = a is None or a.no_answer
        found.append((ReaderGeneration(answer="" if withheld else a.text, copy_rate=0.0 if withheld else 1.0,
                                       confidence=a.probability if a else None,
                                       stop_probability=a.null_probability if a else None, no_answer=withheld,
                                       withheld_answer=a.text if a is not None and a.no_answer else None), share))
    return found


def _reader_only(reader, tokenizer, examples, passages, distractors, seed, batch_size, on_result) -> list[QAResult]:
    """Mode "reader" alone: the same seeded passage draws as `evaluate_oracle`, no CPLM loaded."""
    all_ids = sorted(passages)
    rng = random.Random(seed)
    chosen = [oracle_passage_ids(example, all_ids, distractors, rng) for example in examples]
    results = []
    step = max(batch_size, 1)
    for first in range(0, len(examples), step):
        group = list(range(first, min(first + step, len(examples))))
        read = _read(reader, tokenizer, [examples[i].question for i in group],
                     [[passages[p][1] for p in chosen[i]] for i in group])
        for i, (generation, latency) in zip(group, read, strict=True):
            em, f1 = squad2_question_scores(generation.answer, examples[i].answers)
            result = QAResult(qid=examples[i].qid, mode="reader", question=examples[i].question,
                              prediction=generation.answer, references=examples[i].answers, em=100 * em,
                              f1=100 * f1, copy_rate=generation.copy_rate, latency_ms=latency, passages=chosen[i],
                              confidence=generation.confidence, no_answer=generation.no_answer,
                              stop_probability=generation.stop_probability,
                              withheld_answer=generation.withheld_answer)
            results.append(result)
            if on_result:
                on_result(result)
    return results


def retrieval_scores(questions: list[str], chosen: list[list[str]], passages: dict[str, tuple[str, str]],
                     device="cpu") -> list[list[float]]:
    """Each question's cosine similarity to each of its passages, as the index's retriever scores them."""
    embedder = MiniLMEmbedder(str(device))
    needed = sorted({pid for ids in chosen for pid in ids})
    vectors = dict(zip(needed, embedder.embed([passage_text_for_retrieval(*passages[pid]) for pid in needed]),
                       strict=True))
    asked = embedder.embed(questions)
    return [[float(vectors[pid] @ question) for pid in ids] for question, ids in zip(asked, chosen, strict=True)]


def summarize(results: list[QAResult]) -> dict[str, float]:
    summary: dict[str, float] = {}
    for mode in sorted({r.mode for r in results}):
        chosen = [r for r in results if r.mode == mode]
        summary[f"qa/{mode}/em"] = round(float(np.mean([r.em for r in chosen])), 2)
        summary[f"qa/{mode}/f1"] = round(float(np.mean([r.f1 for r in chosen])), 2)
        summary[f"qa/{mode}/copy_rate"] = round(float(np.mean([r.copy_rate for r in chosen])), 3)
        summary[f"qa/{mode}/n"] = len(chosen)
        if any(r.withheld_answer is not None for r in chosen):  # a reader's "no answer": what answering always
            scores = [(r.em, r.f1) if r.withheld_answer is None else  # would have scored, and how often it abstained
                      tuple(100 * x for x in squad2_question_scores(r.withheld_answer, r.references)) for r in chosen]
            summary[f"qa/{mode}/em_answering_always"] = round(float(np.mean([em for em, _ in scores])), 2)
            summary[f"qa/{mode}/f1_answering_always"] = round(float(np.mean([f1 for _, f1 in scores])), 2)
            summary[f"qa/{mode}/no_answer"] = sum(r.no_answer for r in chosen)
    return summary
