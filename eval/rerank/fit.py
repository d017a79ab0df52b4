"""Fit the start reranker (`cprag.rerank`) on decoded training-file questions and measure it on validation.

    python eval/rerank/fit.py /tmp/cprag-rerank/train.jsonl /tmp/cprag-rerank/dev.jsonl [--out eval/rerank]
        [--save cprag/checkpoints/default]

Both files come from `eval/rerank/collect.py`. Every choice (the beam, the loss, the L2 strength) is made by
5-fold cross-validation on the training records, grouped by article; validation is scored once, with the chosen
settings, against greedy decoding on the same questions (paired bootstrap 95% intervals). Writes summary.json and
report.md to OUT, and with `--save` the reranker to that checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from cprag.metrics import paired_interval
from cprag.rerank import SpanCandidate, StartReranker, span_features

LOSSES = ("best", "expected")
L2 = (1e-3, 1e-2, 1e-1, 1.0)


def load(path: Path, beam: int) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        alternatives = record["alternatives"][:beam]
        candidates = [SpanCandidate(a["answer"], a["token_log_probs"], a["log_prob"], a["first_prior"],
                                    a["last_prior"], a["passage"]) for a in alternatives]
        records.append({"qid": record["qid"], "article": record["qid"].rsplit("-", 1)[0],
                        "features": span_features(record["question"], candidates),
                        "f1": torch.tensor([a["f1"] for a in alternatives]),
                        "em": torch.tensor([a["em"] for a in alternatives])})
    return records


def fit(records: list[dict], loss: str, l2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights, mean and scale of a linear scorer trained listwise on `records` (each with the same number of
    candidates)."""
    stacked = torch.cat([r["features"] for r in records])
    mean, scale = stacked.mean(0), stacked.std(0).clamp(min=1e-3)
    # questions where the choice matters: the candidates' F1 differ
    useful = [r for r in records if float(r["f1"].max() - r["f1"].min()) > 0]
    features = (torch.stack([r["features"] for r in useful]) - mean) / scale  # (N, B, F)
    f1 = torch.stack([r["f1"] for r in useful]) / 100  # (N, B)
    best = (f1 == f1.max(1, keepdim=True).values).float()
    targets = best / best.sum(1, keepdim=True) if loss == "best" else f1
    weights = torch.zeros(features.shape[-1], requires_grad=True)
    optimizer = torch.optim.LBFGS([weights], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        log_p = torch.log_softmax(features @ weights, -1)  # (N, B)
        fitted = -(targets * log_p).sum(1) if loss == "best" else -(targets * log_p.exp()).sum(1)
        value = fitted.mean() + l2 * (weights ** 2).sum()
        value.backward()
        return value

    optimizer.step(closure)
    return weights.detach(), mean, scale


def picked(records: list[dict], weights, mean, scale) -> tuple[np.ndarray, np.ndarray]:
    choices = [int((((r["features"] - mean) / scale) @ weights).argmax()) for r in records]
    return (np.array([float(r["em"][c]) for r, c in zip(records, choices, strict=True)]),
            np.array([float(r["f1"][c]) for r, c in zip(records, choices, strict=True)]))


def cross_validated_f1(records: list[dict], loss: str, l2: float, folds: int = 5) -> float:
    articles = sorted({r["article"] for r in records})
    fold_of = {a: i % folds for i, a in enumerate(np.random.default_rng(0).permutation(articles))}
    f1s = []
    for fold in range(folds):
        train = [r for r in records if fold_of[r["article"]] != fold]
        test = [r for r in records if fold_of[r["article"]] == fold]
        f1s.extend(picked(test, *fit(train, loss, l2))[1])
    return float(np.mean(f1s))



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", type=Path)
    parser.add_argument("validation", type=Path)
    parser.add_argument("--beams", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("--save", type=Path, help="checkpoint directory to write reranker.json into")
    args = parser.parse_args(argv)
    summary: dict = {}
    best = None
    for beam in args.beams:
        train = load(args.train, beam)
        greedy_cv = float(np.mean([float(r["f1"][0]) for r in train]))
        summary[f"cv/{beam}/greedy_f1"] = round(greedy_cv, 2)
        for loss in LOSSES:
            for l2 in L2:
                score = cross_validated_f1(train, loss, l2)
                summary[f"cv/{beam}/{loss}/l2={l2:g}/f1"] = round(score, 2)
                print(f"beam {beam} {loss} l2 {l2:g}: cv F1 {score:.2f} (greedy {greedy_cv:.2f})", file=sys.stderr)
                if best is None or score - greedy_cv > best[0]:
                    best = (score - greedy_cv, beam, loss, l2)
    _, beam, loss, l2 = best
    train, validation = load(args.train, beam), load(args.validation, beam)
    weights, mean, scale = fit(train, loss, l2)
    em, f1 = picked(validation, weights, mean, scale)
    greedy_em = np.array([float(r["em"][0]) for r in validation])
    greedy_f1 = np.array([float(r["f1"][0]) for r in validation])
    summary.update({
        "chosen/beam": beam, "chosen/loss": loss, "chosen/l2": l2, "train/n": len(train),
        "validation/n": len(validation),
        "validation/greedy_em": round(float(greedy_em.mean()), 2),
        "validation/greedy_f1": round(float(greedy_f1.mean()), 2),
        "validation/rerank_em": round(float(em.mean()), 2), "validation/rerank_f1": round(float(f1.mean()), 2),
        "validation/em_minus_greedy_ci95": paired_interval(em, greedy_em),
        "validation/f1_minus_greedy_ci95": paired_interval(f1, greedy_f1),
        "validation/changed": int(sum(a != b for a, b in zip(f1, greedy_f1, strict=True))),
        "validation/oracle_f1": round(float(np.mean([float(r["f1"].max()) for r in validation])), 2),
    })
    for other in args.beams:  # the chosen settings at every beam, on validation, for the report
        records = load(args.validation, other)
        summary[f"validation/beam{other}/rerank_f1"] = round(float(picked(records, *fit(
            load(args.train, other), loss, l2))[1].mean()), 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        StartReranker(weights.tolist(), mean.tolist(), scale.tolist(), beam, {
            "train": args.train.name, "train/n": len(train), "loss": loss, "l2": l2,
            **{k: v for k, v in summary.items() if k.startswith("validation/")}}).save(args.save)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
