"""Greedy hidden-mode decoding of many questions per backbone pass.

Each question keeps its own memory (its passages' keys, padded to the batch's longest memory and masked), its
own prompt (left padded: the last prompt position is the same column in every row) and its own KV-cache row.
One forward pass per step serves every unfinished question, so each step reads the weights once for the whole
batch instead of once per question. A key shard retrieved by several questions stays one device tensor in the
key-shard cache; the padded batch memory is rebuilt from those shards per batch.

The answers are those of `cprag.decoding.generate.generate` one question at a time (greedy, `choose="token"`, whole
words, drafting): the same choices at every step, from the same mixture. A row that is copying drafts its
passage's next tokens, as the single-question decoder does, and the pass checks every row's draft at once: rows
feed drafts of different lengths, right padded to the longest. What a row did not keep (rejected drafts and its
padding) is rolled to the front of its cache row and masked, so each row's kept positions stay contiguous at the
right, as the left-padded prompt started them; the roll waits for the next pass, so rows that finished (and a
batch's last pass) skip it. With a start beam of B, a question is B rows: row r starts from
the r-th most probable first token (as `generate` orders them) and decodes greedily from there, and the question's
answer is the one its reranker (or, without one, the likeliest) picks, so B alternatives cost one batch's passes
rather than B passes each. Whether a call is decoded here or one question at a time is decided by
`cprag.decoding.route`; a model with a query refiner (whose window would read the padding) is not decoded here.

The rules (word continuation, the greedy choice, the first step, the start beam, the choice among answers, the
trace of every token) are `cprag.decoding.rules`, the ones `generate` follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cprag.decoding.batch_context import drop_unused, left_padded, select_rows
from cprag.decoding.memory import batch_memory, joined_memory, shared_memory
from cprag.decoding.prompt import prompt_ids
from cprag.decoding.prompt_prefix import PromptPrefix
from cprag.decoding.rerank import StartReranker
from cprag.decoding.results import Generation, citations
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
    copied_source,
    first_token_confidence,
    step_entry_ids,
    successor_entries,
    without_stops,
)
from cprag.index.key_cache import DevicePassage
from cprag.model.copy_head import ContextState, CopyMemory
from cprag.model.lexical import inside_word


@dataclass
class _Row:
    """One question's decoding state: one start of its start beam, traced token by token."""

    index: int  # the question's place in the batch
    prompt: list[int]
    passages: list[DevicePassage]
    continues: torch.Tensor | None  # (M_i,) entry m continues entry m - 1's word
    memory_ids: list[int]  # (M_i,) the token each entry pastes
    trace: Trace
    confidence: float | None = None
    stop_probability: float | None = None
    no_answer: bool = False
    done: bool = False
    rank: int = 0  # the start beam's rank of the first token this row starts from (0: the greedy one)
    prior: torch.Tensor | None = None  # (M_i, F) lexical features of the entries (what the reranker reads)
    passage_scores: Sequence[float] | None = None  # the retriever's score of each passage (the passage prior)

    def goes_on(self, entry: int | None) -> bool:
        return word_goes_on(self.continues, self.trace.owner, entry)


def batch_supported(model, mode: str) -> bool:
    """Whether `generate_batch` decodes this model and mode (otherwise questions go one at a time)."""
    return mode == "hidden" and model.cp_head.query_refiner is None


@dataclass
class _Setup:
    """What every pass of one `generate_batch` call reads."""

    model: object
    tokenizer: object
    questions: list[str]  # the question of each row
    rows: list[_Row]
    prefix: PromptPrefix | None
    start_beam: int
    device: torch.device
    stop: set[int]
    min_confidence: float
    max_new_tokens: int
    passage_prior: float
    end_bias: float


