"""Questions asked of a whole indexed corpus, as `cprag ask` answers them: retrieval over every passage, then the
hidden read, scored against hand-checked answers, with the citation each answer carries.

    python eval/scripts/corpus_ask.py eval/ingest/questions.jsonl --index indexes/pydocs [--out eval/ingest]

Each line of the questions file is {"doc_id", "question", "answers": [...], "evidence"}: `doc_id` is the document
the answer is in (as the index names it: the path inside the indexed folder), `evidence` the sentence that holds
it. Per question: the answer (withheld ones score as ""), SQuAD EM/F1 against `answers`, whether the expected
document was among the k passages read, and the first citation's document, page (PDF) and anchor (HTML).

Report: `summary.json` (aggregate figures, by file type), `answers.jsonl` (every question) and `report.md`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from cprag import Index
from cprag.evaluation.metrics import squad2_question_scores
from cprag.model.cpu_features import cpu_name


def read_questions(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for number, row in enumerate(rows, 1):
        missing = {"doc_id", "question", "answers"} - row.keys()
        if missing:
            raise SystemExit(f"{path}:{number}: missing {sorted(missing)}")
    return rows[:limit] if limit else rows


def scored(row: dict, answer) -> dict:
    prediction = "" if answer.no_answer else answer.answer
    em, f1 = squad2_question_scores(prediction, row["answers"])
    read = [p["doc_id"] for p in answer.passages]
    cited = answer.citations[0] if answer.citations else None
    return {
        "question": row["question"], "answers": row["answers"], "doc_id": row["doc_id"], "prediction": prediction,
        "no_answer": answer.no_answer, "em": em, "f1": round(f1, 4), "retrieved": row["doc_id"] in read,
        "top_doc": read[0] if read else None, "read": read,
        "citation": None if cited is None else {"doc_id": cited.doc_id, "page": cited.page, "anchor": cited.anchor,
                                                "text": cited.text},
        "cited_expected_doc": cited is not None and cited.doc_id == row["doc_id"],
        "total_ms": answer.timings_ms.get("total"),
    }


def aggregate(rows: list[dict]) -> dict:
    n = len(rows)
    if not n:
        return {"n": 0}
    share = lambda key: round(100 * sum(bool(r[key]) for r in rows) / n, 1)  # noqa: E731
    return {"n": n, "em": round(100 * sum(r["em"] for r in rows) / n, 2),
            "f1": round(100 * sum(r["f1"] for r in rows) / n, 2), "answered": round(100 - share("no_answer"), 1),
            "expected_doc_retrieved": share("retrieved"), "cited_expected_doc": share("cited_expected_doc")}


def report(summary: dict, rows: list[dict]) -> str:
    lines = [f"# Questions over `{summary['index']}`", "",
             f"{summary['overall']['n']} questions, k={summary['k']}, batch {summary['batch_size']}, "
             f"{summary['cpu']}, {summary['seconds']:.0f} s.", "",
             "| part | n | EM | F1 | answered % | expected doc read % | cited the expected doc % |",
             "|---|---|---|---|---|---|---|"]
    for name, part in {"all": summary["overall"], **summary["by_type"]}.items():
        lines.append(f"| {name} | {part['n']} | {part['em']} | {part['f1']} | {part['answered']} | "
                     f"{part['expected_doc_retrieved']} | {part['cited_expected_doc']} |")
    lines += ["", "## Every question", "", "| question | expected | answer | F1 | cited at |", "|---|---|---|---|---|"]
    for r in rows:
        cited = r["citation"]
        where = "–" if cited is None else cited["doc_id"] + (f" p.{cited['page']}" if cited["page"] else "") + (
            f" #{cited['anchor']}" if cited["anchor"] else "")
        cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines.append(f"| {cell(r['question'])} | {cell(r['answers'][0])} | "
                     f"{cell(r['prediction']) or '(withheld)'} | {r['f1']:.2f} | {cell(where)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("questions", type=Path)
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped checkpoint")
    parser.add_argument("--out", type=Path, default=Path("eval/ingest"))
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    questions = read_questions(args.questions, args.limit)
    index = Index(args.index, checkpoint=args.checkpoint)
    rows: list[dict] = []
    tick = time.perf_counter()
    with Progress(console=Console(stderr=True)) as progress:  # stdout is the summary's JSON
        task = progress.add_task("asking", total=len(questions))
        for first in range(0, len(questions), args.batch_size):
            chunk = questions[first:first + args.batch_size]
            answers = index.ask_many([q["question"] for q in chunk], k=args.k, batch_size=args.batch_size)
            rows += [scored(q, a) for q, a in zip(chunk, answers, strict=True)]
            progress.advance(task, len(chunk))
    seconds = time.perf_counter() - tick
    by_type: dict[str, list[dict]] = {}
    for r in rows:
        by_type.setdefault(Path(r["doc_id"]).suffix.lstrip(".") or "other", []).append(r)
    summary = {"index": str(args.index), "questions": str(args.questions), "k": args.k,
               "batch_size": args.batch_size, "cpu": cpu_name(), "seconds": round(seconds, 1),
               "counts": index.manifest.get("counts"), "overall": aggregate(rows),
               "by_type": {name: aggregate(part) for name, part in sorted(by_type.items())}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "report.md").write_text(report(summary, rows))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
