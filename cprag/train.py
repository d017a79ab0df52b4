"""Hidden-document QA training of the CP head on cached backbone features (`cprag train`).

Objective (hidden form): the passage is encoded on its own; the backbone reads the chat-formatted question, then
the answer as the passage's own tokens, then the end-of-turn token. The loss is the mixture NLL over the answer
positions and the end position (weighted), with the gold passage and distractor passages in memory, and the
successor bias teacher-forced from the aligned span. The backbone stays frozen, so its features are computed once.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.features import PassageFeatures, QuestionFeatures
from cprag.lexical import (
    TOKEN_TYPES,
    entry_token_types,
    lexical_features,
    question_type,
    question_words,
    sentence_ids,
    word_ids,
)
from cprag.model import CopyMemory
from cprag.prompt import prompt_ids, visible_prompt_layout
from cprag.squad import article_of
from cprag.train_config import TrainConfig

STATE_FILE = "train_state.pt"
# biases and feature weights that must travel several nats; Adam moves a parameter by about lr per step
SCALAR_PARAMETERS = ("cp_head.successor", "cp_head.sink_bias", "copy_gate.bias", "cp_head.lexical",
                     "cp_head.lexical_end")


@dataclass
class Batch:
    hidden: torch.Tensor  # (B, L, H) question + answer final hidden states
    cp: torch.Tensor | None  # (B, L, C) their CP-head input, None when it is `hidden`
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, Q) answer tokens then the end, -100 on padding
    weights: torch.Tensor  # (B, Q)
    prev_source: torch.Tensor  # (B, Q) gold memory entry of the previous answer token, -1 for the first
    lm_lse: torch.Tensor  # (B, Q)
    lm_target: torch.Tensor  # (B, Q)
    query_positions: torch.Tensor  # (B, Q) positions in the question sequence that predict the targets
    memory_hidden: torch.Tensor  # (N, Tp, H) the batch's distinct passages
    memory_ids: torch.Tensor  # (N, Tp)
    memory_mask: torch.Tensor  # (N, Tp) bool, False on padding
    question_memory_mask: torch.Tensor  # (B, N * Tp) the entries each question may attend
    prior: torch.Tensor | None = None  # (B, N * Tp, F) lexical features of the entries for each question


def _pad(tensors: list[torch.Tensor], value=0) -> torch.Tensor:
    width = max(t.shape[0] for t in tensors)
    out = torch.full((len(tensors), width, *tensors[0].shape[1:]), value, dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out


def make_batch(questions: list[QuestionFeatures], prompts: dict[str, list[int]], passages: dict[str, PassageFeatures],
               distractor_pool: dict[str, list[str]], distractors: int, bos_id: int, rng: random.Random,
               end_weight: float = 1.0, lexicon: Lexicon | None = None) -> Batch:
    """Collate questions over one shared set of passages: their gold passages plus same-article extras.

    Each question's memory is its gold passage and `distractors` others from that set (a per-question mask), so
    keys are computed once per distinct passage in the batch rather than once per (question, passage) pair.
    With a `lexicon`, each question also gets the lexical features of every entry (cprag.lexical).
    """
    golds = list(dict.fromkeys(q.passage_id for q in questions))
    extras = [p for q in questions for p in distractor_pool[q.passage_id] if p not in golds]
    extras = list(dict.fromkeys(extras))
    rng.shuffle(extras)
    memory = golds + extras[: max(0, distractors + 1 - len(golds)) + 2]
    rng.shuffle(memory)
    slot = {pid: i for i, pid in enumerate(memory)}
    width = max(passages[p].hidden.shape[0] for p in memory)
    passage_mask = _pad([torch.ones(passages[p].hidden.shape[0], dtype=torch.bool) for p in memory])

    b, width_q = len(questions), max(len(q.targets) for q in questions)
    targets = torch.full((b, width_q), -100, dtype=torch.long)
    weights, lse, target_logit = torch.zeros((b, width_q)), torch.zeros((b, width_q)), torch.zeros((b, width_q))
    prev = torch.full((b, width_q), -1, dtype=torch.long)
    query_positions = torch.zeros((b, width_q), dtype=torch.long)
    visible = torch.zeros((b, len(memory), width), dtype=torch.bool)
    for row, q in enumerate(questions):
        others = [p for p in memory if p != q.passage_id]
        for pid in [q.passage_id, *rng.sample(others, min(distractors, len(others)))]:
            visible[row, slot[pid]] = passage_mask[slot[pid]]
        n = len(q.targets)  # answer tokens, then the end
        query_positions[row, :n] = torch.arange(q.prompt_len - 1, q.prompt_len - 1 + n)
        query_positions[row, n:] = q.prompt_len - 1  # padding queries, weight 0
        targets[row, :n] = q.targets
        weights[row, :n] = 1.0
        weights[row, n - 1] = end_weight  # the end decision gets real weight, not one token's worth
        lse[row, :n] = q.lm_lse
        target_logit[row, :n] = q.lm_target
        start = slot[q.passage_id] * width + q.span[0]  # entry j of a passage pastes its token j
        prev[row, 1:n] = torch.arange(start, start + n - 1)
    prior = lexicon.features(questions, memory, passages, width) if lexicon is not None else None
    return Batch(
        hidden=_pad([q.hidden for q in questions]).float(),
        cp=_pad([q.cp for q in questions]).float() if questions[0].cp is not None else None,
        input_ids=_pad([torch.tensor(prompts[q.qid] + q.targets[:-1].tolist()) for q in questions]),
        attention_mask=_pad([torch.ones(q.hidden.shape[0], dtype=torch.long) for q in questions]),
        targets=targets, weights=weights, prev_source=prev, lm_lse=lse, lm_target=target_logit,
        query_positions=query_positions,
        memory_hidden=_pad([passages[p].hidden for p in memory]).float(),
        memory_ids=_pad([torch.cat([torch.tensor([bos_id]), passages[p].ids]) for p in memory]),
        memory_mask=passage_mask, question_memory_mask=visible.reshape(b, -1), prior=prior,
    )


def batch_forward(model, batch: Batch, **loss_inputs):
    """The batch's passages as one shared memory (each question sees its own entries), then the CPLM outputs at
    the answer positions. Returns (output, memory)."""
    docs = model.document_keys_from_hidden(batch.memory_hidden, batch.memory_ids, batch.memory_mask)
    memory = CopyMemory(keys=docs.keys.reshape(1, -1, docs.keys.shape[-1]), ids=docs.ids.reshape(1, -1),
                        mask=batch.question_memory_mask, prior=batch.prior)
    out = model.forward_hidden(
        batch.hidden, batch.input_ids, batch.attention_mask, memory=memory, prev_source=batch.prev_source,
        lm_stats=(batch.lm_lse, batch.lm_target), return_log_probs=False, query_positions=batch.query_positions,
        cp_features=batch.cp, **loss_inputs,
    )
    return out, memory


def batch_loss(model, batch: Batch) -> torch.Tensor:
    return batch_forward(model, batch, targets=batch.targets, target_weights=batch.weights)[0].loss


@dataclass
class VisibleBatch:
    """The visible training form: passages in the prompt, answers copied from the model's own context."""

    input_ids: torch.Tensor  # (B, L) prompt with the gold passage and distractors, then the answer tokens
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, Q) answer tokens then the end, -100 on padding
    weights: torch.Tensor  # (B, Q)
    query_positions: torch.Tensor  # (B, Q)


