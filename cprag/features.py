"""Backbone features cached once for CP-head training: the frozen backbone runs each passage and each
(question + answer) sequence one time, and training then only touches the small trainable parts.

Passages: the CP head's input for [BOS, t_1 .. t_n] (the final hidden states, plus the `cp_layers` states when
configured). Questions: final hidden states of the chat prompt followed by the answer as the passage's own tokens,
their CP-head input, and the LM head's logsumexp and target logit at the answer positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cprag.encode import tokenize_passage
from cprag.prompt import end_of_turn_id, prompt_ids
from cprag.squad import SquadData, answer_token_span

FEATURES_VERSION = 2


@dataclass
class PassageFeatures:
    hidden: torch.Tensor  # (n + 1, C) float16 CP-head input, for [BOS, t_1 .. t_n]
    ids: torch.Tensor  # (n,) int64 passage tokens
    offsets: torch.Tensor  # (n, 2) int64 character spans


@dataclass
class QuestionFeatures:
    qid: str
    passage_id: str
    hidden: torch.Tensor  # (L, H) float16 final hidden states of prompt + answer tokens
    cp: torch.Tensor | None  # (L, C) float16 CP-head input, None when it is `hidden` itself
    prompt_len: int
    span: tuple[int, int]  # inclusive passage-token range of the answer
    targets: torch.Tensor  # (A + 1,) answer tokens then the end-of-turn token
    lm_lse: torch.Tensor  # (A + 1,) float32 logsumexp of the LM logits at the positions predicting targets
    lm_target: torch.Tensor  # (A + 1,) float32 LM logit of each target


def features_key(data_path: Path, fingerprint: str, cp_layers: list[int] | None = None) -> str:
    digest = hashlib.sha256(Path(data_path).read_bytes()).hexdigest()[:12]
    layers = "-L" + ".".join(map(str, cp_layers)) if cp_layers else ""
    return f"v{FEATURES_VERSION}-{digest}-{fingerprint[:12]}{layers}"


def _batched(items: list, lengths: list[int], max_tokens: int):
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for index in order:
        if batch and lengths[batch[0]] * (len(batch) + 1) > max_tokens:
            yield batch
            batch = []
        batch.append(index)
    if batch:
        yield batch


@torch.inference_mode()
def _hidden_states(model, sequences: list[list[int]], pad_id: int, max_tokens: int, on_batch: Callable | None):
    """(final hidden states, CP-head input or None) of each sequence (right padded, batched by length)."""
    result: list[tuple | None] = [None] * len(sequences)
    separate = bool(model.config.cp_layers)
    lengths = [len(s) for s in sequences]
    for batch in _batched(sequences, lengths, max_tokens):
        width = max(lengths[i] for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            ids[row, : lengths[index]] = torch.tensor(sequences[index])
            mask[row, : lengths[index]] = 1
        hidden, features, _ = model.encode_hidden(ids, mask)
        for row, index in enumerate(batch):
            n = lengths[index]
            result[index] = (hidden[row, :n].to(torch.float16).clone(),
                             features[row, :n].to(torch.float16).clone() if separate else None)
        if on_batch:
            on_batch(len(batch))
    return result


def extract_features(
    model, tokenizer, data: SquadData, max_tokens: int = 4096, on_progress: Callable | None = None,
    max_answer_tokens: int = 24,
):
    """(passage features by id, question features, skipped counts). Answers longer than `max_answer_tokens`
    passage tokens are skipped and counted: SQuAD answers are short, and those few are mostly clauses."""
    bos, end = tokenizer.bos_token_id, end_of_turn_id(tokenizer)
    passage_ids = sorted(data.passages)
    tokenized = {pid: tokenize_passage(tokenizer, data.passages[pid][1]) for pid in passage_ids}
    sequences = [[bos] + tokenized[pid].ids for pid in passage_ids]
    done = [0]

    def tick(stage):
        def inner(count):
            done[0] += count
            if on_progress:
                on_progress(stage, done[0], total[0])
        return inner

    total = [len(sequences)]
    hidden = _hidden_states(model, sequences, bos, max_tokens, tick("passages"))
    passages = {
        pid: PassageFeatures(hidden=h if cp is None else cp, ids=torch.tensor(tokenized[pid].ids),
                             offsets=torch.tensor(tokenized[pid].offsets).reshape(-1, 2))
        for pid, (h, cp) in zip(passage_ids, hidden, strict=True)
    }

    skipped: dict[str, int] = {}
    kept, question_sequences = [], []
    for example in data.examples:
        tokens = tokenized[example.passage_id]
        answer = example.answers[0]
        span = answer_token_span(tokens.offsets, example.answer_start, example.answer_start + len(answer))
        if span is None or span[1] - span[0] + 1 > max_answer_tokens:
            reason = "answer has no passage tokens" if span is None else "answer longer than max_answer_tokens"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        answer_ids = tokens.ids[span[0] : span[1] + 1]
        prompt = prompt_ids(tokenizer, example.question)
        kept.append((example, span, answer_ids, len(prompt)))
        question_sequences.append(prompt + answer_ids)
    done[0], total[0] = 0, len(question_sequences)
    hidden = _hidden_states(model, question_sequences, bos, max_tokens, tick("questions"))
    embeddings = model.get_input_embeddings().weight
    questions = []
    with torch.inference_mode():
        for (example, span, answer_ids, prompt_len), (h, cp) in zip(kept, hidden, strict=True):
            targets = torch.tensor(answer_ids + [end])
            positions = h[prompt_len - 1 :].float()  # (A + 1, H)
            logits = positions @ embeddings.T
            questions.append(QuestionFeatures(
                qid=example.qid, passage_id=example.passage_id, hidden=h, cp=cp, prompt_len=prompt_len, span=span,
                targets=targets, lm_lse=torch.logsumexp(logits, -1),
                lm_target=logits.gather(-1, targets[:, None]).squeeze(-1),
            ))
    return passages, questions, skipped


def load_or_extract(cache_dir: Path, key: str, build: Callable):
    """Features from `cache_dir/key.pt`, or built and saved there (atomically) on first use."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{key}.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    features = build()
    staging = path.with_suffix(".tmp")
    torch.save(features, staging)
    staging.replace(path)
    return features
