"""Greedy decoding in three modes, with every copied token traced to its source passage and characters.

- hidden:  the backbone reads the question only; passages are present as CP keys (external memory).
- visible: the passages are in the prompt; the CP head copies from the model's own context.
- closed:  the question alone, no passages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cprag.cache import DevicePassage
from cprag.errors import QuestionTooLong
from cprag.mixture import NEG_INF
from cprag.model import CopyMemory
from cprag.prompt import end_of_turn_id, prompt_ids

MODES = ("hidden", "visible", "closed")
LOG_HALF = math.log(0.5)


@dataclass
class Citation:
    doc_id: str
    title: str
    start: int  # character offsets in the document's text
    end: int
    text: str


@dataclass
class Generation:
    answer: str
    token_ids: list[int]
    sources: list[tuple[int, int] | None]  # per token: (passage index, token position) when copied
    citations: list[Citation] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def copy_rate(self) -> float:
        return sum(s is not None for s in self.sources) / len(self.sources) if self.sources else 0.0


def shared_memory(passages: list[DevicePassage]) -> tuple[CopyMemory | None, torch.Tensor, torch.Tensor]:
    """One memory over all passages, plus per entry its passage index and token position."""
    if not passages:
        return None, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    keys = torch.cat([p.keys for p in passages]).unsqueeze(0)  # (1, M, D)
    ids = torch.cat([p.ids for p in passages]).unsqueeze(0)  # (1, M)
    owner = torch.cat([torch.full((len(p.ids),), i, dtype=torch.long) for i, p in enumerate(passages)])
    position = torch.cat([torch.arange(len(p.ids)) for p in passages])
    return CopyMemory(keys=keys, ids=ids), owner, position


def _copied_source(out, token: int, memory: CopyMemory | None) -> int | None:
    """The memory entry a token was copied from, when the copy path gave it more mass than the generator."""
    if memory is None:
        return None
    log_a = out.copy_log_attention[0, -1, : memory.size]
    same = memory.ids[0] == token
    if not bool(same.any()):
        return None
    masked = log_a.masked_fill(~same, NEG_INF)
    copied = out.log_gate[0, -1] + torch.logsumexp(masked, -1)
    total = out.log_probs[0, -1, token]
    # copied mass above half of p(token): the copy path, not the generator, chose it
    if copied - total < LOG_HALF:
        return None
    return int(masked.argmax())


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    question: str,
    passages: list[DevicePassage],
    mode: str = "hidden",
    max_new_tokens: int = 32,
    stop_at_end: bool = True,
) -> Generation:
    """Greedy answer; `stop_at_end=False` always generates `max_new_tokens` (for equal-length timing)."""
    window = model.config.max_position_embeddings
    if mode == "visible":
        prompt = _visible_prompt(tokenizer, question, passages, window - max_new_tokens)
    else:
        prompt = prompt_ids(tokenizer, question)
    if len(prompt) + max_new_tokens > window:
        raise QuestionTooLong(len(prompt) + max_new_tokens, window)
    memory, owner, position = shared_memory(passages) if mode == "hidden" else (None, None, None)
    device = next(model.parameters()).device
    stop = {end_of_turn_id(tokenizer), tokenizer.eos_token_id} if stop_at_end else set()

    out = model(torch.tensor([prompt], device=device), memory=memory, use_cache=True)
    tokens: list[int] = []
    sources: list[tuple[int, int] | None] = []
    for _ in range(max_new_tokens):
        token = int(out.log_probs[0, -1].argmax())
        if token in stop:
            break
        entry = _copied_source(out, token, memory)
        tokens.append(token)
        sources.append(None if entry is None else (int(owner[entry]), int(position[entry])))
        previous = torch.tensor([[-1 if entry is None else entry]], device=device)  # for the successor bias
        out = model(torch.tensor([[token]], device=device), memory=memory, context=out.context, use_cache=True,
                    prev_source=previous)
    generation = Generation(
        answer=tokenizer.decode(tokens, skip_special_tokens=True).strip(), token_ids=tokens, sources=sources,
        prompt_tokens=len(prompt),
    )
    generation.citations = citations(generation, passages) if mode == "hidden" else []
    return generation


def citations(generation: Generation, passages: list[DevicePassage]) -> list[Citation]:
    """Group runs of tokens copied from consecutive positions of one passage into character spans."""
    spans: list[tuple[int, int, int]] = []  # (passage, first position, last position)
    for source in generation.sources:
        if source is None:
            continue
        passage, position = source
        if spans and spans[-1][0] == passage and spans[-1][2] + 1 == position:
            spans[-1] = (passage, spans[-1][1], position)
        else:
            spans.append((passage, position, position))
    result = []
    for passage_index, first, last in spans:
        stored = passages[passage_index].passage
        start, end = int(stored.keys.offsets[first][0]), int(stored.keys.offsets[last][1])
        result.append(Citation(
            doc_id=stored.doc_id, title=stored.title, start=stored.char_start + start, end=stored.char_start + end,
            text=stored.text[start:end],
        ))
    return result


def _visible_prompt(tokenizer, question: str, passages: list[DevicePassage], budget: int) -> list[int]:
    """The prompt with passages in it, dropping whole passages from the end (then truncating) to fit the window."""
    texts = [p.passage.text for p in passages]
    while True:
        prompt = prompt_ids(tokenizer, question, texts)
        if len(prompt) <= budget or not texts:
            return prompt
        if len(texts) > 1:
            texts = texts[:-1]
        else:
            overflow = len(prompt) - budget
            ids = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
            if overflow >= len(ids):
                texts = []
            else:
                texts = [tokenizer.decode(ids[: len(ids) - overflow])]
