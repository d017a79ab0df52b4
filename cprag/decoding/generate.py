"""Greedy decoding of one question in three modes, with every copied token traced to its source passage.

- hidden:  the backbone reads the question only; passages are present as CP keys (external memory).
- visible: the passages are in the prompt; the CP head copies from keys of their prompt positions.
- closed:  the question alone, no passages.

The rules (word continuation, the greedy choice with its end bias, the first step, the start beam, the choice
among answers) are `cprag.decoding.rules`; `cprag.decoding.batched` decodes many questions with the same rules.

The options of `generate`:

`choose="entry"` takes the most probable single derivation at each step (one copy entry, or the generator);
`choose="token"` takes the most probable token of the mixture, then credits the entry that gave it most.
`whole_words` finishes every copied word: after a token copied from passage entry j, when entry j+1 continues
the same word (letters or digits on both sides, no space), entry j+1 is copied next, and no "end here" entry
may end a span inside a word. Training answers never cut a word, and a 7-digit number is 7 tokens.

In visible mode the passages are in the prompt, and with `visible_keys` the CP head copies from them as it
copies from hidden ones: each passage token gets a key from the prompt's own hidden states
(`prompt_passage_memory`), scored with the same successor bias, end entries and lexical prior, and cited.
Without it, only the plain own-context entries (what the visible training form trains) can be copied.

With passages the first token is never the end: the answer is the best one the passages give, and its
`confidence` (the copy path's probability of that first token) decides whether it is given at all: below
`min_confidence` the generation is empty and marked `no_answer` (the passages hold no answer).

`start_beam` > 1 (with passages) also decodes greedily from the next `start_beam - 1` most probable first
tokens and answers with the most probable whole answer, scored as log p(answer tokens, then the end) divided
by length ** `length_penalty`, or with the one `reranker` (`cprag.decoding.rerank`) scores highest. The confidence
and the abstention stay those of the greedy first token.

A token copied from passage entry j drafts the passage's next `draft_tokens` tokens (entries j+1, j+2, ...),
and one backbone pass checks them all: a drafted token is kept only where greedy decoding would have chosen
the same token from the same entry, so the answer is exactly the plain greedy one, in fewer passes.

`prefix` (`cprag.decoding.prompt_prefix`), computed once for this model, spares the prompt pass the fixed beginning
every hidden and closed-book prompt shares; the answer is the same.

`passage_scores` (the retriever's score of each passage) with `passage_prior` > 0 adds the passage prior
(`cprag.decoding.passage_prior`) to the copy scores in hidden mode: entries of less similar passages are pushed
down.

`end_bias` (nats; default the checkpoint's `config.end_bias`) is added to the log-probability of ending at
every choice after the first (`cprag.decoding.step.with_end_bias`): below 0 an answer runs on where the model is
unsure it is over. Reported log-probabilities stay the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cprag.decoding.memory import lexical_prior, prompt_passage_memory, shared_memory
from cprag.decoding.passage_prior import passage_bias
from cprag.decoding.prompt import prompt_ids, visible_prompt_layout
from cprag.decoding.prompt_prefix import PromptPrefix
from cprag.decoding.rerank import StartReranker
from cprag.decoding.results import Alternative, Generation, citations
from cprag.decoding.rules import (
    Trace,
    check_fits,
    choose_alternative,
    greedy_tokens,
    start_tokens,
    stop_ids,
    stop_probability,
    word_goes_on,
)
from cprag.decoding.step import (
    Step,
    best_derivation,
    copied_source,
    first_token_confidence,
    step_entry_ids,
    successor_entries,
    with_end_bias,
    without_stops,
)
from cprag.index.key_cache import DevicePassage
from cprag.model.copy_head import CopyMemory
from cprag.model.lexical import inside_word


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
    choose: str = "token",
    whole_words: bool = True,
    visible_keys: bool = True,
    min_confidence: float = 0.0,
    start_beam: int = 1,
    length_penalty: float = 0.0,
    reranker: StartReranker | None = None,
    prefix: PromptPrefix | None = None,
    passage_scores: Sequence[float] | None = None,
    passage_prior: float = 0.0,
    end_bias: float | None = None,
) -> Generation:
    """Greedy answer to `question` from `passages` in `mode`, each option as the module's docstring says;
    `stop_at_end=False` always generates `max_new_tokens` (for equal-length timing)."""
    if choose not in ("entry", "token"):
        raise ValueError(f"choose must be 'entry' or 'token', not {choose!r}")
    if start_beam < 1:
        raise ValueError(f"start_beam must be at least 1, not {start_beam}")
    end_bias = model.config.end_bias if end_bias is None else end_bias
    read = _read_prompt(model, tokenizer, question, passages, mode, max_new_tokens, prefix, whole_words,
                        visible_keys, passage_scores, passage_prior)
    decoder = _Decoder(model, tokenizer, read.memory, read.owner, read.position, read.continues,
                       stop_ids(tokenizer) if stop_at_end else set(), choose, end_bias, max_new_tokens, draft_tokens)
    generation = decoder.answer(question, read, min_confidence, start_beam, reranker, length_penalty)
    if not generation.no_answer:
        generation.citations = citations(generation, passages) if read.memory is not None else []
    return generation


@dataclass
class _Read:
    """A question's prompt after its pass: the memory it copies from and the step its answer starts at."""

    prompt: list[int]
    memory: CopyMemory | None
    owner: torch.Tensor | None  # (M,) each entry's passage
    position: torch.Tensor | None  # (M,) each entry's token position in its passage
    continues: torch.Tensor | None  # (M,) entry m's token continues entry m - 1's word, when whole words are kept
    step: Step
    context: object  # the running ContextState, its KV cache included