@torch.inference_mode()
def generate_batch(model, tokenizer, questions: list[str], passages: list[list[DevicePassage]],
                   max_new_tokens: int = 32, whole_words: bool = True, min_confidence: float = 0.0,
                   mode: str = "hidden", on_token: Callable[[int, int, tuple[int, int] | None], None] | None = None,
                   cancelled: Callable[[int], bool] | None = None, draft_tokens: int = 8,
                   prefix: PromptPrefix | None = None, max_rows: int | None = None,
                   passage_scores: list[Sequence[float] | None] | None = None, passage_prior: float = 0.0,
                   end_bias: float | None = None, start_beam: int = 1, reranker: StartReranker | None = None
                   ) -> list[Generation]:
    """Greedy answers to `questions`, question i from `passages[i]`, decoded together: the same answers,
    sources, confidences and citations as `generate` gives each question alone.

    `on_token(i, token, source)` hears each token of question i as it is chosen (source: (passage index,
    position) when copied), for streaming; question i stops decoding once `cancelled(i)` is true (a client that
    went away), and its generation is what it had by then. `prefix`: see `cprag.decoding.generate.generate`.

    `max_rows` caps the rows decoded together (default: all the questions at once). With a cap, the batch is
    continuous: whenever half its rows have finished, the next questions' prompts are run and join it, so a
    long answer does not hold back the questions after it. Questions start shortest prompt first (a stream's
    in the order asked), so the prompts run together pad little.

    `passage_scores[i]` (the retriever's score of each of question i's passages) with `passage_prior` > 0 adds
    the passage prior (`cprag.decoding.passage_prior`) to question i's copy scores; `end_bias`: see `generate`.

    `start_beam` B > 1 decodes each question with passages as B rows, from its B most probable first tokens, and
    answers with the alternative `reranker` picks (the likeliest without one): `generate`'s start beam, with
    every alternative of every question in one batch (`max_rows` counts rows). Not with `on_token`/`cancelled`:
    a stream would hear the alternatives not chosen."""
    if len(questions) != len(passages):
        raise ValueError(f"{len(questions)} questions but {len(passages)} passage lists")
    if start_beam < 1:
        raise ValueError(f"start_beam must be at least 1, not {start_beam}")
    if start_beam > 1 and (on_token is not None or cancelled is not None):
        raise ValueError("a start beam decodes alternatives a stream must not hear: use start_beam=1 to stream")
    if not batch_supported(model, mode):
        raise ValueError(f"{mode} mode with this model is decoded one question at a time (cprag.decoding.route)")
    rows = _rows(tokenizer, questions, passages, max_new_tokens, model.config.max_position_embeddings, whole_words,
                 start_beam, on_token, passage_scores)
    setup = _Setup(model, tokenizer, [questions[row.index] for row in rows], rows, prefix, start_beam,
                   next(model.parameters()).device, stop_ids(tokenizer), min_confidence, max_new_tokens,
                   passage_prior, model.config.end_bias if end_bias is None else end_bias)
    max_rows = len(rows) if max_rows is None else max_rows
    waiting, running = list(range(len(rows))), None  # rows not yet started; the batch being decoded
    if on_token is None and cancelled is None:
        # questions of like prompt length start together, so a prompt pass pads less (4.7% more questions per
        # second at 16 per batch, eval/cpu-latency.md); a stream keeps its order: first asked, first started
        waiting.sort(key=lambda n: (len(rows[n].prompt), rows[n].index, rows[n].rank))
    while True:
        if running is not None:
            for i in running.live:
                if not rows[i].done and cancelled is not None and cancelled(i):
                    rows[i].done = True
            keep = [j for j, i in enumerate(running.live) if not rows[i].done]
            # finished rows leave the batch: later steps cost only what is left
            running = None if not keep else running if len(keep) == len(running.live) else running.select(keep)
        if waiting and (running is None or len(running.live) <= max_rows // 2):
            # half the rows are free: the next questions' prompts are run and join the batch
            room = max_rows - (0 if running is None else len(running.live))
            started = _start(setup, waiting[:room])
            waiting = waiting[room:]
            running = started if running is None else running.joined(started)
            continue  # rows that ended at their first token leave before the next step
        if running is None:
            break
        _step(setup, running, draft_tokens)

    by_question: list[list[_Row]] = [[] for _ in questions]
    for row in rows:
        by_question[row.index].append(row)
    return [_generation(tokenizer, questions[number], beam, reranker) for number, beam in enumerate(by_question)]


def _rows(tokenizer, questions, passages, max_new_tokens, window, whole_words, start_beam, on_token,
          passage_scores) -> list[_Row]:
    """Every question's rows in rank order (one per start of its start beam); `_Row.index` is its question."""
    scores = passage_scores if passage_scores is not None else [None] * len(questions)
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    for prompt in prompts:
        check_fits(len(prompt), max_new_tokens, window)
    rows = []
    for number, (prompt, shards) in enumerate(zip(prompts, passages, strict=True)):
        memory, owner, position = shared_memory(shards)
        continues = inside_word(tokenizer, memory.ids[0]) if memory is not None and whole_words else None
        memory_ids = [] if memory is None else memory.ids[0].tolist()
        listener = None if on_token is None else (
            lambda token, source, number=number: on_token(number, token, source))
        for rank in range(start_beam if shards else 1):  # without passages the first token is greedy's
            rows.append(_Row(number, prompt, shards, continues, memory_ids, Trace(owner, position, listener=listener),
                             rank=rank, passage_scores=scores[number]))
    return rows


def _generation(tokenizer, question: str, beam: list[_Row], reranker: StartReranker | None) -> Generation:
    """A question's generation from its rows (one per start, greedy's first), as `generate` reports it."""
    greedy = beam[0]
    generation = Generation(answer="", token_ids=[], sources=[], prompt_tokens=len(greedy.prompt),
                            confidence=greedy.confidence, no_answer=greedy.no_answer,
                            stop_probability=greedy.stop_probability)
    if greedy.no_answer:  # every row of the question abstained with it: the same first step
        return generation
    alternatives = [row.trace.alternative(tokenizer) for row in beam]
    best = choose_alternative(question, alternatives, reranker, greedy.prior, greedy.trace.owner)
    generation.answer, generation.token_ids, generation.sources = best.answer, best.token_ids, best.sources
    generation.alternatives = alternatives
    generation.citations = citations(generation, greedy.passages) if greedy.passages else []
    return generation


@dataclass
class _Running:
    """The rows being decoded together: their running context, memory, next positions and question numbers.
    Every row's kept positions sit contiguous at the right of its context (masked columns to their left)."""

    context: ContextState
    memory: CopyMemory | None
    sizes: list[int]  # each row's memory entries (the rest of the padded memory is masked)
    next_position: torch.Tensor  # (B, 1)
    live: list[int]  # the row of `_Setup.rows` each batch row decodes
    # (B, 1) each row's last positions that the last pass did not keep (rejected drafts, padding), still in the
    # context: rolled out by `settled` only before a pass reads it, so rows that finished are never rolled
    unused: torch.Tensor | None = None

    def settled(self) -> _Running:
        """The rows with their unused positions rolled to the front and masked (`drop_unused`)."""
        if self.unused is not None:
            self.context, self.unused = drop_unused(self.context, self.unused), None
        return self

    def select(self, keep: list[int]) -> _Running:
        """Only the rows `keep` (their order kept)."""
        context, memory, next_position = select_rows(self.context, self.memory, self.next_position, keep)
        unused = None if self.unused is None else self.unused[torch.tensor(keep, device=self.unused.device)]
        return _Running(context, memory, [self.sizes[j] for j in keep], next_position, [self.live[j] for j in keep],
                        unused)

    def joined(self, other: _Running) -> _Running:
        """This batch's rows, then `other`'s: contexts left padded (masked) to one width, memories right padded."""
        self.settled()
        other.settled()
        width = max(self.context.length, other.context.length)
        a, b = left_padded(self.context, width), left_padded(other.context, width)
        context = ContextState(keys=torch.cat([a.keys, b.keys]), ids=torch.cat([a.ids, b.ids]),
                               mask=torch.cat([a.mask, b.mask]), cache=a.cache)
        for layer, extra in zip(a.cache.layers, b.cache.layers, strict=True):
            layer.keys, layer.values = torch.cat([layer.keys, extra.keys]), torch.cat([layer.values, extra.values])
        memory = joined_memory(self.memory, other.memory, len(self.live), len(other.live))
        return _Running(context, memory, self.sizes + other.sizes,
                        torch.cat([self.next_position, other.next_position]), self.live + other.live)

    def memory_ids(self, j: int) -> torch.Tensor | None:
        """Batch row j's memory as the step helpers read it: (M,) ids padded to the batch's memory (the padding is
        masked, so it never wins), or None when the row has no passages."""
        return _memory_ids(self.memory, self.sizes, j)


def _memory_ids(memory: CopyMemory | None, sizes: list[int], j: int) -> torch.Tensor | None:
    return None if memory is None or sizes[j] == 0 else memory.ids[j]


def _start(setup: _Setup, numbers: list[int]) -> _Running:
    """Run the prompts of rows `numbers` (one pass) and choose each one's first token.

    A question's start-beam rows have the same prompt and memory, so its first step is the same for all of
    them: the pass runs once per question, and its cache, memory and step are copied to the other rows."""
    shared: dict[int, int] = {}  # question -> the place of its first row among the rows whose prompt runs
    firsts, source = [], []  # those rows; each row's place among them
    for n in numbers:
        if setup.rows[n].index not in shared:
            shared[setup.rows[n].index] = len(firsts)
            firsts.append(n)
        source.append(shared[setup.rows[n].index])
    rows, device = [setup.rows[n] for n in firsts], setup.device
    memory, sizes = batch_memory(setup.model, setup.tokenizer, [setup.questions[n] for n in firsts],
                                 [row.passages for row in rows], rows, device, setup.passage_prior)
    out, next_position, unused = _prompt_pass(setup, rows, memory)
    for row, i in zip([setup.rows[n] for n in numbers], source, strict=True):
        row.prior = rows[i].prior
        _first_token(setup, row, _row_step(out, i, -1), _memory_ids(memory, sizes, i), out.context.ids[i])
    context = out.context
    if len(rows) < len(numbers):  # every row its own copy of its question's state, to decode on from
        context, memory, next_position = select_rows(context, memory, next_position, source)
        unused = None if unused is None else unused[torch.tensor(source, device=device)]
    return _Running(context, memory, [sizes[i] for i in source], next_position, list(numbers), unused)


def _prompt_pass(setup: _Setup, rows: list[_Row], memory: CopyMemory | None):
    """One pass over the rows' prompts: (outputs, next positions (B, 1), unused positions (B, 1) or None)."""
    batch, device, prefix = len(rows), setup.device, setup.prefix
    if prefix is not None and all(prefix.fits(row.prompt) for row in rows):
        # the fixed beginning from its cache, then each row's own tokens, right padded (rolled left later)
        own = [row.prompt[prefix.length :] for row in rows]
        width = max(len(o) for o in own)
        ids = torch.zeros((batch, width), dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, tokens in enumerate(own):
            ids[i, : len(tokens)] = torch.tensor(tokens)
            attention[i, : len(tokens)] = 1
        ids, attention = ids.to(device), attention.to(device)
        lengths = torch.tensor([[len(o)] for o in own], device=device)  # (B, 1)
        positions = prefix.length + torch.arange(width, device=device).expand(batch, -1)
        out = setup.model(ids, attention, memory=memory, context=prefix.context(batch), use_cache=True,
                          position_ids=positions, query_positions=prefix.length + lengths - 1)
        return out, prefix.length + lengths, width - lengths
    # left-padded prompts: every row's last prompt token sits in the last column
    width = max(len(row.prompt) for row in rows)
    ids = torch.zeros((batch, width), dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)
        attention[i, width - len(row.prompt):] = 1
    ids, attention = ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # each row's own positions, from 0
    last = torch.full((batch, 1), width - 1, device=device)
    out = setup.model(ids, attention, memory=memory, use_cache=True, position_ids=positions, query_positions=last)
    return out, positions[:, -1:] + 1, None


def _first_token(setup: _Setup, row: _Row, step: Step, memory_ids: torch.Tensor | None,
                 context_ids: torch.Tensor) -> None:
    """The row's first token, as `generate` chooses it: with passages never the end, withheld below
    `min_confidence`, and the row's rank-th start of the start beam."""
    stop = setup.stop
    if memory_ids is None:  # no passages: the first token may be the end, as in `generate`
        _choose(row, step, None, stop, setup.max_new_tokens, greedy_tokens(step.log_probs, stop, setup.end_bias))
        return
    # an answer from the passages, or none at all: never an empty one
    row.stop_probability = stop_probability(step, stop)
    step = without_stops(step, stop, step_entry_ids(setup.model, memory_ids, context_ids,
                                                    step.copy_log_attention.shape[0]))
    token = greedy_tokens(step.log_probs, stop, setup.end_bias)
    row.confidence = first_token_confidence(step, memory_ids, token)
    if row.confidence < setup.min_confidence:
        row.no_answer = row.done = True
        return
    if row.rank:  # the rank-th of the next most probable first tokens, as `generate`'s start beam takes them
        token = start_tokens(step, token, setup.start_beam)[row.rank]
    row.trace.emit(token, copied_source(step, token, memory_ids), step)
    row.done = len(row.trace.tokens) >= setup.max_new_tokens


def _step(setup: _Setup, running: _Running, draft_tokens: int) -> None:
    """One pass for every row of `running`: its last token, then (while copying) the entries that follow it in
    its passage, checked against greedy choices; `running` moves on by what each row kept."""
    rows, device, max_new_tokens = setup.rows, setup.device, setup.max_new_tokens
    live = running.live
    drafts = [successor_entries(rows[i].trace.entry, rows[i].trace.owner,
                                min(draft_tokens, max_new_tokens - len(rows[i].trace.tokens))) for i in live]
    width = 1 + max(len(d) for d in drafts)
    feed = torch.zeros((len(live), width), dtype=torch.long)
    fed = torch.zeros((len(live), width), dtype=torch.long)
    previous = torch.full((len(live), width), -1, dtype=torch.long)  # the successor bias sees each source
    for j, (i, draft) in enumerate(zip(live, drafts, strict=True)):
        row = rows[i]
        feed[j, : 1 + len(draft)] = torch.tensor([row.trace.tokens[-1]] + [row.memory_ids[e] for e in draft])
        fed[j, : 1 + len(draft)] = 1
        previous[j, : 1 + len(draft)] = torch.tensor([-1 if row.trace.entry is None else row.trace.entry] + draft)
    feed, fed, previous = feed.to(device), fed.to(device), previous.to(device)
    running.settled()
    out = setup.model(feed, fed, memory=running.memory, context=running.context, use_cache=True,
                      prev_source=previous, position_ids=running.next_position + torch.arange(width, device=device))
    greedy = greedy_tokens(out.log_probs, setup.stop, setup.end_bias)  # (B, T)
    used = []
    for j, (i, draft) in enumerate(zip(live, drafts, strict=True)):
        memory_ids = running.memory_ids(j)
        kept = _keep_draft(rows[i], draft, out, j, memory_ids, setup.stop, greedy[j])
        _choose(rows[i], _row_step(out, j, kept), memory_ids, setup.stop, max_new_tokens, greedy[j][kept])
        used.append(1 + kept)
    used = torch.tensor(used, device=device).unsqueeze(1)  # (B, 1) positions each row keeps
    running.context, running.next_position = out.context, running.next_position + used
    running.unused = width - used


def _row_step(out, i: int, position: int) -> Step:
    return Step(out.log_probs[i, position], out.log_gate[i, position], out.copy_log_attention[i, position])


def _keep_draft(row: _Row, draft: list[int], out, j: int, memory_ids: torch.Tensor | None, stop: set[int],
                greedy: list[int]) -> int:
    """How many of the row's drafted entries greedy decoding would have copied, one by one: each is emitted.
    `greedy[t]`: the row's greedy token at position t of the pass (`greedy_tokens`)."""
    kept = 0
    for drafted in draft:
        step = _row_step(out, j, kept)
        if not row.goes_on(drafted):  # a word's continuation is copied anyway
            guess = greedy[kept]
            if guess != row.memory_ids[drafted] or guess in stop or copied_source(step, guess, memory_ids) != drafted:
                break
        row.trace.emit(row.memory_ids[drafted], drafted, step)
        kept += 1
    return kept


def _choose(row: _Row, step: Step, memory_ids: torch.Tensor | None, stop: set[int], max_new_tokens: int,
            greedy: int) -> None:
    """The row's next token at `step`: a forced word continuation, the end, or `greedy`, the mixture's best token
    as greedy decoding weighs it (`greedy_tokens`)."""
    trace = row.trace
    if len(trace.tokens) >= max_new_tokens:
        row.done = True
        return
    if trace.entry is not None and row.goes_on(trace.entry + 1):
        entry = trace.entry + 1
        trace.emit(int(memory_ids[entry]), entry, step)
    else:
        if greedy in stop:
            trace.end(greedy, step)
            row.done = True
            return
        trace.emit(greedy, copied_source(step, greedy, memory_ids), step)
    if len(trace.tokens) >= max_new_tokens:
        row.done = True
