"""Chat prompts: the question alone (hidden documents, closed book) or with passages in it (visible documents)."""

from __future__ import annotations

SYSTEM = "Answer the question with a short phrase."

# hidden: the passages as CP keys only; visible: the passages in the prompt; closed: no passages
MODES = ("hidden", "visible", "closed")
# what `ask` answers in: the decoding modes, and "reader", the span reader over the passages' text (no prompt here:
# cprag.decoding.span_read)
ASK_MODES = (*MODES, "reader")


def _messages(question: str, passages: list[str] | None) -> list[dict]:
    content = question
    if passages:
        context = "\n\n".join(f"Passage {i + 1}: {text}" for i, text in enumerate(passages))
        content = f"{context}\n\nQuestion: {question}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def prompt_ids(tokenizer, question: str, passages: list[str] | None = None) -> list[int]:
    """Token ids of the chat prompt up to and including the assistant turn's header."""
    ids = tokenizer.apply_chat_template(_messages(question, passages), add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def end_of_turn_id(tokenizer) -> int:
    """The token that closes the assistant's answer (`<|im_end|>` for SmolLM2)."""
    token = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return token if isinstance(token, int) and token != tokenizer.unk_token_id else tokenizer.eos_token_id


def visible_prompt_layout(tokenizer, question: str, passages: list[list[int]], budget: int | None = None,
                          ) -> tuple[list[int], list[tuple[int, int]]]:
    """The visible prompt built around the passages' own token ids (as they were tokenized for their keys), so
    every passage token sits at a known prompt position. Whole passages are dropped from the end, then the last
    one is cut, until the prompt fits `budget` tokens (None: no limit). Decoding and the visible training form
    both build their prompts here.

    Returns the prompt ids and, per passage kept, (prompt position of its first token, tokens kept).
    """
    marker = "\u2063cprag-passages\u2063"
    template = tokenizer.apply_chat_template(_messages(marker, None), tokenize=False, add_generation_prompt=True)
    before, after = template.split(marker)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    head, tail = encode(before), encode(f"\n\nQuestion: {question}{after}")
    labels = [encode(("\n\n" if i else "") + f"Passage {i + 1}:\n") for i in range(len(passages))]
    bodies = list(passages)

    def length() -> int:
        return len(head) + len(tail) + sum(map(len, labels[: len(bodies)])) + sum(map(len, bodies))

    while budget is not None and bodies and length() > budget:
        if len(bodies) > 1:
            bodies.pop()
            continue
        room = budget - len(head) - len(tail) - len(labels[0])
        bodies = [bodies[0][:room]] if room > 0 else []
    prompt, spans = list(head), []
    for label, body in zip(labels[: len(bodies)], bodies, strict=True):
        prompt += label
        spans.append((len(prompt), len(body)))
        prompt += body
    return prompt + tail, spans
