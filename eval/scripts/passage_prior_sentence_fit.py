"""Would a sentence prior help? The passage prior's idea one level down, measured teacher-forced.

Records, per question (gold passage + 4 same-article distractors, the passage-prior fit's questions), the CP
head's first-step scores over every memory entry, the retriever's cosine of the question to each passage, and the
same embedder's cosine to each sentence (`cprag.model.lexical.sentence_ids` over the passage's tokens, decoded).
Offline it sweeps `score + w_p (s_p - max s) + w_s (c_sentence - max c)` and asks, as `passage_prior_fit.py` does,
whether the best entry starts the answer; paired bootstrap against the shipped passage prior alone (w_p = 15,
w_s = 0). It also splits the wrong starts by where they land: in the answer's sentence, elsewhere in the gold
passage, or in a distractor.

    python eval/scripts/passage_prior_sentence_fit.py ../shared/data/squad-v1.1-train.json --unseen --articles 60 \\
        --questions 2000 --records /tmp/sentence.jsonl --out eval/passage-prior

Resumable: records already in `--records` are kept. Writes sentence_fit.json to OUT.

Report: `eval/passage-prior/sentence_fit.json` (the sentence prior in `eval/levers.md`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.evaluation.oracle_qa import OracleMemory, retrieval_scores
from cprag.evaluation.squad import read_squad
from cprag.index.retrieve import MiniLMEmbedder
from cprag.model.checkpoint import load_model
from cprag.model.lexical import sentence_ids
from cprag.training.recipe import add_fit_question_arguments, fit_questions, resume_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
from passage_prior_fit import answer_entries, first_step_scores  # noqa: E402  (the passage-prior fit's own record)

PASSAGE_WEIGHTS = (0, 10, 15, 20)
SENTENCE_WEIGHTS = (0, 2, 4, 6, 8, 10, 15, 20, 30)


def collect(args) -> list[dict]:
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    examples, chosen = fit_questions(args.data, data, tokenizer, args.questions, args.seed,
                                     args.seen if args.unseen else None, args.articles)
    done, todo = resume_records(args.records, examples)
    if todo:
        similarities = retrieval_scores([examples[i].question for i in todo], [chosen[i] for i in todo],
                                        data.passages)
        memory, prefix = OracleMemory(model, tokenizer, data.passages), prompt_prefix(model, tokenizer)
        memory.get(sorted({pid for i in todo for pid in chosen[i]}))
        embedder = MiniLMEmbedder("cpu")
        questions = embedder.embed([examples[i].question for i in todo])
        sentences: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # passage id -> (entry sentence, vectors)
        started = time.time()
        with args.records.open("a") as handle:
            for n, (i, similarity) in enumerate(zip(todo, similarities, strict=True)):
                example, shards = examples[i], memory.get(chosen[i])
                attention, owner = first_step_scores(model, tokenizer, prefix, example.question, shards)
                entry_sentence, cosine = [], []
                for pid, shard in zip(chosen[i], shards, strict=True):
                    if pid not in sentences:
                        ids = sentence_ids(tokenizer, shard.ids)
                        texts = [tokenizer.decode(shard.ids[ids == s].tolist(), skip_special_tokens=True).strip()
                                 or "." for s in range(int(ids.max()) + 1)]
                        sentences[pid] = (ids.numpy(), embedder.embed(texts))
                    ids, vectors = sentences[pid]
                    entry_sentence.extend((ids + len(cosine)).tolist())
                    cosine.extend((vectors @ questions[n]).tolist())
                gold = chosen[i].index(example.passage_id)
                record = {"qid": example.qid, "scores": [round(float(x), 3) for x in attention],
                          "owner": owner.tolist(), "similarity": [round(s, 5) for s in similarity], "gold": gold,
                          "sentence": entry_sentence, "sentence_cosine": [round(c, 5) for c in cosine],
                          "answer_entries": answer_entries(tokenizer, example.context, example.answers,
                                                           int(np.flatnonzero(owner == gold)[0]))}
                handle.write(json.dumps(record) + "\n")
                done[example.qid] = record
                if n % 100 == 0:
                    print(f"{time.strftime('%H:%M:%S')} {n}/{len(todo)} ({time.time() - started:.0f} s)",
                          file=sys.stderr, flush=True)
    return [done[e.qid] for e in examples]


def best_entry(record: dict, passage_weight: float, sentence_weight: float) -> int:
    similarity, owner = np.asarray(record["similarity"]), np.asarray(record["owner"])
    cosine, sentence = np.asarray(record["sentence_cosine"]), np.asarray(record["sentence"])
    return int((np.asarray(record["scores"]) + passage_weight * (similarity - similarity.max())[owner]
                + sentence_weight * (cosine - cosine.max())[sentence]).argmax())


def where(record: dict, entry: int) -> str:
    """Where a first token lands: the answer, the answer's sentence, the gold passage, or a distractor."""
    sentence = np.asarray(record["sentence"])
    if entry in record["answer_entries"]:
        return "answer"
    if sentence[entry] in {sentence[e] for e in record["answer_entries"]}:
        return "answer_sentence"
    return "gold_passage" if record["owner"][entry] == record["gold"] else "distractor"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_question_arguments(parser, questions=2000)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = [r for r in collect(args) if r["answer_entries"]]
    shipped = np.array([where(r, best_entry(r, 15, 0)) == "answer" for r in records], dtype=float)
    bootstrap, rows = np.random.default_rng(args.seed), []
    for passage_weight in PASSAGE_WEIGHTS:
        for sentence_weight in SENTENCE_WEIGHTS:
            landed = [where(r, best_entry(r, passage_weight, sentence_weight)) for r in records]
            right = np.array([w == "answer" for w in landed], dtype=float)
            change = right - shipped
            draws = [change[bootstrap.integers(0, len(change), len(change))].mean() for _ in range(1000)]
            rows.append({"passage_weight": passage_weight, "sentence_weight": sentence_weight,
                         **{f"start/{k}": round(100 * landed.count(k) / len(landed), 2)
                            for k in ("answer", "answer_sentence", "gold_passage", "distractor")},
                         "delta_vs_shipped_ci95": [round(100 * float(np.percentile(draws, q)), 2)
                                                   for q in (2.5, 97.5)]})
            print(json.dumps(rows[-1]))
    cosine_top = np.mean([int(np.argmax(r["sentence_cosine"])) in {r["sentence"][e] for e in r["answer_entries"]}
                          for r in records])
    summary = {"sentence/questions": len(records), "sentence/embedder_top_sentence_holds_answer": round(
        100 * float(cosine_top), 2), "sentence/rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sentence_fit.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "sentence/rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
