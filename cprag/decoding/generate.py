"""Greedy decoding in three modes, with every copied token traced to its source passage and characters.

- hidden:  the backbone reads the question only; passages are present as CP keys (external memory).
- visible: the passages are in the prompt; the CP head copies from keys of their prompt positions.
- closed:  the question alone, no passages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cprag.decoding.passage_prior import passage_bias
from cprag.decoding.prompt import end_of_turn_id, prompt_ids, visible_prompt_layout
from cprag.decoding.prompt_prefix import PromptPrefix
from cprag.decoding.rerank import SpanCandidate, StartReranker
from cprag.decoding.step import (
    Step,
    best_derivation,
    copied_source,
    first_token_confidence,
    shared_memory,
    step_entry_ids,
    successor_entries,
    with_end_bias,
    without_stops,
)
from cprag.errors import QuestionTooLong
from cprag.index.key_cache import DevicePassage
from cprag.model.copy_head import CopyMemory
from cprag.model.lexical import (
    inside_word,
    lexical_features,
    memory_lexicon,
    question_type,
    question_words,
)

MODES = ("hidden", "visible", "closed")


@dataclass
class Citation:
    doc_id: str
    title: str
    start: int  # character offsets in the document's text
    end: int
    text: str


@dataclass
class Alternative:
    """One greedy continuation of a first token: its answer and log p(its tokens, then the end)."""

    answer: str
    token_ids: list[int]
    sources: list[tuple[int, int] | None]
    log_prob: float
    token_log_probs: list[float] = field(default_factory=list)  # log p of each token; log_prob adds the end's
    entries: list[int | None] = field(default_factory=list)  # the memory entry each token was copied from

    def score(self, length_penalty: float = 0.0) -> float:
        return self.log_prob / max(len(self.token_ids), 1) ** length_penalty


@dataclass
class Generation:
    answer: str
    token_ids: list[int]
    sources: list[tuple[int, int] | None]  # per token: (passage index, token position) when copied
    citations: list[Citation] = field(default_factory=list)
    prompt_tokens: int = 0
    # with passages: the copy path's probability of the first answer token, g · Σ a_j over the passage entries
    # that paste it (None without passages); below `min_confidence` the answer is withheld (`no_answer`)
    confidence: float | None = None
    no_answer: bool = False
    # the probability of ending at once, before ending is barred: what no-answer training teaches (None
    # without passages)
    stop_probability: float | None = None

    # every answer decoded (one per first token tried with `start_beam`; the chosen one among them)
    alternatives: list[Alternative] = field(default_factory=list)

    @property
    def copy_rate(self) -> float:
        return sum(s is not None for s in self.sources) / len(self.sources) if self.sources else 0.0


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
    """Greedy answer; `stop_at_end=False` always generates `max_new_tokens` (for equal-length timing).

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
    and
    the abstention stay those of the greedy first token.

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
    if choose not in ("entry", "token"):
        raise ValueError(f"choose must be 'entry' or 'token', not {choose!r}")
    if start_beam < 1:
        raise ValueError(f"start_beam must be at least 1, not {start_beam}")
    end_bias = model.config.end_bias if end_bias is None else end_bias
    window = model.config.max_position_embeddings
    bodies, spans = [], []
    if mode == "visible":
        bodies = [p.ids[:-1].tolist() for p in passages]  # paste ids: the passage's tokens, then the end
        prompt, spans = visible_prompt_layout(tokenizer, question, bodies, window - max_new_tokens)
    else:
        prompt = prompt_ids(tokenizer, question)
    if len(prompt) + max_new_tokens > window:
        raise QuestionTooLong(len(prompt) + max_new_tokens, window)
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
    continues = None  # (M,) entry m's token continues entry m - 1's word, when whole words are kept
    if memory is not None and whole_words:
        continues = inside_word(tokenizer, memory.ids[0])
        memory.end_allowed = ~continues.unsqueeze(0).to(device)
    if memory is not None:
        memory.prior = lexical_prior(model, tokenizer, question, memory.ids[0])
    if mode == "hidden" and memory is not None:
        memory.bias = passage_bias(passage_scores, [len(p.ids) for p in passages], passage_prior, device,
                                   memory.keys.dtype)
    stop = {end_of_turn_id(tokenizer), tokenizer.eos_token_id} if stop_at_end else set()

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
    step, context = Step.at(out, -1), out.context

    def pick(step: Step, context, offset: int = 0) -> tuple[int, int | None]:
        """The next (token, external entry) at a step whose context ends `offset` positions before its last."""
        if choose == "token":
            token = int(with_end_bias(step, stop, end_bias).log_probs.argmax())
            return token, copied_source(step, token, memory)
        entry_ids = step_entry_ids(model, memory, context, step.copy_log_attention.shape[0])
        return best_derivation(with_end_bias(step, stop, end_bias, entry_ids), entry_ids, memory)

    confidence, first, stop_probability, starts = None, None, None, []
    if memory is not None and stop:  # an answer from the passages, or none at all: never an empty one
        stop_probability = float(step.log_probs[sorted(stop)].exp().sum())
        step = without_stops(step, stop, step_entry_ids(model, memory, context, step.copy_log_attention.shape[0]))
        first = pick(step, context)
        confidence = first_token_confidence(step, memory, first[0])
        if confidence < min_confidence:
            return Generation(answer="", token_ids=[], sources=[], prompt_tokens=len(prompt), confidence=confidence,
                              no_answer=True, stop_probability=stop_probability)
        if start_beam > 1:  # the greedy first token, then the next most probable ones, each credited to its entry
            others = [int(t) for t in step.log_probs.topk(start_beam + 1).indices if int(t) != first[0]]
            starts = [first] + [(t, copied_source(step, t, memory)) for t in others[: start_beam - 1]]

    def word_goes_on(entry: int | None) -> bool:
        """Entry `entry` finishes the word its predecessor's copy started (so it must be copied next)."""
        return (continues is not None and entry is not None and 0 < entry < len(continues)
                and bool(continues[entry]) and owner[entry] == owner[entry - 1])

    def decode(first: tuple[int, int | None] | None, step: Step, context) -> Alternative:
        """Greedy decoding from the prompt's last step, starting with `first` when given."""
        tokens: list[int] = []
        sources: list[tuple[int, int] | None] = []
        token_log_probs: list[float] = []
        entries: list[int | None] = []
        log_prob = 0.0

        def emit(token: int, entry: int | None, at: Step) -> None:
            nonlocal log_prob
            token_log_probs.append(float(at.log_probs[token]))
            log_prob += token_log_probs[-1]
            tokens.append(token)
            entries.append(entry)
            sources.append(None if entry is None else (int(owner[entry]), int(position[entry])))

        entry = None
        while len(tokens) < max_new_tokens:
            if first is not None:
                (token, entry), first = first, None
            elif entry is not None and word_goes_on(entry + 1):
                entry = entry + 1
                token = int(memory.ids[0, entry])
            else:
                token, entry = pick(step, context)
            if token in stop:
                log_prob += float(step.log_probs[token])
                break
            emit(token, entry, step)
            if len(tokens) == max_new_tokens:
                break
            draft = successor_entries(entry, owner, min(draft_tokens, max_new_tokens - len(tokens)))
            feed = [token] + [int(memory.ids[0, e]) for e in draft]
            previous = [-1 if entry is None else entry] + draft  # the successor bias sees each token's source
            out = model(torch.tensor([feed], device=device), memory=memory, context=context, use_cache=True,
                        prev_source=torch.tensor([previous], device=device))
            kept = 0
            for drafted in draft:
                step = Step.at(out, kept)
                if not word_goes_on(drafted):
                    guess, source = pick(step, out.context)
                    if guess != int(memory.ids[0, drafted]) or guess in stop or source != drafted:
                        break
                emit(int(memory.ids[0, drafted]), drafted, step)
                entry = drafted
                kept += 1
            step, context = Step.at(out, kept), _rewind(out.context, len(draft) - kept)
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        return Alternative(answer, tokens, sources, log_prob, token_log_probs, entries)

    if len(starts) > 1:
        alternatives = []
        for start in starts:
            alternatives.append(decode(start, step, context))
            extra = context.cache.get_seq_length() - len(prompt)
            if extra > 0:
                context.cache.crop(-extra)  # back to the prompt for the next start
        if reranker is not None:
            prior = memory.prior[0] if memory.prior is not None else None
            best = alternatives[reranker.choose(question, span_candidates(alternatives, prior, owner))]
        else:
            best = max(alternatives, key=lambda a: a.score(length_penalty))
    else:
        best = decode(first, step, context)
        alternatives = [best]
    generation = Generation(
        answer=best.answer, token_ids=best.token_ids, sources=best.sources, prompt_tokens=len(prompt),
        confidence=confidence, stop_probability=stop_probability, alternatives=alternatives,
    )
    generation.citations = citations(generation, passages) if memory is not None else []
    return generation


