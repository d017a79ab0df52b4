"""How well must an abstention score separate answerable from unanswerable questions to meet a NoAns target?

Takes one `cprag eval squad2 --modes hidden` results.jsonl (per-question F1 of the answer given when answering
always) and replaces the abstention score with synthetic ones of known separation: binormal scores, unanswerable
~ N(0, 1) and answerable ~ N(mu, 1), so AUC = Phi(mu / sqrt 2). For each AUC it applies the project's 5-point rule
(`cprag.evaluation.metrics.threshold_at_rule`: withhold as many unanswerable questions as HasAns F1 allows within
5 points of answering always) and prints NoAns, HasAns F1 and overall F1, averaged over seeds.

The answerable scores are drawn independently of whether the answer is right, so a real score that also withholds
wrong answers first does somewhat better at the same AUC (the shipped verifier, AUC 0.693 on the whole public half,
withholds 29.7% ungated, where this model gives about 25%); the rows say which AUC is needed, not what a score
reaches.

    python eval/scripts/abstention_auc_needed.py eval/squad2-full/results.jsonl --json
"""
from __future__ import annotations

import argparse
import json
from statistics import NormalDist

import numpy as np

from cprag.evaluation.metrics import RULE_DROP, auc, threshold_at_rule


def outcome(score: np.ndarray, answerable: np.ndarray, f1: np.ndarray) -> dict[str, float]:
    """NoAns (%), HasAns F1 and overall F1 when answers scoring below the 5-point rule's threshold are withheld."""
    threshold, noans = threshold_at_rule(score, answerable, f1)
    kept = score >= threshold
    has = float(np.where(kept, f1, 0.0)[answerable].mean())
    overall = float((np.where(kept, f1, 0.0)[answerable].sum() + 100.0 * (~kept)[~answerable].sum()) / len(f1))
    return {"auc": auc(answerable, score), "noans": 100 * noans, "hasans_f1": has, "overall_f1": overall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.jsonl of `cprag eval squad2 --modes hidden`")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    rows = [json.loads(line) for line in open(args.results)]
    answerable = np.array([bool(r["references"]) for r in rows])
    f1 = np.array([float(r["f1"]) if r["references"] else 0.0 for r in rows])
    always = float(f1[answerable].mean())
    table = []
    for target in (0.65, 0.70, 0.75, 0.80, 0.825, 0.85, 0.875, 0.90, 0.95):
        mu = 2 ** 0.5 * NormalDist().inv_cdf(target)
        runs = []
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            runs.append(outcome(answerable * mu + rng.standard_normal(len(rows)), answerable, f1))
        table.append({k: round(float(np.mean([r[k] for r in runs])), 3 if k == "auc" else 1) for k in runs[0]})
    if args.json:
        print(json.dumps({"questions": len(rows), "unanswerable": int((~answerable).sum()),
                          "hasans_f1_always": round(always, 1), "rule_drop": RULE_DROP, "rows": table}, indent=2))
        return
    print(f"{len(rows)} questions, {(~answerable).sum()} unanswerable; HasAns F1 answering always {always:.1f}")
    print("| AUC | NoAns at the rule | HasAns F1 | overall F1 |\n|---|---|---|---|")
    for row in table:
        print(f"| {row['auc']:.3f} | {row['noans']:.1f}% | {row['hasans_f1']:.1f} | {row['overall_f1']:.1f} |")


if __name__ == "__main__":
    main()
