"""Would more features or a hidden layer make a better start reranker? Article-grouped 5-fold CV on the records
`eval/scripts/rerank_collect.py` writes, for feature sets beyond `cprag.decoding.rerank.span_features` and for a
one-hidden-layer scorer. Made `eval/rerank/variants.json` (summed up in `eval/levers.md`).

    python eval/scripts/rerank_variants.py /tmp/cprag-rerank/train.jsonl [--beam 4] [--out eval/rerank/variants.json]

Feature sets (added to the shipped ones): `pscore`, the retriever's cosine of the candidate's passage below the
best passage's; `spanmean`, the lexical features averaged over every copied entry of the span (not only its ends);
`agree`, how many other candidates share a word with it and the largest such overlap; `nest`, whether its text is
inside another candidate's or holds one. Scorers: linear (the shipped form) or linear plus `tanh` hidden units,
both trained with the shipped `best` listwise loss. Every row is paired against the shipped setting (linear, base
features, L2 0.001) on the same questions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.rerank import SpanCandidate, span_features
from cprag.model.lexical import STOPWORDS

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rerank_fit import article_of_record  # noqa: E402  (the fit's own grouping of records by article)

FEATURE_SETS = ("base", "pscore", "spanmean", "agree+nest", "pscore+spanmean+agree+nest")
SCORERS = ((0, 1e-3), (0, 1e-2), (16, 1e-2), (16, 1e-1), (32, 3e-2))  # (hidden units, L2)


def content_words(text: str) -> list[str]:
    """The words `span_features` compares: lower-cased, alphanumeric, longer than one letter, not stopwords."""
    return [w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 1 and w not in STOPWORDS]


def word_overlap(a: list[str], b: list[str]) -> float:
    """Token F1 of two word lists (0 when either is empty), as in `span_features`."""
    common = sum(min(a.count(w), b.count(w)) for w in set(a))
    return 0.0 if common == 0 else 2 * common / (len(a) + len(b))


def extra_features(record: dict, alternatives: list[dict], kinds: str, span_size: int) -> torch.Tensor:
    scores, words = record.get("passage_scores"), [content_words(a["answer"]) for a in alternatives]
    rows = []
    for i, a in enumerate(alternatives):
        others = [b for j, b in enumerate(alternatives) if j != i]
        row = []
        if "pscore" in kinds:
            row.append(0.0 if a["passage"] is None or scores is None else scores[a["passage"]] - max(scores))
        if "spanmean" in kinds:
            row.extend(a["span_prior_mean"] or [0.0] * span_size)
        if "agree" in kinds:
            overlaps = [word_overlap(words[i], words[j]) for j in range(len(alternatives)) if j != i]
            row.extend([sum(o > 0 for o in overlaps) / max(len(overlaps), 1), max(overlaps, default=0.0)])
        if "nest" in kinds:
            text = a["answer"].strip().lower()
            row.extend([float(bool(text) and any(text in b["answer"].lower() for b in others)),
                        float(any(b["answer"].strip() and b["answer"].strip().lower() in text for b in others))])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def build(raw: list[dict], beam: int, kinds: str) -> list[dict]:
    span_size = max(len(a["span_prior_mean"]) for r in raw for a in r["alternatives"] if a["span_prior_mean"])
    records = []
    for r in raw:
        alternatives = r["alternatives"][:beam]
        if len(alternatives) < beam:
            continue
        candidates = [SpanCandidate(a["answer"], a["token_log_probs"], a["log_prob"], a["first_prior"],
                                    a["last_prior"], a["passage"]) for a in alternatives]
        features = span_features(r["question"], candidates)
        if kinds != "base":
            features = torch.cat([features, extra_features(r, alternatives, kinds, span_size)], 1)
        records.append({"article": article_of_record(r), "features": features,
                        "f1": torch.tensor([a["f1"] for a in alternatives]),
                        "em": torch.tensor([a["em"] for a in alternatives])})
    return records


def fit(records: list[dict], hidden: int, l2: float):
    """A scorer (features (B, F) -> (B,)) trained with the `best` listwise loss."""
    stacked = torch.cat([r["features"] for r in records])
    mean, scale = stacked.mean(0), stacked.std(0).clamp(min=1e-3)
    useful = [r for r in records if float(r["f1"].max() - r["f1"].min()) > 0]
    features = (torch.stack([r["features"] for r in useful]) - mean) / scale  # (N, B, F)
    f1 = torch.stack([r["f1"] for r in useful])
    best = (f1 == f1.max(1, keepdim=True).values).float()
    targets = best / best.sum(1, keepdim=True)
    generator = torch.Generator().manual_seed(0)
    linear = torch.zeros(features.shape[-1], requires_grad=True)
    inner = (torch.randn(features.shape[-1], hidden, generator=generator) * 0.1).requires_grad_()
    bias, outer = torch.zeros(hidden, requires_grad=True), (torch.randn(hidden, generator=generator) * 0.1)
    outer.requires_grad_()
    params = [linear] + ([inner, bias, outer] if hidden else [])

    def score(z):
        return z @ linear + (torch.tanh(z @ inner + bias) @ outer if hidden else 0)

    optimizer = torch.optim.LBFGS(params, max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        value = -(targets * torch.log_softmax(score(features), -1)).sum(1).mean()
        value = value + l2 * sum((p ** 2).sum() for p in params)
        value.backward()
        return value

    optimizer.step(closure)
    return lambda f: score((f - mean) / scale).detach()


def cross_validated(records: list[dict], hidden: int, l2: float, folds: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(EM, F1) per question of the candidate each fold's scorer picks, in record order."""
    articles = sorted({r["article"] for r in records})
    fold_of = {a: i % folds for i, a in enumerate(np.random.default_rng(0).permutation(articles))}
    em, f1 = np.zeros(len(records)), np.zeros(len(records))
    for fold in range(folds):
        scorer = fit([r for r in records if fold_of[r["article"]] != fold], hidden, l2)
        for i, r in enumerate(records):
            if fold_of[r["article"]] == fold:
                choice = int(scorer(r["features"]).argmax())
                em[i], f1[i] = float(r["em"][choice]), float(r["f1"][choice])
    return em, f1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", type=Path)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "rerank" / "variants.json")
    args = parser.parse_args(argv)
    raw = [json.loads(line) for line in args.train.read_text().splitlines()]
    rows, shipped, bootstrap = [], None, np.random.default_rng(0)
    for kinds in FEATURE_SETS:
        records = build(raw, args.beam, kinds)
        for hidden, l2 in SCORERS:
            em, f1 = cross_validated(records, hidden, l2)
            shipped = f1 if shipped is None else shipped
            change = f1 - shipped
            draws = [change[bootstrap.integers(0, len(change), len(change))].mean() for _ in range(1000)]
            rows.append({"features": kinds, "hidden": hidden, "l2": l2, "n": len(records),
                         "cv_em": round(float(em.mean()), 2), "cv_f1": round(float(f1.mean()), 2),
                         "greedy_f1": round(float(np.mean([float(r["f1"][0]) for r in records])), 2),
                         "f1_minus_shipped_ci95": [round(float(np.percentile(draws, q)), 2) for q in (2.5, 97.5)]})
            print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"variants/beam": args.beam, "variants/rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
