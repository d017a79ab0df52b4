"""A damaged index directory gives a one-line error naming the file and the fix, never a wrong answer, and
what the fix says works: FAISS damage is repaired by rerunning `cprag index` (nothing re-encoded)."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cprag.cli import app
from cprag.index.retrieve import MiniLMEmbedder
from tests.index_helpers import index_corpus, stored_rows
from tests.tiny_models import DOCS, tiny_checkpoint, write_jsonl


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def newer_format(index: Path) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    (index / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))


def faiss_file(index: Path, kind: str) -> Path:
    """The FAISS file (kind "index" or "ids") that the manifest's committed version names."""
    return index / json.loads((index / "manifest.json").read_text())["faiss"][kind]


def lance_data_removed(index: Path) -> None:
    for file in (index / "lancedb" / "passages.lance" / "data").iterdir():
        file.unlink()


DAMAGE = {
    "manifest truncated": (lambda i: truncate(i / "manifest.json"), "manifest.json is not valid JSON", "--rebuild"),
    "manifest missing": (lambda i: (i / "manifest.json").unlink(), "manifest.json is missing", "--rebuild"),
    "manifest of a newer format": (newer_format, "newer than this cprag reads", "upgrade cprag"),
    "faiss index truncated": (lambda i: truncate(faiss_file(i, "index")), ".index is unreadable",
                              "rebuilds the FAISS"),
    "faiss index missing": (lambda i: faiss_file(i, "index").unlink(), ".index is missing", "rebuilds the FAISS"),
    "faiss ids truncated": (lambda i: truncate(faiss_file(i, "ids")), ".ids.json is not valid JSON",
                            "rebuilds the FAISS"),
    "faiss ids missing": (lambda i: faiss_file(i, "ids").unlink(), ".ids.json is missing", "rebuilds the FAISS"),
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
    for kind in ("index", "ids"):  # FAISS files of another build of 3 of the 5 documents
        shutil.copy(faiss_file(root / "small", kind), faiss_file(index, kind))
    result = ask(index, checkpoint)
    assert result.exit_code == 1 and ".ids.json lists 3 passages but the table holds 5" in result.output
    index_corpus(corpus, index, checkpoint, embedder)
    assert json.loads(ask(index, checkpoint).stdout)["passages"]


def test_a_manifest_naming_faiss_files_outside_the_index_is_refused(built, tmp_path):
    root, checkpoint, _, _ = built
    index = tmp_path / "idx"
    shutil.copytree(root / "clean", index)
    manifest = json.loads((index / "manifest.json").read_text())
    manifest["faiss"]["index"] = "../../elsewhere.index"
    (index / "manifest.json").write_text(json.dumps(manifest))
    result = ask(index, checkpoint)
    assert result.exit_code == 1 and "manifest.json names no valid FAISS files" in result.output, result.output


def test_a_format_1_index_is_read_and_the_next_update_rewrites_it_as_format_2(built, tmp_path):
    """Format 1 kept its FAISS files under fixed names; they are still read, and the next update commits
    version-named files and removes the old ones."""
    root, checkpoint, corpus, embedder = built
    index = tmp_path / "idx"
    shutil.copytree(root / "clean", index)
    manifest = json.loads((index / "manifest.json").read_text())
    faiss_file(index, "index").rename(index / "faiss.index")
    faiss_file(index, "ids").rename(index / "faiss_ids.json")
    del manifest["faiss"]
    (index / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    answer = ask(index, checkpoint)
    assert answer.exit_code == 0 and json.loads(answer.stdout)["passages"], answer.output
    rows = stored_rows(index)
    assert index_corpus(corpus, index, checkpoint, embedder).encoded == 0 and stored_rows(index) == rows
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    assert sorted(p.name for p in index.glob("faiss*")) == sorted(manifest["faiss"].values())
    assert json.loads(ask(index, checkpoint).stdout)["passages"] == json.loads(answer.stdout)["passages"]
