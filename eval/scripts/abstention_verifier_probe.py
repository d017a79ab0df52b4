"""Would a verifier that reads the question beside the answer's sentence tell unanswerable questions apart?

The hidden-mode confidence barely does (SQuAD 2.0 AUC 0.53): the question meets the passage only through one CP
query per step. This measures the other design: the backbone reads "Context: <the sentence the answer was copied
from>, Question: <q>" (about 60 tokens, one extra pass per answer), and a logistic probe on its frozen hidden states
(the last token's, at layers 15, 22 and the final norm) scores whether the sentence answers the question.

The probe is trained on SQuAD v1.1 train only: answerable questions with their answer's sentence against the
rewritten unanswerable questions of `pipelines/squad_negatives.py` with their original answer's sentence (and,
with --wrong-sentences, answerable questions beside the paragraph's best-matching other sentence). It is scored
on an `cprag eval squad2` run's results.jsonl: each prediction's sentence in its passage, read from the SQuAD 2.0
file. Prints the AUC (answerable above unanswerable) and the share of unanswerable questions withheld at the
shipped rule (HasAns F1 at most 5 below answering always), for the probe, the confidence, and both ranks summed.

    python pipelines/squad_negatives.py ../shared/data/squad-v1.1-train.json --out negatives.json
    python eval/scripts/abstention_verifier_probe.py ../shared/data/squad-v1.1-train.json negatives.json \\
        ../shared/data/squad-v2.0-dev-public.json eval/squad2/results.jsonl [--pairs 3000] [--out DIR]

With --crossfit-folds N, probes are also fitted on the SQuAD 2.0 results themselves, whose unanswerable questions
are human-written: each question is scored by a probe fitted on the other folds' articles (out of fold), alone and
with the rewrite pairs added.

Not a shipped path: the backbone would read one sentence of a document, which hidden mode otherwise never does.

Report: `eval/abstention/verifier-full/summary.json` (`--out`; the verifier lever in `eval/levers.md`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import numpy as np
import torch

from cprag.decoding.verify import answer_sentence, sentence_spans, verifier_prompt, verifier_states
from cprag.evaluation.metrics import auc, threshold_at_rule
from cprag.model.checkpoint import load_model
from cprag.model.runtime import place, resolve_dtype
from cprag.training.verifier_train import fit_head

STOPWORDS = set("the a an of in on at to for by with from and or is are was were be been what which who whom whose "
                "when where why how did do does that this these those it its as into than".split())
LAYERS = (15, 22)  # besides the final norm's output


def sentence_at(text: str, offset: int) -> str:
    return answer_sentence(text, offset)


def words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS and len(w) > 1}


def probe_features(model, tokenizer, texts: list[str], batch: int = 16) -> np.ndarray:
    """(N, 3H) the last token's hidden state at LAYERS and after the final norm (cprag.decoding.verify)."""
    return verifier_states(model, tokenizer, texts, list(LAYERS), batch_size=batch).numpy()


def fit_probe(features: np.ndarray, labels: np.ndarray, weight_decay: float = 1e-2):
    """Standardised L2 logistic regression (LBFGS, cprag.training.verifier_train.fit_head); the scoring function."""
    mean, scale, weight, bias = fit_head(torch.tensor(features), torch.tensor(labels), weight_decay)
    return lambda f: (((torch.tensor(f) - mean) / scale) @ weight + bias).numpy()


def withheld_at_rule(score: np.ndarray, answerable: np.ndarray, f1: np.ndarray, drop: float = 5.0) -> float:
    """The largest share of unanswerable questions withheld (score below a threshold) while HasAns F1 stays within
    `drop` points of answering always."""
    return threshold_at_rule(score, answerable, f1, drop)[1]


def training_pairs(train_file: Path, negatives_file: Path, pairs: int, wrong_sentences: bool, seed: int):
    rng = random.Random(seed)
    answerable = [(qa, p["context"]) for a in json.loads(train_file.read_text())["data"] for p in a["paragraphs"]
                  for qa in p["qas"]]
    rewritten = [(qa, p["context"]) for a in json.loads(negatives_file.read_text())["data"]
                 for p in a["paragraphs"] for qa in p["qas"] if qa.get("is_impossible")]
    rng.shuffle(answerable)
    rng.shuffle(rewritten)
    texts, labels = [], []
    for qa, context in answerable[:pairs]:
        gold = sentence_at(context, qa["answers"][0]["answer_start"])
        texts.append(verifier_prompt(gold, qa["question"]))
        labels.append(1)
        others = [context[a:b] for a, b in sentence_spans(context) if context[a:b] != gold]
        if wrong_sentences and others:
            asked = words(qa["question"])
            texts.append(verifier_prompt(max(others, key=lambda s: len(asked & words(s))), qa["question"]))
            labels.append(0)
    for qa, context in rewritten[:pairs]:
        texts.append(verifier_prompt(sentence_at(context, qa["plausible_answers"][0]["answer_start"]), qa["question"]))
        labels.append(0)
    return texts, np.array(labels)


