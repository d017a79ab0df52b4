"""Build one corpus many times while a second process competes for the cores, and compare every build with one made
alone, by a digest over doc ids, text, token ids, offsets and keys (the rows of the passages table).

    python eval/scripts/reproducible_trials.py CORPUS [--trials 50] [--out eval/reproducible] [--compete index]

CORPUS: anything `cprag index` reads (a JSONL, a SQuAD file, a folder). The reference is `cprag index` run alone
in a process of its own; so is a build on one thread (`OMP_NUM_THREADS=1`). The trials then run in this process,
the model loaded once (`cprag.build_index` into a fresh folder each time), while `--compete index` runs a second
`cprag index` of the same corpus into another folder, restarted whenever it ends, or `--compete spin` keeps every
core busy with spinning processes. Trials already in `trials.jsonl` are kept, so an interrupted run resumes.
Writes `summary.json` and `report.md` in OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = ["passage_id", "doc_id", "text", "token_ids", "offsets", "keys"]


def digest(index: Path) -> str:
    from cprag.index.store import PassageStore

    table = PassageStore(index, 384).table.to_arrow().sort_by("passage_id").select(COLUMNS)
    found = hashlib.sha256()
    for row in table.to_pylist():
        for name in COLUMNS:
            value = row[name]
            found.update(value if isinstance(value, bytes) else str(value).encode())
    return found.hexdigest()


def build(corpus: Path, index: Path, checkpoint: str | None, threads: int | None = None) -> float:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "cprag", "index", str(corpus), "--index", str(index), "--rebuild", "--json"]
    if checkpoint:
        command += ["--checkpoint", checkpoint]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


class Competitor:
    """A second process on the cores for as long as it is open: a `cprag index` restarted as it ends, or spinners."""

    def __init__(self, kind: str, corpus: Path, folder: Path, checkpoint: str | None):
        self.kind, self.corpus, self.folder, self.checkpoint = kind, corpus, folder, checkpoint
        self.processes: list[subprocess.Popen] = []

    def __enter__(self):
        self._start()
        return self

    def _start(self) -> None:
        if self.kind == "spin":
            self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                              for _ in range(os.cpu_count() or 2)]
            return
        command = [sys.executable, "-m", "cprag", "index", str(self.corpus), "--index", str(self.folder), "--rebuild",
                   "--json"] + (["--checkpoint", self.checkpoint] if self.checkpoint else [])
        self.processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]

    def running(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def keep_going(self) -> None:
        if self.kind == "index" and self.processes[0].poll() is not None:
            self._start()

    def __exit__(self, *_):
        for process in self.processes:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("eval/reproducible"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/cprag-reproducible"))
    parser.add_argument("--compete", choices=["index", "spin"], default="index")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    trials_file = args.out / "trials.jsonl"
    done = [json.loads(line) for line in trials_file.read_text().splitlines()] if trials_file.exists() else []
    reference = args.workdir / "alone"
    alone_s = build(args.corpus, reference, args.checkpoint)
    expected = digest(reference)
    one_thread_s = build(args.corpus, args.workdir / "one-thread", args.checkpoint, threads=1)
    one_thread = digest(args.workdir / "one-thread")
    print(json.dumps({"alone": expected[:16], "one_thread": one_thread[:16]}), file=sys.stderr, flush=True)
    import cprag  # noqa: F401 - before torch: MKL's reproducible mode (cprag.model.reproducible)
    from cprag.index.build import IndexConfig, build_index
    from cprag.index.retrieve import MiniLMEmbedder
    from cprag.model.checkpoint import load_model, model_fingerprint
    from cprag.model.runtime import default_device, place, resolve_dtype

    model, tokenizer = load_model(args.checkpoint)
    fingerprint = model_fingerprint(model)
    model = place(model, "cpu", resolve_dtype(default_device()))
    embedder = MiniLMEmbedder()
    with Competitor(args.compete, args.corpus, args.workdir / "competitor", args.checkpoint) as competitor:
        for trial in range(len(done), args.trials):
            index = args.workdir / f"trial-{trial}"
            time.sleep(0.5)
            competitor.keep_going()  # a second `cprag index` on the cores for every trial
            started = time.perf_counter()
            build_index(args.corpus, index, model, tokenizer, embedder, IndexConfig(rebuild=True),
                        fingerprint=fingerprint)
            seconds = time.perf_counter() - started
            found = digest(index)
            shutil.rmtree(index, ignore_errors=True)
            line = {"trial": trial, "digest": found[:16], "identical": found == expected,
                    "seconds": round(seconds, 1), "competitor_running": competitor.running()}
            done.append(line)
            with open(trials_file, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            print(json.dumps(line), file=sys.stderr, flush=True)
    identical = sum(t["identical"] for t in done)
    summary = {"corpus": str(args.corpus), "compete": args.compete, "trials": len(done), "identical": identical,
               "alone_digest": expected[:16], "one_thread_digest": one_thread[:16],
               "one_thread_identical": one_thread == expected, "alone_seconds": round(alone_s, 1),
               "one_thread_seconds": round(one_thread_s, 1),
               "loaded_seconds_median": sorted(t["seconds"] for t in done)[len(done) // 2] if done else None,
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "mkl_cbwr": os.environ.get("MKL_CBWR", "(set by cprag)")}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "report.md").write_text(
        f"# Builds beside a competing process\n\n{len(done)} builds of `{args.corpus}` while a second process "
        f"competed for the cores (`--compete {args.compete}`): **{identical} of {len(done)}** gave rows identical "
        f"to the build made alone (digest over doc ids, text, token ids, offsets and keys). A build alone on one "
        f"thread: {'identical' if one_thread == expected else 'different'}. Build seconds: alone {alone_s:.1f}, "
        f"one thread {one_thread_s:.1f}, beside the competitor (median) {summary['loaded_seconds_median']}.\n")
    print(json.dumps(summary))
    return 0 if identical == len(done) and one_thread == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
