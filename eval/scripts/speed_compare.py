"""Today's code against a baseline commit, in one run: `cprag index` encoding speed, hidden `ask` latency at k=5,
and questions per second one at a time against 16 per batch.

    python eval/scripts/speed_compare.py ../shared/data/squad-v1.1-dev-public.json --baseline 25939f2 --out eval/speed

The baseline is checked out into a temporary git worktree and run from the same virtual environment with its own
code and shipped checkpoint (each at its own default dtype). Both time `cprag index` (their own encoder) over 200
seeded SQuAD paragraphs, build an index of 40 others (the bench's `--documents 40` draw), then answer the same
questions with `Index.ask` at k=5, warm key shards, 8 warm-up questions first; today's tree then answers them with
`Index.ask_many` at 16 per batch. The two trees run one after the other, alternating, and the report takes each
tree's median over its runs, so a slow minute on a shared machine falls on both.
Writes summary.json and report.md to OUT.

Report: `eval/speed/summary.json` and `eval/speed/report.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs inside each tree (only APIs both trees have): index with the CLI, then time asks.
MEASURE = r"""
import inspect, json, statistics, sys, time
from pathlib import Path
from typer.testing import CliRunner
import cprag
assert Path(cprag.__file__).resolve().is_relative_to(Path.cwd().resolve()), cprag.__file__
from cprag.cli import app
from cprag.api import Index
corpus, index, questions, batch = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
encode_corpus = sys.argv[5]


