"""Fit the end bias (`CPLMConfig.end_bias`, `cprag.decoding.step.with_end_bias`) on training-file questions a
checkpoint never saw.

For each question (gold passage + 4 same-article distractors, as `cprag eval squad --oracle` draws them, with the
checkpoint's passage prior) one model pass teacher-forces the gold answer's tokens, copied from their own passage
entries, and records at every step what greedy decoding weighs: the log-probability of the gold token, of the
best other token, and of ending. Offline, for each bias b added to ending's log-probability, it asks whether
greedy decoding would give exactly the gold answer: the first token right, every later choice the gold token
(word continuations are forced, as `whole_words` decoding forces them), then the end. Paired bootstrap
intervals against b = 0.

    python eval/scripts/end_bias_fit.py ../shared/data/squad-v1.1-train.json --unseen --articles 30 \\
        --questions 3000 --records /tmp/end.jsonl --out eval/end-bias [--save]

Resumable: records already in `--records` are kept. The chosen bias is 0 unless some bias beats 0 for sure (paired
95% interval above 0); then it is the one nearest 0 within 0.05 points of the best exact rate. `--save` writes it
into the checkpoint's config.json as `end_bias`.

Report: `eval/end-bias/fit.json`, summed up by hand in `eval/end-bias/report.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cprag.api import load_passage_prior
from cprag.decoding.memory import lexical_prior, shared_memory
from cprag.decoding.passage_prior import passage_bias
from cprag.decoding.prompt import end_of_turn_id, prompt_ids
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.decoding.step import Step
from cprag.evaluation.oracle_qa import OracleMemory, retrieval_scores
from cprag.evaluation.squad import answer_token_span, read_squad
from cprag.index.encode import tokenize_passage
from cprag.model.checkpoint import load_model
from cprag.model.config import CPLMConfig
from cprag.model.lexical import inside_word
from cprag.training.recipe import add_fit_question_arguments, fit_questions, resume_records

BIASES = (2, 1, 0.5, 0, -0.5, -1, -1.5, -2, -2.5, -3, -4, -5, -6)
NEG = -1e30


@torch.inference_mode()
def answer_steps(model, tokenizer, prefix, question: str, shards, scores, prior: float, gold: int,
                 span: tuple[int, int]) -> dict:
    """The greedy choices along the gold answer (tokens `span` of passage `gold`), teacher-forced."""
    memory, owner, _ = shared_memory(shards)
    memory.prior = lexical_prior(model, tokenizer, question, memory.ids[0])
    memory.bias = passage_bias(scores, [len(p.ids) for p in shards], prior, "cpu", memory.keys.dtype)
    continues = inside_word(tokenizer, memory.ids[0])
    memory.end_allowed = ~continues.unsqueeze(0)  # whole-word decoding: no span ends inside a word
    offset = int((owner == gold).nonzero()[0])
    entries = list(range(offset + span[0], offset + span[1] + 1))  # entry m pastes passage token m - offset
    tokens = [int(memory.ids[0, m]) for m in entries]
    prompt = prompt_ids(tokenizer, question)
    own = prompt[prefix.length :]
    out = model(torch.tensor([own + tokens]), memory=memory, context=prefix.context(),
                prev_source=torch.tensor([[-1] * len(own) + entries]),  # each answer token's own entry
                position_ids=torch.arange(prefix.length, len(prompt) + len(tokens)).unsqueeze(0))
    stop = torch.tensor(sorted({end_of_turn_id(tokenizer), tokenizer.eos_token_id}))
    steps = []
    for k in range(len(tokens) + 1):
        log_probs = Step.at(out, len(own) - 1 + k).log_probs.float()
        going_on = log_probs.index_fill(0, stop, NEG)
        if k == 0:  # the first token is never the end
            first = int(going_on.argmax())
            continue
        after = entries[k - 1] + 1
        forced = after < len(continues) and bool(continues[after]) and bool(owner[after] == owner[after - 1])
        gold_token = float(going_on[tokens[k]]) if k < len(tokens) else None
        other = going_on if k == len(tokens) else going_on.index_fill(0, torch.tensor([tokens[k]]), NEG)
        steps.append({"forced": forced, "end": round(float(log_probs[stop].max()), 4),
                      "other": round(float(other.max()), 4),
                      "gold": None if gold_token is None else round(gold_token, 4)})
    return {"first_ok": first == tokens[0], "steps": steps, "tokens": tokens}


def outcome(record: dict, bias: float) -> str:
    """What greedy decoding with `bias` on ending gives: exact, start (wrong first token), early (ends inside
    the answer), wrong (another token inside it), or overrun (goes on past its end)."""
    if not record["first_ok"]:
        return "start"
    steps = record["steps"]
    for k, step in enumerate(steps):
        end = step["end"] + bias
        if k == len(steps) - 1:
            return "exact" if not step["forced"] and end > step["other"] else "overrun"
        if step["forced"]:
            continue
        if end >= max(step["gold"], step["other"]):
            return "early"
        if step["other"] > step["gold"]:
            return "wrong"
    return "exact"


def collect(args) -> list[dict]:
    model, tokenizer = load_model(args.checkpoint)
    prior = load_passage_prior(args.checkpoint)
    data = read_squad(args.data)
    examples, chosen = fit_questions(args.data, data, tokenizer, args.questions, args.seed,
                                     args.seen if args.unseen else None, args.articles)
    done, todo = resume_records(args.records, examples)
    if todo:
        scores = retrieval_scores([examples[i].question for i in todo], [chosen[i] for i in todo], data.passages)
        memory, prefix = OracleMemory(model, tokenizer, data.passages), prompt_prefix(model, tokenizer)
        started = time.time()
        needed = sorted({pid for i in todo for pid in chosen[i]})
        memory.get(needed)  # every passage at once: encoded in full batches, several times faster than by question
        print(f"encoded {len(needed)} passages in {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        with args.records.open("a") as handle:
            for n, (i, similarity) in enumerate(zip(todo, scores, strict=True)):
                example = examples[i]
                offsets = tokenize_passage(tokenizer, example.context).offsets
                span = answer_token_span(offsets, example.answer_start, example.answer_start + len(example.answers[0]))
                record = {"qid": example.qid, "skipped": span is None}
                if span is not None:
                    record |= answer_steps(model, tokenizer, prefix, example.question, memory.get(chosen[i]),
                                           similarity, prior, chosen[i].index(example.passage_id), span)
                handle.write(json.dumps(record) + "\n")
                done[example.qid] = record
                if n % 100 == 0:
                    print(f"{time.strftime('%H:%M:%S')} {n}/{len(todo)} ({time.time() - started:.0f} s)",
                          file=sys.stderr, flush=True)
    return [done[e.qid] for e in examples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fit_question_arguments(parser, questions=3000)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args(argv)
    records = [r for r in collect(args) if not r["skipped"]]
    base = np.array([outcome(r, 0.0) == "exact" for r in records])
    bootstrap = np.random.default_rng(args.seed)
    rows = []
    for bias in BIASES:
        outcomes = [outcome(r, bias) for r in records]
        exact = np.array([o == "exact" for o in outcomes])
        change = exact.astype(float) - base
        draws = [change[bootstrap.integers(0, len(change), len(change))].mean() for _ in range(2000)]
        rows.append({"bias": bias, "exact": round(100 * exact.mean(), 2), "gained": int((exact & ~base).sum()),
                     "lost": int((base & ~exact).sum()),
                     "delta_ci95": [round(100 * float(np.percentile(draws, q)), 2) for q in (2.5, 97.5)],
                     **{kind: outcomes.count(kind) for kind in ("start", "early", "wrong", "overrun")}})
    # a bias only where it beats none for sure (paired 95% interval above 0); then the one nearest 0 within
    # 0.05 points of the best
    better = [r for r in rows if r["delta_ci95"][0] > 0]
    best = max((r["exact"] for r in better), default=None)
    chosen = 0.0 if best is None else min((r["bias"] for r in better if r["exact"] >= best - 0.05), key=abs)
    summary = {"end_bias/questions": len(records), "end_bias/chosen": chosen, "end_bias/rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fit.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in rows:
        print(json.dumps(r))
    print(f"chosen end bias {chosen} on {len(records)} questions")
    if args.save:
        stored = CPLMConfig.from_pretrained(args.checkpoint)
        stored.end_bias = float(chosen)
        stored.save_pretrained(args.checkpoint)
        print(f"wrote end_bias {chosen} to {args.checkpoint}/config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
