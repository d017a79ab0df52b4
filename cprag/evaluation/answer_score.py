"""Score an answer under the CPLM with a passage hidden in its copy memory: what the foundation demo shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cprag.decoding.prompt import end_of_turn_id, prompt_ids
from cprag.index.encode import encode_passages, tokenize_passage
from cprag.model.copy_head import CopyMemory


@dataclass
class TokenScore:
    token: str
    log_p: float  # mixture log-probability with the passage hidden in memory
    log_p_base: float  # the backbone's own LM head, no copying
    gate: float  # g: the weight the `<copy>` entry gives to copying
    copied_from: tuple[int, int] | None  # character span in the passage of the most attended memory entry
    copy_attention: float  # attention on that entry


@dataclass
class CopyScore:
    passage: str
    question: str
    answer: str
    tokens: list[TokenScore]

    @property
    def log_p(self) -> float:
        return sum(t.log_p for t in self.tokens)

    @property
    def log_p_base(self) -> float:
        return sum(t.log_p_base for t in self.tokens)


def answer_token_ids(tokenizer, passage: str, answer: str) -> list[int]:
    """The answer as the passage's own tokens (what can be copied), or as its own tokens when absent."""
    start = passage.find(answer)
    if start < 0:
        return tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
    tokens = tokenize_passage(tokenizer, passage)
    end = start + len(answer)
    return [t for t, (a, b) in zip(tokens.ids, tokens.offsets, strict=True) if a < end and b > start]


@torch.inference_mode()
def score_answer(model, tokenizer, passage: str, question: str, answer: str) -> CopyScore:
    tokenized = tokenize_passage(tokenizer, passage)
    _, keys = next(iter(encode_passages(model, [tokenized], bos_id=tokenizer.bos_token_id)))
    memory = CopyMemory(
        keys=torch.from_numpy(keys.keys).float().unsqueeze(0), ids=torch.from_numpy(keys.ids).long().unsqueeze(0)
    )
    answer_ids = answer_token_ids(tokenizer, passage, answer) + [end_of_turn_id(tokenizer)]
    prompt = prompt_ids(tokenizer, question)
    input_ids = torch.tensor([prompt + answer_ids[:-1]])
    out = model(input_ids, memory=memory)
    base = torch.log_softmax(model.lm_logits(out.hidden_states), -1)
    first = len(prompt) - 1  # the position that predicts the first answer token
    scores = []
    for step, token in enumerate(answer_ids):
        position = first + step
        attention = out.copy_log_attention[0, position, : memory.size].exp()
        best = int(attention.argmax()) if memory.size else None
        scores.append(
            TokenScore(
                token=tokenizer.decode([token]),
                log_p=out.log_probs[0, position, token].item(),
                log_p_base=base[0, position, token].item(),
                gate=out.log_gate[0, position].exp().item(),
                copied_from=tuple(int(v) for v in keys.offsets[best]) if best is not None else None,
                copy_attention=attention[best].item() if best is not None else 0.0,
            )
        )
    return CopyScore(passage=passage, question=question, answer=answer, tokens=scores)
