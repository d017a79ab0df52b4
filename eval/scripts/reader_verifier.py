"""The span reader as the verifier of hidden answers: after hidden mode has chosen its span, the reader reads the
question with the one passage the span was copied from, and says whether the passage answers it.

    python eval/scripts/reader_verifier.py --out eval/reader-verify/summary.json

Inputs are hidden-mode results that name each question's passages (`cprag eval squad2 ... --out` and `cprag eval
squad ... --out` write them): by default the seeded 1,000 of the public SQuAD 2.0 half (`eval/squad2-verify`, which
also carries the shipped logistic verifier's scores) and the seeded 1,000 of SQuAD v1.1 dev (`eval/squad-verify`).
For each answer it reads the first passage in memory order that holds the answer's text, so one passage a
question, not k. It prints:

- the AUC, answerable over unanswerable, of the hidden confidence, the logistic verifier and the reader's scores
  (1 - p(null), and the margin of its best span over its null entry);
- SQuAD 2.0 figures (official rules: HasAns F1, NoAns accuracy, overall F1) for each way of using the reader:
  withhold where its null entry wins, keeping the hidden span or giving the reader's own span where the two
  disagree; withhold below the 5-point rule's threshold on 1 - p(null) (the most unanswerable withheld while
  HasAns F1 stays within 5 points of answering always); and the best threshold for overall F1;
- each rule's cost on SQuAD v1.1 dev, where every question has an answer (F1 against answering always, and the
  share of exactly right answers withheld);
- the reader's milliseconds per verified question, and the CPU.

The thresholds are fitted and scored on the same public half; apply them elsewhere to see whether they carry. A
reader trained on part of that half (`pipelines/squad_folds.py`) is scored on the other part only (`--held-out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from cprag.decoding.span_read import read_passages
from cprag.evaluation.metrics import auc, best_threshold, squad2_question_scores, threshold_at_rule
from cprag.evaluation.oracle_qa import QAResult
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad2 import abstention_scores
from cprag.model.cpu_features import cpu_name
from cprag.model.reader_checkpoint import load_reader
from cprag.model.runtime import DTYPES


def source_passage(row: dict, passages: dict[str, tuple[str, str]]) -> str | None:
    """The first passage in memory order whose text holds the hidden answer; None for an empty answer."""
    if not row["prediction"]:
        return None
    for passage_id in row["passages"]:
        text = passages[passage_id][1]
        if row["prediction"] in text:
            return text
    return None


def read_sources(reader, tokenizer, rows: list[dict], passages: dict, batch_size: int) -> tuple[list, float]:
    """The reader's answer over each row's source passage (None where there is none), and ms per question read."""
    sources = [source_passage(r, passages) for r in rows]
    asked = [i for i, s in enumerate(sources) if s is not None]
    answers: list = [None] * len(rows)
    started = time.perf_counter()
    for first in range(0, len(asked), batch_size):
        group = asked[first: first + batch_size]
        for i, answer in zip(group, read_passages(reader, tokenizer, [rows[i]["question"] for i in group],
                                                  [[sources[i]] for i in group]), strict=True):
            answers[i] = answer
    return answers, 1000 * (time.perf_counter() - started) / max(len(asked), 1)


def scores(answers: list) -> dict[str, np.ndarray]:
    """Per row: 1 - p(null) and the span-over-null margin (0 and -inf where nothing was read)."""
    p = np.array([0.0 if a is None else 1.0 - a.null_probability for a in answers])
    margin = np.array([-np.inf if a is None else a.score - a.null_score for a in answers])
    return {"p_answerable": p, "margin": margin}


def figures(rows: list[dict], predictions: list[str]) -> dict[str, float]:
    """Official SQuAD 2.0 figures (percent) of these predictions ("" withholds)."""
    results = [replace(QAResult(**r), prediction=p, confidence=None) for r, p in zip(rows, predictions, strict=True)]
    return abstention_scores(results, {r["qid"]: bool(r["references"]) for r in rows}, 0.0)


def disagree(hidden: str, answer) -> bool:
    return answer is not None and squad2_question_scores(answer.text, [hidden])[1] == 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--squad2-results", default="eval/squad2-verify/results.jsonl")
    parser.add_argument("--squad2-data", default="../shared/data/squad-v2.0-dev-public.json")
    parser.add_argument("--squad-results", default="eval/squad-verify/results.jsonl")
    parser.add_argument("--squad-data", default="../shared/data/squad-v1.1-dev-public.json")
    parser.add_argument("--held-out", help="score only the SQuAD 2.0 questions of this file: the fold of the public "
                        "half the reader did not train on (pipelines/squad_folds.py)")
    parser.add_argument("--reader", help="the span reader's folder (default: the shipped one)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args(argv)

    reader, tokenizer = load_reader(args.reader, dtype=DTYPES[args.dtype])
    summary: dict = {"cpu": cpu_name(), "dtype": args.dtype, "reader": args.reader or "shipped"}

    rows = [r for r in map(json.loads, open(args.squad2_results)) if r["mode"] == "hidden"]
    if args.held_out:  # out of fold: the questions of the articles the reader never read
        held = {q.qid for q in read_squad(args.held_out, unanswerable=True).examples}
        rows = [r for r in rows if r["qid"] in held]
        summary["held_out"] = args.held_out
    passages = read_squad(args.squad2_data, unanswerable=True).passages
    answers, ms = read_sources(reader, tokenizer, rows, passages, args.batch_size)
    labels = np.array([bool(r["references"]) for r in rows])
    hidden = [r["prediction"] for r in rows]
    score = scores(answers)
    spans = [r["prediction"] if a is None else a.text for r, a in zip(rows, answers, strict=True)]
    hidden_f1 = np.array([100 * squad2_question_scores(p, r["references"])[1] for p, r in zip(hidden, rows,
                                                                                              strict=True)])
    rule_at, _ = threshold_at_rule(score["p_answerable"], labels, hidden_f1)
    best, best_at = best_threshold(list(score["p_answerable"]), list(labels), list(hidden_f1 / 100),
                                   [bool(p) for p in hidden])
    says_no = [a is None or a.no_answer for a in answers]
    policies = {
        "hidden, answering always": hidden,
        "reader's null entry withholds, hidden span kept": ["" if no else h for h, no in zip(hidden, says_no,
                                                                                           strict=True)],
        "reader's null entry withholds, reader's span where they disagree":
            ["" if no else (a.text if disagree(h, a) else h) for h, a, no in zip(hidden, answers, says_no,
                                                                                 strict=True)],
        "5-point rule on 1 - p(null), hidden span kept":
            ["" if s < rule_at else h for h, s in zip(hidden, score["p_answerable"], strict=True)],
        "best threshold on 1 - p(null), hidden span kept":
            ["" if s < best_at else h for h, s in zip(hidden, score["p_answerable"], strict=True)],
    }
    summary["squad2"] = {
        "n": len(rows), "unanswerable": int((~labels).sum()), "verified": sum(a is not None for a in answers),
        "reader_ms_per_question": round(ms, 1),
        "auc": {"hidden confidence": round(auc(labels, np.array([r["confidence"] or 0.0 for r in rows])), 3),
                "reader 1 - p(null)": round(auc(labels, score["p_answerable"]), 3),
                "reader span - null margin": round(auc(labels, score["margin"]), 3)},
        "rule_threshold": round(float(rule_at), 6), "best_threshold": round(float(best_at), 6),
        "best_f1": round(best, 2),
        "reader says no answer": int(sum(says_no)),
        "disagree, reader sure": sum(disagree(h, a) and not a.no_answer for h, a in zip(hidden, answers,
                                                                                       strict=True)),
        "reader's own span (answering always)": figures(rows, spans),
        "policies": {name: figures(rows, p) for name, p in policies.items()},
    }
    if any(r.get("answerable") is not None for r in rows):  # an answer it did not score counts as kept (1.0)
        summary["squad2"]["auc"]["logistic verifier"] = round(auc(labels, np.array(
            [1.0 if r.get("answerable") is None else r["answerable"] for r in rows])), 3)

    if args.squad_results:
        rows1 = [r for r in map(json.loads, open(args.squad_results)) if r["mode"] == "hidden"]
        answers1, _ = read_sources(reader, tokenizer, rows1, read_squad(args.squad_data).passages, args.batch_size)
        hidden1 = [r["prediction"] for r in rows1]
        score1 = scores(answers1)["p_answerable"]
        right = np.array([r["em"] == 100.0 for r in rows1])
        no1 = np.array([a is None or a.no_answer for a in answers1])
        applied = {"null entry": no1, "5-point rule": score1 < rule_at, "best threshold": score1 < best_at}
        summary["squad"] = {"n": len(rows1), "f1 answering always": figures(rows1, hidden1)["f1"]}
        for name, withheld in applied.items():
            kept = ["" if w else h for h, w in zip(hidden1, withheld, strict=True)]
            summary["squad"][name] = {"f1": figures(rows1, kept)["f1"], "withheld": round(float(withheld.mean()), 4),
                                      "right withheld": round(float(withheld[right].mean()), 4)}

    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