def lexical_prior(model, tokenizer, question: str, ids: torch.Tensor) -> torch.Tensor | None:
    """(1, M, F) query-time lexical features of memory entries pasting `ids` (M,), or None without a prior."""
    if not model.config.lexical_prior:
        return None
    config = model.config
    words, sentences, types = memory_lexicon(tokenizer, ids, config.lexical_sentence_starts)
    return lexical_features(question_words(tokenizer, question), words, config.lexical_window_sizes,
                            sentences if config.lexical_sentences else None, question_type(question),
                            types if config.lexical_types else None,
                            config.lexical_sentence_starts).unsqueeze(0).to(ids.device)


def span_candidates(alternatives: list[Alternative], prior: torch.Tensor | None, owner: torch.Tensor
                    ) -> list[SpanCandidate]:
    """What the reranker reads of each alternative: its probabilities, and the lexical features (`prior`, (M, F)
    over the memory's entries) at its ends."""
    candidates = []
    for a in alternatives:
        first, last = (a.entries[0], a.entries[-1]) if a.entries else (None, None)
        candidates.append(SpanCandidate(
            a.answer, a.token_log_probs, a.log_prob,
            None if first is None or prior is None else prior[first].tolist(),
            None if last is None or prior is None else prior[last].tolist(),
            None if first is None else int(owner[first])))
    return candidates


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
        if last >= len(stored.keys.offsets):  # a passage without offsets (the needle's visible haystack)
            continue
        start, end = int(stored.keys.offsets[first][0]), int(stored.keys.offsets[last][1])
        result.append(Citation(
            doc_id=stored.doc_id, title=stored.title, start=stored.char_start + start, end=stored.char_start + end,
            text=stored.text[start:end],
        ))
    return result


