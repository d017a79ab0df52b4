"""Fit the start reranker (`cprag.decoding.rerank`) on decoded training-file questions and measure it on validation.

    python eval/scripts/rerank_fit.py /tmp/cprag-rerank/train.jsonl /tmp/cprag-rerank/dev.jsonl [--out eval/rerank]
        [--save cprag/checkpoints/default]

Both files come from `eval/scripts/rerank_collect.py`. Every choice (the beam, the scorer: linear with a loss and an L2
strength, or one hidden GELU layer with a width and a number of epochs) is made by 5-fold cross-validation on the
training records, grouped by article; validation is scored once, with the chosen settings, against greedy decoding
on the same questions (paired bootstrap 95% intervals). Writes summary.json to OUT (the report is written by hand
from it), and with `--save` the reranker to that checkpoint directory.

Report: `eval/rerank/summary.json` (`summary-linear.json`: the previous checkpoint's linear fit), summed up by hand in
`eval/rerank/report.md`; `--save` writes the shipped `reranker.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.rerank import SpanCandidate, StartReranker, span_features
from cprag.evaluation.metrics import paired_interval

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py

LOSSES = ("best", "expected")
L2 = (1e-3, 1e-2, 1e-1, 1.0)
# one hidden layer: (units, epochs, seeds); AdamW, weight decay 0.1, the `best` loss, batches of 128 questions
HIDDEN = ((16, 10, 1), (64, 5, 1), (64, 10, 1), (16, 10, 5))
HIDDEN_WEIGHT_DECAY = 0.1


@dataclass(frozen=True)
class Scorer:
    """One setting the cross-validation compares."""

    loss: str = "best"
    l2: float = 0.0  # linear only
    hidden: int = 0  # 0: linear
    epochs: int = 0  # hidden layer only
    seeds: int = 1  # hidden layer only: members trained from this many seeds, their scores averaged

    @property
    def name(self) -> str:
        if not self.hidden:
            return f"{self.loss}/l2={self.l2:g}"
        return f"hidden={self.hidden}/epochs={self.epochs}" + (f"/seeds={self.seeds}" if self.seeds > 1 else "")


SCORERS = tuple(Scorer(loss, l2) for loss in LOSSES for l2 in L2) + tuple(
    Scorer("best", hidden=units, epochs=epochs, seeds=seeds) for units, epochs, seeds in HIDDEN)


def article_of_record(record: dict) -> str:
    """The article a record's question is from, which cross-validation folds group by: recorded by `collect.py`,
    or read from a training-file id (explore-ARTICLE-PARAGRAPH-QUESTION) in records written before it was."""
    return record.get("article") or "-".join(record["qid"].split("-")[:2])


def load(path: Path, beam: int) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        alternatives = record["alternatives"][:beam]
        candidates = [SpanCandidate(a["answer"], a["token_log_probs"], a["log_prob"], a["first_prior"],
                                    a["last_prior"], a["passage"]) for a in alternatives]
        records.append({"qid": record["qid"], "article": article_of_record(record),
                        "features": span_features(record["question"], candidates),
                        "f1": torch.tensor([a["f1"] for a in alternatives]),
                        "em": torch.tensor([a["em"] for a in alternatives])})
    return records


def _training_set(records: list[dict], loss: str):
    """Normalisation and the listwise problem: (mean, scale, features (N, B, F), targets (N, B)), over the questions
    where the choice matters (the candidates' F1 differ)."""
    stacked = torch.cat([r["features"] for r in records])
    mean, scale = stacked.mean(0), stacked.std(0).clamp(min=1e-3)
    useful = [r for r in records if float(r["f1"].max() - r["f1"].min()) > 0]
    features = (torch.stack([r["features"] for r in useful]) - mean) / scale  # (N, B, F)
    f1 = torch.stack([r["f1"] for r in useful]) / 100  # (N, B)
    best = (f1 == f1.max(1, keepdim=True).values).float()
    return mean, scale, features, best / best.sum(1, keepdim=True) if loss == "best" else f1


def _listwise_loss(scores: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    log_p = torch.log_softmax(scores, -1)  # (N, B)
    return (-(targets * log_p).sum(1) if loss == "best" else -(targets * log_p.exp()).sum(1)).mean()


def fit(records: list[dict], scorer: Scorer, beam: int = 0, seed: int = 0) -> StartReranker:
    """A reranker trained listwise on `records` (each with the same number of candidates)."""
    mean, scale, features, targets = _training_set(records, scorer.loss)
    if not scorer.hidden:
        weights = torch.zeros(features.shape[-1], requires_grad=True)
        optimizer = torch.optim.LBFGS([weights], max_iter=500, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            value = _listwise_loss(features @ weights, targets, scorer.loss) + scorer.l2 * (weights ** 2).sum()
            value.backward()
            return value

        optimizer.step(closure)
        return StartReranker(weights.detach().tolist(), mean.tolist(), scale.tolist(), beam, {})
    members = [_hidden_layer(features, targets, scorer, seed + member) for member in range(scorer.seeds)]
    # the mean of the members' scores is one wider layer: their units side by side, output weights over seeds
    return StartReranker([w / scorer.seeds for _, _, out in members for w in out], mean.tolist(), scale.tolist(),
                         beam, {}, hidden=[row for inner, _, _ in members for row in inner],
                         hidden_bias=[b for _, bias, _ in members for b in bias])


def _hidden_layer(features: torch.Tensor, targets: torch.Tensor, scorer: Scorer, seed: int):
    """(W (H, F), b (H,), w (H,)) of one GELU layer trained listwise by AdamW, as lists."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(features.shape[-1], scorer.hidden), torch.nn.GELU(),
                              torch.nn.Linear(scorer.hidden, 1, bias=False))
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=HIDDEN_WEIGHT_DECAY)
    for _ in range(scorer.epochs):
        order = torch.randperm(len(features), generator=generator)
        for first in range(0, len(order), 128):
            batch = order[first : first + 128]
            value = _listwise_loss(net(features[batch]).squeeze(-1), targets[batch], scorer.loss)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
    return net[0].weight.detach().tolist(), net[0].bias.detach().tolist(), net[2].weight.detach()[0].tolist()


def picked(records: list[dict], reranker: StartReranker) -> tuple[np.ndarray, np.ndarray]:
    """EM and F1 of the reranker's choice on each record."""
    with torch.no_grad():
        choices = [int(reranker.scores(r["features"]).argmax()) for r in records]
    return (np.array([float(r["em"][c]) for r, c in zip(records, choices, strict=True)]),
            np.array([float(r["f1"][c]) for r, c in zip(records, choices, strict=True)]))


def cross_validated_f1(records: list[dict], scorer: Scorer, folds: int = 5) -> np.ndarray:
    """Each record's out-of-fold F1 (folds grouped by article), in the records' order."""
    articles = sorted({r["article"] for r in records})
    fold_of = {a: i % folds for i, a in enumerate(np.random.default_rng(0).permutation(articles))}
    f1 = np.zeros(len(records))
    for fold in range(folds):
        train = [r for r in records if fold_of[r["article"]] != fold]
        test = [i for i, r in enumerate(records) if fold_of[r["article"]] == fold]
        f1[test] = picked([records[i] for i in test], fit(train, scorer))[1]
    return f1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", type=Path)
    parser.add_argument("validation", type=Path)
    parser.add_argument("--beams", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "rerank")
    parser.add_argument("--save", type=Path, help="checkpoint directory to write reranker.json into")
    args = parser.parse_args(argv)
    summary: dict = {}
    best, best_linear = None, None  # (CV gain over greedy, beam, scorer, out-of-fold F1s)
    for beam in args.beams:
        train = load(args.train, beam)
        greedy_cv = float(np.mean([float(r["f1"][0]) for r in train]))
        summary[f"cv/{beam}/greedy_f1"] = round(greedy_cv, 2)
        for scorer in SCORERS:
            f1 = cross_validated_f1(train, scorer)
            summary[f"cv/{beam}/{scorer.name}/f1"] = round(float(f1.mean()), 2)
            print(f"beam {beam} {scorer.name}: cv F1 {f1.mean():.2f} (greedy {greedy_cv:.2f})", file=sys.stderr)
            candidate = (float(f1.mean()) - greedy_cv, beam, scorer, f1)
            if best is None or candidate[0] > best[0]:
                best = candidate
            if not scorer.hidden and (best_linear is None or candidate[0] > best_linear[0]):
                best_linear = candidate
    _, beam, scorer, cv_f1 = best
    if best_linear[1] == beam:  # the same questions: the chosen scorer paired against the best linear one
        summary["cv/chosen_minus_best_linear_ci95"] = paired_interval(cv_f1, best_linear[3])
    train, validation = load(args.train, beam), load(args.validation, beam)
    reranker = fit(train, scorer, beam)
    em, f1 = picked(validation, reranker)
    greedy_em = np.array([float(r["em"][0]) for r in validation])
    greedy_f1 = np.array([float(r["f1"][0]) for r in validation])
    summary.update({
        "chosen/beam": beam, "chosen/scorer": scorer.name, "train/n": len(train),
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
        summary[f"validation/beam{other}/rerank_f1"] = round(float(picked(records, fit(
            load(args.train, other), scorer))[1].mean()), 2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        reranker.fitted_on = {"train": args.train.name, "train/n": len(train), "scorer": scorer.name,
                              **{k: v for k, v in summary.items() if k.startswith("validation/")}}
        reranker.save(args.save)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
