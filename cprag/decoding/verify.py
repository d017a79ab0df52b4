"""The verifier stage: after hidden mode has chosen a span, read the question beside the sentence it came from.

Hidden mode never lets the question meet the passage except through one CP query per step, so its confidence
barely tells an answered question from one the passages do not answer (SQuAD 2.0 AUC 0.54). The verifier reads
the two together: one extra backbone pass over about 60 tokens per answer, scored by the checkpoint's
`AnswerVerifier` head (`cprag.model.answer_verifier`). It reads one sentence of the document, not the k passages,
so it costs a fraction of visible mode (`cprag eval bench`, latency/verify@k5_ms).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from cprag.model.answer_verifier import PROMPT_TEMPLATE, AnswerVerifier

# a sentence ends at . ! or ? followed by space and a capital, digit, quote or bracket (SQuAD-style prose; a
# paragraph without one is one sentence, cut to the verifier's token budget)
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
VERIFY_BATCH = 32  # prompts per backbone pass, shortest first (padding stays small)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """[(start, end)] character spans of the sentences of `text`, covering it."""
    spans, start = [], 0
    for match in SENTENCE_BREAK.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    return spans + [(start, len(text))]


def answer_sentence(text: str, start: int, end: int | None = None) -> str:
    """The sentence(s) of `text` holding characters [start, end): where a span runs across a sentence break, every
    sentence it touches."""
    end = start if end is None else max(end, start)
    touched = [(a, b) for a, b in sentence_spans(text) if a <= end and b >= start]
    if not touched:
        return text[max(0, start - 150) : end + 150]
    return text[touched[0][0] : touched[-1][1]].strip()


def verifier_prompt(sentence: str, question: str, template: str = PROMPT_TEMPLATE) -> str:
    return template.format(sentence=" ".join(sentence.split()), question=" ".join(question.split()))


@torch.inference_mode()
def verifier_states(model, tokenizer, texts: list[str], layers: list[int], max_tokens: int = 256,
                    batch_size: int = VERIFY_BATCH, on_progress: Callable[[int], None] | None = None
                    ) -> torch.Tensor:
    """(N, (len(layers) + 1) · H) float32: each text's last-token state at `layers` and after the final norm."""
    if not texts:
        return torch.zeros(0, (len(layers) + 1) * model.config.hidden_size)
    backbone = model.backbone
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"][-max_tokens:] for text in texts]
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    out: list[torch.Tensor | None] = [None] * len(texts)
    for first in range(0, len(order), batch_size):
        chosen = order[first : first + batch_size]
        width = max(len(encoded[i]) for i in chosen)
        ids = torch.full((len(chosen), width), pad, dtype=torch.long)  # right-padded: the last real token is read
        mask = torch.zeros((len(chosen), width), dtype=torch.long)
        for row, i in enumerate(chosen):
            ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            mask[row, : len(encoded[i])] = 1
        result = backbone(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        last = (mask.sum(1) - 1).to(device)  # (B,)
        rows = torch.arange(len(chosen), device=device)
        states = [result.hidden_states[layer][rows, last] for layer in layers] + [result.last_hidden_state[rows, last]]
        joined = torch.cat(states, dim=-1).float().cpu()  # (B, F)
        for row, i in enumerate(chosen):
            out[i] = joined[row]
        if on_progress is not None:
            on_progress(min(first + batch_size, len(order)))
    return torch.stack(out)


def verify(model, tokenizer, verifier: AnswerVerifier, pairs: list[tuple[str, str]],
           batch_size: int = VERIFY_BATCH) -> list[float]:
    """p(answerable) of each (sentence, question) pair."""
    if not pairs:
        return []
    texts = [verifier_prompt(sentence, question, verifier.prompt) for sentence, question in pairs]
    states = verifier_states(model, tokenizer, texts, verifier.layers, verifier.max_tokens, batch_size)
    return verifier.probability(states).tolist()


def cited_sentence(citations: list, passages: list) -> str | None:
    """The sentence of the read passages (`DevicePassage`s) where the first copied span starts; None when the
    answer copied nothing (nothing to verify it against)."""
    if not citations:
        return None
    first = citations[0]
    for entry in passages:
        stored = entry.passage
        offset = first.start - stored.char_start
        if stored.doc_id == first.doc_id and 0 <= offset < len(stored.text):
            return answer_sentence(stored.text, offset, first.end - stored.char_start)
    return None