def build(source, target):
    result = CliRunner().invoke(app, ["index", source, "--index", target, "--rebuild", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


built = build(encode_corpus, index + "-encode")  # the encoding figure, over more tokens than the asks' corpus
build(corpus, index)
opened = Index(index)
options = dict(k=5, min_confidence=0.0, min_retrieval_score=-1.0)
if "start_beam" in inspect.signature(opened.ask).parameters:
    options["start_beam"] = 1  # greedy, as every commit compared decodes (the default became the reranked beam)
for q in questions[:8]:
    opened.ask(q, **options)  # warm: shards cached, first-call costs paid
times, answers = [], []
for q in questions:
    tick = time.perf_counter()
    answers.append(opened.ask(q, **options).answer)
    times.append((time.perf_counter() - tick) * 1000)
figures = {"encode_tokens_per_second": built["encode_tokens_per_second"], "encode_tokens": built["tokens_encoded"],
           "dtype": built.get("dtype", "float32"),
           "ask_p50_ms": statistics.median(times), "ask_mean_ms": statistics.fmean(times),
           "qps@1": len(questions) / (sum(times) / 1000)}
if batch and hasattr(opened, "ask_many"):
    tick = time.perf_counter()
    batched = opened.ask_many(questions, batch_size=batch, **options)
    figures[f"qps@{batch}"] = len(questions) / (time.perf_counter() - tick)
    figures["batch_answers_identical"] = int([a.answer for a in batched] == answers)
    figures["batch_answers_agreeing"] = sum(a.answer == b for a, b in zip(batched, answers))
    if "dtype" in inspect.signature(Index).parameters:  # exactness apart from bf16 rounding: the same in fp32
        exact = Index(index, dtype="float32")
        singles = [exact.ask(q, **options).answer for q in questions]
        figures["batch_answers_identical_float32"] = int(
            [a.answer for a in exact.ask_many(questions, batch_size=batch, **options)] == singles)
print("FIGURES " + json.dumps(figures))
"""


def questions_for(titles: list[str], count: int) -> list[str]:
    forms = ["What is said about {}?", "When did {} happen?", "Who is behind {}?", "Where is {}?"]
    asked = [form.format(title) for form in forms for title in titles]
    return (asked * (count // max(len(asked), 1) + 1))[:count]


def run_tree(tree: Path, corpus: Path, encode_corpus: Path, scratch: Path, questions: list[str], batch: int
             ) -> dict:
    index = scratch / f"index-{tree.name}"
    command = [sys.executable, "-c", MEASURE, str(corpus), str(index), json.dumps(questions), str(batch),
               str(encode_corpus)]
    env = {**{k: v for k, v in os.environ.items() if k != "CPRAG_DTYPE"}, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("FIGURES "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path, help="SQuAD JSON: each paragraph is a document")
    parser.add_argument("--baseline", default="25939f2", help="the commit to compare against")
    parser.add_argument("--documents", type=int, default=40, help="the asks' corpus")
    parser.add_argument("--encode-documents", type=int, default=200, help="the encoding figure's corpus")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "speed")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from cprag.index.corpus import read_corpus

    everything = read_corpus(args.corpus).documents
    documents = random.Random(args.seed).sample(everything, args.documents)
    encoded = random.Random(args.seed + 1).sample(everything, args.encode_documents)
    questions = questions_for([d.title or d.id for d in documents], args.questions)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        corpus, encode_corpus = scratch / "corpus.jsonl", scratch / "encode-corpus.jsonl"
        for path, chosen in ((corpus, documents), (encode_corpus, encoded)):
            path.write_text("".join(json.dumps({"id": d.id, "title": d.title, "text": d.text}) + "\n"
                                    for d in chosen))
        baseline = scratch / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            runs = {"baseline": [], "today": []}
            for _ in range(args.rounds):
                runs["baseline"].append(run_tree(baseline, corpus, encode_corpus, scratch, questions, args.batch))
                runs["today"].append(run_tree(ROOT, corpus, encode_corpus, scratch, questions, args.batch))
                print(json.dumps({name: values[-1] for name, values in runs.items()}), file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    median = {name: {key: statistics.median(r[key] for r in values) for key in values[0]
                     if isinstance(values[0][key], (int, float))} for name, values in runs.items()}
    old, new = median["baseline"], median["today"]
    summary = {
        "speed/baseline_commit": args.baseline, "speed/commit": head, "speed/documents": args.documents,
        "speed/questions": args.questions, "speed/rounds": args.rounds,
        "speed/dtype_baseline": runs["baseline"][0]["dtype"], "speed/dtype": runs["today"][0]["dtype"],
        "speed/encode_tokens": runs["today"][0]["encode_tokens"],
        "speed/encode_tps_baseline": round(old["encode_tokens_per_second"], 1),
        "speed/encode_tps": round(new["encode_tokens_per_second"], 1),
        "speed/encode_tps_over_baseline": round(new["encode_tokens_per_second"] / old["encode_tokens_per_second"], 2),
        "speed/ask_p50_ms_baseline": round(old["ask_p50_ms"], 1), "speed/ask_p50_ms": round(new["ask_p50_ms"], 1),
        "speed/ask_p50_over_baseline": round(new["ask_p50_ms"] / old["ask_p50_ms"], 3),
        "speed/qps@1": round(new["qps@1"], 2), f"speed/qps@{args.batch}": round(new[f"qps@{args.batch}"], 2),
        f"speed/qps@{args.batch}_over_qps@1": round(new[f"qps@{args.batch}"] / new["qps@1"], 2),
        "speed/batch_answers_identical": int(all(r.get("batch_answers_identical", 0) for r in runs["today"])),
        # bf16 rounds differently at different batch shapes (oneDNN picks kernels by shape), so a few answers move;
        # fp32 shows whether batching itself changes any
        "speed/batch_answers_agreeing": min(r.get("batch_answers_agreeing", 0) for r in runs["today"]),
        "speed/batch_answers_identical_float32": int(all(r.get("batch_answers_identical_float32", 0)
                                                         for r in runs["today"])),
        "speed/runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in summary.items() if k != "speed/runs")
    title = f"# Today's code ({head}) against {args.baseline}, one run"
    (args.out / "report.md").write_text(f"{title}\n\n{__doc__}\n| figure | value |\n|---|---|\n{rows}\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "speed/runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
