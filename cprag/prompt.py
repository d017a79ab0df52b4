"""Chat prompts: the question alone (hidden documents, closed book) or with passages in it (visible documents)."""

from __future__ import annotations

SYSTEM = "Answer the question with a short phrase."


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
