"""`cprag eval squad2`: abstention on SQuAD 2.0. Each question gets its own paragraph plus distractors (oracle
memory); answerable or not, the model gives its best answer and a confidence, and an answer whose confidence is
below the threshold is withheld. Scored as the official SQuAD 2.0 script scores it: HasAns EM/F1, NoAns accuracy,
overall EM/F1, and the threshold that would maximise overall F1. Keys: qa2/<mode>/...
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from cprag.decoding.rerank import default_start_beam
from cprag.evaluation.metrics import auc, best_threshold, squad2_question_scores, threshold_at_rule
from cprag.evaluation.oracle_qa import QAResult, evaluate_oracle
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import SquadEvalConfig, bar_plot, sample_examples
from cprag.evaluation.verified import VERIFIED_MODES, verify_results, withheld_by_verifier


def abstention_scores(results: list[QAResult], answerable: dict[str, bool], threshold: float,
                      verifier=None) -> dict[str, float]:
    """Official SQuAD 2.0 figures (percent) when answers with confidence below `threshold` are withheld (or, given
    the `verifier`, the answers it withholds)."""
    em, f1, has = [], [], []
    for r in results:
        if verifier is not None:
            withheld = withheld_by_verifier(r, verifier)
        else:
            withheld = r.confidence is not None and r.confidence < threshold
        prediction = "" if withheld else r.prediction
        scores = squad2_question_scores(prediction, r.references)
        em.append(scores[0])
        f1.append(scores[1])
        has.append(answerable[r.qid])
    em, f1, has = np.array(em), np.array(f1), np.array(has, dtype=bool)

    def mean(values: np.ndarray) -> float:
        return round(100 * float(values.mean()), 2) if values.size else 0.0

    return {"em": mean(em), "f1": mean(f1), "has_em": mean(em[has]), "has_f1": mean(f1[has]),
            "noans_acc": mean(em[~has])}


def summarize_squad2(results: list[QAResult], answerable: dict[str, bool], threshold: float,
                     verifier=None) -> dict[str, float]:
    """qa2/<mode>/... at `threshold`, plus the same answering always (`..._always`) and the best threshold; with
    the `verifier`, qa2/<mode>+verifier/... for the verified modes, answers withheld by the verifier alone,
    and the AUC (answerable over unanswerable) of the confidence and of the verifier."""
    summary: dict[str, float] = {}
    for mode in sorted({r.mode for r in results}):
        if verifier is not None and mode in VERIFIED_MODES:
            summary.update(verifier_rows(results, mode, answerable, verifier))
        chosen = [r for r in results if r.mode == mode]
        if mode == "reader":
            summary.update(reader_rows(chosen, answerable))
            continue
        prefix = f"qa2/{mode}/"
        usable = [r for r in chosen if r.confidence is not None]  # closed mode has no passages, hence none
        at = threshold if usable else 0.0
        summary.update({prefix + k: v for k, v in abstention_scores(chosen, answerable, at).items()})
        always = abstention_scores(chosen, answerable, 0.0)
        summary[prefix + "has_f1_always"] = always["has_f1"]
        summary[prefix + "f1_always"] = always["f1"]
        summary[prefix + "threshold"] = at
        if usable:
            singles = [squad2_question_scores(r.prediction, r.references)[1] for r in usable]
            best, best_at = best_threshold([r.confidence for r in usable], [answerable[r.qid] for r in usable],
                                           singles, [bool(r.prediction) for r in usable])
            summary[prefix + "best_f1"] = round(best, 2)
            summary[prefix + "best_threshold"] = round(best_at, 6) if np.isfinite(best_at) else 1.0
        summary[prefix + "n"] = len(chosen)
        summary[prefix + "has_n"] = sum(answerable[r.qid] for r in chosen)
    return summary


def reader_rows(chosen: list[QAResult], answerable: dict[str, bool]) -> dict[str, float]:
    """qa2/reader/...: the span reader withholds by its own null entry (no answer where the null outscores every
    span), not by a confidence threshold. Its answerable score is 1 - the null entry's probability; the AUC, the
    threshold that maximises overall F1 and the 5-point rule's threshold are read on that score."""
    prefix = "qa2/reader/"
    rows = {prefix + k: v for k, v in abstention_scores(chosen, answerable, 0.0).items()}
    spans = [replace(r, prediction=r.withheld_answer if r.withheld_answer is not None else r.prediction,
                     confidence=None) for r in chosen]
    always = abstention_scores(spans, answerable, 0.0)
    rows[prefix + "has_f1_always"], rows[prefix + "f1_always"] = always["has_f1"], always["f1"]
    rows[prefix + "threshold"] = 0.0  # no confidence threshold: the null entry decides
    rows[prefix + "n"], rows[prefix + "has_n"] = len(chosen), sum(answerable[r.qid] for r in chosen)
    score = np.array([1.0 - (r.stop_probability or 0.0) for r in chosen])
    labels = np.array([answerable[r.qid] for r in chosen], dtype=bool)
    singles = np.array([squad2_question_scores(r.prediction, r.references)[1] for r in spans])
    best, best_at = best_threshold(list(score), list(labels), list(singles), [bool(r.prediction) for r in spans])
    rows[prefix + "best_f1"] = round(best, 2)
    rows[prefix + "best_threshold"] = round(best_at, 6) if np.isfinite(best_at) else 1.0
    if 0 < labels.sum() < len(labels):
        rows[prefix + "auc"] = round(auc(labels, score), 3)
        at, _ = threshold_at_rule(score, labels, 100 * singles)
        ruled = [replace(r, confidence=float(s)) for r, s in zip(spans, score, strict=True)]
        rows |= {f"{prefix}rule_{k}": v for k, v in abstention_scores(ruled, answerable, at).items()}
        rows[prefix + "rule_threshold"] = round(at, 6)
    return rows


