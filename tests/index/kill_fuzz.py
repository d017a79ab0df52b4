"""Kill `cprag index` anywhere, resume, and compare with a clean build (the suite runs a few trials;
`eval/scripts/reliability_kill_fuzz.py` runs 100 and writes the report).

A trial runs the real CLI (`cprag index`, tiny model, chunks of one passage) in a child process that SIGKILLs
itself, either at a random instant of its build or just before or after a chosen commit event: a LanceDB upsert or
delete, the FAISS files' write, a file replace (the FAISS ids, the FAISS vectors, the manifest), or the removal of
the previous version's FAISS files. Half of the trials build a fresh index, half update a finished one to a
changed corpus (upserts and deletes). After each kill a reader opens the index: after an update it must get a
version that equals one of the clean builds exactly; after a first build, that or the one-line "unfinished" error.
Then runs resume the build (and may be killed again) until one finishes; the result must equal the clean build
of the final corpus (the same passage ids, token ids and key bytes, FAISS ids and manifest counts) and leave no
FAISS files that its manifest does not name.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

EVENTS = ("upsert", "delete", "write_index", "replace", "unlink")
# what a reader may see right after a kill: an update always leaves a finished version
READER_ALLOWED = {"update": {"v1", "v2"}, "fresh": {"v2", "IndexNotFound", "IndexUnfinished"}}

CHILD = r"""
import os, random, signal, sys, threading
spec = {spec!r}
rng = random.Random(spec["seed"])
def die():
    os.kill(os.getpid(), signal.SIGKILL)
import faiss, cprag.index.build, cprag.index.retrieve
from cprag.index.store import PassageStore
count = [0]
def hooked(real):
    def call(*args, **kwargs):
        count[0] += 1
        if spec["mode"] == "event" and count[0] == spec["event"] and spec["when"] == "before":
            die()
        result = real(*args, **kwargs)
        if spec["mode"] == "event" and count[0] == spec["event"] and spec["when"] == "after":
            die()
        return result
    return call
PassageStore.upsert = hooked(PassageStore.upsert)
PassageStore.delete = hooked(PassageStore.delete)
faiss.write_index = hooked(faiss.write_index)
os.replace = hooked(os.replace)
os.unlink = hooked(os.unlink)
locked = cprag.index.build._build_locked
def timed(*args, **kwargs):
    import time
    if spec["mode"] == "time":
        threading.Timer(spec["delay"], die).start()
    tick = time.perf_counter()
    result = locked(*args, **kwargs)
    print("EVENTS", count[0], "SECONDS", time.perf_counter() - tick, file=sys.stderr)
    return result
cprag.index.build._build_locked = timed
from cprag.cli import app
app(["index", spec["corpus"], "--index", spec["index"], "--checkpoint", spec["checkpoint"],
     "--max-passage-tokens", "120", "--chunk", "1", "--json"])
"""


@dataclass
class Trial:
    seed: int
    kind: str  # "fresh" or "update"
    kills: list[dict] = field(default_factory=list)  # each kill: mode, event/when or delay, what a reader saw
    runs: int = 0
    lost: int = 0
    duplicated: int = 0
    extra: int = 0
    equal: bool = False
    problems: list[str] = field(default_factory=list)


def run_child(spec: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(spec=spec)], capture_output=True, text=True,
                          timeout=timeout)


def snapshot_rows(index_dir: Path) -> dict:
    """What a reader sees (cprag.index.reader): rows by passage id, FAISS ids, manifest counts. It waits as `Index`
    does (`COMMIT_WAIT_S`) while a running writer's commit lands between its reads; without a writer that costs
    nothing."""
    from cprag.index.reader import open_snapshot

    snap = open_snapshot(index_dir)
    table = snap.store.table.to_arrow()
    rows = table.select(["passage_id", "doc_hash", "token_ids", "keys"]).to_pylist()
    return {"rows": sorted((r["passage_id"], r["doc_hash"], r["token_ids"], r["keys"]) for r in rows),
            "faiss_ids": sorted(snap.passage_index.passage_ids), "counts": snap.manifest["counts"]}


def latest_rows(index_dir: Path) -> list:
    """Every row of the latest table version (what a writer resumes from), duplicates included."""
    from cprag.index.store import PassageStore

    table = PassageStore(index_dir, 384).table.to_arrow()
    return sorted((r["passage_id"], r["doc_hash"], r["token_ids"], r["keys"])
                  for r in table.select(["passage_id", "doc_hash", "token_ids", "keys"]).to_pylist())


def reader_view(index_dir: Path, clean: dict[str, dict]) -> str:
    """What a reader gets right after a kill: the name of the clean build it equals, or the error's class."""
    from cprag.errors import CpragError

    try:
        seen = snapshot_rows(index_dir)
    except CpragError as error:
        message = str(error)
        assert "\n" not in message, message
        return type(error).__name__
    for name, expected in clean.items():
        if seen == expected:
            return name
    return "MIXED"


def measured_run(spec: dict) -> tuple[int, float]:
    """A run that must finish: the hookable events it passed and the seconds of its locked build."""
    result = run_child({**spec, "seed": 0, "mode": "none"})
    assert result.returncode == 0, result.stderr[-2000:]
    events, _, seconds = result.stderr.rsplit("EVENTS", 1)[1].split()[:3]  # "EVENTS n SECONDS s"
    return int(events), float(seconds)


