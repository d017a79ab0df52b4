"""The decoding rules, each written once: both decoders (`cprag.decoding.generate`, one question, and
`cprag.decoding.batched`, many per backbone pass) choose, continue, stop and trace tokens through these.

- a copied word is finished before anything else is chosen (`word_goes_on`);
- the greedy token is the mixture's argmax with the end bias added to every way to end (`greedy_tokens`);
- with passages the first token is never the end: `stop_probability` records how much ending had, the step is
  taken without its stops, and the copy path's probability of the chosen first token is the confidence;
- a start beam also starts from the next most probable first tokens (`start_tokens`), and the reranker (or,
  without one, the likeliest) picks among the answers (`choose_alternative`);
- every emitted token is traced to the memory entry it was copied from (`Trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cprag.decoding.prompt import end_of_turn_id
from cprag.decoding.rerank import StartReranker
from cprag.decoding.results import Alternative, span_candidates
from cprag.decoding.step import Step
from cprag.errors import QuestionTooLong


def stop_ids(tokenizer) -> set[int]:
    """The tokens that end an answer: the end of the assistant's turn, and end of sequence."""
    return {end_of_turn_id(tokenizer), tokenizer.eos_token_id}


def check_fits(prompt_tokens: int, max_new_tokens: int, window: int) -> None:
    """A prompt and its longest answer must fit the model's window (`QuestionTooLong` otherwise)."""
    if prompt_tokens + max_new_tokens > window:
        raise QuestionTooLong(prompt_tokens + max_new_tokens, window)


def word_goes_on(continues: torch.Tensor | None, owner: torch.Tensor, entry: int | None) -> bool:
    """Entry `entry` finishes the word its predecessor's copy started, so it must be copied next.

    continues (M,): entry m's token continues entry m - 1's word (None when whole words are not kept);
    owner (M,): the passage of each entry (a word never runs on into the next passage)."""
    return (continues is not None and entry is not None and 0 < entry < len(continues)
            and bool(continues[entry]) and owner[entry] == owner[entry - 1])


def greedy_tokens(log_probs: torch.Tensor, stop: set[int], end_bias: float):
    """The token greedy decoding picks from log_probs (..., V) at every row and position, in one argmax, with
    `end_bias` (nats) added to the stop tokens (`cprag.decoding.step.with_end_bias` weighs one step the same way):
    an int for a (V,) input, else nested lists (...) of token ids."""
    if end_bias != 0 and stop:
        barred = torch.tensor(sorted(stop), device=log_probs.device)
        log_probs = log_probs.index_add(-1, barred, log_probs.new_full((*log_probs.shape[:-1], len(barred)), end_bias))
    return log_probs.argmax(-1).tolist()


def stop_probability(step: Step, stop: set[int]) -> float:
    """The probability of ending at once, before ending is barred: what no-answer training teaches."""
    return float(step.log_probs[sorted(stop)].exp().sum())


def start_tokens(step: Step, first: int, start_beam: int) -> list[int]:
    """The first tokens a start beam decodes from: the greedy `first`, then the next most probable ones."""
    others = [int(t) for t in step.log_probs.topk(start_beam + 1).indices if int(t) != first]
    return [first] + others[: start_beam - 1]


def choose_alternative(question: str, alternatives: list[Alternative], reranker: StartReranker | None,
                       prior: torch.Tensor | None, owner: torch.Tensor, length_penalty: float = 0.0) -> Alternative:
    """The answer among a start beam's: the one `reranker` scores highest (it reads `prior` (M, F), the lexical
    features at each span's ends), or without one the likeliest by `Alternative.score(length_penalty)`."""
    if len(alternatives) == 1:
        return alternatives[0]
    if reranker is not None:
        return alternatives[reranker.choose(question, span_candidates(alternatives, prior, owner))]
    return max(alternatives, key=lambda a: a.score(length_penalty))


@dataclass
class Trace:
    """One answer as it is decoded: its tokens, where each was copied from, and their log-probabilities.

    owner, position (M,): each memory entry's passage and token position there, so a copied token's source is
    (passage, position); `listener(token, source)` hears each token as it is emitted (streaming)."""

    owner: torch.Tensor
    position: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    sources: list[tuple[int, int] | None] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    entries: list[int | None] = field(default_factory=list)
    entry: int | None = None  # the entry the last token was copied from
    end_log_prob: float = 0.0  # log p(the end) where the answer ended (0 when it ran to max_new_tokens)
    listener: Callable[[int, tuple[int, int] | None], None] | None = None

    def emit(self, token: int, entry: int | None, step: Step) -> None:
        self.log_probs.append(float(step.log_probs[token]))
        self.tokens.append(token)
        self.entries.append(entry)
        self.sources.append(None if entry is None else (int(self.owner[entry]), int(self.position[entry])))
        self.entry = entry
        if self.listener is not None:
            self.listener(token, self.sources[-1])

    def end(self, token: int, step: Step) -> None:
        self.end_log_prob = float(step.log_probs[token])

    def alternative(self, tokenizer) -> Alternative:
        # summed in emission order, then the end: the log-probability both decoders report
        log_prob = sum(self.log_probs) + self.end_log_prob
        answer = tokenizer.decode(self.tokens, skip_special_tokens=True).strip()
        return Alternative(answer, self.tokens, self.sources, log_prob, self.log_probs, self.entries)