def _read_prompt(model, tokenizer, question, passages, mode, max_new_tokens, prefix, whole_words, visible_keys,
                 passage_scores, passage_prior) -> _Read:
    """Build the question's prompt and memory and run the prompt pass (from the shared prefix when it fits)."""
    window = model.config.max_position_embeddings
    bodies, spans = [], []
    if mode == "visible":
        bodies = [p.ids[:-1].tolist() for p in passages]  # paste ids: the passage's tokens, then the end
        prompt, spans = visible_prompt_layout(tokenizer, question, bodies, window - max_new_tokens)
    else:
        prompt = prompt_ids(tokenizer, question)
    check_fits(len(prompt), max_new_tokens, window)
    device = next(model.parameters()).device
    prompt_tensor = torch.tensor([prompt], device=device)
    from_prefix = prefix is not None and mode != "visible" and prefix.fits(prompt)
    if not from_prefix:  # a visible prompt's memory needs its passages' features: the whole prompt is run
        hidden, features, cache = model.encode_hidden(prompt_tensor, torch.ones_like(prompt_tensor), use_cache=True)
    memory, owner, position = None, None, None
    if mode == "hidden":
        memory, owner, position = shared_memory(passages, model.head_dtype)
    elif mode == "visible" and visible_keys and spans:
        memory, owner, position = prompt_passage_memory(model, features, prompt_tensor, spans, bodies)
    continues = None
    if memory is not None and whole_words:
        continues = inside_word(tokenizer, memory.ids[0])
        memory.end_allowed = ~continues.unsqueeze(0).to(device)
    if memory is not None:
        memory.prior = lexical_prior(model, tokenizer, question, memory.ids[0])
    if mode == "hidden" and memory is not None:
        memory.bias = passage_bias(passage_scores, [len(p.ids) for p in passages], passage_prior, device,
                                   memory.keys.dtype)
    last = torch.tensor([[len(prompt) - 1]], device=device)  # only the last prompt position predicts
    copyable = None
    if mode == "visible" and memory is not None:  # passage positions are copied through their memory entries only
        copyable = torch.ones_like(prompt_tensor, dtype=torch.bool)
        for start, kept in spans:
            copyable[0, start - 1 : start + kept] = False
    if from_prefix:  # the fixed beginning's cache and keys, then only the question's own tokens
        own = prompt_tensor[:, prefix.length :]
        out = model(own, memory=memory, context=prefix.context(), use_cache=True, query_positions=last,
                    position_ids=torch.arange(prefix.length, len(prompt), device=device).unsqueeze(0))
    else:
        out = model.forward_hidden(hidden, prompt_tensor, torch.ones_like(prompt_tensor), memory,
                                   cp_features=features, query_positions=last, copyable=copyable)
        out.context.cache = cache
    return _Read(prompt, memory, owner, position, continues, Step.at(out, -1), out.context)