def make_visible_batch(questions: list[QuestionFeatures], question_text: dict[str, str],
                       passages: dict[str, PassageFeatures], distractor_pool: dict[str, list[str]], distractors: int,
                       tokenizer, rng: random.Random, end_weight: float = 1.0) -> VisibleBatch:
    """Each question's prompt holds its gold passage and `distractors` same-article passages, in random order."""
    sequences, width_q = [], max(len(q.targets) for q in questions)
    targets = torch.full((len(questions), width_q), -100, dtype=torch.long)
    weights = torch.zeros((len(questions), width_q))
    query_positions = torch.zeros((len(questions), width_q), dtype=torch.long)
    for row, q in enumerate(questions):
        others = [p for p in distractor_pool[q.passage_id] if p != q.passage_id]
        chosen = rng.sample(others, min(distractors, len(others)))
        chosen.insert(rng.randrange(len(chosen) + 1), q.passage_id)
        prompt = visible_prompt_layout(tokenizer, question_text[q.qid], [passages[p].ids.tolist() for p in chosen])[0]
        sequences.append(torch.tensor(prompt + q.targets[:-1].tolist()))
        n = len(q.targets)
        query_positions[row, :n] = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        query_positions[row, n:] = len(prompt) - 1
        targets[row, :n] = q.targets
        weights[row, :n] = 1.0
        weights[row, n - 1] = end_weight
    return VisibleBatch(input_ids=_pad(sequences), attention_mask=_pad([torch.ones(len(s), dtype=torch.long)
                                                                       for s in sequences]),
                        targets=targets, weights=weights, query_positions=query_positions)


