"""Decoding from several first tokens (`generate(..., start_beam=B)`) against greedy decoding, on the seeded
1,000-question sample of the public dev half that `cprag eval squad DEV --oracle --limit 1000` asks (hidden mode,
gold passage + 4 same-article distractors, official EM / F1).

    python eval/scripts/start_beam.py ../shared/data/squad-v1.1-dev-public.json [--beam 4] [--questions 1000]
        [--out eval/start-beam] [--workdir /tmp/cprag-start-beam]

One decode per question at the largest beam gives every smaller one: alternatives come in the order of their
first token's probability, so beam B is the first B of them, and the greedy answer is the first. Each alternative
is scored as log p(its tokens, then the end) / length ** alpha, for alpha in 0 (the answer's probability), 0.5
and 1 (per token). Answers stream to WORKDIR/answers.jsonl, so an interrupted run resumes. The first
`--timed` questions are also decoded greedily for the latency ratio of the same run. Writes summary.json,
report.md and f1_by_beam.png to OUT.

Report: `eval/start-beam/` (summary.json, report.md, f1_by_beam.png).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from cprag.decoding.generate import generate
from cprag.evaluation.metrics import paired_interval, squad2_question_scores
from cprag.evaluation.oracle_qa import OracleMemory, oracle_passage_ids
from cprag.evaluation.squad import read_squad
from cprag.evaluation.squad_eval import bar_plot, sample_examples
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py

ALPHAS = (0.0, 0.5, 1.0)


def decode_all(args) -> list[dict]:
    model, tokenizer = load_model(args.checkpoint)
    data = read_squad(args.data)
    examples = sample_examples(data, args.questions, args.seed)
    log = args.workdir / "answers.jsonl"
    done = {json.loads(line)["qid"]: json.loads(line) for line in log.read_text().splitlines()} \
        if log.is_file() else {}
    memory, all_ids = OracleMemory(model, tokenizer, data.passages), sorted(data.passages)
    rng = random.Random(args.seed)
    started = time.time()
    for number, example in enumerate(examples):
        chosen = oracle_passage_ids(example, all_ids, 4, rng)  # drawn for every question: the same memories
        if example.qid in done:
            continue
        shards = memory.get(chosen)
        tick = time.perf_counter()
        beam = generate(model, tokenizer, example.question, shards, "hidden", 32, start_beam=args.beam)
        record = {"qid": example.qid, "beam_ms": (time.perf_counter() - tick) * 1000, "alternatives": [
            {"answer": a.answer, "log_prob": a.log_prob, "tokens": len(a.token_ids),
             **dict(zip(("em", "f1"), (100 * s for s in squad2_question_scores(a.answer, example.answers)),
                        strict=True))} for a in beam.alternatives]}
        if number < args.timed:
            tick = time.perf_counter()
            greedy = generate(model, tokenizer, example.question, shards, "hidden", 32)
            record["greedy_ms"] = (time.perf_counter() - tick) * 1000
            assert greedy.answer == beam.alternatives[0].answer  # the first alternative is the greedy answer
        done[example.qid] = record
        with open(log, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if len(done) % 25 == 0:
            print(f"{time.strftime('%H:%M:%S')} {len(done)}/{len(examples)} "
                  f"({(time.time() - started) / 60:.1f} min)", file=sys.stderr, flush=True)
    return [done[e.qid] for e in examples]


def choose(record: dict, beam: int, alpha: float) -> dict:
    alternatives = record["alternatives"][:beam]
    return max(alternatives, key=lambda a: a["log_prob"] / max(a["tokens"], 1) ** alpha)



def summarize(records: list[dict], max_beam: int) -> dict:
    greedy_f1 = np.array([r["alternatives"][0]["f1"] for r in records])
    greedy_em = np.array([r["alternatives"][0]["em"] for r in records])
    summary: dict = {"beam/n": len(records)}
    for beam in range(1, max_beam + 1):
        best = [max(r["alternatives"][:beam], key=lambda a: a["f1"]) for r in records]
        summary[f"beam/{beam}/oracle_f1"] = round(float(np.mean([b["f1"] for b in best])), 2)
        for alpha in ALPHAS if beam > 1 else (0.0,):
            picked = [choose(r, beam, alpha) for r in records]
            f1s, ems = np.array([p["f1"] for p in picked]), np.array([p["em"] for p in picked])
            key = f"beam/{beam}/alpha{alpha:g}"
            summary[f"{key}/em"], summary[f"{key}/f1"] = round(float(ems.mean()), 2), round(float(f1s.mean()), 2)
            if beam > 1:
                summary[f"{key}/f1_minus_greedy_ci95"] = paired_interval(f1s, greedy_f1)
                summary[f"{key}/em_minus_greedy_ci95"] = paired_interval(ems, greedy_em)
                summary[f"{key}/changed"] = int(sum(p is not r["alternatives"][0] for p, r in zip(picked, records,
                                                                                                  strict=True)))
    timed = [r for r in records if "greedy_ms" in r]
    if timed:
        summary["latency/timed_n"] = len(timed)
        summary["latency/beam_over_greedy"] = round(sum(r["beam_ms"] for r in timed) /
                                                    sum(r["greedy_ms"] for r in timed), 2)
    return summary


def report(summary: dict, max_beam: int, checkpoint: Path) -> str:
    rows = [f"| 1 (greedy) | | {summary['beam/1/alpha0/em']:.1f} | {summary['beam/1/alpha0/f1']:.1f} | | | "
            f"{summary['beam/1/oracle_f1']:.1f} |"]
    for beam in range(2, max_beam + 1):
        for alpha in ALPHAS:
            key = f"beam/{beam}/alpha{alpha:g}"
            rows.append(f"| {beam} | {alpha:g} | {summary[key + '/em']:.1f} | {summary[key + '/f1']:.1f} | "
                        f"{summary[key + '/f1_minus_greedy_ci95']} | {summary[key + '/changed']} | "
                        f"{summary[f'beam/{beam}/oracle_f1']:.1f} |")
    table = "\n".join(rows)
    latency = (f"Decoding {max_beam} starts took {summary['latency/beam_over_greedy']}× the greedy time per question "
               f"(the first {summary['latency/timed_n']} questions, both in this run).") \
        if "latency/beam_over_greedy" in summary else ""
    return f"""# Start beam: decoding from several first tokens

