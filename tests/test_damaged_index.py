"""A damaged index directory gives a one-line error naming the file and the fix, never a wrong answer, and
what the fix says works: FAISS damage is repaired by rerunning `cprag index` (nothing re-encoded)."""

import json
import shutil
from pathlib import Path

import pytest
from test_index_ask import DOCS, index_corpus, stored_rows, tiny_checkpoint, write_jsonl
from typer.testing import CliRunner

from cprag.cli import app
from cprag.retrieve import MiniLMEmbedder


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def newer_format(index: Path) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))


def lance_data_removed(index: Path) -> None:
    for file in (index / "lancedb" / "passages.lance" / "data").iterdir():
        file.unlink()


DAMAGE = {
    "manifest truncated": (lambda i: truncate(i / "manifest.json"), "manifest.json is not valid JSON", "--rebuild"),
    "manifest missing": (lambda i: (i / "manifest.json").unlink(), "manifest.json is missing", "--rebuild"),
    "manifest of a newer format": (newer_format, "newer than this cprag reads", "upgrade cprag"),
    "faiss.index truncated": (lambda i: truncate(i / "faiss.index"), "faiss.index is unreadable", "rebuilds the FAISS"),
    "faiss.index missing": (lambda i: (i / "faiss.index").unlink(), "faiss.index is missing", "rebuilds the FAISS"),
    "faiss ids truncated": (lambda i: truncate(i / "faiss_ids.json"), "faiss_ids.json is not valid JSON",
                            "rebuilds the FAISS"),
    "faiss ids missing": (lambda i: (i / "faiss_ids.json").unlink(), "faiss_ids.json is missing",
                          "rebuilds the FAISS"),
    "lance data files missing": (lance_data_removed, "lancedb/passages is unreadable", "--rebuild"),
    "lance table missing": (lambda i: shutil.rmtree(i / "lancedb" / "passages.lance"),
                            "lancedb/passages is missing", "--rebuild"),
}


@pytest.fixture(scope="module")
def backbone_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("backbone-cache")


@pytest.fixture(autouse=True)
def warm_backbone_cache(backbone_cache, monkeypatch):
    """One converted tiny backbone for the module, so the first-load conversion bar is not in the CLI output."""
    monkeypatch.setenv("CPRAG_CACHE", str(backbone_cache))


@pytest.fixture(scope="module")
def built(tmp_path_factory, backbone_cache):
    root = tmp_path_factory.mktemp("damaged")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CPRAG_CACHE", str(backbone_cache))
        checkpoint = tiny_checkpoint(root / "model")
        corpus = write_jsonl(root / "corpus.jsonl", DOCS)
        embedder = MiniLMEmbedder()
        index_corpus(corpus, root / "clean", checkpoint, embedder)
        index_corpus(write_jsonl(root / "small.jsonl", DOCS[:3]), root / "small", checkpoint, embedder)
    return root, checkpoint, corpus, embedder


def ask(index: Path, checkpoint: Path):
    return CliRunner().invoke(app, ["ask", "When was the lighthouse built?", "--index", str(index), "-k", "2",
                                    "--max-new-tokens", "2", "--checkpoint", str(checkpoint), "--json"])


@pytest.mark.parametrize("case", DAMAGE)
def test_each_damage_gives_one_line_naming_the_file_and_the_fix(built, tmp_path, case):
    root, checkpoint, corpus, embedder = built
    index = tmp_path / "idx"
    shutil.copytree(root / "clean", index)
    damage, message, fix = DAMAGE[case]
    damage(index)
    result = ask(index, checkpoint)
    assert result.exit_code == 1, result.output
    assert message in result.output and fix in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    info = CliRunner().invoke(app, ["info", "--index", str(index), "--json"])  # info reads only the manifest
    assert info.exit_code == (1 if case.startswith("manifest") else 0), info.output
    if "rebuilds the FAISS" in fix:  # the fix named: rerun cprag index, nothing re-encoded
        rows = stored_rows(index)
        report = index_corpus(corpus, index, checkpoint, embedder)
        assert report.encoded == 0 and stored_rows(index) == rows
        assert ask(index, checkpoint).exit_code == 0


def test_faiss_ids_that_disagree_with_the_table_are_refused(built, tmp_path):
    root, checkpoint, corpus, embedder = built
    index = tmp_path / "idx"
    shutil.copytree(root / "clean", index)
    for name in ("faiss.index", "faiss_ids.json"):  # FAISS files of another build of 3 of the 5 documents
        shutil.copy(root / "small" / name, index / name)
    result = ask(index, checkpoint)
    assert result.exit_code == 1 and "faiss_ids.json lists 3 passages but the table holds 5" in result.output
    index_corpus(corpus, index, checkpoint, embedder)
    assert json.loads(ask(index, checkpoint).stdout)["passages"]