@dataclass
class Setup:
    checkpoint: Path
    corpora: dict[str, Path]  # "v1", "v2"
    clean: dict[str, dict]  # clean snapshots of v1 and v2
    built_v1: Path  # a finished index of v1, copied for update trials
    events: dict[str, int]  # events of a fresh v2 build, and of the v1 -> v2 update
    seconds: dict[str, float]


def prepare(workdir: Path, checkpoint: Path, v1_docs: list[dict], v2_docs: list[dict]) -> Setup:
    corpora = {}
    for name, docs in (("v1", v1_docs), ("v2", v2_docs)):
        corpora[name] = workdir / f"{name}.jsonl"
        corpora[name].write_text("".join(json.dumps(d) + "\n" for d in docs))
    clean, events, seconds = {}, {}, {}
    common = {"checkpoint": str(checkpoint)}
    for name in ("v1", "v2"):
        index_dir = workdir / f"clean-{name}"
        events[f"fresh-{name}"], seconds[f"fresh-{name}"] = measured_run(
            {**common, "corpus": str(corpora[name]), "index": str(index_dir)})
        clean[name] = snapshot_rows(index_dir)
    shutil.copytree(workdir / "clean-v1", workdir / "update-probe")
    events["update"], seconds["update"] = measured_run(
        {**common, "corpus": str(corpora["v2"]), "index": str(workdir / "update-probe")})
    assert snapshot_rows(workdir / "update-probe") == clean["v2"]
    return Setup(checkpoint, corpora, clean, workdir / "clean-v1", events, seconds)


def run_trial(setup: Setup, workdir: Path, seed: int, max_kills: int = 3) -> Trial:
    rng = random.Random(seed)
    kind = "update" if seed % 2 else "fresh"
    trial = Trial(seed=seed, kind=kind)
    index_dir = workdir / f"trial-{seed}"
    shutil.rmtree(index_dir, ignore_errors=True)
    if kind == "update":
        shutil.copytree(setup.built_v1, index_dir)
    events = setup.events["update" if kind == "update" else "fresh-v2"]
    for attempt in range(max_kills + 1):
        kill = attempt == 0 or (attempt < max_kills and rng.random() < 0.5)
        spec = {"seed": rng.randrange(2**31), "corpus": str(setup.corpora["v2"]), "index": str(index_dir),
                "checkpoint": str(setup.checkpoint), "mode": "none"}
        if kill and rng.random() < 0.5:
            spec.update(mode="event", event=rng.randint(1, events), when=rng.choice(["before", "after"]))
        elif kill:
            # an instant of the locked build (the writer's whole life under the lock)
            spec.update(mode="time", delay=round(rng.uniform(0, setup.seconds["update" if kind == "update"
                                                                             else "fresh-v2"]), 3))
        result = run_child(spec)
        trial.runs += 1
        if result.returncode == -signal.SIGKILL:
            record = {k: spec[k] for k in ("mode", "event", "when", "delay") if k in spec}
            record["reader"] = reader_view(index_dir, setup.clean)
            if record["reader"] not in READER_ALLOWED[kind]:
                trial.problems.append(f"a reader saw {record['reader']} after kill {record}")
            trial.kills.append(record)
            continue
        if result.returncode != 0:
            trial.problems.append(f"run exited {result.returncode}: {result.stderr.strip()[-300:]}")
        if result.returncode == 0:
            break
    else:
        result = run_child({"seed": 0, "mode": "none", "corpus": str(setup.corpora["v2"]), "index": str(index_dir),
                            "checkpoint": str(setup.checkpoint)})
        trial.runs += 1
        if result.returncode != 0:
            trial.problems.append(f"final run exited {result.returncode}: {result.stderr.strip()[-300:]}")
    expected = setup.clean["v2"]
    final = latest_rows(index_dir)
    want = {r[0] for r in expected["rows"]}
    have = [r[0] for r in final]
    trial.lost = len(want - set(have))
    trial.duplicated = len(have) - len(set(have))
    trial.extra = len(set(have) - want)
    try:
        trial.equal = snapshot_rows(index_dir) == expected and final == expected["rows"]
        named = set(json.loads((index_dir / "manifest.json").read_text())["faiss"].values())
        stray = {p.name for p in index_dir.glob("faiss*")} - named
        if stray:
            trial.problems.append(f"FAISS files no manifest names were left behind: {sorted(stray)}")
    except Exception as error:  # noqa: BLE001 - recorded as a problem of the trial
        trial.problems.append(f"the final index does not open: {error}")
    if not trial.equal:
        trial.problems.append("the final index differs from the clean build")
    shutil.rmtree(index_dir, ignore_errors=True)
    return trial


def summary(trials: list[Trial]) -> dict:
    kills = [k for t in trials for k in t.kills]
    readers: dict[str, int] = {}
    for k in kills:
        readers[k["reader"]] = readers.get(k["reader"], 0) + 1
    return {"trials": len(trials), "kills": len(kills), "runs": sum(t.runs for t in trials),
            "kills_by_mode": {m: sum(k["mode"] == m for k in kills) for m in ("event", "time")},
            "lost": sum(t.lost for t in trials), "duplicated": sum(t.duplicated for t in trials),
            "extra": sum(t.extra for t in trials), "equal_to_clean": sum(t.equal for t in trials),
            "reader_after_kill": readers, "problems": [p for t in trials for p in t.problems],
            "trial_records": [asdict(t) for t in trials]}
