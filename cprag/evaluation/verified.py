"""The verifier in evaluation: each answer's sentence read beside its question, and the figures with and without.

`cprag eval squad --verify` and `cprag eval squad2 --verify` decode as always, then score every hidden or visible
answer with the checkpoint's verifier (`cprag.decoding.verify`), reading the sentence of the passages in memory
where the answer's text first occurs. Summary keys: `<ns>/<mode>+verifier/...` are the mode's figures with the
answers below the verifier's threshold withheld (the confidence threshold then 0, as in `ask`); `verify/<mode>/...`
say how many were withheld, how many of them were right, the AUCs and the verifier's cost per question.
"""

from __future__ import annotations

import time

import numpy as np

from cprag.decoding.verify import VERIFY_BATCH, answer_sentence, verify
from cprag.evaluation.metrics import auc, squad2_question_scores
from cprag.evaluation.oracle_qa import QAResult

VERIFIED_MODES = ("hidden", "visible")  # the modes whose answers are spans of passages


def found_sentence(prediction: str, passage_ids: list[str], texts: dict[str, str]) -> str | None:
    """The sentence of the first passage (in memory order) whose text holds `prediction`; None without one."""
    if not prediction:
        return None
    for passage_id in passage_ids:
        text = texts.get(passage_id, "")
        found = text.find(prediction)
        if found >= 0:
            return answer_sentence(text, found, found + len(prediction))
    return None


def result_sentence(result: QAResult, passages: dict[str, tuple[str, str]]) -> str | None:
    """The sentence of the first passage read that holds the answer's text; None without one."""
    texts = {passage_id: passages[passage_id][1] for passage_id in result.passages if passage_id in passages}
    return found_sentence(result.prediction, result.passages, texts)


def verify_results(model, tokenizer, verifier, results: list[QAResult], passages: dict[str, tuple[str, str]],
                   batch_size: int = VERIFY_BATCH) -> float:
    """Set `answerable` on every hidden/visible result whose answer is found in its passages; returns the
    verifier's milliseconds per verified answer."""
    chosen = [(r, result_sentence(r, passages)) for r in results if r.mode in VERIFIED_MODES]
    chosen = [(r, sentence) for r, sentence in chosen if sentence is not None]
    if not chosen:
        return 0.0
    started = time.perf_counter()
    scores = verify(model, tokenizer, verifier, [(s, r.question) for r, s in chosen], batch_size)
    for (result, _), score in zip(chosen, scores, strict=True):
        result.answerable = round(score, 4)
    return 1000 * (time.perf_counter() - started) / len(chosen)


def withheld_by_verifier(result: QAResult, verifier) -> bool:
    return result.answerable is not None and verifier.withholds(result.answerable, result.confidence)


def verified_figures(results: list[QAResult], verifier, namespace: str = "qa") -> dict[str, float]:
    """Per verified mode: EM/F1 with the verifier's withholding (`<namespace>/<mode>+verifier/...`), the share of
    answers withheld and the share of exactly right answers withheld (`verify/<mode>/...`), and the AUC of the
    verifier and of the confidence at telling right answers (EM) from the rest."""
    figures: dict[str, float] = {}
    for mode in VERIFIED_MODES:
        chosen = [r for r in results if r.mode == mode]
        if not chosen:
            continue
        kept = [("" if withheld_by_verifier(r, verifier) else r.prediction) for r in chosen]
        scores = np.array([squad2_question_scores(p, r.references) for p, r in zip(kept, chosen, strict=True)])
        withheld = np.array([withheld_by_verifier(r, verifier) for r in chosen])
        right = np.array([r.em == 100.0 and bool(r.references) for r in chosen])
        figures[f"{namespace}/{mode}+verifier/em"] = round(100 * float(scores[:, 0].mean()), 2)
        figures[f"{namespace}/{mode}+verifier/f1"] = round(100 * float(scores[:, 1].mean()), 2)
        figures[f"verify/{mode}/withheld"] = round(float(withheld.mean()), 4)
        figures[f"verify/{mode}/right_withheld"] = round(float(withheld[right].mean()), 4) if right.any() else 0.0
        figures[f"verify/{mode}/verified"] = sum(r.answerable is not None for r in chosen)
        verifier_score = np.array([1.0 if r.answerable is None else r.answerable for r in chosen])
        confidence = np.array([r.confidence or 0.0 for r in chosen])
        if 0 < right.sum() < len(right):
            figures[f"verify/{mode}/auc_right"] = round(auc(right, verifier_score), 3)
            figures[f"verify/{mode}/confidence_auc_right"] = round(auc(right, confidence), 3)
    figures["verify/threshold"] = verifier.threshold
    figures["verify/keep_confidence"] = verifier.keep_confidence
    return figures
