"""Readers while `cprag index` writes, and `cprag index` killed anywhere (a few seeded trials of the 100 that
`eval/scripts/reliability_kill_fuzz.py` runs)."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.errors import IndexBusy
from cprag.model.checkpoint import load_model
from tests.index.kill_fuzz import READER_ALLOWED, prepare, run_trial, snapshot_rows
from tests.index_helpers import wait_for, writer_script

LONG = " ".join(f"The clock chimed {i} times on day {i}." for i in range(24))
V1 = [
    {"id": "lighthouse", "title": "Varna Point", "text": "The lighthouse at Varna Point was built in 1871."},
    {"id": "bridge", "title": "Tellin", "text": "The glass bridge of Tellin was designed by Ines Marr."},
    {"id": "clock", "title": "River Clock", "text": LONG},
    {"id": "geese", "title": "Geese", "text": "Geese arrive at the lake in October."},
]
# an update: one document changed, one shrunk to fewer passages (its leftovers deleted), one added
V2 = [
    V1[0],
    {"id": "bridge", "title": "Tellin", "text": "The glass bridge of Tellin was rebuilt by Odo Vance in 2011."},
    {"id": "clock", "title": "River Clock", "text": "The clock was silenced in 1990."},
    V1[3],
    {"id": "mill", "title": "Mill", "text": "The mill grinds barley for the village."},
]


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, checkpoint):  # noqa: F811
    workdir = tmp_path_factory.mktemp("fuzz")
    return workdir, prepare(workdir, checkpoint, V1, V2)


def test_the_clean_builds_differ_so_a_mixed_view_would_show(fuzz):
    _, setup = fuzz
    v1, v2 = setup.clean["v1"], setup.clean["v2"]
    assert v1["counts"]["passages"] > 5 and v2["counts"]["passages"] == 5
    assert {r[0] for r in v1["rows"]} - {r[0] for r in v2["rows"]}  # the update deletes passages
    assert setup.events["update"] > 4


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_killed_anywhere_the_resumed_index_equals_a_clean_build(fuzz, seed):
    workdir, setup = fuzz
    trial = run_trial(setup, workdir, seed)
    assert trial.kills, "the trial never killed the writer"
    assert trial.problems == [] and trial.equal
    assert (trial.lost, trial.duplicated, trial.extra) == (0, 0, 0)
    # an update leaves readers on a finished version wherever it dies; a first build has none until it finishes
    assert {k["reader"] for k in trial.kills} <= READER_ALLOWED[trial.kind]


def test_readers_during_an_update_see_one_committed_version_or_a_busy_message(fuzz, checkpoint,  # noqa: F811
                                                                               tmp_path):
    import shutil



    _, setup = fuzz
    index_dir, marker = tmp_path / "idx", tmp_path / "started"
    shutil.copytree(setup.built_v1, index_dir)
    model, tokenizer = load_model(checkpoint)
    writer = subprocess.Popen([sys.executable, "-c", writer_script(checkpoint, setup.corpora["v2"], index_dir,
                                                                      marker, 0.3)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marker, writer)
    seen, cli_runs = [], 0
    while writer.poll() is None or not seen or seen[-1] != "v2":
        index = Index(index_dir, model=model, tokenizer=tokenizer)
        view = snapshot_rows(index_dir)
        seen.append(next((name for name, rows in setup.clean.items() if rows == view), "MIXED"))
        answer = index.ask("Who designed the glass bridge?", k=3)
        fetched = index.store.fetch([p["passage_id"] for p in answer.passages])
        assert len(fetched) == 3  # every retrieved passage is in the version the reader opened
        if cli_runs < 3:
            result = CliRunner().invoke(app, ["ask", "When was the lighthouse built?", "--index", str(index_dir),
                                              "--checkpoint", str(checkpoint), "-k", "2", "--json"])
            assert result.exit_code == 0, result.output
            assert len(json.loads(result.stdout)["passages"]) == 2
            cli_runs += 1
    assert writer.wait(timeout=120) == 0, writer.communicate()
    assert "MIXED" not in seen and seen[0] == "v1" and seen[-1] == "v2"
    assert seen == sorted(seen)  # never back from v2 to v1


def test_a_first_build_in_progress_is_busy_not_damaged(fuzz, checkpoint, tmp_path):  # noqa: F811


    _, setup = fuzz
    index_dir, marker = tmp_path / "idx", tmp_path / "started"
    writer = subprocess.Popen([sys.executable, "-c", writer_script(checkpoint, setup.corpora["v2"], index_dir,
                                                                      marker, 1.0)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(marker, writer)
    with pytest.raises(IndexBusy, match=f"being built by process {writer.pid}"):
        Index(index_dir, checkpoint=checkpoint)
    result = CliRunner().invoke(app, ["ask", "When?", "--index", str(index_dir), "--checkpoint", str(checkpoint)])
    assert result.exit_code == 1 and "is being built" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    writer.kill()
    writer.wait()


def _fill(directory, leave_bytes):
    """Fill the filesystem of `directory` up to `leave_bytes` of free space."""
    import os

    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(directory / "filler", "wb") as handle:
        handle.write(b"\0" * max(free - leave_bytes, 0))


def test_a_full_disk_keeps_the_finished_version_and_says_so(fuzz, checkpoint, embedder, tmp_path):  # noqa: F811
    """A real ENOSPC: the index lives on a 48 MB tmpfs that is filled up before an update (root only)."""
    import os
    import shutil

    from cprag.index.build import IndexConfig, build_index

    _, setup = fuzz
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        index_dir = mount / "idx"
        shutil.copytree(setup.built_v1, index_dir)
        big = [{"id": f"extra{i}", "title": "Extra", "text": f"Extra document {i}. " * 60} for i in range(40)]
        (tmp_path / "grown.jsonl").write_text("".join(json.dumps(d) + "\n" for d in V2 + big))
        _fill(mount, 64 * 1024)
        model, tokenizer = load_model(checkpoint)
        from cprag.errors import DiskFull

        with pytest.raises(DiskFull, match="full .* the last finished version is intact"):
            build_index(tmp_path / "grown.jsonl", index_dir, model, tokenizer, embedder,
                        IndexConfig(120, chunk_passages=4))
        assert snapshot_rows(index_dir) == setup.clean["v1"]  # readers still get the finished version
        result = CliRunner().invoke(app, ["index", str(tmp_path / "grown.jsonl"), "--index", str(index_dir),
                                          "--checkpoint", str(checkpoint), "--max-passage-tokens", "120"])
        assert result.exit_code == 1 and "is full" in result.output and ".cargo" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        (mount / "filler").unlink()
        report = build_index(tmp_path / "grown.jsonl", index_dir, model, tokenizer, embedder, IndexConfig(120))
        assert report.manifest["counts"]["documents"] == len(V2) + len(big)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_first_build_killed_inside_table_creation_starts_the_table_over(fuzz, checkpoint, embedder,  # noqa: F811
                                                                          tmp_path):
    import shutil

    from cprag.errors import IndexCorrupt
    from tests.index_helpers import index_corpus

    _, setup = fuzz
    index_dir = tmp_path / "idx"
    shutil.copytree(setup.built_v1, index_dir)
    shutil.rmtree(index_dir / "lancedb" / "passages.lance" / "_versions")  # a table LanceDB never finished
    with pytest.raises(IndexCorrupt, match="unreadable"):  # a finished version: never dropped silently
        index_corpus(setup.corpora["v2"], index_dir, checkpoint, embedder, chunk_passages=1)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    (index_dir / "manifest.json").write_text(json.dumps({**manifest, "status": "building"}))
    index_corpus(setup.corpora["v2"], index_dir, checkpoint, embedder, chunk_passages=1)
    assert snapshot_rows(index_dir) == setup.clean["v2"]


def test_an_update_interrupted_before_its_deletes_drops_the_leftovers_on_resume(fuzz, checkpoint, embedder,  # noqa: F811
                                                                                 tmp_path):
    """Found by the kill fuzz: the shrunk document's new passage was committed, the run died before deleting its
    old passages, and the resumed run, seeing the document unchanged, kept them."""
    import shutil

    from tests.index_helpers import index_corpus

    _, setup = fuzz
    index_dir = tmp_path / "idx"
    shutil.copytree(setup.built_v1, index_dir)

    def stop_after_the_last_upsert(stage, done, total):
        if done == total:
            raise KeyboardInterrupt

    model, tokenizer = load_model(checkpoint)
    from cprag.index.build import IndexConfig, build_index

    with pytest.raises(KeyboardInterrupt):
        build_index(setup.corpora["v2"], index_dir, model, tokenizer, embedder, IndexConfig(120, chunk_passages=1),
                    on_progress=stop_after_the_last_upsert)
    assert snapshot_rows(index_dir) == setup.clean["v1"]  # readers: still the finished version
    report = index_corpus(setup.corpora["v2"], index_dir, checkpoint, embedder, chunk_passages=1)
    assert report.encoded == 0 and report.removed > 0
    assert snapshot_rows(index_dir) == setup.clean["v2"]
