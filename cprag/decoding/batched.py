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
rather than B passes each. A model with a query refiner (whose window would read the padding) is decoded one
question at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from cprag.decoding.generate import (
    Alternative,
    Generation,
    Step,
    citations,
    copied_source,
    first_token_confidence,
    generate,
    lexical_prior,
    shared_memory,
    span_candidates,
    step_entry_ids,
    without_stops,
)
from cprag.decoding.passage_prior import passage_bias
from cprag.decoding.prompt import end_of_turn_id, prompt_ids
from cprag.decoding.prompt_prefix import PromptPrefix
from cprag.decoding.rerank import StartReranker
from cprag.decoding.step import successor_entries
from cprag.errors import QuestionTooLong
from cprag.index.key_cache import DevicePassage
from cprag.model.copy_head import ContextState, CopyMemory
from cprag.model.lexical import inside_word


@dataclass
class _Row:
    """One question's decoding state."""

    index: int  # the question's place in the batch
    prompt: list[int]
    passages: list[DevicePassage]
    owner: torch.Tensor  # (M_i,) passage index of each entry
    position: torch.Tensor  # (M_i,) token position of each entry in its passage
    continues: torch.Tensor | None  # (M_i,) entry m continues entry m - 1's word
    memory_ids: list[int]  # (M_i,) the token each entry pastes
    tokens: list[int]
    sources: list[tuple[int, int] | None]
    log_probs: list[float]
    entries: list[int | None]
    end_log_prob: float = 0.0
    entry: int | None = None  # the entry the last token was copied from
    confidence: float | None = None
    stop_probability: float | None = None
    no_answer: bool = False
    done: bool = False
    rank: int = 0  # the start beam's rank of the first token this row starts from (0: the greedy one)
    prior: torch.Tensor | None = None  # (M_i, F) lexical features of the entries (what the reranker reads)
    on_token: Callable[[int, int, tuple[int, int] | None], None] | None = None
    passage_scores: Sequence[float] | None = None  # the retriever's score of each passage (the passage prior)


def batch_supported(model, mode: str) -> bool:
    """Whether `generate_batch` decodes this model and mode (otherwise questions go one at a time)."""
    return mode == "hidden" and model.cp_head.query_refiner is None


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
    scores = passage_scores if passage_scores is not None else [None] * len(questions)
    alone = len(questions) == 1 and on_token is None and cancelled is None and (start_beam == 1 or not passages[0])
    if not batch_supported(model, mode) or alone:
        return [generate(model, tokenizer, q, p, mode, max_new_tokens, whole_words=whole_words,
                         min_confidence=min_confidence, draft_tokens=draft_tokens, prefix=prefix,
                         passage_scores=s, passage_prior=passage_prior, end_bias=end_bias, start_beam=start_beam,
                         reranker=reranker)
                for q, p, s in zip(questions, passages, scores, strict=True)]
    window = model.config.max_position_embeddings
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    for prompt in prompts:
        if len(prompt) + max_new_tokens > window:
            raise QuestionTooLong(len(prompt) + max_new_tokens, window)
    device = next(model.parameters()).device
    rows = []  # question i's rows in rank order; rows[n].index is the question row n answers
    for number, (prompt, shards) in enumerate(zip(prompts, passages, strict=True)):
        memory, owner, position = shared_memory(shards)
        continues = inside_word(tokenizer, memory.ids[0]) if memory is not None and whole_words else None
        memory_ids = [] if memory is None else memory.ids[0].tolist()
        for rank in range(start_beam if shards else 1):  # without passages the first token is greedy's
            rows.append(_Row(number, prompt, shards, owner, position, continues, memory_ids, [], [], [], [],
                             rank=rank, on_token=on_token, passage_scores=scores[number]))
    stop = {end_of_turn_id(tokenizer), tokenizer.eos_token_id}
    setup = SimpleNamespace(model=model, tokenizer=tokenizer, questions=[questions[row.index] for row in rows],
                            rows=rows, prefix=prefix, start_beam=start_beam,
                            device=device, stop=stop, min_confidence=min_confidence, max_new_tokens=max_new_tokens,
                            passage_prior=passage_prior,
                            end_bias=model.config.end_bias if end_bias is None else end_bias)
    max_rows = len(rows) if max_rows is None else max_rows
    waiting, running = list(range(len(rows))), None  # questions not yet started; the batch being decoded
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


