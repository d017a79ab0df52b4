"""Kill `cprag index` 100 times anywhere, resume, and report what was lost (see tests/index/kill_fuzz.py for a trial).

    python eval/scripts/reliability_kill_fuzz.py [--trials 100] [--out eval/reliability] [--workdir /tmp/cprag-fuzz]

Writes `summary.json` (every trial: its kills, what a reader saw after each, lost / duplicated / extra rows) and
`report.md`. Trials already in `trials.jsonl` are kept, so an interrupted run resumes. About 15 s a trial on 2
cores: each run of `cprag index` is a fresh process that imports torch.

Report: `eval/reliability/summary.json` and `eval/reliability/report.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root: eval/scripts/x.py
sys.path.insert(0, str(ROOT))  # the trial machinery is the test suite's (tests/index/kill_fuzz.py)

from tests.index.kill_fuzz import Trial, prepare, run_trial, summary  # noqa: E402
from tests.index.test_reliability import V1, V2  # noqa: E402
from tests.tiny_models import tiny_checkpoint  # noqa: E402

FAULTS = [
    ("SIGKILL at a random instant of the locked build", "time"),
    ("SIGKILL just before or after a LanceDB upsert or delete commit, the FAISS write, a file replace "
     "(FAISS ids, FAISS vectors, manifest) or the removal of the previous FAISS files", "event"),
]


def report(result: dict, seconds: float) -> str:
    events: dict[str, int] = {}
    for trial in result["trial_records"]:
        for kill in trial["kills"]:
            if kill["mode"] == "event":
                key = f"event {kill['event']} {kill['when']}"
                events[key] = events.get(key, 0) + 1
    readers = "\n".join(f"| {view} | {n} |" for view, n in sorted(result["reader_after_kill"].items()))
    kinds = {k: sum(t["kind"] == k for t in result["trial_records"]) for k in ("fresh", "update")}
    duration = f"{seconds / 60:.0f} min of trials on 2 cores" if seconds else "2 cores"
    return f"""# Kill anywhere: `cprag index` under SIGKILL

`python eval/scripts/reliability_kill_fuzz.py --trials {result['trials']}` ({duration}). Each trial runs the
real `cprag index` CLI (tiny model, one passage per commit) and kills it; {kinds['fresh']} trials build a fresh
index, {kinds['update']} update a finished one to a changed corpus (a changed document, a shrunk one whose leftover
passages are deleted, a new one). Up to three kills per trial, then runs resume until one finishes.

| fault | kills |
|---|---|
| {FAULTS[0][0]} | {result['kills_by_mode']['time']} |
| {FAULTS[1][0]} | {result['kills_by_mode']['event']} ({len(events)} distinct event positions) |

## After the last run, against a clean build of the same corpus
| | value |
|---|---|
| trials | {result['trials']} |
| runs of `cprag index` | {result['runs']} |
| kills | {result['kills']} |
| final index equal to the clean build (passage ids, token ids, key bytes, FAISS ids, manifest counts) | \
{result['equal_to_clean']} of {result['trials']} |
| passages lost | {result['lost']} |
| passages duplicated | {result['duplicated']} |
| passages that should not be there | {result['extra']} |
| problems (a run that failed, a reader that saw an error after an update's kill or a mix of versions, FAISS \
files left that no manifest names) | {len(result['problems'])} |

## What a reader saw right after each kill
A finished version (`v1` before the update, `v2` after) equal row for row to its clean build; after a first
build killed before it finished, the one-line "unfinished" error. Any other error, or `MIXED` (rows of two
versions), counts as a problem.

| reader saw | kills |
|---|---|
{readers}

`IndexUnfinished` / `IndexNotFound`: a first build killed before it finished ("rerun cprag index"). An update
writes the next version's FAISS files beside the old ones and commits by replacing the manifest, so wherever it
dies readers keep the version the manifest names. {chr(10).join('- ' + p for p in result['problems'][:20])}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "eval" / "reliability")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cprag-fuzz"))
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.workdir / "trials.jsonl"
    done = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    trials = [Trial(**{k: v for k, v in record.items() if k != "finished"}) for record in done][: args.trials]
    if len(trials) < args.trials:  # the clean builds only when trials remain to run
        checkpoint = tiny_checkpoint(args.workdir / "model")
        setup = prepare(args.workdir, checkpoint, V1, V2)
    for seed in range(len(trials) + 1, args.trials + 1):
        trial = run_trial(setup, args.workdir, seed)
        trials.append(trial)
        with open(log, "a") as handle:
            handle.write(json.dumps({**asdict(trial), "finished": time.time()}) + "\n")
        print(f"{time.strftime('%H:%M:%S')} trial {seed}/{args.trials}: {len(trial.kills)} kills, "
              f"equal={trial.equal}, problems={trial.problems}", file=sys.stderr, flush=True)
    result = summary(trials)
    # wall time from the trial log's first and last line (a run resumed across invocations counts once)
    stamps = [json.loads(line).get("finished") for line in log.read_text().splitlines()] if log.is_file() else []
    result["wall_seconds"] = round(stamps[-1] - stamps[0]) if len(stamps) > 1 and None not in stamps else None
    (args.out / "summary.json").write_text(json.dumps(result, indent=2))
    (args.out / "report.md").write_text(report(result, result["wall_seconds"]))
    print(json.dumps({k: v for k, v in result.items() if k != "trial_records"}, indent=2))
    return 0 if not result["problems"] and result["lost"] == result["duplicated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