def test_pairs(squad2_file: Path, results_file: Path):
    data = json.loads(squad2_file.read_text())["data"]
    contexts = {f'{a["title"]}#{i}': p["context"] for a in data for i, p in enumerate(a["paragraphs"])}
    rows = [json.loads(line) for line in results_file.read_text().splitlines() if line.strip()]
    texts = []
    for row in rows:
        sentence = None
        for passage in row["passages"]:
            found = contexts.get(passage, "").find(row["prediction"]) if row["prediction"] else -1
            if found >= 0:
                sentence = sentence_at(contexts[passage], found)
                break
        texts.append(verifier_prompt(sentence or contexts.get(row["passages"][0], "")[:300], row["question"]))
    answerable = np.array([bool(row["references"]) for row in rows])
    return (texts, answerable, np.array([row["f1"] for row in rows], dtype=float),
            np.array([row.get("confidence") or 0.0 for row in rows]))


def article_folds(squad2_file: Path, results_file: Path, folds: int) -> np.ndarray:
    """(N,) the fold of each result row: whole articles, sorted by title and dealt round-robin into `folds`."""
    data = json.loads(squad2_file.read_text())["data"]
    title = {qa["id"]: a["title"] for a in data for p in a["paragraphs"] for qa in p["qas"]}
    rows = [json.loads(line) for line in results_file.read_text().splitlines() if line.strip()]
    names = sorted({title[row["qid"]] for row in rows})
    return np.array([names.index(title[row["qid"]]) % folds for row in rows])


def out_of_fold(features: np.ndarray, labels: np.ndarray, fold: np.ndarray, weight_decay: float,
                extra: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Each row scored by a probe fitted on the other folds' rows (plus `extra` pairs, when given)."""
    score = np.zeros(len(labels))
    for k in np.unique(fold):
        held = fold == k
        x, y = features[~held], labels[~held]
        if extra is not None:
            x, y = np.concatenate([x, extra[0]]), np.concatenate([y, extra[1]])
        score[held] = fit_probe(x.astype(np.float32), y.astype(np.float32), weight_decay)(
            features[held].astype(np.float32))
    return score


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train", type=Path, help="SQuAD v1.1 train JSON")
    parser.add_argument("negatives", type=Path, help="pipelines/squad_negatives.py output over the same file")
    parser.add_argument("squad2", type=Path, help="the SQuAD 2.0 file the results were computed on")
    parser.add_argument("results", type=Path, help="a `cprag eval squad2` run's results.jsonl (hidden mode)")
    parser.add_argument("--pairs", type=int, default=3000, help="answerable and rewritten questions, each")
    parser.add_argument("--wrong-sentences", action="store_true", help="also answerable beside a wrong sentence")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write summary.json here")
    parser.add_argument("--crossfit-folds", type=int, default=0,
                        help="also probes fitted on the SQuAD 2.0 results themselves (their human-written "
                             "unanswerable questions), scored out of fold over this many folds of whole articles")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.checkpoint)
    model = place(model, "cpu", resolve_dtype("cpu"))
    texts, labels = training_pairs(args.train, args.negatives, args.pairs, args.wrong_sentences, args.seed)
    tests, answerable, f1, confidence = test_pairs(args.squad2, args.results)
    features = probe_features(model, tokenizer, texts + tests)
    probe = fit_probe(features[: len(texts)], labels, args.weight_decay)
    score = probe(features[len(texts) :])
    both = np.argsort(np.argsort(score)) + np.argsort(np.argsort(confidence))
    summary = {"verifier/train_pairs": len(texts), "verifier/test_questions": len(tests),
               "verifier/test_unanswerable": int((~answerable).sum()),
               "verifier/train_auc": round(auc(labels == 1, probe(features[: len(texts)])), 3)}
    scores = {"probe": score, "confidence": confidence, "probe+confidence": both}
    if args.crossfit_folds > 1:
        fold = article_folds(args.squad2, args.results, args.crossfit_folds)
        tested = features[len(texts) :]
        scores["crossfit"] = out_of_fold(tested, answerable.astype(float), fold, args.weight_decay)
        scores["crossfit+rewrites"] = out_of_fold(tested, answerable.astype(float), fold, args.weight_decay,
                                                  (features[: len(texts)], labels.astype(float)))
        summary["verifier/crossfit_folds"] = args.crossfit_folds
    for name, values in scores.items():
        summary[f"verifier/{name}/auc"] = round(auc(answerable, values), 3)
        summary[f"verifier/{name}/noans_at_rule"] = round(withheld_at_rule(values, answerable, f1), 3)
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