def _generation(tokenizer, question: str, beam: list[_Row], reranker: StartReranker | None) -> Generation:
    """A question's generation from its rows (one per start, greedy's first), as `generate` reports it."""
    greedy = beam[0]
    generation = Generation(answer="", token_ids=[], sources=[], prompt_tokens=len(greedy.prompt),
                            confidence=greedy.confidence, no_answer=greedy.no_answer,
                            stop_probability=greedy.stop_probability)
    if greedy.no_answer:  # every row of the question abstained with it: the same first step
        return generation
    alternatives = [Alternative(tokenizer.decode(row.tokens, skip_special_tokens=True).strip(), row.tokens,
                                row.sources, sum(row.log_probs) + row.end_log_prob, row.log_probs, row.entries)
                    for row in beam]
    best = alternatives[0]
    if len(alternatives) > 1 and reranker is not None:
        best = alternatives[reranker.choose(question, span_candidates(alternatives, greedy.prior, greedy.owner))]
    elif len(alternatives) > 1:
        best = max(alternatives, key=lambda a: a.score())
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
    live: list[int]  # the question each row decodes
    # (B, 1) each row's last positions that the last pass did not keep (rejected drafts, padding), still in the
    # context: rolled out by `settled` only before a pass reads it, so rows that finished are never rolled
    unused: torch.Tensor | None = None

    def settled(self) -> _Running:
        """The rows with their unused positions rolled to the front and masked (`_drop_unused`)."""
        if self.unused is not None:
            self.context, self.unused = _drop_unused(self.context, self.unused), None
        return self

    def select(self, keep: list[int]) -> _Running:
        """Only the rows `keep` (their order kept)."""
        context, memory, next_position = _select(self.context, self.memory, self.next_position, keep)
        unused = None if self.unused is None else self.unused[torch.tensor(keep, device=self.unused.device)]
        return _Running(context, memory, [self.sizes[j] for j in keep], next_position, [self.live[j] for j in keep],
                        unused)

    def joined(self, other: _Running) -> _Running:
        """This batch's rows, then `other`'s: contexts left padded (masked) to one width, memories right padded."""
        self.settled()
        other.settled()
        width = max(self.context.length, other.context.length)
        a, b = _left_padded(self.context, width), _left_padded(other.context, width)
        context = ContextState(keys=torch.cat([a.keys, b.keys]), ids=torch.cat([a.ids, b.ids]),
                               mask=torch.cat([a.mask, b.mask]), cache=a.cache)
        for layer, extra in zip(a.cache.layers, b.cache.layers, strict=True):
            layer.keys, layer.values = torch.cat([layer.keys, extra.keys]), torch.cat([layer.values, extra.values])
        memory = _joined_memory(self.memory, other.memory, len(self.live), len(other.live))
        return _Running(context, memory, self.sizes + other.sizes,
                        torch.cat([self.next_position, other.next_position]), self.live + other.live)


def _start(setup, numbers: list[int]) -> _Running:
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
    rows, device, prefix = [setup.rows[n] for n in firsts], setup.device, setup.prefix
    memory, sizes = _batch_memory(setup.model, setup.tokenizer, [setup.questions[n] for n in firsts],
                                  [row.passages for row in rows], rows, device, setup.passage_prior)
    batch, unused = len(rows), None
    if prefix is not None and all(prefix.fits(row.prompt) for row in rows):
        # the fixed beginning from its cache, then each row's own tokens, right padded (rolled left below)
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
        unused, next_position = width - lengths, prefix.length + lengths
    else:
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
        out = setup.model(ids, attention, memory=memory, use_cache=True, position_ids=positions,
                          query_positions=last)
        next_position = positions[:, -1:] + 1
    stop, max_new_tokens = setup.stop, setup.max_new_tokens
    for row, i in zip([setup.rows[n] for n in numbers], source, strict=True):
        row.prior = rows[i].prior
        step, view = _row_step(out, i, -1), _row_memory(memory, sizes, i)
        if view is None:  # no passages: the first token may be the end, as in `generate`
            _choose(row, step, None, stop, max_new_tokens, _greedy_tokens(step.log_probs, stop, setup.end_bias))
            continue
        # an answer from the passages, or none at all: never an empty one
        row.stop_probability = float(step.log_probs[sorted(stop)].exp().sum())
        entry_ids = step_entry_ids(setup.model, view, SimpleNamespace(ids=out.context.ids[i : i + 1]),
                                   step.copy_log_attention.shape[0])
        step = without_stops(step, stop, entry_ids)
        token = int(step.log_probs.argmax())
        row.confidence = first_token_confidence(step, view, token)
        if row.confidence < setup.min_confidence:
            row.no_answer = row.done = True
            continue
        if row.rank:  # the rank-th of the next most probable first tokens, as `generate`'s start beam takes them
            others = [int(t) for t in step.log_probs.topk(setup.start_beam + 1).indices if int(t) != token]
            token = others[row.rank - 1]
        _emit(row, token, copied_source(step, token, view), step)
        row.done = len(row.tokens) >= max_new_tokens
    context = out.context
    if len(rows) < len(numbers):  # every row its own copy of its question's state, to decode on from
        context, memory, next_position = _select(context, memory, next_position, source)
        unused = None if unused is None else unused[torch.tensor(source, device=device)]
    return _Running(context, memory, [sizes[i] for i in source], next_position, list(numbers), unused)


