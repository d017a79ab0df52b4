"""Which decoder answers a call, decided once: `cprag.decoding.batched` (many questions, or one question's start
beam, per backbone pass) or `cprag.decoding.generate` (one question at a time). Both give the same answers; the
batched decoder only serves hidden greedy-token decoding by a model without a query refiner.

`Index.ask_many`, the SQuAD evaluations and the needle test all decode through `decode_questions`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cprag.decoding.batched import batch_supported, generate_batch
from cprag.decoding.generate import generate
from cprag.decoding.results import Generation
from cprag.index.key_cache import DevicePassage

TokenListener = Callable[[int, int, tuple[int, int] | None], None]


def batched_route(model, mode: str, questions: int, batch_size: int, start_beam: int, streaming: bool,
                  has_passages: bool = True, choose: str = "token") -> bool:
    """Whether `questions` questions go through the batched decoder.

    A stream (tokens heard as chosen, or a question cancelled midway) is batched when greedy: only the batched
    decoder streams. Otherwise several questions with `batch_size` > 1 are batched, and so is a start beam (its
    alternatives are rows of one batch), unless the one question has no passages (nothing to start from)."""
    if not batch_supported(model, mode) or choose != "token":
        return False
    if streaming:
        return start_beam == 1
    if start_beam > 1:
        return questions > 1 or has_passages
    return questions > 1 and batch_size > 1


def decode_questions(model, tokenizer, questions: list[str], passages: list[list[DevicePassage]],
                     mode: str = "hidden", max_new_tokens: int = 32, *, batch_size: int = 1, start_beam: int = 1,
                     choose: str = "token", on_token: TokenListener | None = None,
                     cancelled: Callable[[int], bool] | None = None,
                     passage_scores: list[Sequence[float] | None] | None = None,
                     **options) -> list[tuple[Generation, float]]:
    """Each question's generation and the milliseconds decoding it took (a batch's time shared evenly).

    `options` are the decoding options both decoders take (min_confidence, prefix, passage_prior, end_bias,
    reranker, draft_tokens, whole_words). Batched, at most `batch_size` questions (each `start_beam` rows) are
    decoded together, the batch refilled as answers finish (`generate_batch`'s `max_rows`)."""
    scores = passage_scores if passage_scores is not None else [None] * len(questions)
    streaming = on_token is not None or cancelled is not None
    if batched_route(model, mode, len(questions), batch_size, start_beam, streaming,
                     has_passages=any(bool(p) for p in passages), choose=choose):
        tick = time.perf_counter()
        generations = generate_batch(model, tokenizer, questions, passages, max_new_tokens, mode=mode,
                                     max_rows=batch_size * start_beam, start_beam=start_beam, on_token=on_token,
                                     cancelled=cancelled, passage_scores=scores, **options)
        share = (time.perf_counter() - tick) * 1000 / max(len(questions), 1)
        return [(generation, share) for generation in generations]
    decoded = []
    for question, shards, score in zip(questions, passages, scores, strict=True):
        tick = time.perf_counter()
        generation = generate(model, tokenizer, question, shards, mode, max_new_tokens, choose=choose,
                              start_beam=start_beam, passage_scores=score, **options)
        decoded.append((generation, (time.perf_counter() - tick) * 1000))
    return decoded
