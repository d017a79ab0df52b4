"""SQuAD v1.1 exact match and F1 with the official normalisation, taking the best over all references."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, and collapse whitespace (as the official script)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1(prediction: str, reference: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = Counter(predicted) & Counter(gold)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_over_references(metric, prediction: str, references: list[str]) -> float:
    return max((metric(prediction, reference) for reference in references), default=0.0)


def squad_scores(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    """{"em", "f1"} in percent over paired predictions and reference lists."""
    if not predictions:
        return {"em": 0.0, "f1": 0.0}
    em = sum(best_over_references(exact_match, p, r) for p, r in zip(predictions, references, strict=True))
    f = sum(best_over_references(f1, p, r) for p, r in zip(predictions, references, strict=True))
    return {"em": 100.0 * em / len(predictions), "f1": 100.0 * f / len(predictions)}