def _step(setup, running: _Running, draft_tokens: int) -> None:
    """One pass for every row of `running`: its last token, then (while copying) the entries that follow it in
    its passage, checked against greedy choices; `running` moves on by what each row kept."""
    rows, device, max_new_tokens = setup.rows, setup.device, setup.max_new_tokens
    live = running.live
    drafts = [successor_entries(rows[i].entry, rows[i].owner,
                                min(draft_tokens, max_new_tokens - len(rows[i].tokens))) for i in live]
    width = 1 + max(len(d) for d in drafts)
    feed = torch.zeros((len(live), width), dtype=torch.long)
    fed = torch.zeros((len(live), width), dtype=torch.long)
    previous = torch.full((len(live), width), -1, dtype=torch.long)  # the successor bias sees each source
    for j, (i, draft) in enumerate(zip(live, drafts, strict=True)):
        row = rows[i]
        feed[j, : 1 + len(draft)] = torch.tensor([row.tokens[-1]] + [row.memory_ids[e] for e in draft])
        fed[j, : 1 + len(draft)] = 1
        previous[j, : 1 + len(draft)] = torch.tensor([-1 if row.entry is None else row.entry] + draft)
    feed, fed, previous = feed.to(device), fed.to(device), previous.to(device)
    running.settled()
    out = setup.model(feed, fed, memory=running.memory, context=running.context, use_cache=True,
                      prev_source=previous, position_ids=running.next_position + torch.arange(width, device=device))
    greedy = _greedy_tokens(out.log_probs, setup.stop, setup.end_bias)  # (B, T)
    used = []
    for j, (i, draft) in enumerate(zip(live, drafts, strict=True)):
        view = _row_memory(running.memory, running.sizes, j)
        kept = _keep_draft(rows[i], draft, out, j, view, setup.stop, greedy[j])
        _choose(rows[i], _row_step(out, j, kept), view, setup.stop, max_new_tokens, greedy[j][kept])
        used.append(1 + kept)
    used = torch.tensor(used, device=device).unsqueeze(1)  # (B, 1) positions each row keeps
    running.context, running.next_position = out.context, running.next_position + used
    running.unused = width - used


def _left_padded(context: ContextState, width: int) -> ContextState:
    """The context with masked columns added on the left up to `width` (its cache padded the same way)."""
    extra = width - context.length
    if extra == 0:
        return context
    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.new_zeros((t.shape[0], extra, *t.shape[2:])), t], dim=1)

    for layer in context.cache.layers:  # (B, heads, T, head dim)
        zeros = layer.keys.new_zeros((layer.keys.shape[0], layer.keys.shape[1], extra, layer.keys.shape[3]))
        layer.keys, layer.values = torch.cat([zeros, layer.keys], 2), torch.cat([zeros, layer.values], 2)
    return ContextState(keys=pad(context.keys), ids=pad(context.ids), mask=pad(context.mask), cache=context.cache)


def _joined_memory(a: CopyMemory | None, b: CopyMemory | None, rows_a: int, rows_b: int) -> CopyMemory | None:
    """Two batches' memories (of `rows_a` and `rows_b` rows), one after the other, right padded (masked) to the
    larger size."""
    if a is None and b is None:
        return None
    size = max(m.size for m in (a, b) if m is not None)

    def padded(memory: CopyMemory | None, batch: int, field: str, like: torch.Tensor):
        value = None if memory is None else getattr(memory, field)
        if value is None:  # rows without passages (every entry masked), or without this field (a bias of 0)
            return like.new_zeros((batch, size, *like.shape[2:]))
        return torch.cat([value, value.new_zeros((value.shape[0], size - value.shape[1], *value.shape[2:]))], 1)

    fields = {}
    for field in ("keys", "ids", "mask", "prior", "end_allowed", "bias"):
        like = next((getattr(m, field) for m in (a, b) if m is not None and getattr(m, field) is not None), None)
        if like is not None:
            fields[field] = torch.cat([padded(a, rows_a, field, like), padded(b, rows_b, field, like)])
    return CopyMemory(**fields)


