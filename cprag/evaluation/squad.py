"""SQuAD-format data: reading, answers aligned to the passage's own tokens, and article-level splits."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from cprag.errors import CorpusError


@dataclass
class QAExample:
    qid: str
    question: str
    answers: list[str]  # every reference answer
    article: str
    paragraph: int  # index of the paragraph in its article: the passage id is f"{article}#{paragraph}"
    context: str
    answer_start: int  # character offset of the first reference answer in context (-1: unanswerable)

    @property
    def answerable(self) -> bool:
        return bool(self.answers)

    @property
    def passage_id(self) -> str:
        return f"{self.article}#{self.paragraph}"


@dataclass
class SquadData:
    examples: list[QAExample]
    passages: dict[str, tuple[str, str]]  # passage id -> (title, context)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count


def read_squad(path: str | Path, unanswerable: bool = False) -> SquadData:
    """Read SQuAD v1.1 JSON. Answers not found at their offset are skipped and counted, never fatal. With
    `unanswerable`, SQuAD 2.0 questions marked `is_impossible` are kept, with no answers."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise CorpusError(str(path), f"cannot read ({error.strerror})") from None
    if not raw.strip():
        raise CorpusError(str(path), "the file is empty")
    try:
        articles = json.loads(raw)["data"]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorpusError(str(path), f"not valid JSON ({error})") from None
    except (KeyError, TypeError):
        raise CorpusError(str(path), 'not SQuAD format: no top-level "data" list') from None
    examples, passages, skipped = [], {}, {}
    try:
        for article in articles:
            for index, paragraph in enumerate(article["paragraphs"]):
                context = paragraph["context"]
                passages[f"{article['title']}#{index}"] = (article["title"], context)
                for qa in paragraph["qas"]:
                    if unanswerable and qa.get("is_impossible"):
                        examples.append(QAExample(qa["id"], qa["question"], [], article["title"], index, context, -1))
                        continue
                    answers = [a["text"] for a in qa["answers"]]
                    first = qa["answers"][0] if qa["answers"] else None
                    if first is None or context[first["answer_start"]:][: len(first["text"])] != first["text"]:
                        skipped["answer not found at its offset"] = skipped.get("answer not found at its offset", 0) + 1
                        continue
                    examples.append(QAExample(qa["id"], qa["question"], answers, article["title"], index, context,
                                              first["answer_start"]))
    except (KeyError, TypeError, IndexError) as error:
        raise CorpusError(str(path), f"not SQuAD format: missing {error}") from None
    return SquadData(examples=examples, passages=passages, skipped=skipped)


def article_of(passage_id: str) -> str:
    """The article of a SQuAD passage id (TITLE#i)."""
    return passage_id.rsplit("#", 1)[0]


def article_split(data: SquadData, validation_fraction: float = 0.2, seed: int = 0) -> tuple[set[str], set[str]]:
    """(train articles, validation articles): whole articles, ordered by a seeded hash, never split by question."""
    titles = sorted({e.article for e in data.examples})
    ranked = sorted(titles, key=lambda t: hashlib.sha256(f"{seed}:{t}".encode()).hexdigest())
    count = max(1, round(len(titles) * validation_fraction))
    return set(ranked[count:]), set(ranked[:count])


def answer_token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """Inclusive token range covering characters [start, end), or None when no token overlaps."""
    covering = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
    return (covering[0], covering[-1]) if covering else None