def prompt_passage_memory(model, features: torch.Tensor, prompt: torch.Tensor, spans: list[tuple[int, int]],
                          bodies: list[list[int]]) -> tuple[CopyMemory, torch.Tensor, torch.Tensor]:
    """One memory over the passages of a visible prompt, keyed from the prompt's CP features (1, L, C).

    A passage whose tokens t_1..t_n start at prompt position s is keyed as `document_keys` keys [BOS, t_1..t_n],
    with the label token at s - 1 in BOS's place: entry j pastes t_{j+1}, and a whole passage's last entry pastes
    the end. A passage cut to fit the window has no end entry.
    """
    keys, ids, owner, position = [], [], [], []
    for index, (start, kept) in enumerate(spans):
        window = slice(start - 1, start + kept)
        encoded = model.document_keys_from_hidden(features[:, window], prompt[:, window],
                                                  torch.ones_like(prompt[:, window]))
        entries = kept + 1 if kept == len(bodies[index]) else kept
        keys.append(encoded.keys[0, :entries])
        ids.append(encoded.ids[0, :entries])
        owner.append(torch.full((entries,), index, dtype=torch.long))
        position.append(torch.arange(entries))
    memory = CopyMemory(keys=torch.cat(keys).unsqueeze(0), ids=torch.cat(ids).unsqueeze(0))
    return memory, torch.cat(owner), torch.cat(position)
