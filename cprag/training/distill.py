"""Distillation targets: the split reader's start and end distributions, computed once, stored sparsely.

The hidden head picks an answer's first token by attention over document keys that never read the question; the
split reader (cprag.model.span_reader) reads the question beside the passage. DensePhrases (Lee et al., 2021)
trains query-agnostic phrase vectors with a KL term toward such a reader's start and end distributions; here the
reader reads each training question with its gold passage (from the activation cache, as its training does) and
keeps the top `top_k` positions of each distribution:

    p_start(i) = softmax_i(s_i),  p_end(j) = softmax_j(e_j)   over the passage's word starts / word ends.

The gold passage alone: the reader puts its mass there on SQuAD (99% of its choices among gold + 4 distractors),
so a distractor's positions take the student's remaining mass, as the pointer loss already asks. A passage longer
than one reader row is read in the window that holds the answer; positions are the passage's own token numbers,
which are the hidden memory's entry numbers within that passage (entry j pastes token j).

The loss (`start_distillation`) is KL(p_start ‖ q) between those targets and the hidden head's copy distribution
at the first answer position, renormalised over the memory entries the question sees.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cprag.decoding.span_read import ROW_TOKENS
from cprag.errors import CheckpointError
from cprag.model.reader_checkpoint import READER_WEIGHTS
from cprag.training.examples import TrainQuestion

NEG = -1e4
FORMAT = "cprag-reader-targets-v1"


@dataclass
class ReaderTargets:
    """Per question id: (positions (K,) long, probabilities (K,) float) of the reader's start and of its end."""

    start: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    end: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # the reader, the cache and the run that made them

    def save(self, path: str | Path) -> None:
        path = Path(path)
        staging = path.with_suffix(".tmp")
        torch.save({"format": FORMAT, "start": self.start, "end": self.end, "meta": self.meta}, staging)
        staging.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> ReaderTargets:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(str(path), "no reader targets here; make them with "
                                  "`python pipelines/reader_targets.py`")
        try:
            stored = torch.load(path, weights_only=False)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise CheckpointError(str(path), f"not a reader-targets file ({error})") from error
        if not isinstance(stored, dict) or stored.get("format") != FORMAT:
            raise CheckpointError(str(path), f"not a reader-targets file ({FORMAT})")
        return cls(stored["start"], stored["end"], stored["meta"])


def _top(scores: torch.Tensor, ok: torch.Tensor, offset: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` most probable allowed positions of softmax(scores), renormalised: (K,) positions + offset, (K,)."""
    log_p = torch.log_softmax(scores.float().masked_fill(~ok, NEG), -1)
    k = min(top_k, int(ok.sum()))
    values, where = log_p.topk(k)
    return where + offset, torch.softmax(values, -1)


@torch.no_grad()
def reader_targets(reader, data, questions: list[TrainQuestion], top_k: int = 32, batch_size: int = 16,
                   dtype: torch.dtype = torch.bfloat16, done: ReaderTargets | None = None,
                   on_progress: Callable[[int, int], None] | None = None) -> ReaderTargets:
    """The reader's start and end targets for `questions` (answerable ones, read with their gold passage from
    `data`, a cprag.training.reader_train.ReaderData). Questions already in `done` are kept, not read again."""
    targets = done or ReaderTargets()
    todo = [q for q in questions if not q.impossible and q.qid not in targets.start]
    device = reader.null.device
    for first in range(0, len(todo), batch_size):
        chosen = todo[first : first + batch_size]
        pairs, places = [], []
        for q in chosen:
            asked = data.prompt(q)
            states = data.passage(q.passage_id)
            room = max(ROW_TOKENS - len(asked) - 1, 16)
            begin = max(0, min(q.span[1] + 1 - room, q.span[0])) if len(states) > room else 0
            pairs.append((asked.to(device), states[begin : begin + room].to(device)))
            places.append(begin)
        joined = reader.pack(pairs, ROW_TOKENS)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            start, end = reader.top(joined)
        for index, (q, begin) in enumerate(zip(chosen, places, strict=True)):
            row, at, m, n = joined.places[index]
            starts, ends = data.bounds(q.passage_id)
            starts, ends = torch.tensor(starts[begin : begin + n]), torch.tensor(ends[begin : begin + n])
            starts[q.span[0] - begin] = ends[q.span[1] - begin] = True  # the gold span's own ends are allowed
            targets.start[q.qid] = _top(start[row, at + m : at + m + n].cpu(), starts, begin, top_k)
            targets.end[q.qid] = _top(end[row, at + m : at + m + n].cpu(), ends, begin, top_k)
        if on_progress:
            on_progress(min(first + batch_size, len(todo)), len(todo))
    return targets


def targets_fingerprint(reader_dir: str | Path) -> str:
    """A short hash of the reader's weights file: which reader made a targets file."""
    digest = hashlib.sha256()
    with open(Path(reader_dir) / READER_WEIGHTS, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def target_entries(targets: ReaderTargets, questions: list[TrainQuestion], answerable: list[bool],
                   slot: dict[str, int], width: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) memory entries of each question's start targets (-1: none) and (B, K) their probabilities; a
    question without targets, or asked without its answer, gets none."""
    entries = torch.full((len(questions), top_k), -1, dtype=torch.long)
    probs = torch.zeros((len(questions), top_k))
    for row, (q, ok) in enumerate(zip(questions, answerable, strict=True)):
        if ok and q.qid in targets.start:
            positions, p = targets.start[q.qid]
            k = min(top_k, len(positions))
            entries[row, :k] = slot[q.passage_id] * width + positions[:k]
            probs[row, :k] = p[:k] / p[:k].sum()
    return entries, probs


def start_distillation(copy_log_attention: torch.Tensor, memory_size: int, entries: torch.Tensor,
                       probs: torch.Tensor) -> torch.Tensor:
    """Mean over the questions with targets of KL(p_start ‖ q), q the copy distribution at the first answer
    position over the memory entries (renormalised: the sink, the "end here" twins and the question's own
    positions are left out). copy_log_attention (B, T, E...); entries, probs (B, K)."""
    log_a = copy_log_attention[:, 0, :memory_size].float()  # (B, E)
    log_q = log_a - torch.logsumexp(log_a, -1, keepdim=True)
    known = entries >= 0
    picked = log_q.gather(-1, entries.clamp(min=0)).clamp(min=-30.0)  # (B, K)
    own = torch.where(known, probs * torch.log(probs.clamp(min=1e-12)), torch.zeros_like(probs))
    kl = torch.where(known, own - probs * picked, torch.zeros_like(probs)).sum(-1)  # (B,)
    rows = known.any(-1)
    return kl.sum() / rows.sum().clamp(min=1)


def describe(targets: ReaderTargets, seconds: float) -> dict:
    """Figures a targets file records about itself."""
    sizes = [len(p) for p, _ in targets.start.values()]
    top = [float(p[0]) for _, p in targets.start.values()]
    return {"questions": len(targets.start), "top_k": max(sizes, default=0),
            "mean_top_start_probability": round(sum(top) / max(1, len(top)), 4), "seconds": round(seconds, 1),
            "made": time.strftime("%Y-%m-%d")}