`python eval/scripts/start_beam.py DEV --beam {max_beam}`: checkpoint `{checkpoint}`, the seeded
{summary['beam/n']}-question sample of the public dev half
(`cprag eval squad DEV --oracle --limit {summary['beam/n']}`), hidden mode, gold passage + 4 same-article
distractors, official EM / F1. Beam B decodes greedily from each of the B most probable first tokens and answers
with the alternative of the highest log p(tokens, end) / length ** alpha. `changed`: questions whose answer differs
from the greedy one. `oracle F1`: the best alternative per question, picked by its F1 (the ceiling of any way to
choose among them). Intervals: paired bootstrap, 95%, 10,000 resamples.

| beam | alpha | EM | F1 | F1 − greedy (95% CI) | changed | oracle F1 |
|---|---|---|---|---|---|---|
{table}

{latency}

![F1 by beam](f1_by_beam.png)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed", type=int, default=100, help="questions also decoded greedily, for latency")
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "start-beam")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cprag-start-beam"))
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    records = decode_all(args)
    summary = summarize(records, args.beam)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "report.md").write_text(report(summary, args.beam, args.checkpoint))
    labels = [str(b) for b in range(1, args.beam + 1)]
    series = [[summary["beam/1/alpha0/f1"]] + [summary[f"beam/{b}/alpha{a:g}/f1"] for b in range(2, args.beam + 1)]
              for a in ALPHAS] + [[summary[f"beam/{b}/oracle_f1"] for b in range(1, args.beam + 1)]]
    bar_plot(args.out / "f1_by_beam.png", labels, series, [f"alpha {a:g}" for a in ALPHAS] + ["oracle"],
             "F1 (%)", f"Hidden F1 by start beam (n={summary['beam/n']})")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
