"""SQuAD exact match and F1 with the official normalisation (v1.1, and v2.0 with its empty answers), the best
over all references, and the official best abstention threshold."""

from __future__ import annotations

import re
import string
from collections import Counter

import numpy as np

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


def f1_v2(prediction: str, reference: str) -> float:
    """SQuAD 2.0 F1: as v1.1, except that an empty answer scores 1 against an empty reference and 0 otherwise."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not gold:
        return float(predicted == gold)
    return f1(prediction, reference)


def squad2_question_scores(prediction: str, references: list[str]) -> tuple[float, float]:
    """(EM, F1) of one prediction ("" = no answer) as the official SQuAD 2.0 script scores it: references that
    normalise to nothing are dropped, and an unanswerable question's only reference is ""."""
    gold = [r for r in references if normalize_answer(r)] or [""]
    return max(exact_match(prediction, g) for g in gold), max(f1_v2(prediction, g) for g in gold)


def best_threshold(confidences: list[float], answerable: list[bool], scores: list[float],
                   answered: list[bool]) -> tuple[float, float]:
    """The official script's `find_best_thresh`, on confidences: abstaining below a threshold, which one gives
    the best total score? `scores` are each question's score when answered, `answered` whether its prediction is
    non-empty. Returns (best total in percent, the confidence threshold: answer when confidence >= it)."""
    current = best = sum(not a for a in answerable)  # everything withheld: every unanswerable one is right
    threshold = float("inf")
    for index in sorted(range(len(confidences)), key=lambda i: -confidences[i]):
        current += scores[index] if answerable[index] else (-1.0 if answered[index] else 0.0)
        if current > best:
            best, threshold = current, confidences[index]
    return 100.0 * best / max(1, len(confidences)), threshold


def threshold_within(confidences: list[float], answerable: list[bool], scores: list[float],
                     max_drop: float) -> float:
    """The highest confidence threshold (answer when confidence >= it) whose HasAns score stays within
    `max_drop` points (percent) of answering every question: as many answers withheld as that budget allows.
    `scores` are each question's score (0..1) when answered. Where the confidence separates answerable from
    unanswerable questions poorly, the official best-F1 threshold withholds almost every answer (saying "no
    answer" to all of a half-unanswerable set scores 50); this one bounds what abstention costs the answerable
    questions. 0.0 (answer always) when no threshold fits the budget."""
    has = sorted((c, s) for c, a, s in zip(confidences, answerable, scores, strict=True) if a)
    budget = max_drop / 100.0 * len(has)
    lost, threshold = 0.0, 0.0
    for index, (confidence, score) in enumerate(has):  # withhold the least confident answers first
        lost += score
        if lost > budget + 1e-9:
            break
        following = has[index + 1][0] if index + 1 < len(has) else confidence + 1e-6
        if following > confidence:  # a threshold can only fall between distinct confidences
            threshold = following
    return threshold


def paired_interval(a, b, resamples: int = 10_000, seed: int = 0) -> list[float]:
    """95% paired bootstrap interval of mean(a - b) over questions (a, b: per-question scores)."""
    import numpy as np

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    means = (a - b)[rng.integers(0, len(a), size=(resamples, len(a)))].mean(axis=1)
    return [round(float(np.percentile(means, 2.5)), 2), round(float(np.percentile(means, 97.5)), 2)]


RULE_DROP = 5.0  # HasAns F1 points the abstention threshold may cost (the project's rule)


def auc(positive: np.ndarray, score: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative (ties count half)."""
    positive = np.asarray(positive, dtype=bool)
    _, group, counts = np.unique(np.asarray(score), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[group]  # 1-based ranks; tied scores share their mean rank
    n1, n0 = positive.sum(), (~positive).sum()
    if n1 == 0 or n0 == 0:
        return float("nan")
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def threshold_at_rule(score: np.ndarray, answerable: np.ndarray, f1: np.ndarray, drop: float = RULE_DROP
                      ) -> tuple[float, float]:
    """(threshold, share of unanswerable withheld): the threshold withholding the most unanswerable questions
    (score below it) while HasAns F1 (percent) stays within `drop` points of answering always. `threshold_within`'s
    rule, with the threshold halfway between the last score withheld and the next (not on the next answerable
    score), as a probability fitted on one sample is applied to others."""
    score, answerable, f1 = np.asarray(score, float), np.asarray(answerable, bool), np.asarray(f1, float)
    order = np.argsort(score, kind="stable")
    sorted_score = score[order]
    lost = np.cumsum(np.where(answerable[order], f1[order], 0.0)) / max(answerable.sum(), 1)
    withheld = np.cumsum(~answerable[order]) / max((~answerable).sum(), 1)
    best, best_at = 0.0, 0.0
    for i in range(len(order)):  # withholding order[: i + 1]: the threshold sits just above sorted_score[i]
        if i + 1 < len(order) and sorted_score[i + 1] == sorted_score[i]:
            continue  # a threshold cannot split tied scores
        if lost[i] > drop:
            break
        if withheld[i] > best:
            above = sorted_score[i + 1] if i + 1 < len(order) else sorted_score[i] + 1e-6
            best, best_at = float(withheld[i]), float((sorted_score[i] + above) / 2)
    return best_at, best