def visible_batch_loss(model, batch: VisibleBatch) -> torch.Tensor:
    """The frozen backbone reads each prompt (no gradient), then the mixture NLL at the answer positions."""
    with torch.no_grad():
        hidden, features, _ = model.encode_hidden(batch.input_ids, batch.attention_mask)
        at = batch.query_positions.unsqueeze(-1)
        logits = model.lm_logits(hidden.gather(1, at.expand(-1, -1, hidden.shape[-1])))  # (B, Q, V)
        stats = (torch.logsumexp(logits, -1), logits.gather(-1, batch.targets.clamp(min=0).unsqueeze(-1))[..., 0])
    return model.forward_hidden(
        hidden, batch.input_ids, batch.attention_mask, targets=batch.targets, target_weights=batch.weights,
        lm_stats=stats, return_log_probs=False, query_positions=batch.query_positions, cp_features=features,
    ).loss


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
    def build(cls, model, tokenizer, question_text: dict[str, str], qids,
              passages: dict[str, PassageFeatures]) -> Lexicon | None:
        """None when the model has no lexical prior."""
        if not model.config.lexical_prior:
            return None
        sentences = {pid: sentence_ids(tokenizer, p.ids.tolist()) for pid, p in passages.items()} \
            if model.config.lexical_sentences else None
        types, starts = model.config.lexical_types, model.config.lexical_sentence_starts
        return cls({pid: word_ids(tokenizer, p.ids.tolist()) for pid, p in passages.items()},
                   {qid: question_words(tokenizer, question_text[qid]) for qid in qids},
                   model.config.lexical_window_sizes, sentences,
                   {qid: question_type(question_text[qid]) for qid in qids} if types else None,
                   {pid: entry_token_types(tokenizer, p.ids, starts) for pid, p in passages.items()} if types
                   else None, starts)

    def features(self, questions: list[QuestionFeatures], memory: list[str], passages: dict[str, PassageFeatures],
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


@dataclass
class TrainReport:
    steps: int
    examples: int
    seconds: float
    losses: list[float]
    resumed_from: int = 0


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    for parameter in model.backbone.parameters():
        parameter.requires_grad_(False)
    return [p for n, p in model.named_parameters() if not n.startswith("backbone.")]


def train_head(
    model, tokenizer, questions: list[QuestionFeatures], passages: dict[str, PassageFeatures],
    question_text: dict[str, str], config: TrainConfig, out_dir: Path | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> TrainReport:
    """Train the CP head (and the `<copy>` row) on cached features; resumable from `out_dir/train_state.pt`."""
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    params = trainable_parameters(model)
    scalar_ids = {id(p) for name, p in model.named_parameters() if name in SCALAR_PARAMETERS}
    groups = [{"params": [p for p in params if id(p) not in scalar_ids], "lr": config.lr},
              {"params": [p for p in params if id(p) in scalar_ids], "lr": config.lr * config.scalar_lr_scale,
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = max(1, len(questions) // config.batch_size)
    total = int(config.epochs * steps_per_epoch)
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in groups],
                                                    total_steps=max(total, 1),
                                                    pct_start=0.1)
    prompts = {q.qid: prompt_ids(tokenizer, question_text[q.qid]) for q in questions}
    lexicon = Lexicon.build(model, tokenizer, question_text, prompts, passages)
    pool = _distractor_pool(questions, passages)
    everything = sorted(passages)
    for pid, same_article in pool.items():  # hard distractors first: same article, then any passage
        if len(same_article) <= config.distractors:
            pool[pid] = same_article + rng.sample(everything, config.distractors + 1)

    step, losses, order = 0, [], []
    state_path = Path(out_dir) / STATE_FILE if out_dir else None
    if state_path:
        state_path.parent.mkdir(parents=True, exist_ok=True)
    if state_path and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["config"] == asdict(config):
            model.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            rng.setstate(state["rng"])
            torch.set_rng_state(state["torch_rng"])
            step, losses, order = state["step"], state["losses"], state["order"]
    resumed_from = step
    started = time.perf_counter()
    model.train()
    while step < total:
        if not order:
            order = _article_grouped_order(questions, rng)
        chosen = [questions[i] for i in order[: config.batch_size]]
        order = order[config.batch_size :]
        if config.form == "visible":
            loss = visible_batch_loss(model, make_visible_batch(chosen, question_text, passages, pool,
                                                                config.distractors, tokenizer, rng, config.end_weight))
        else:
            loss = batch_loss(model, make_batch(chosen, prompts, passages, pool, config.distractors,
                                                tokenizer.bos_token_id, rng, config.end_weight, lexicon))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(round(loss.item(), 4))
        if on_progress:
            on_progress(step, total, loss.item())
        if state_path and (step % config.save_every == 0 or step == total):
            _save_state(state_path, model, optimizer, scheduler, rng, step, losses, order, config)
    model.eval()
    return TrainReport(steps=step, examples=len(questions), seconds=time.perf_counter() - started, losses=losses,
                       resumed_from=resumed_from)


def _distractor_pool(questions: list[QuestionFeatures], passages: dict[str, PassageFeatures]) -> dict[str, list[str]]:
    """For each gold passage, the passages of its article (the hard distractors)."""
    by_article: dict[str, list[str]] = {}
    for pid in passages:
        by_article.setdefault(article_of(pid), []).append(pid)
    return {q.passage_id: by_article[article_of(q.passage_id)] for q in questions}


def teacher_forced_validation(model, tokenizer, questions: list[QuestionFeatures],
                              passages: dict[str, PassageFeatures], question_text: dict[str, str],
                              distractors: int, seed: int = 0, batch_size: int = 16) -> dict[str, float]:
    """`teacher_forced_metrics` over held-out questions, batched like training (same-article distractors)."""
    rng = random.Random(seed)
    pool = _distractor_pool(questions, passages)
    prompts = {q.qid: prompt_ids(tokenizer, question_text[q.qid]) for q in questions}
    lexicon = Lexicon.build(model, tokenizer, question_text, prompts, passages)
    order = _article_grouped_order(questions, rng)
    batches = [make_batch([questions[i] for i in order[start : start + batch_size]], prompts, passages, pool,
                          distractors, tokenizer.bos_token_id, rng, lexicon=lexicon)
               for start in range(0, len(order), batch_size)]
    return teacher_forced_metrics(model, batches)


def _article_grouped_order(questions: list[QuestionFeatures], rng: random.Random) -> list[int]:
    """A shuffled epoch in which neighbours share an article, so a batch shares its passages (hard distractors)."""
    by_article: dict[str, list[int]] = {}
    for index, q in enumerate(questions):
        by_article.setdefault(article_of(q.passage_id), []).append(index)
    groups = list(by_article.values())
    rng.shuffle(groups)
    order = []
    for group in groups:
        rng.shuffle(group)
        order.extend(group)
    return order


def _save_state(path: Path, model, optimizer, scheduler, rng, step, losses, order, config) -> None:
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("backbone.")}
    staging = path.with_suffix(".tmp")
    torch.save({"model": trainable, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "losses": losses,
                "order": order, "config": asdict(config)}, staging)
    staging.replace(path)


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))


