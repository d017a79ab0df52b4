"""Hidden-document QA training of the CPLM through its top backbone blocks (`cprag train`).

Objective (hidden form): each passage is encoded on its own; the backbone reads the chat-formatted question, then
the answer as the passage's own tokens, then the end-of-turn token. The loss is the mixture NLL over the answer
positions and the end (weighted), with the gold passage and distractors in memory and the successor bias teacher-
forced from the aligned span. No-answer questions (memory without the gold passage, or rewritten questions with it:
`--negatives`) are trained to stop at once through the generator: their loss is -log[(1 - g + g·a_sink)·p_gen(end)],
so the copy mass goes to the sink and nothing is copied. The blocks below `cache_layer` are frozen and read from the
activation cache; the blocks above it run in every step, and their adapters (when configured) train through the CP
and LM losses.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.decoding.memory import lexical_prior, prompt_passage_memory
from cprag.decoding.prompt import prompt_ids
from cprag.errors import CacheMismatch, ConfigError
from cprag.model.blocks import both_ways_mask
from cprag.model.copy_head import CopyMemory
from cprag.model.lexical import sentence_ids
from cprag.training.activations import ActivationCache
from cprag.training.batches import (
    Batch,
    Lexicon,
    VisibleExample,
    distractor_pool,
    make_batch,
    make_visible_example,
    on_device,
)
from cprag.training.config import TrainConfig
from cprag.training.distill import ReaderTargets, start_distillation, target_entries
from cprag.training.examples import Examples, TrainQuestion

STATE_FILE = "train_state.pt"
DISTILLED_POSITIONS = 32  # the reader's most probable starts a question's distillation term reads
# biases and feature weights that must travel several nats; Adam moves a parameter by about lr per step
SCALAR_PARAMETERS = ("cp_head.successor", "cp_head.sink_bias", "copy_gate.bias", "cp_head.lexical",
                     "cp_head.lexical_end")


def compute_context(dtype: str, device: torch.device | str = "cpu"):
    """bf16 autocast for the backbone blocks (a CPU's bf16 matrix units, or a GPU), or nothing for fp32."""
    kind = torch.device(device).type
    return torch.autocast(kind, dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext()


def model_device(model) -> torch.device:
    return model.copy_gate.weight.device


def lm_statistics(model, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor):
    """(logsumexp of the LM logits, LM logit of each target) at `positions` (B, Q) of hidden (B, L, H); zeros
    where the target is padding (-100), which is never scored: the vocabulary matrix is built only where needed."""
    valid = targets != -100  # (B, Q)
    rows, columns = valid.nonzero(as_tuple=True)
    at = hidden[rows, positions[rows, columns]]  # (K, H)
    logits = model.lm_logits(at).float()  # (K, V)
    lse = torch.zeros(targets.shape, dtype=logits.dtype, device=logits.device)
    target = torch.zeros_like(lse)
    lse = lse.index_put((rows, columns), torch.logsumexp(logits, -1))
    target = target.index_put((rows, columns), logits.gather(-1, targets[rows, columns].unsqueeze(-1))[:, 0])
    return lse, target


@dataclass
class TrainData:
    """Everything a step needs besides the model: examples, their cached activations, prompts and features."""

    examples: Examples
    cache: ActivationCache
    prompts: dict[str, list[int]]
    lexicon: Lexicon | None
    pool: dict[str, list[str]]
    end_twins: bool
    sentences: dict[str, torch.Tensor]  # passage id -> sentence number of each token (in-passage no-answers)
    reader_targets: ReaderTargets | None = None  # the split reader's start distributions (distillation)

    @classmethod
    def build(cls, model, tokenizer, examples: Examples, cache: ActivationCache, distractors: int, seed: int,
              questions: list[TrainQuestion] | None = None) -> TrainData:
        """Keep the questions (default: all) whose sequence and passages are in the cache, which must hold them
        as these examples tokenize them (a changed tokenizer or prompt would misalign every position)."""
        available = [q for q in (questions if questions is not None else examples.questions)
                     if f"q/{q.qid}" in cache and f"p/{q.passage_id}" in cache]
        passages = {pid: p for pid, p in examples.passages.items() if f"p/{pid}" in cache}
        lengths = {f"q/{q.qid}": q.prompt_len + len(q.answer_ids) for q in available}
        lengths.update({f"p/{pid}": len(p.ids) + 1 for pid, p in passages.items()})
        stale = [key for key, n in lengths.items() if cache.length(key) != n]
        if stale:
            raise CacheMismatch(str(cache.directory), f"{len(stale)} sequences (e.g. {stale[0]}) have other "
                                "lengths than these examples: remove the folder to rebuild it")
        kept = Examples(passages, available, examples.skipped)
        lexicon = Lexicon.build(model.config, tokenizer, available, passages)
        sentences = lexicon.sentences if lexicon is not None and lexicon.sentences is not None else \
            {pid: sentence_ids(tokenizer, p.ids) for pid, p in passages.items()}
        return cls(kept, cache, {q.qid: prompt_ids(tokenizer, q.question) for q in available}, lexicon,
                   distractor_pool(available, passages, distractors + 1, random.Random(seed)),
                   model.config.end_entries, sentences)

    def batch(self, questions: list[TrainQuestion], distractors: int, bos_id: int, rng: random.Random,
              no_answer: list[bool], end_weight: float = 1.0, in_passage: list[bool] | None = None) -> Batch:
        batch = make_batch(questions, self.prompts, self.examples.passages, self.pool, distractors, bos_id, rng,
                           no_answer, end_weight, self.lexicon, self.end_twins, in_passage, self.sentences)
        if self.reader_targets is not None:
            slot = {key.split("/", 1)[1]: i for i, key in enumerate(batch.passage_keys)}
            batch.start_entries, batch.start_probs = target_entries(
                self.reader_targets, questions, [not u for u in no_answer], slot, batch.memory_ids.shape[1],
                DISTILLED_POSITIONS)
        return batch


def batch_forward(model, batch: Batch, cache: ActivationCache, start: int, dtype: str, **targets):
    """The batch's passages as one shared memory (each question sees its own entries), then the CPLM outputs at
    the target positions. Returns (output, memory, LM statistics)."""
    device = model_device(model)
    batch = on_device(batch, device)
    question_states, question_mask = cache.states(batch.question_keys, lengths=batch.lengths)
    question_states = {k: v.to(device) for k, v in question_states.items()}
    with compute_context(dtype, device):
        hidden, features = model.trained_states(question_states, question_mask.to(device), start)
    stats = lm_statistics(model, hidden.float(), batch.query_positions, batch.targets)
    passage_features = packed_features(model, cache, batch.passage_keys, start, dtype, batch.memory_ids.shape[1])
    docs = model.document_keys_from_hidden(passage_features, batch.memory_ids, batch.memory_mask)
    memory = CopyMemory(keys=docs.keys.reshape(1, -1, docs.keys.shape[-1]), ids=docs.ids.reshape(1, -1),
                        mask=batch.question_memory_mask, prior=batch.prior)
    out = model.forward_hidden(
        hidden.float(), batch.input_ids, batch.attention_mask, memory=memory, prev_source=batch.prev_source,
        lm_stats=stats, return_log_probs=False, query_positions=batch.query_positions, cp_features=features.float(),
        **targets,
    )
    return out, memory, stats


def packed_features(model, cache: ActivationCache, keys: list[str], start: int, dtype: str,
                    width: int) -> torch.Tensor:
    """CP-head input of several cached sequences, run packed into short rows (little padding, attention within a
    row), returned right padded to `width`: (N, width, C) float32."""
    states, positions, placed = cache.packed(keys)
    device = model_device(model)
    # a document read both ways reads its whole passage in the trained blocks (the cached ones stay causal)
    mask = both_ways_mask(position_ids=positions).to(device) if model.config.document_attention == "both" else None
    with compute_context(dtype, device):
        _, features = model.trained_states({k: v.to(device) for k, v in states.items()}, None, start,
                                           position_ids=positions.to(device), mask=mask)
    out = features.new_zeros((len(keys), width, features.shape[-1]), dtype=torch.float32)
    for index, (row, first) in enumerate(placed):
        length = cache.length(keys[index])
        out[index, :length] = features[row, first : first + length].float()
    return out


def qa_loss(out, stats, targets: torch.Tensor, weights: torch.Tensor, no_answer: torch.Tensor) -> torch.Tensor:
    """Mixture NLL of answerable rows; for no-answer rows, -log[(1 - g + g·a_sink)·p_gen(end)] at their only
    position, so nothing is copied and the generator ends the answer. Weighted mean over target positions."""
    answerable = (~no_answer).unsqueeze(1).float()
    weights = weights * (targets != -100)
    log_p_gen = stats[1] - stats[0]  # (B, Q) LM log-probability of each target
    stop = out.generator_log_weight[:, 0] + log_p_gen[:, 0]  # (B,)
    total = -(out.target_log_probs * weights * answerable).sum() - (stop * weights[:, 0] * no_answer).sum()
    return total / weights.sum().clamp(min=1e-9)


def pointer_loss(out, gold_entries: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """-log a_j of the exact entry each answer token (and the end) is copied from: the mixture alone credits
    every entry that pastes the same token (" the" occurs everywhere), this names the position."""
    known = gold_entries >= 0
    log_a = out.copy_log_attention.gather(-1, gold_entries.clamp(min=0).unsqueeze(-1))[..., 0]  # (B, Q)
    chosen = weights * known
    return -(log_a.clamp(min=-30.0) * chosen).sum() / chosen.sum().clamp(min=1e-9)


def batch_loss(model, batch: Batch, cache: ActivationCache, start: int, dtype: str,
               pointer_weight: float = 0.0, distill_weight: float = 0.0) -> torch.Tensor:
    batch = on_device(batch, model_device(model))
    out, memory, stats = batch_forward(model, batch, cache, start, dtype, targets=batch.targets)
    loss = qa_loss(out, stats, batch.targets, batch.weights, batch.no_answer)
    if pointer_weight:
        loss = loss + pointer_weight * pointer_loss(out, batch.gold_entries, batch.weights)
    if distill_weight and batch.start_entries is not None:
        loss = loss + distill_weight * start_distillation(out.copy_log_attention, memory.size, batch.start_entries,
                                                          batch.start_probs)
    return loss


def visible_loss(model, tokenizer, example: VisibleExample, start: int, dtype: str) -> torch.Tensor:
    """The visible form of one question, keyed and scored as visible decoding does (`generate`)."""
    device = model_device(model)
    example = on_device(example, device)
    ids = example.input_ids
    mask = torch.ones_like(ids)
    with torch.no_grad(), compute_context(dtype, device):
        states = model.frozen_states(ids, mask, start)
    with compute_context(dtype, device):
        hidden, features = model.trained_states({k: v.float() for k, v in states.items()}, mask, start)
    hidden, features = hidden.float(), features.float()
    stats = lm_statistics(model, hidden, example.query_positions, example.targets)
    prompt = ids[:, : example.prompt_len]
    memory, _, _ = prompt_passage_memory(model, features[:, : example.prompt_len], prompt, example.spans,
                                         example.bodies)
    prior = lexical_prior(model, tokenizer, example.question, memory.ids[0])
    memory.prior = prior.to(device) if prior is not None else None
    copyable = torch.ones_like(ids, dtype=torch.bool)
    for first, kept in example.spans:  # passage positions are copied through their memory entries only
        copyable[0, first - 1 : first + kept] = False
    out = model.forward_hidden(hidden, ids, mask, memory, prev_source=example.prev_source, lm_stats=stats,
                               return_log_probs=False, query_positions=example.query_positions,
                               cp_features=features, copyable=copyable, targets=example.targets)
    return qa_loss(out, stats, example.targets, example.weights, torch.tensor([example.no_answer], device=device))


@dataclass
class TrainReport:
    steps: int
    examples: int
    seconds: float
    losses: list[float]
    resumed_from: int = 0
    visible_examples: int = 0


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The CP head, the `<copy>` row and the adapters; every backbone weight stays frozen."""
    for parameter in model.backbone.parameters():
        parameter.requires_grad_(False)
    return [p for n, p in model.named_parameters() if not n.startswith("backbone.")]


def _optimizer(model, config: TrainConfig):
    params = trainable_parameters(model)
    named = dict(model.named_parameters())
    scalars = {id(named[n]) for n in SCALAR_PARAMETERS if n in named}
    adapters = {id(p) for n, p in named.items() if n.startswith("adapters.")}
    groups = [
        {"params": [p for p in params if id(p) not in scalars | adapters], "lr": config.lr},
        {"params": [p for p in params if id(p) in scalars], "lr": config.lr * config.scalar_lr_scale,
         "weight_decay": 0.0},
        {"params": [p for p in params if id(p) in adapters], "lr": config.adapter_lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return params, torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)


def train_model(
    model, tokenizer, data: TrainData, config: TrainConfig, out_dir: Path | None = None,
    on_progress: Callable[[int, int, float], None] | None = None,
) -> TrainReport:
    """Train the head and adapters on cached activations; resumable from `out_dir/train_state.pt`."""
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    questions = data.examples.questions
    params, optimizer = _optimizer(model, config)
    steps_per_epoch = max(1, len(questions) // config.batch_size)
    total = int(config.epochs * steps_per_epoch)
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    if config.skip_steps >= total:
        raise ConfigError("--skip-steps", config.skip_steps, f"leaves nothing to train: the run has {total} steps")
    steps = max(total - config.skip_steps, 1)
    # a tenth of the steps warm up; OneCycleLR divides by zero when that tenth is exactly one step (10 steps)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                    total_steps=steps, pct_start=0.1 if steps >= 20 else 0.3)
    step, losses, order, visible = config.skip_steps, [], _skipped_order(questions, rng, config), 0
    state_path = Path(out_dir) / STATE_FILE if out_dir else None
    if state_path:
        state_path.parent.mkdir(parents=True, exist_ok=True)
    # a saved state resumes only the same run: same settings, same questions in the same order
    run = {"config": asdict(config), "questions": hashlib.sha256("\n".join(q.qid for q in questions).encode())
           .hexdigest()}
    if state_path and state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["run"] == run:
            model.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            rng.setstate(state["rng"])
            torch.set_rng_state(state["torch_rng"])
            step, losses, order, visible = state["step"], state["losses"], state["order"], state["visible"]
    resumed_from = step
    started = time.perf_counter()
    start = config.cache_layer
    model.train()
    while step < total:
        if not order:
            order = _article_grouped_order(questions, rng)
        chosen = [questions[i] for i in order[: config.batch_size]]
        order = order[config.batch_size :]
        # a rewritten question (--negatives) is unanswerable with its passage; it draws nothing, so runs without
        # them keep their seeded order
        no_answer = [q.impossible or rng.random() < config.no_answer_fraction for q in chosen]
        # drawn only when used, so runs without in-passage no-answers keep their seeded order
        in_passage = [u and rng.random() < config.no_answer_in_passage for u in no_answer] \
            if config.no_answer_in_passage else None
        batch = data.batch(chosen, config.distractors, tokenizer.bos_token_id, rng, no_answer, config.end_weight,
                           in_passage)
        loss = batch_loss(model, batch, data.cache, start, config.dtype, config.pointer_weight,
                          config.distill_weight)
        optimizer.zero_grad()
        loss.backward()
        if config.visible_every and (step + 1) % config.visible_every == 0:
            for q in rng.sample(questions, config.visible_batch):
                example = make_visible_example(q, data.examples.passages, data.pool, config.distractors,
                                               tokenizer, rng, rng.random() < config.no_answer_fraction,
                                               config.end_weight)
                (visible_loss(model, tokenizer, example, start, config.dtype) / config.visible_batch).backward()
                visible += 1
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        step += 1
        losses.append(round(loss.item(), 4))
        if on_progress:
            on_progress(step, total, loss.item())
        if state_path and (step % config.save_every == 0 or step == total):
            _save_state(state_path, model, optimizer, scheduler, rng, step, losses, order, visible, run)
    model.eval()
    return TrainReport(steps=step, examples=len(questions), seconds=time.perf_counter() - started, losses=losses,
                       resumed_from=resumed_from, visible_examples=visible)


def _skipped_order(questions: list[TrainQuestion], rng: random.Random, config: TrainConfig) -> list[int]:
    """What is left of the seeded epoch orders after the first `skip_steps` batches: the questions a run from
    the same seed reaches next (the orders come first from the seeded generator, as in that run)."""
    order, skip = [], config.skip_steps * config.batch_size
    while skip > 0:
        order = _article_grouped_order(questions, rng)
        dropped = min(skip, len(order))
        order, skip = order[dropped:], skip - dropped
    return order


def _article_grouped_order(questions: list[TrainQuestion], rng: random.Random) -> list[int]:
    """A shuffled epoch in which neighbours share an article, and within it a passage: a batch then holds the
    questions of a few passages of one article, which are each other's hard distractors, and its passages are
    encoded once for all of them."""
    by_article: dict[str, dict[str, list[int]]] = {}
    for index, q in enumerate(questions):
        by_article.setdefault(q.article, {}).setdefault(q.passage_id, []).append(index)
    articles = list(by_article.values())
    rng.shuffle(articles)
    order = []
    for passages in articles:
        groups = list(passages.values())
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
            order.extend(group)
    return order


def _save_state(path: Path, model, optimizer, scheduler, rng, step, losses, order, visible, run) -> None:
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("backbone.")}
    staging = path.with_suffix(".tmp")
    torch.save({"model": trainable, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "losses": losses,
                "order": order, "visible": visible, "run": run}, staging)
    staging.replace(path)


def teacher_forced_validation(model, tokenizer, data: TrainData, config: TrainConfig, limit: int | None = None,
                              seed: int = 0, batch_size: int = 16) -> dict[str, float]:
    """`teacher_forced_metrics` over (a seeded sample of `limit`) questions, batched like training, all answerable."""
    rng = random.Random(seed)
    questions = data.examples.questions
    if limit is not None and limit < len(questions):
        questions = rng.sample(questions, limit)
    order = _article_grouped_order(questions, rng)
    batches = []
    for first in range(0, len(order), batch_size):
        chosen = [questions[i] for i in order[first : first + batch_size]]
        batches.append(data.batch(chosen, config.distractors, tokenizer.bos_token_id, rng, [False] * len(chosen)))
    return teacher_forced_metrics(model, batches, data.cache, config.cache_layer, config.dtype)


@torch.no_grad()
def teacher_forced_metrics(model, batches: list[Batch], cache: ActivationCache, start: int,
                           dtype: str) -> dict[str, float]:
    """Fast validation without decoding: with the gold answer prefix fed in, is each step's most attended copy
    entry (or the sink) the right token? `tf/start` is the first answer token, `tf/end` the stop decision,
    `tf/exact` every step of an answer. Greedy decoding that copies reproduces the answer iff `tf/exact` holds."""
    model.eval()
    first = last = exact = tokens = correct = 0
    for batch in batches:
        batch = on_device(batch, model_device(model))
        out, memory, _ = batch_forward(model, batch, cache, start, dtype)
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