def verifier_rows(results: list[QAResult], mode: str, answerable: dict[str, bool], verifier) -> dict[str, float]:
    chosen = [r for r in results if r.mode == mode]
    prefix = f"qa2/{mode}+verifier/"
    rows = {prefix + k: v for k, v in abstention_scores(chosen, answerable, 0.0, verifier).items()}
    rows[prefix + "threshold"] = verifier.threshold
    rows[prefix + "keep_confidence"] = verifier.keep_confidence
    always = abstention_scores(chosen, answerable, 0.0)
    rows[prefix + "has_f1_always"], rows[prefix + "f1_always"] = always["has_f1"], always["f1"]
    rows[prefix + "has_n"] = sum(answerable[r.qid] for r in chosen)
    rows[prefix + "n"] = len(chosen)
    labels = np.array([answerable[r.qid] for r in chosen])
    if 0 < labels.sum() < len(labels):
        rows[prefix + "auc"] = round(auc(labels, np.array([1.0 if r.answerable is None else r.answerable
                                                           for r in chosen])), 3)
        rows[f"qa2/{mode}/auc"] = round(auc(labels, np.array([r.confidence or 0.0 for r in chosen])), 3)
    return rows


def evaluate_squad2(data_path: str | Path, config: SquadEvalConfig, model, tokenizer, threshold: float,
                    on_progress: Callable[[int, int], None] | None = None,
                    on_result: Callable[[QAResult], None] | None = None, reranker=None, verifier=None,
                    reader=None) -> tuple[dict, list[QAResult]]:
    """Answer every sampled question (always, recording confidences), then score with abstention below
    `threshold`. Returns (summary, results). Abstention follows the greedy first token's confidence whatever
    the start beam (`config.start_beam`, None: `reranker`'s), which only changes the answers given. With
    `verifier`, every answer is also verified (after all are decoded) and scored both ways. Mode "reader" needs
    `reader`, a loaded span reader (`reader_rows`)."""
    data = read_squad(data_path, unanswerable=True)
    examples = sample_examples(data, config.limit, config.seed, config.articles)
    total, done = len(examples) * len(config.modes), [0]

    def tick(result):
        done[0] += 1
        if on_result:
            on_result(result)
        if on_progress:
            on_progress(done[0], total)

    start_beam = default_start_beam(reranker) if config.start_beam is None else config.start_beam
    results = evaluate_oracle(model, tokenizer, examples, data.passages, list(config.modes), config.distractors,
                              config.seed, config.max_new_tokens, on_result=tick, batch_size=config.batch_size,
                              passage_prior=config.passage_prior, end_bias=config.end_bias,
                              start_beam=start_beam, reranker=reranker, reader=reader)
    answerable = {e.qid: e.answerable for e in examples}
    verify_ms = verify_results(model, tokenizer, verifier, results, data.passages) if verifier else None
    summary = summarize_squad2(results, answerable, threshold, verifier)
    if verify_ms is not None:
        summary["latency/verify_ms"] = round(verify_ms, 1)
    summary["eval/passage_prior"] = config.passage_prior
    summary["eval/start_beam"] = start_beam
    summary["eval/end_bias"] = model.config.end_bias if config.end_bias is None else config.end_bias
    summary["eval/questions"] = len(examples)
    summary["eval/unanswerable"] = sum(not a for a in answerable.values())
    return summary, results


