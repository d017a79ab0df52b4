"""Fit the answer verifier of a checkpoint and tune its threshold; writes `verifier.json` beside the checkpoint.

    python pipelines/squad_negatives.py ../shared/data/squad-v1.1-train.json --out runs/negatives.json
    python pipelines/train_verifier.py ../shared/data/squad-v1.1-train.json runs/negatives.json \\
        ../shared/data/squad-v2.0-dev-public.json eval/squad2-full/results.jsonl --out runs/verifier

The head is fitted on `--pairs` answerable SQuAD v1.1 training questions beside their answer's sentence and as
many rule-made rewrites beside their original answer's sentence (`cprag.training.verifier_train`). It is then
scored on an `eval squad2` run's hidden answers (each answer's sentence found in the passages it read), and the
threshold is set by the project's rule: the most unanswerable questions withheld while HasAns F1 stays within 5
points of answering always, answers the copy path is confident in (`--keep-confidence`) never withheld. States are
cached in OUT (a rerun skips reading them); progress goes to OUT/progress.txt. Copy OUT/verifier.json into the
checkpoint directory to ship it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.verify import verifier_prompt, verifier_states
from cprag.evaluation.metrics import auc, threshold_at_rule
from cprag.evaluation.verified import found_sentence
from cprag.model.answer_verifier import PROMPT_TEMPLATE, AnswerVerifier
from cprag.model.checkpoint import load_model, model_fingerprint
from cprag.model.runtime import place, resolve_dtype
from cprag.training.verifier_train import fit_head, training_pairs

# chosen on the public SQuAD 2.0 half and the out-of-domain set together (eval/levers.md, "The verifier, shipped"):
# on real documents the confidence tells right answers from wrong and the verifier barely does
KEEP_CONFIDENCE = 0.30
LAYERS = [15, 22]  # besides the final norm's output: the screen of eval/levers.md ("A verifier that reads ...")


def answered_pairs(squad2: Path, results: Path) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray, np.ndarray]:
    """(sentence, question) of each hidden answer of an `eval squad2` run, with answerable, F1 and confidence."""
    data = json.loads(squad2.read_text(encoding="utf-8"))["data"]
    contexts = {f'{a["title"]}#{i}': p["context"] for a in data for i, p in enumerate(a["paragraphs"])}
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if row["mode"] == "hidden"]
    # an answer found in no passage (or none given) is read beside the start of the first passage
    pairs = [(found_sentence(row["prediction"], row["passages"], contexts)
              or contexts.get(row["passages"][0], "")[:300], row["question"]) for row in rows]
    return (pairs, np.array([bool(r["references"]) for r in rows]), np.array([r["f1"] for r in rows], float),
            np.array([r.get("confidence") or 0.0 for r in rows]))


def scores_when_withholding(withheld: np.ndarray, answerable: np.ndarray, f1: np.ndarray) -> tuple[float, float]:
    """(HasAns F1, overall F1) when the `withheld` answers say "no answer" instead: right for the unanswerable."""
    has = np.where(withheld, 0.0, f1)[answerable].mean()
    overall = np.where(answerable, np.where(withheld, 0.0, f1), np.where(withheld, 100.0, f1)).mean()
    return float(has), float(overall)


def cached_states(path: Path, model, tokenizer, texts: list[str], progress: Path) -> torch.Tensor:
    if path.exists():
        states = torch.load(path)
        if len(states) == len(texts):
            return states
    start = time.time()

    def report(done: int) -> None:
        progress.write_text(f"{path.name}: {done}/{len(texts)} prompts read, {time.time() - start:.0f} s\n")

    states = verifier_states(model, tokenizer, texts, LAYERS, on_progress=report)
    torch.save(states, path)
    return states


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", type=Path, help="SQuAD v1.1 train JSON")
    parser.add_argument("negatives", type=Path, help="pipelines/squad_negatives.py output over the same file")
    parser.add_argument("squad2", type=Path, help="the SQuAD 2.0 file the results were computed on")
    parser.add_argument("results", type=Path, help="an `eval squad2` run's results.jsonl (hidden mode)")
    parser.add_argument("--pairs", type=int, default=4000, help="answerable and rewritten questions, each")
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--keep-confidence", type=float, default=KEEP_CONFIDENCE,
                        help="answers the copy path is at least this confident in are never withheld (default "
                             f"{KEEP_CONFIDENCE}; above 1: off)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / "progress.txt"
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.checkpoint)
    fingerprint = model_fingerprint(model)
    model = place(model, "cpu", resolve_dtype("cpu"))
    pairs = training_pairs(args.train, args.negatives, args.pairs, args.seed)
    started = time.time()
    states = cached_states(args.out / "train_states.pt", model, tokenizer,
                           [verifier_prompt(p.sentence, p.question) for p in pairs], progress)
    labels = torch.tensor([p.label for p in pairs])
    mean, scale, weight, bias = fit_head(states, labels, args.weight_decay)
    tests, answerable, f1, confidence = answered_pairs(args.squad2, args.results)
    test_states = cached_states(args.out / "test_states.pt", model, tokenizer,
                                [verifier_prompt(s, q) for s, q in tests], progress)
    seconds = time.time() - started
    head = AnswerVerifier(layers=LAYERS, hidden_size=model.config.hidden_size, mean=mean.tolist(),
                          scale=scale.tolist(), weight=weight.tolist(), bias=bias, threshold=0.0,
                          prompt=PROMPT_TEMPLATE, fingerprint=fingerprint)
    score = head.probability(test_states).numpy()
    head.keep_confidence = args.keep_confidence
    gated = np.where(confidence >= args.keep_confidence, 2.0, score)  # kept whatever the verifier says
    threshold, withheld = threshold_at_rule(gated, answerable, f1)
    ungated_threshold, ungated_withheld = threshold_at_rule(score, answerable, f1)
    conf_threshold, conf_withheld = threshold_at_rule(confidence, answerable, f1)
    head.threshold = round(min(threshold, 1.0), 6)
    has_f1, overall_f1 = scores_when_withholding(gated < head.threshold, answerable, f1)
    head.fitted_on = (f"{args.pairs} answerable SQuAD v1.1 training questions and {args.pairs} rule-made rewrites "
                      f"(seed {args.seed}); threshold: most unanswerable withheld within 5 HasAns F1 of answering "
                      f"always, on {len(tests)} SQuAD 2.0 answers ({args.results}), answers with confidence "
                      f"at least {args.keep_confidence} kept")
    head.save(args.out)
    summary = {"verifier/train_pairs": len(pairs), "verifier/test_questions": len(tests),
               "verifier/test_unanswerable": int((~answerable).sum()),
               "verifier/train_auc": round(auc(labels.numpy() == 1, head.probability(states).numpy()), 3),
               "verifier/auc": round(auc(answerable, score), 3), "verifier/threshold": head.threshold,
               "verifier/noans_at_rule": round(withheld, 3), "verifier/has_f1_at_rule": round(has_f1, 2),
               "verifier/overall_f1_at_rule": round(overall_f1, 2),
               "always/has_f1": round(float(f1[answerable].mean()), 2),
               "verifier/keep_confidence": args.keep_confidence,
               "verifier/ungated_threshold": round(ungated_threshold, 6),
               "verifier/ungated_noans_at_rule": round(ungated_withheld, 3),
               "confidence/auc": round(auc(answerable, confidence), 3),
               "confidence/threshold_at_rule": round(conf_threshold, 6), "confidence/noans_at_rule": round(
                   conf_withheld, 3), "verifier/states_seconds": round(seconds, 1)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'verifier.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
