"""Unanswerable questions made from answerable ones, for training abstention on a passage that is in memory.

SQuAD 2.0's unanswerable questions are written against a paragraph that stays in memory, with a plausible answer
in it; its authors count the kinds (Rajpurkar et al. 2018, table 3): antonym 20%, entity swap 21%, negation 9%,
mutual exclusion 15%, impossible condition 4%, other 24%. Training on passages that merely lack the answer (the
default recipe's no-answer questions) does not teach the model to notice that a question asks about something
its passage does not say. These rules rewrite a SQuAD v1.1 question so that its own paragraph no longer answers it:

    entity    a name the question shares with its paragraph becomes another name of the article that the
              paragraph does not contain (or another name of the same paragraph: a plausible wrong subject)
    number    a number the question shares with its paragraph becomes one the paragraph does not contain
    antonym   a word of a fixed list becomes its opposite ("largest" -> "smallest", "before" -> "after")
    negation  "was founded" -> "was not founded", "can be" -> "cannot be"

The rules are noisy (a swapped name may do the same thing in the paragraph too); `perturb` returns None where no
rule applies. The texts are deterministic given the random generator.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("entity", "number", "antonym", "negation")

_PAIRS = [
    ("largest", "smallest"), ("biggest", "smallest"), ("highest", "lowest"), ("most", "least"),
    ("first", "last"), ("earliest", "latest"), ("oldest", "newest"), ("longest", "shortest"),
    ("before", "after"), ("above", "below"), ("north", "south"), ("east", "west"), ("northern", "southern"),
    ("eastern", "western"), ("increase", "decrease"), ("increased", "decreased"), ("more", "less"),
    ("minimum", "maximum"), ("best", "worst"), ("major", "minor"), ("inside", "outside"), ("early", "late"),
    ("win", "lose"), ("won", "lost"), ("positive", "negative"), ("high", "low"), ("large", "small"),
    ("public", "private"), ("rich", "poor"), ("modern", "ancient"), ("internal", "external"),
    ("upper", "lower"), ("accepted", "rejected"), ("allowed", "forbidden"), ("success", "failure"),
    ("successful", "unsuccessful"), ("strongest", "weakest"), ("fastest", "slowest"), ("start", "end"),
    ("started", "ended"), ("begin", "end"), ("began", "ended"), ("legal", "illegal"), ("common", "rare"),
    ("supported", "opposed"), ("support", "oppose"), ("male", "female"), ("men", "women"),
]
ANTONYMS = {a: b for a, b in _PAIRS} | {b: a for a, b in _PAIRS}

# a capitalised word ("U.S." is one; a full stop otherwise ends the phrase), joined by "of", "de", ...
_CAPITAL = r"(?:[A-Z](?:\.[A-Z])+\.?|[A-Z][\w'&-]*)"
_NAME = re.compile(rf"\b{_CAPITAL}(?:\s+(?:(?:of|de|von|van)\s+)?{_CAPITAL})*")
_NUMBER = re.compile(r"\b\d[\d,]*(?:\.\d+)?\b")
_WORD = re.compile(r"\b[a-z]+\b")
_PASSIVE = re.compile(r"\b(is|was|are|were|has been|have been|had been)\s+(\w+(?:ed|en))\b")
_MODAL = re.compile(r"\b(can|could|will|would|should|must|may|might)\s+(?!not\b)(\w+)\b")
# words that start a question or a name-like phrase without naming anything
_NOT_NAMES = {"What", "Who", "Whom", "Whose", "When", "Where", "Which", "Why", "How", "In", "On", "At", "The", "A",
              "An", "Of", "For", "By", "To", "From", "During", "After", "Before", "Is", "Was", "Are", "Were", "Did",
              "Do", "Does", "Can", "I", "It", "This", "That", "These", "Those", "According", "Along", "As", "If"}


@dataclass
class Negative:
    question: str
    kind: str  # one of KINDS
    replaced: str  # the words the rule took out
    inserted: str  # and what it put in


def names(text: str, common: set[str] = frozenset()) -> list[str]:
    """Capitalised phrases of `text` (names, titles). Leading words that only start a sentence are dropped: those
    of a fixed list, and those in `common` (words the text also writes in lower case)."""
    found = []
    for match in _NAME.finditer(text):
        words = match.group().split()
        while words and (words[0] in _NOT_NAMES or words[0].lower() in common):
            words = words[1:]
        phrase = " ".join(words).strip(".'")
        if phrase and phrase not in found:
            found.append(phrase)
    return found


def common_words(text: str) -> set[str]:
    """The words `text` writes in lower case somewhere: a capitalised one of them starts a sentence."""
    return set(_WORD.findall(text))


def _swap_entity(question: str, context: str, article_names: list[str], rng: random.Random) -> Negative | None:
    # names the question shares with its paragraph (the question is about them), longest first
    shared = [n for n in names(question) if n in context and not question.startswith(n)]
    if not shared:
        return None
    old = rng.choice(shared)
    own = [n for n in names(context) if n not in question and old not in n and n not in old]
    elsewhere = [n for n in article_names if n not in context and n not in question]
    pool = own if own and (not elsewhere or rng.random() < 0.5) else elsewhere
    # a name of as many words reads more like the same kind of thing (a person for a person)
    pool = [n for n in pool if len(n.split()) == len(old.split())] or pool
    if not pool:
        return None
    new = rng.choice(pool)
    return Negative(question.replace(old, new, 1), "entity", old, new)


def _swap_number(question: str, context: str, rng: random.Random) -> Negative | None:
    shared = [m for m in _NUMBER.finditer(question) if m.group() in context]
    if not shared:
        return None
    match = rng.choice(shared)
    old = match.group()
    digits = old.replace(",", "")
    if not digits.isdigit():
        return None
    value = int(digits)
    for _ in range(20):
        new = str(value + rng.choice([-1, 1]) * rng.randint(1, 12 if 1000 <= value <= 2100 else max(2, value // 3)))
        if int(new) >= 0 and new != digits:
            new = f"{int(new):,}" if "," in old else new
            if new not in context:
                return Negative(question[: match.start()] + new + question[match.end():], "number", old, new)
    return None


def _swap_antonym(question: str, rng: random.Random) -> Negative | None:
    hits = [m for m in _WORD.finditer(question) if m.group() in ANTONYMS]
    if not hits:
        return None
    match = rng.choice(hits)
    new = ANTONYMS[match.group()]
    return Negative(question[: match.start()] + new + question[match.end():], "antonym", match.group(), new)


def _negate(question: str, rng: random.Random) -> Negative | None:
    hits = [(m, f"{m.group(1)} not {m.group(2)}") for m in _PASSIVE.finditer(question)]
    hits += [(m, ("cannot" if m.group(1) == "can" else f"{m.group(1)} not") + f" {m.group(2)}")
             for m in _MODAL.finditer(question)]
    if not hits:
        return None
    match, new = rng.choice(hits)
    return Negative(question[: match.start()] + new + question[match.end():], "negation", match.group(), new)


def perturb(question: str, context: str, article_names: list[str], rng: random.Random,
            kinds: tuple[str, ...] = KINDS) -> Negative | None:
    """One rewrite of `question` that its paragraph `context` does not answer, by a rule drawn in a seeded order
    among those that apply (`article_names`: the names of the question's article, for entity swaps)."""
    order = list(kinds)
    rng.shuffle(order)
    for kind in order:
        if kind == "entity":
            found = _swap_entity(question, context, article_names, rng)
        elif kind == "number":
            found = _swap_number(question, context, rng)
        elif kind == "antonym":
            found = _swap_antonym(question, rng)
        else:
            found = _negate(question, rng)
        if found is not None and found.question != question:
            return found
    return None


def negatives_file(raw: dict, share: float, seed: int, kinds: tuple[str, ...] = KINDS) -> tuple[dict, Counter]:
    """A seeded `share` of the questions of SQuAD v1.1 dict `raw`, rewritten: (a SQuAD 2.0 dict with every
    article and paragraph of `raw` in order, each holding only its rewritten questions, and the count per kind,
    with "no rule applies" for the drawn questions none of `kinds` could rewrite)."""
    rng = random.Random(seed)
    common = common_words(" ".join(p["context"] for a in raw["data"] for p in a["paragraphs"]))
    counts: Counter = Counter()
    articles = []
    for article in raw["data"]:
        article_names = list(dict.fromkeys(n for p in article["paragraphs"] for n in names(p["context"], common)))
        paragraphs = []
        for paragraph in article["paragraphs"]:
            qas = []
            for qa in paragraph["qas"]:
                if rng.random() >= share:
                    continue
                found = perturb(qa["question"], paragraph["context"], article_names, rng, kinds)
                if found is None:
                    counts["no rule applies"] += 1
                    continue
                counts[found.kind] += 1
                qas.append({"id": f"neg-{found.kind}-{qa['id']}", "question": found.question, "answers": [],
                            "is_impossible": True, "plausible_answers": qa["answers"][:1],
                            "rewrite": {"kind": found.kind, "from": qa["question"], "replaced": found.replaced,
                                        "inserted": found.inserted}})
            paragraphs.append({"context": paragraph["context"], "qas": qas})
        articles.append({"title": article["title"], "paragraphs": paragraphs})
    return {"version": "v2.0", "data": articles}, counts