def write_squad2_report(out_dir: str | Path, summary: dict, results: list[QAResult], title: str) -> None:
    """results.jsonl, summary.json, report.md and a bar plot of HasAns F1 / NoAns accuracy / overall F1."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.jsonl", "w") as handle:
        for result in results:
            handle.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    modes = sorted({k.split("/")[1] for k in summary if k.startswith("qa2/")})
    rows = "\n".join(
        f"| {m} | {summary[f'qa2/{m}/n']} | {summary[f'qa2/{m}/threshold']:.3f} | {summary[f'qa2/{m}/has_f1']:.1f} "
        f"({summary[f'qa2/{m}/has_f1_always']:.1f}) | {summary[f'qa2/{m}/noans_acc']:.1f} | "
        f"{summary[f'qa2/{m}/em']:.1f} | {summary[f'qa2/{m}/f1']:.1f} | {summary.get(f'qa2/{m}/best_f1', '')} |"
        for m in modes)
    score_of = {m: "verifier" if "+" in m else "1 - p(null)" if m == "reader" else "confidence" for m in modes}
    aucs = "".join(f"- AUC answerable over unanswerable, {score_of[m]} ({m}): "
                   f"{summary[f'qa2/{m}/auc']}\n" for m in modes if f"qa2/{m}/auc" in summary)
    if "qa2/reader/rule_threshold" in summary:
        aucs += (f"- reader at the 5-point rule's threshold ({summary['qa2/reader/rule_threshold']:.3f} on "
                 f"1 - p(null)): HasAns F1 {summary['qa2/reader/rule_has_f1']:.1f}, NoAns "
                 f"{summary['qa2/reader/rule_noans_acc']:.1f}, overall F1 {summary['qa2/reader/rule_f1']:.1f}\n")
    aucs = aucs + "\n" if aucs else ""
    bar_plot(out_dir / "abstention.png", modes,
              [[summary[f"qa2/{m}/has_f1"] for m in modes], [summary[f"qa2/{m}/noans_acc"] for m in modes],
               [summary[f"qa2/{m}/f1"] for m in modes]], ["HasAns F1", "NoAns accuracy", "overall F1"], "%",
              f"{title}: abstention")
    (out_dir / "report.md").write_text(
        f"# {title}\n\nAnswers whose confidence is below the threshold are withheld (SQuAD 2.0 rules; in brackets, "
        "HasAns F1 when every question is answered). In the `+verifier` rows the answers the verifier scores below "
        "its threshold are withheld instead (cprag.decoding.verify). The span reader withholds where its null "
        "entry outscores every span (threshold 0: none applied); its AUC is read on 1 - p(null)."
        "\n\n| mode | n | threshold | HasAns F1 | NoAns acc "
        f"| EM | F1 | best F1 |\n|---|---|---|---|---|---|---|---|\n{rows}\n\n{aucs}![abstention](abstention.png)\n")
