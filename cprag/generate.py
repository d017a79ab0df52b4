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


@dataclass
class Step:
    """One position's outputs: what the next token is chosen from."""

    log_probs: torch.Tensor  # (V,)
    log_gate: torch.Tensor  # ()
    copy_log_attention: torch.Tensor  # (E + P,)

    @classmethod
    def at(cls, out, position: int) -> Step:
        return cls(out.log_probs[0, position], out.log_gate[0, position], out.copy_log_attention[0, position])


def _copied_source(step: Step, token: int, memory: CopyMemory | None) -> int | None:
    """The memory entry a token was copied from, when the copy path gave it more mass than the generator."""
    if memory is None:
        return None
    log_a = step.copy_log_attention[: memory.size]
    same = memory.ids[0] == token
    if not bool(same.any()):
        return None
    masked = log_a.masked_fill(~same, NEG_INF)
    copied = step.log_gate + torch.logsumexp(masked, -1)
    total = step.log_probs[token]
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
    draft_tokens: int = 8,
) -> Generation:
    """Greedy answer; `stop_at_end=False` always generates `max_new_tokens` (for equal-length timing).

    A token copied from passage entry j drafts the passage's next `draft_tokens` tokens (entries j+1, j+2, ...),
    and one backbone pass checks them all: a drafted token is kept only where greedy decoding would have chosen
    the same token from the same entry, so the answer is exactly the plain greedy one, in fewer passes.
    """
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

    last = torch.tensor([[len(prompt) - 1]], device=device)  # only the last prompt position predicts
    out = model(torch.tensor([prompt], device=device), memory=memory, use_cache=True, query_positions=last)
    step, context = Step.at(out, -1), out.context
    tokens: list[int] = []
    sources: list[tuple[int, int] | None] = []

    def emit(token: int, entry: int | None) -> None:
        tokens.append(token)
        sources.append(None if entry is None else (int(owner[entry]), int(position[entry])))

    while len(tokens) < max_new_tokens:
        token = int(step.log_probs.argmax())
        if token in stop:
            break
        entry = _copied_source(step, token, memory)
        emit(token, entry)
        if len(tokens) == max_new_tokens:
            break
        draft = _successors(entry, owner, min(draft_tokens, max_new_tokens - len(tokens)))
        feed = [token] + [int(memory.ids[0, e]) for e in draft]
        previous = [-1 if entry is None else entry] + draft  # the successor bias sees each token's source
        out = model(torch.tensor([feed], device=device), memory=memory, context=context, use_cache=True,
                    prev_source=torch.tensor([previous], device=device))
        kept = 0
        for drafted in draft:
            step = Step.at(out, kept)
            guess = int(step.log_probs.argmax())
            if guess != int(memory.ids[0, drafted]) or guess in stop or \
                    _copied_source(step, guess, memory) != drafted:
                break
            emit(guess, drafted)
            kept += 1
        step, context = Step.at(out, kept), _rewind(out.context, len(draft) - kept)
    generation = Generation(
        answer=tokenizer.decode(tokens, skip_special_tokens=True).strip(), token_ids=tokens, sources=sources,
        prompt_tokens=len(prompt),
    )
    generation.citations = citations(generation, passages) if mode == "hidden" else []
    return generation


def _successors(entry: int | None, owner: torch.Tensor | None, count: int) -> list[int]:
    """Entries entry+1 .. entry+count that belong to the same passage (nothing for a generated token)."""
    if entry is None or count <= 0:
        return []
    last = min(entry + count, len(owner) - 1)
    return [e for e in range(entry + 1, last + 1) if owner[e] == owner[entry]]


def _rewind(context, drop: int):
    """Forget the last `drop` positions of the running context (rejected draft tokens) and of its KV cache."""
    if drop <= 0:
        return context
    context.keys, context.ids, context.mask = (t[:, :-drop] for t in (context.keys, context.ids, context.mask))
    context.cache.crop(-drop)
    return context


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