def _batch_memory(model, tokenizer, questions, passages, rows: list[_Row], device, passage_prior: float = 0.0
                  ) -> tuple[CopyMemory | None, list[int]]:
    """(B, M, ...) memory: each row's passages, padded to the longest row and masked; and each row's size."""
    sizes = [sum(len(p.ids) for p in shards) for shards in passages]
    if not any(sizes):
        return None, sizes
    size, batch = max(sizes), len(rows)
    first = next(p for shards in passages for p in shards)
    keys = torch.zeros((batch, size, first.keys.shape[-1]), dtype=model.head_dtype, device=device)
    ids = torch.zeros((batch, size), dtype=torch.long, device=device)
    mask = torch.zeros((batch, size), dtype=torch.bool, device=device)
    end_allowed = torch.zeros((batch, size), dtype=torch.bool, device=device)
    prior, bias = None, None
    computed: dict[int, torch.Tensor | None] = {}  # a question's lexical features, shared by its start-beam rows
    for i, (question, shards, row) in enumerate(zip(questions, passages, rows, strict=True)):
        if not shards:
            continue
        n = sizes[i]
        keys[i, :n] = torch.cat([p.keys for p in shards])
        ids[i, :n] = torch.cat([p.ids for p in shards])
        mask[i, :n] = True
        end_allowed[i, :n] = True if row.continues is None else ~row.continues.to(device)
        if row.index not in computed:
            computed[row.index] = lexical_prior(model, tokenizer, question, ids[i, :n])
        features = computed[row.index]
        row.prior = None if features is None else features[0]
        if features is not None:
            if prior is None:
                prior = torch.zeros((batch, size, features.shape[-1]), dtype=features.dtype, device=device)
            prior[i, :n] = features[0]
        row_bias = passage_bias(row.passage_scores, [len(p.ids) for p in shards], passage_prior, device, keys.dtype)
        if row_bias is not None:
            if bias is None:
                bias = torch.zeros((batch, size), dtype=row_bias.dtype, device=device)
            bias[i, :n] = row_bias[0]
    return CopyMemory(keys=keys, ids=ids, mask=mask, prior=prior, end_allowed=end_allowed, bias=bias), sizes


def _select(context, memory: CopyMemory | None, next_position: torch.Tensor, keep: list[int]):
    """The batch's running context, memory and next positions with only the rows `keep` (their order kept)."""
    index = torch.tensor(keep, device=next_position.device)
    context.cache.batch_select_indices(index)
    context.keys, context.ids, context.mask = (t[index] for t in (context.keys, context.ids, context.mask))
    if context.refine is not None:
        context.refine = context.refine[index]
    if context.copyable is not None:
        context.copyable = context.copyable[index]
    if memory is not None:
        memory = CopyMemory(keys=memory.keys[index], ids=memory.ids[index], mask=memory.mask[index],
                            prior=None if memory.prior is None else memory.prior[index],
                            end_allowed=None if memory.end_allowed is None else memory.end_allowed[index],
                            bias=None if memory.bias is None else memory.bias[index])
    return context, memory, next_position[index]


def _row_memory(memory: CopyMemory | None, sizes: list[int], i: int):
    """Row i's memory as the single-question helpers read it: (1, M) ids and the padded size (padding entries
    are masked, so they never win), or None when the row has no passages."""
    if memory is None or sizes[i] == 0:
        return None
    return SimpleNamespace(ids=memory.ids[i : i + 1], size=memory.size)


def _row_step(out, i: int, position: int) -> Step:
    return Step(out.log_probs[i, position], out.log_gate[i, position], out.copy_log_attention[i, position])