@dataclass
class _Decoder:
    """Greedy decoding of one question against its memory, drafting copied spans (`generate`'s loop)."""

    model: object
    tokenizer: object
    memory: CopyMemory | None
    owner: torch.Tensor | None
    position: torch.Tensor | None
    continues: torch.Tensor | None
    stop: set[int]
    choose: str
    end_bias: float
    max_new_tokens: int
    draft_tokens: int

    def entry_ids(self, step: Step, context) -> torch.Tensor:
        ids = None if self.memory is None else self.memory.ids[0]
        return step_entry_ids(self.model, ids, context.ids[0], step.copy_log_attention.shape[0])

    def pick(self, step: Step, context) -> tuple[int, int | None]:
        """The next (token, external entry) at `step`: the mixture's greedy token credited to the entry that gave
        it most (`choose="token"`), or the most probable single derivation (`choose="entry"`)."""
        ids = None if self.memory is None else self.memory.ids[0]
        if self.choose == "token":
            token = greedy_tokens(step.log_probs, self.stop, self.end_bias)
            return token, copied_source(step, token, ids)
        entry_ids = self.entry_ids(step, context)
        return best_derivation(with_end_bias(step, self.stop, self.end_bias, entry_ids), entry_ids,
                               0 if self.memory is None else self.memory.size)

    def answer(self, question: str, read: _Read, min_confidence: float, start_beam: int,
               reranker: StartReranker | None, length_penalty: float) -> Generation:
        """The answer from the prompt's last step: with passages its first token is never the end, and below
        `min_confidence` it is withheld; a start beam decodes from each start and keeps the chosen answer."""
        memory, step, context, stop = self.memory, read.step, read.context, self.stop
        confidence, first, stopping, starts = None, None, None, []
        if memory is not None and stop:  # an answer from the passages, or none at all: never an empty one
            stopping = stop_probability(step, stop)
            step = without_stops(step, stop, self.entry_ids(step, context))
            first = self.pick(step, context)
            confidence = first_token_confidence(step, memory.ids[0], first[0])
            if confidence < min_confidence:
                return Generation(answer="", token_ids=[], sources=[], prompt_tokens=len(read.prompt),
                                  confidence=confidence, no_answer=True, stop_probability=stopping)
            if start_beam > 1:  # the greedy first token, then the next most probable ones, each credited
                starts = [first] + [(t, copied_source(step, t, memory.ids[0]))
                                    for t in start_tokens(step, first[0], start_beam)[1:]]
        if len(starts) > 1:
            alternatives = []
            for start in starts:
                alternatives.append(self.decode(start, step, context))
                extra = context.cache.get_seq_length() - len(read.prompt)
                if extra > 0:
                    context.cache.crop(-extra)  # back to the prompt for the next start
            prior = memory.prior[0] if memory.prior is not None else None
            best = choose_alternative(question, alternatives, reranker, prior, read.owner, length_penalty)
        else:
            best = self.decode(first, step, context)
            alternatives = [best]
        return Generation(answer=best.answer, token_ids=best.token_ids, sources=best.sources,
                          prompt_tokens=len(read.prompt), confidence=confidence, stop_probability=stopping,
                          alternatives=alternatives)

    def decode(self, first: tuple[int, int | None] | None, step: Step, context) -> Alternative:
        """Greedy decoding from the prompt's last step, starting with `first` when given."""
        trace, model, stop = Trace(self.owner, self.position), self.model, self.stop
        device = step.log_probs.device
        while len(trace.tokens) < self.max_new_tokens:
            if first is not None:
                (token, entry), first = first, None
            elif trace.entry is not None and word_goes_on(self.continues, self.owner, trace.entry + 1):
                entry = trace.entry + 1
                token = int(self.memory.ids[0, entry])
            else:
                token, entry = self.pick(step, context)
            if token in stop:
                trace.end(token, step)
                break
            trace.emit(token, entry, step)
            if len(trace.tokens) == self.max_new_tokens:
                break
            room = self.max_new_tokens - len(trace.tokens)
            draft = successor_entries(entry, self.owner, min(self.draft_tokens, room))
            feed = [token] + [int(self.memory.ids[0, e]) for e in draft]
            previous = [-1 if entry is None else entry] + draft  # the successor bias sees each token's source
            out = model(torch.tensor([feed], device=device), memory=self.memory, context=context, use_cache=True,
                        prev_source=torch.tensor([previous], device=device))
            kept = 0
            for drafted in draft:
                step = Step.at(out, kept)
                if not word_goes_on(self.continues, self.owner, drafted):
                    guess, source = self.pick(step, out.context)
                    if guess != int(self.memory.ids[0, drafted]) or guess in stop or source != drafted:
                        break
                trace.emit(int(self.memory.ids[0, drafted]), drafted, step)
                kept += 1
            step, context = Step.at(out, kept), _rewind(out.context, len(draft) - kept)
        return trace.alternative(self.tokenizer)


def _rewind(context, drop: int):
    """Forget the last `drop` positions of the running context (rejected draft tokens) and of its KV cache."""
    if drop <= 0:
        return context
    context.keys, context.ids, context.mask = (t[:, :-drop] for t in (context.keys, context.ids, context.mask))
    if context.refine is not None:
        context.refine = context.refine[:, :-drop]
    if context.copyable is not None:
        context.copyable = context.copyable[:, :-drop]
    context.cache.crop(-drop)
    return context