@torch.no_grad()
def teacher_forced_metrics(model, batches: list[Batch]) -> dict[str, float]:
    """Fast validation without decoding: with the gold answer prefix fed in, is each step's most attended copy
    entry (or the sink) the right token? `tf/start` is the first answer token, `tf/end` the stop decision,
    `tf/exact` every step of an answer. Greedy decoding that copies reproduces the answer iff `tf/exact` holds."""
    model.eval()
    first = last = exact = tokens = correct = 0
    for batch in batches:
        out, memory = batch_forward(model, batch)
        entries = out.copy_log_attention.argmax(-1)  # (B, Q)
        external = 2 * memory.size if model.cp_head.end_q_proj is not None else memory.size
        ids = memory.ids[0]
        if external > memory.size:  # the "end here" twins paste the end token
            ids = torch.cat([ids, torch.full_like(ids, model.config.end_id)])
        own = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], 1)
        pasted = torch.where(entries < external, ids[entries.clamp(max=external - 1)],
                             own.gather(1, (entries - external).clamp(min=0)))
        copies = out.copy_log_attention.max(-1).values > out.sink_log_attention
        hit = (pasted == batch.targets) & copies
        valid = batch.targets != -100
        lengths = valid.sum(1)
        first += hit[:, 0].sum().item()
        last += hit.gather(1, (lengths - 1)[:, None]).sum().item()
        exact += (hit | ~valid).all(1).sum().item()
        tokens += valid.sum().item()
        correct += (hit & valid).sum().item()
    n = sum(b.targets.shape[0] for b in batches)
    return {"tf/n": n, "tf/start": round(100 * first / n, 2), "tf/end": round(100 * last / n, 2),
            "tf/exact": round(100 * exact / n, 2), "tf/token": round(100 * correct / tokens, 2)}
