"""Builds eval/ood/real-docs.json: an out-of-domain QA set over real documents installed on this machine.

The documents are Debian's python3-doc HTML (never its tutorial), the long descriptions (READMEs) of installed
Python packages and man pages. Each document is one article; its whole text is cut into paragraph-sized contexts
of 40-250 words, and the hand-written questions in eval/ood/questions.jsonl are attached to the context holding
their anchor string. Every answer must be a verbatim span of its context: the build fails loudly otherwise.

    .venv/bin/python eval/scripts/ood_build.py                  # writes eval/ood/real-docs.json, prints counts
    .venv/bin/python eval/scripts/ood_build.py --dump man/tar   # an article's contexts, numbered, to write questions
    .venv/bin/python eval/scripts/ood_build.py --list           # every article's context count

Run it with the project's virtual environment: the READMEs are read from that interpreter's site-packages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from cprag.evaluation.metrics import normalize_answer
from cprag.index.readers import read_structured
from cprag.index.readers.markdown import markdown_document

ROOT = Path(__file__).resolve().parents[2]
PYDOC = Path("/usr/share/doc/python3-doc/html")
MAN1 = Path("/usr/share/man/man1")
SITE_PACKAGES = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
QUESTIONS = ROOT / "eval" / "ood" / "questions.jsonl"
OUTPUT = ROOT / "eval" / "ood" / "real-docs.json"
MIN_WORDS, MAX_WORDS = 40, 250
SOFT_WORDS = 130  # a context this long ends at the next block boundary: SQuAD-sized paragraphs, not walls of text
MIN_CONTEXTS = 5  # the oracle draws 4 distractors from the question's own article

# article id -> source: "pydoc/<path under html/ without .html>", "readme/<distribution>", "man/<page>"
ARTICLES = [
    "pydoc/library/json", "pydoc/library/venv", "pydoc/library/csv", "pydoc/library/gzip", "pydoc/library/tempfile",
    "pydoc/library/hashlib", "pydoc/library/functools", "pydoc/howto/sorting", "pydoc/howto/unicode",
    "pydoc/faq/general", "pydoc/glossary",
    "readme/rich", "readme/typer", "readme/fastapi", "readme/faiss_cpu", "readme/attrs", "readme/huggingface_hub",
    "readme/msgpack", "readme/pandas", "readme/sympy", "readme/accelerate", "readme/uvicorn",
    "man/tar", "man/grep", "man/xargs", "man/gzip", "man/ls", "man/sed", "man/ssh", "man/zstd", "man/git",
    "man/find",
]


class BuildError(Exception):
    """The set cannot be built as asked (a missing source, an anchor or answer not found)."""


def words(text: str) -> int:
    return len(text.split())


def clean(text: str) -> str:
    return " ".join(text.split())


_SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z(`\"'\-])")


def _units(block: str) -> list[str]:
    """A block small enough to keep whole, else its sentences (a sentence over the limit is cut by words)."""
    if words(block) <= MAX_WORDS:
        return [block]
    units = []
    for sentence in _SENTENCE_END.split(block):
        tokens = sentence.split()
        units += [" ".join(tokens[i:i + MAX_WORDS]) for i in range(0, len(tokens), MAX_WORDS)]
    return units


def chunk(blocks: list[tuple[tuple[str, ...], str]]) -> list[str]:
    """Consecutive blocks packed into contexts of MIN_WORDS..MAX_WORDS words; a new heading starts a new context
    once the current one is long enough, so a context rarely straddles two topics."""
    contexts: list[str] = []
    current: list[str] = []
    current_heading: tuple[str, ...] | None = None
    for heading, block in blocks:
        for unit in _units(clean(block)):
            size = sum(map(words, current))
            topic_change = heading != current_heading and size >= MIN_WORDS
            if current and (size + words(unit) > MAX_WORDS or size >= SOFT_WORDS or topic_change):
                contexts.append(" ".join(current))
                current = []
            current.append(unit)
            current_heading = heading
    if current:
        contexts.append(" ".join(current))
    merged: list[str] = []
    for context in contexts:  # a short leftover joins the one before it when they fit together
        if words(context) < MIN_WORDS and merged and words(merged[-1]) + words(context) <= MAX_WORDS:
            merged[-1] += " " + context
        else:
            merged.append(context)
    return [c for c in merged if MIN_WORDS <= words(c) <= MAX_WORDS]


def _structured_blocks(document) -> list[tuple[tuple[str, ...], str]]:
    """Prose and table sections (code, link rows and headings are left out: they are not answer text)."""
    return [(s.heading_path[:2], document.section_text(s)) for s in document.sections if s.kind in {"prose", "table"}]


def pydoc_article(path: str) -> tuple[str, list[str]]:
    if path.startswith("tutorial/"):
        raise BuildError("the Python tutorial is withheld for judging: never use it")
    document = read_structured(PYDOC / f"{path}.html")
    return f"{document.title} (Python docs)", chunk(_structured_blocks(document))


def readme_article(distribution: str) -> tuple[str, list[str]]:
    matches = sorted(SITE_PACKAGES.glob(f"{distribution}-*.dist-info/METADATA"))
    if not matches:
        raise BuildError(f"no installed distribution {distribution!r} under {SITE_PACKAGES}")
    metadata = matches[0].read_text(encoding="utf-8")
    headers, _, body = metadata.partition("\n\n")  # the long description follows the first blank line
    name = re.search(r"^Name: (.+)$", headers, re.MULTILINE).group(1).strip()
    version = re.search(r"^Version: (.+)$", headers, re.MULTILINE).group(1).strip()
    document = markdown_document(body)
    return f"{name} {version} README", chunk(_structured_blocks(document))


def _render_man(page: str) -> str:
    source = MAN1 / f"{page}.1.gz"
    if not source.exists():
        raise BuildError(f"no man page {source}")
    environment = {**os.environ, "MANWIDTH": "1000", "MAN_KEEP_FORMATTING": "", "LC_ALL": "C.UTF-8"}
    rendered = subprocess.run(["man", "-l", str(source)], capture_output=True, text=True, env=environment,
                              check=True).stdout
    return subprocess.run(["col", "-bx"], input=rendered, capture_output=True, text=True, check=True).stdout


def man_article(page: str) -> tuple[str, list[str]]:
    lines = _render_man(page).splitlines()[1:-1]  # the first and last lines are the page's header and footer
    blocks: list[tuple[tuple[str, ...], str]] = []
    heading: tuple[str, ...] = ()
    paragraph: list[str] = []
    for line in lines + [""]:
        if line and not line[0].isspace():  # a section heading (NAME, DESCRIPTION, OPTIONS...)
            heading = (line.strip(),)
            continue
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            if heading != ("SYNOPSIS",):  # usage lines are not prose
                blocks.append((heading, " ".join(paragraph)))
            paragraph = []
    return f"{page}(1) manual page", chunk(blocks)


def article(article_id: str) -> tuple[str, list[str]]:
    kind, _, source = article_id.partition("/")
    readers = {"pydoc": pydoc_article, "readme": readme_article, "man": man_article}
    if kind not in readers:
        raise BuildError(f"unknown article kind in {article_id!r}")
    title, contexts = readers[kind](source)
    if len(contexts) < MIN_CONTEXTS:
        raise BuildError(f"{article_id}: only {len(contexts)} contexts (needs {MIN_CONTEXTS})")
    return title, contexts


def read_questions(path: Path) -> list[dict]:
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        missing = {"article", "anchor", "question", "answer"} - set(item)
        if missing:
            raise BuildError(f"{path.name} line {number}: missing {sorted(missing)}")
        item["line"] = number
        questions.append(item)
    return questions


def locate(question: dict, contexts: list[str]) -> tuple[int, int]:
    """(context index, answer offset): the one context holding the anchor, the answer inside it (inside the
    anchor's own text when the anchor holds it, so a repeated answer points at the intended mention)."""
    where = f"questions line {question['line']} ({question['article']})"
    anchor, answer = question["anchor"], question["answer"]
    holders = [i for i, c in enumerate(contexts) if anchor in c]
    if len(holders) != 1:
        raise BuildError(f"{where}: anchor {anchor!r} is in {len(holders)} contexts, not exactly one")
    context = contexts[holders[0]]
    anchor_at = context.index(anchor)
    if answer in anchor:
        start = anchor_at + anchor.index(answer)
    else:
        mentions = [m.start() for m in re.finditer(re.escape(answer), context)]
        if not mentions:
            raise BuildError(f"{where}: answer {answer!r} is not in the anchor's context")
        start = min(mentions, key=lambda at: abs(at - anchor_at))  # the mention nearest the anchor
    if context[start:start + len(answer)] != answer or not 1 <= words(answer) <= 10:
        raise BuildError(f"{where}: answer {answer!r} is not a 1-10 word span at offset {start}")
    if not normalize_answer(answer):  # all punctuation: exact match and F1 would compare two empty strings
        raise BuildError(f"{where}: answer {answer!r} is empty once normalized for scoring")
    return holders[0], start


def build(questions: list[dict]) -> tuple[dict, dict]:
    by_article: dict[str, list[dict]] = {}
    for question in questions:
        if question["article"] not in ARTICLES:
            raise BuildError(f"questions line {question['line']}: unknown article {question['article']!r}")
        by_article.setdefault(question["article"], []).append(question)
    data, counts = [], Counter()
    for article_id in ARTICLES:
        title, contexts = article(article_id)
        paragraphs = [{"context": c, "qas": []} for c in contexts]
        for number, question in enumerate(by_article.get(article_id, []), 1):
            index, start = locate(question, contexts)
            qid = f"ood-{article_id.replace('/', '-')}-{number}"
            paragraphs[index]["qas"].append({"id": qid, "question": question["question"],
                                             "answers": [{"text": question["answer"], "answer_start": start}]})
        source = article_id.split("/")[0]
        counts[f"{source}/articles"] += 1
        counts[f"{source}/contexts"] += len(contexts)
        counts[f"{source}/questions"] += len(by_article.get(article_id, []))
        data.append({"title": title, "paragraphs": paragraphs})
    return {"version": "cprag-ood-real-docs-1", "data": data}, dict(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", metavar="ARTICLE", help="print one article's numbered contexts and stop")
    parser.add_argument("--list", action="store_true", help="print each article's context count and stop")
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    try:
        if args.dump:
            title, contexts = article(args.dump)
            print(f"# {title}")
            for index, context in enumerate(contexts):
                print(f"[{index}] ({words(context)} words) {context}\n")
            return 0
        if args.list:  # keeps going past a bad article, to pick sources
            for article_id in ARTICLES:
                try:
                    title, contexts = article(article_id)
                except BuildError as error:
                    print(f"{article_id}\t-\t{error}")
                    continue
                print(f"{article_id}\t{len(contexts)}\t{title}")
            return 0
        dataset, counts = build(read_questions(QUESTIONS))
    except BuildError as error:
        print(f"ood_build: {error}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(dataset, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(counts, indent=1, sort_keys=True))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
