"""Training batches: which passages each question sees, its targets, and the lexical features of its memory.

Hidden form: a batch of questions shares one set of passages (their gold passages plus same-article extras), each
question attending only to its own gold passage and `distractors` others, so every passage's keys are computed once
per batch. A no-answer question sees `distractors + 1` passages without its gold one, or (`in_passage`) its gold
passage with the answer's sentences hidden plus `distractors` others: the passages are about the question but do not
hold its answer, as a SQuAD 2.0 unanswerable question is written. A rewritten question (`TrainQuestion.impossible`,
cprag.training.negatives) sees its whole gold passage plus `distractors` others: the question no longer matches it.
Every
kind's target is to stop at once with the copy mass on the sink (see cprag.training.train). Visible form: one question
at a
time, its passages in the prompt (`visible_prompt_layout`), as visible decoding builds it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

import torch

from cprag.decoding.prompt import visible_prompt_layout
from cprag.evaluation.squad import article_of
from cprag.model.lexical import (
    TOKEN_TYPES,
    entry_token_types,
    lexical_features,
    question_type,
    question_words,
    sentence_ids,
    word_ids,
)
from cprag.training.examples import PassageTokens, TrainQuestion


@dataclass
class Batch:
    question_keys: list[str]  # activation-cache keys (q/<qid>)
    lengths: list[int]  # positions of each question sequence that the batch uses
    input_ids: torch.Tensor  # (B, L) prompt + answer tokens
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, Q) answer tokens then the end (the end alone for no-answer), -100 on padding
    weights: torch.Tensor  # (B, Q)
    prev_source: torch.Tensor  # (B, Q) memory entry of the previous answer token, -1 for the first
    gold_entries: torch.Tensor  # (B, Q) the external entry each target is copied from (end: its twin), -1: none
    query_positions: torch.Tensor  # (B, Q) positions that predict the targets
    no_answer: torch.Tensor  # (B,) bool: the memory lacks the gold passage or its answer's sentences, or the
    # question was rewritten so that its passage does not answer it
    passage_keys: list[str]  # (N) the batch's distinct passages (p/<pid>)
    memory_ids: torch.Tensor  # (N, Tp) [BOS, t_1 .. t_n], right padded
    memory_mask: torch.Tensor  # (N, Tp) bool
    question_memory_mask: torch.Tensor  # (B, N * Tp) the entries each question may attend
    prior: torch.Tensor | None = None  # (B, N * Tp, F) lexical features of the entries for each question
    # the split reader's start distribution (cprag.training.distill): (B, K) entries, -1 where none, and (B, K)
    # their probabilities
    start_entries: torch.Tensor | None = None
    start_probs: torch.Tensor | None = None


def on_device(example, device: torch.device):
    """A batch (or visible example) with every tensor on `device`: built on the CPU, trained wherever the model is."""
    moved = {f.name: getattr(example, f.name).to(device) for f in fields(example)
             if isinstance(getattr(example, f.name), torch.Tensor) and getattr(example, f.name).device != device}
    return replace(example, **moved) if moved else example


def pad(tensors: list[torch.Tensor], value=0) -> torch.Tensor:
    width = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), width, *tensors[0].shape[1:]), value, dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out


def distractor_pool(questions: list[TrainQuestion], passages: dict[str, PassageTokens], minimum: int,
                    rng: random.Random) -> dict[str, list[str]]:
    """For each gold passage, the other passages of its article (the hard distractors), topped up with random
    passages when the article has fewer than `minimum`."""
    by_article: dict[str, list[str]] = {}
    for pid in passages:
        by_article.setdefault(article_of(pid), []).append(pid)
    everything = sorted(passages)
    pool = {}
    for q in questions:
        same = [p for p in by_article[q.article] if p != q.passage_id]
        if len(same) < minimum:
            extra = rng.sample(everything, min(len(everything), minimum + len(same) + 1))
            same += [p for p in extra if p != q.passage_id and p not in same][: minimum - len(same)]
        pool[q.passage_id] = same
    return pool


def make_batch(questions: list[TrainQuestion], prompts: dict[str, list[int]], passages: dict[str, PassageTokens],
               pool: dict[str, list[str]], distractors: int, bos_id: int, rng: random.Random, no_answer: list[bool],
               end_weight: float = 1.0, lexicon: Lexicon | None = None, end_twins: bool = True,
               in_passage: list[bool] | None = None, sentences: dict[str, torch.Tensor] | None = None) -> Batch:
    """Collate questions over one shared set of passages (see the module docstring). `end_twins`: the model has
    "end here" entries, so the end of an answer is copied from a known entry too. `in_passage[i]` (with
    `no_answer[i]`, and `sentences`: each passage's sentence number per token) hides only question i's answer
    sentences; where the answer's tokens also occur in the rest of its passage, question i falls back to
    distractors alone (the rest would answer it)."""
    in_passage = in_passage or [False] * len(questions)
    golds = list(dict.fromkeys(q.passage_id for q in questions))
    extras = list(dict.fromkeys(p for q in questions for p in pool[q.passage_id] if p not in golds))
    rng.shuffle(extras)
    memory = golds + extras[: max(0, distractors + 2 - len(golds)) + 2]
    rng.shuffle(memory)
    slot = {pid: i for i, pid in enumerate(memory)}
    width = max(len(passages[p].ids) + 1 for p in memory)
    passage_mask = pad([torch.ones(len(passages[p].ids) + 1, dtype=torch.bool) for p in memory])

    b, width_q = len(questions), max(len(q.targets) for q in questions)
    targets = torch.full((b, width_q), -100, dtype=torch.long)
    weights = torch.zeros((b, width_q))
    prev = torch.full((b, width_q), -1, dtype=torch.long)
    gold = torch.full((b, width_q), -1, dtype=torch.long)
    query_positions = torch.zeros((b, width_q), dtype=torch.long)
    visible = torch.zeros((b, len(memory), width), dtype=torch.bool)
    lengths = []
    for row, (q, unanswerable, inside) in enumerate(zip(questions, no_answer, in_passage, strict=True)):
        hidden = answer_sentences(q, passages[q.passage_id].ids, sentences) \
            if unanswerable and inside and not q.impossible else None
        # one more distractor in the gold passage's place; a rewritten question keeps its passage
        without_gold = unanswerable and hidden is None and not q.impossible
        others = [p for p in memory if p != q.passage_id]
        seen = rng.sample(others, min(distractors + without_gold, len(others)))
        for pid in seen if without_gold else [q.passage_id, *seen]:
            visible[row, slot[pid]] = passage_mask[slot[pid]]
        if hidden is not None:  # entry j pastes passage token j: the answer's sentences cannot be copied
            visible[row, slot[q.passage_id], : hidden.shape[0]] &= ~hidden
        answer = [] if unanswerable else q.answer_ids
        n = len(answer) + 1  # answer tokens, then the end
        query_positions[row, :n] = torch.arange(q.prompt_len - 1, q.prompt_len - 1 + n)
        query_positions[row, n:] = q.prompt_len - 1  # padding queries, weight 0
        targets[row, :n] = torch.tensor(answer + [q.end_id])
        weights[row, :n] = 1.0
        weights[row, n - 1] = end_weight  # the end decision gets real weight, not one token's worth
        if not unanswerable:
            start = slot[q.passage_id] * width + q.span[0]  # entry j of a passage pastes its token j
            prev[row, 1:n] = torch.arange(start, start + n - 1)
            gold[row, : n - 1] = torch.arange(start, start + n - 1)
            if end_twins:  # the "end here" twin of the entry after the last answer token
                gold[row, n - 1] = len(memory) * width + start + n - 1
        lengths.append(q.prompt_len + len(answer))
    prior = lexicon.features(questions, memory, passages, width) if lexicon is not None else None
    return Batch(
        question_keys=[f"q/{q.qid}" for q in questions], lengths=lengths,
        input_ids=pad([torch.tensor(prompts[q.qid] + q.answer_ids)[:n] for q, n in zip(questions, lengths,
                                                                                         strict=True)]),
        attention_mask=pad([torch.ones(n, dtype=torch.long) for n in lengths]),
        targets=targets, weights=weights, prev_source=prev, gold_entries=gold, query_positions=query_positions,
        no_answer=torch.tensor(no_answer, dtype=torch.bool),
        passage_keys=[f"p/{p}" for p in memory],
        memory_ids=pad([torch.tensor([bos_id] + passages[p].ids) for p in memory]),
        memory_mask=passage_mask, question_memory_mask=visible.reshape(b, -1), prior=prior,
    )


def answer_sentences(q: TrainQuestion, ids: list[int], sentences: dict[str, torch.Tensor] | None
                     ) -> torch.Tensor | None:
    """(n,) bool over the passage's tokens: the sentences that hold question `q`'s answer. None when the
    answer's tokens occur again in the other sentences (hiding these would not make it unanswerable)."""
    if sentences is None:
        return None
    numbers = sentences[q.passage_id]
    hidden = (numbers >= numbers[q.span[0]]) & (numbers <= numbers[q.span[1]])
    rest = [token if keep else -1 for token, keep in zip(ids, (~hidden).tolist(), strict=True)]
    answer, n = q.answer_ids, len(q.answer_ids)
    if any(rest[i : i + n] == answer for i in range(len(rest) - n + 1)):
        return None
    return hidden


@dataclass
class VisibleExample:
    """One question in the visible form: its passages in the prompt, the answer copied from their keys."""

    input_ids: torch.Tensor  # (1, L) prompt then the answer tokens
    prompt_len: int
    spans: list[tuple[int, int]]  # per passage: prompt position of its first token, tokens kept
    bodies: list[list[int]]  # each passage's tokens
    targets: torch.Tensor  # (1, Q)
    weights: torch.Tensor  # (1, Q)
    prev_source: torch.Tensor  # (1, Q)
    query_positions: torch.Tensor  # (1, Q)
    no_answer: bool
    question: str


def make_visible_example(q: TrainQuestion, passages: dict[str, PassageTokens], pool: dict[str, list[str]],
                         distractors: int, tokenizer, rng: random.Random, unanswerable: bool,
                         end_weight: float = 1.0) -> VisibleExample:
    others = pool[q.passage_id]
    without_gold = unanswerable and not q.impossible  # one more distractor in its place, as make_batch does
    unanswerable = unanswerable or q.impossible
    chosen = rng.sample(others, min(distractors + without_gold, len(others)))
    if not without_gold:
        chosen.insert(rng.randrange(len(chosen) + 1), q.passage_id)
    bodies = [passages[p].ids for p in chosen]
    prompt, spans = visible_prompt_layout(tokenizer, q.question, bodies)
    answer = [] if unanswerable else q.answer_ids
    n = len(answer) + 1
    prev = torch.full((1, n), -1, dtype=torch.long)
    if not unanswerable:
        gold = chosen.index(q.passage_id)
        offset = sum(len(bodies[i]) + 1 for i in range(gold))  # each whole passage has n + 1 entries
        prev[0, 1:] = torch.arange(offset + q.span[0], offset + q.span[0] + n - 1)
    weights = torch.ones((1, n))
    weights[0, -1] = end_weight
    return VisibleExample(
        input_ids=torch.tensor([prompt + answer]), prompt_len=len(prompt), spans=spans, bodies=bodies,
        targets=torch.tensor([answer + [q.end_id]]), weights=weights, prev_source=prev,
        query_positions=torch.arange(len(prompt) - 1, len(prompt) - 1 + n).unsqueeze(0), no_answer=unanswerable,
        question=q.question,
    )


@dataclass
class Lexicon:
    """The tokenizer's word table and each question's content words, for the lexical features."""

    passages: dict[str, torch.Tensor]  # passage id -> word id of each passage token (-1 for none)
    questions: dict[str, torch.Tensor]  # qid -> distinct word ids
    windows: list[int]  # the overlap features' half-widths
    sentences: dict[str, torch.Tensor] | None  # passage id -> sentence number of each token, when used
    kinds: dict[str, int] | None = None  # qid -> question type, for the answer-type prior
    token_types: dict[str, torch.Tensor] | None = None  # passage id -> token type of each passage token
    sentence_starts: bool = False

    @classmethod
    def build(cls, config, tokenizer, questions: list[TrainQuestion],
              passages: dict[str, PassageTokens]) -> Lexicon | None:
        """None when the model has no lexical prior."""
        if not config.lexical_prior:
            return None
        sentences = {pid: sentence_ids(tokenizer, p.ids) for pid, p in passages.items()} \
            if config.lexical_sentences else None
        types, starts = config.lexical_types, config.lexical_sentence_starts
        return cls({pid: word_ids(tokenizer, p.ids) for pid, p in passages.items()},
                   {q.qid: question_words(tokenizer, q.question) for q in questions},
                   config.lexical_window_sizes, sentences,
                   {q.qid: question_type(q.question) for q in questions} if types else None,
                   {pid: entry_token_types(tokenizer, p.ids, starts) for pid, p in passages.items()} if types
                   else None, starts)

    def features(self, questions: list[TrainQuestion], memory: list[str], passages: dict[str, PassageTokens],
                 width: int) -> torch.Tensor:
        """(B, N * width, F) lexical features of a batch memory (N passages in rows of `width` entries) for each
        question. Entry j of a passage pastes token j + 1; its last entry pastes the end (no word)."""
        words = torch.full((len(memory), width), -1, dtype=torch.long)
        kinds = torch.full((len(memory), width), TOKEN_TYPES.index("other"), dtype=torch.long)
        # a passage's sentences are numbered within its row; the end entry and padding form one more sentence
        sentences = (torch.arange(len(memory)).unsqueeze(1) * width + width - 1).expand(-1, width).clone()
        for index, pid in enumerate(memory):
            n = len(passages[pid].ids)
            words[index, :n] = self.passages[pid]
            if self.token_types is not None:
                kinds[index, :n] = self.token_types[pid]
            if self.sentences is not None:
                sentences[index, :n] = self.sentences[pid] + index * width
        sentences = sentences.reshape(-1) if self.sentences is not None else None
        kinds = kinds.reshape(-1) if self.token_types is not None else None
        return torch.stack([lexical_features(self.questions[q.qid], words.reshape(-1), self.windows, sentences,
                                             self.kinds[q.qid] if self.kinds else None, kinds, self.sentence_starts)
                            for q in questions])
