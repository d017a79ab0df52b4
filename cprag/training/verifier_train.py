"""Fitting the answer verifier (`cprag.model.answer_verifier`): training pairs, the head, and its threshold.

Pairs are (sentence, question, label). Answerable: a SQuAD v1.1 training question beside its answer's sentence.
Unanswerable: the rule-made rewrites of `pipelines/squad_negatives.py` beside their original answer's sentence
(the passage no longer answers them), and SQuAD 2.0's human-written negatives beside their plausible answer's
sentence when a file of them is given. The head is a logistic regression on the frozen backbone's states: on a
135M backbone, tuning blocks on these pairs overfits (eval/levers.md, "Human-written negatives").

The threshold follows the project's abstention rule: the largest share of unanswerable questions withheld while
HasAns F1 stays within 5 points of answering always, on an `eval squad2` run's answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from cprag.decoding.verify import answer_sentence


@dataclass(frozen=True)
class VerifierPair:
    sentence: str
    question: str
    label: int  # 1: the sentence answers the question


def squad_pairs(path: Path, limit: int | None, rng: random.Random, answerable: bool) -> list[VerifierPair]:
    """A seeded sample of a SQuAD file's answerable questions (with their answer's sentence) or unanswerable ones
    (with their plausible answer's sentence)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    chosen = []
    for article in data:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                impossible = bool(qa.get("is_impossible"))
                spans = qa.get("plausible_answers" if impossible else "answers") or []
                if impossible != (not answerable) or not spans:
                    continue
                start = spans[0]["answer_start"]
                sentence = answer_sentence(paragraph["context"], start, start + len(spans[0]["text"]))
                chosen.append(VerifierPair(sentence, qa["question"], int(answerable)))
    rng.shuffle(chosen)
    return chosen if limit is None else chosen[:limit]


def training_pairs(train: Path, negatives: Path, pairs: int, seed: int = 0,
                   human_negatives: Path | None = None) -> list[VerifierPair]:
    """`pairs` answerable and `pairs` rewritten questions (plus every human-written negative of `human_negatives`
    and as many answerable questions of the same file), seeded."""
    rng = random.Random(seed)
    chosen = squad_pairs(train, pairs, rng, True) + squad_pairs(negatives, pairs, rng, False)
    if human_negatives is not None:
        human = squad_pairs(human_negatives, None, rng, False)
        chosen += human + squad_pairs(human_negatives, len(human), rng, True)
    return chosen


def fit_head(states: torch.Tensor, labels: torch.Tensor, weight_decay: float = 1e-2, max_iter: int = 300
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(mean, scale, weight, bias): an L2-regularised logistic regression of `labels` (N,) on standardised
    `states` (N, F), fitted by LBFGS (deterministic)."""
    x, y = states.float(), labels.float()
    mean, scale = x.mean(0), x.std(0) + 1e-4
    z = (x - mean) / scale  # (N, F)
    weight = torch.zeros(z.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ weight + bias, y)
        loss = loss + weight_decay * (weight * weight).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return mean, scale, weight.detach(), float(bias.detach())
