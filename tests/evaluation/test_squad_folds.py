"""Folds of whole articles (pipelines/squad_folds.py): what trains on one fold of the public SQuAD 2.0 half is scored
on the other."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "pipelines" / "squad_folds.py"


def squad_file(path: Path, sizes: list[int]) -> Path:
    articles = [{"title": f"Article_{a}", "paragraphs": [{"context": f"Text of article {a}.", "qas": [
        {"id": f"{a}-{q}", "question": f"Question {q}?", "answers": [], "is_impossible": q % 2 == 0}
        for q in range(n)]}]} for a, n in enumerate(sizes)]
    path.write_text(json.dumps({"version": "v2.0", "data": articles}))
    return path


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)


def test_folds_deal_every_article_once_and_balance_questions(tmp_path):
    sizes = [9, 2, 5, 7, 3, 4]
    data = squad_file(tmp_path / "data.json", sizes)
    done = run(str(data), "--out", str(tmp_path / "folds"), "--folds", "2")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    folds = [json.loads((tmp_path / "folds" / f"fold-{i}.json").read_text())["data"] for i in range(2)]
    titles = [a["title"] for fold in folds for a in fold]
    assert sorted(titles) == sorted(f"Article_{a}" for a in range(len(sizes)))  # each article in one fold
    counts = [sum(len(p["qas"]) for a in fold for p in a["paragraphs"]) for fold in folds]
    assert sum(counts) == sum(sizes) and abs(counts[0] - counts[1]) <= max(sizes)
    assert [r["questions"] for r in report] == counts
    assert [r["unanswerable"] for r in report] == [sum(q["is_impossible"] for a in fold for p in a["paragraphs"]
                                                       for q in p["qas"]) for fold in folds]
    assert run(str(data), "--out", str(tmp_path / "again"), "--folds", "2").returncode == 0
    assert (tmp_path / "again" / "fold-0.json").read_text() == (tmp_path / "folds" / "fold-0.json").read_text()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    data = squad_file(tmp_path / "data.json", [3, 4])
    too_many = run(str(data), "--out", str(tmp_path / "a"), "--folds", "3")
    assert too_many.returncode == 2 and too_many.stderr.startswith("error:") and not (tmp_path / "a").exists()
    (tmp_path / "empty.json").write_text("")
    unreadable = run(str(tmp_path / "empty.json"), "--out", str(tmp_path / "b"))
    assert unreadable.returncode == 1 and "not a readable SQuAD file" in unreadable.stderr
    assert len(unreadable.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()