def _greedy_tokens(log_probs: torch.Tensor, stop: set[int], end_bias: float):
    """The token greedy decoding picks from log_probs (..., V) at every row and position, in one argmax, weighed as
    `with_end_bias` weighs one step (the bias added to the stop tokens): nested lists (...) of token ids."""
    if end_bias != 0 and stop:
        barred = torch.tensor(sorted(stop), device=log_probs.device)
        log_probs = log_probs.index_add(-1, barred, log_probs.new_full((*log_probs.shape[:-1], len(barred)), end_bias))
    return log_probs.argmax(-1).tolist()


def _keep_draft(row: _Row, draft: list[int], out, j: int, view, stop: set[int], greedy: list[int]) -> int:
    """How many of the row's drafted entries greedy decoding would have copied, one by one: each is emitted.
    `greedy[t]`: the row's greedy token at position t of the pass (`_greedy_tokens`)."""
    kept = 0
    for drafted in draft:
        step = _row_step(out, j, kept)
        if not _word_goes_on(row, drafted):  # a word's continuation is copied anyway
            guess = greedy[kept]
            if guess != row.memory_ids[drafted] or guess in stop or copied_source(step, guess, view) != drafted:
                break
        _emit(row, row.memory_ids[drafted], drafted, step)
        kept += 1
    return kept


def _drop_unused(context, unused: torch.Tensor):
    """Each row's last `unused` (B, 1) positions (rejected drafts, padding) rolled to the front and masked.

    Positions are baked into the cached keys (rotary) and passed explicitly, so a column's place only matters
    for what is masked: the kept positions stay contiguous at the right of every row."""
    if not bool(unused.any()):
        return context
    length = context.mask.shape[1]
    columns = torch.arange(length, device=unused.device).unsqueeze(0)  # (1, T)
    source = (columns - unused) % length  # (B, T): column t takes what stood at t - unused
    context.keys = _moved_columns(context.keys, source)
    context.ids = context.ids.gather(1, source)
    context.mask = context.mask.gather(1, source) & (columns >= unused)
    if context.refine is not None:
        context.refine = _moved_columns(context.refine, source)
    if context.copyable is not None:
        context.copyable = context.copyable.gather(1, source)
    rows = None  # (B * heads * T,) the cache row each new row is copied from: the same for every layer
    for layer in context.cache.layers:
        batch, heads, _, dim = layer.keys.shape  # (B, heads, T, head dim)
        if rows is None:
            rows = (torch.arange(batch * heads, device=source.device).view(batch, heads, 1) * length
                    + source.unsqueeze(1)).reshape(-1)
        layer.keys, layer.values = (t.reshape(-1, dim).index_select(0, rows).view(batch, heads, length, dim)
                                    for t in (layer.keys, layer.values))
    return context


def _moved_columns(values: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """values (B, T, D) with column t of row b taken from column source[b, t]: whole D-vectors copied by one
    `index_select`, about 13 times as fast as an element-wise `gather` at a batch's cache sizes."""
    batch, length, dim = values.shape
    rows = (torch.arange(batch, device=source.device).unsqueeze(1) * length + source).reshape(-1)
    return values.reshape(-1, dim).index_select(0, rows).view(batch, length, dim)


def _word_goes_on(row: _Row, entry: int | None) -> bool:
    """Entry `entry` finishes the word its predecessor's copy started (so it must be copied next)."""
    return (row.continues is not None and entry is not None and 0 < entry < len(row.continues)
            and bool(row.continues[entry]) and row.owner[entry] == row.owner[entry - 1])


def _choose(row: _Row, step: Step, view, stop: set[int], max_new_tokens: int, greedy: int) -> None:
    """The row's next token at `step`: a forced word continuation, the end, or `greedy`, the mixture's best token
    as greedy decoding weighs it (`_greedy_tokens`)."""
    if len(row.tokens) >= max_new_tokens:
        row.done = True
        return
    if row.entry is not None and _word_goes_on(row, row.entry + 1):
        entry = row.entry + 1
        _emit(row, int(view.ids[0, entry]), entry, step)
    else:
        token = greedy
        if token in stop:
            row.end_log_prob = float(step.log_probs[token])
            row.done = True
            return
        _emit(row, token, copied_source(step, token, view), step)
    if len(row.tokens) >= max_new_tokens:
        row.done = True


def _emit(row: _Row, token: int, entry: int | None, step: Step) -> None:
    row.log_probs.append(float(step.log_probs[token]))
    row.tokens.append(token)
    row.entries.append(entry)
    row.sources.append(None if entry is None else (int(row.owner[entry]), int(row.position[entry])))
    row.entry = entry
    if row.on_token is not None:
        row.on_token(row.index, token, row.sources[-1])
