"""Lexical match features for copy entries: does the question's vocabulary occur near the token an entry pastes?

The stored token ids of a hidden document are enough to compute them at question time, so the backbone still
never reads the document. They are inputs to the CP head (`CPLMConfig.lexical_prior`), which learns how much
each one is worth; what counts as a word here is fixed and tokenizer-derived, not learned.

Per memory entry (pasting token x_m):
- `overlap@w`, for each window size w: the idf-weighted share of the question's content words found within w
  tokens of x_m;
- with sentences: `sentence`, that share within x_m's sentence, and `sentence/best`, the same over the best
  sentence's share in the whole memory (SQuAD answers sit in the sentence that best matches the question);
- `in_question`: x_m is itself a question word (answers rarely repeat the question);
- with types: the answer-type prior, one indicator per (question type, token type) pair that is on for the
  question's type and x_m's type ("how many" and a digit, "who" and a capitalised word, ...).
"""

from __future__ import annotations

import functools
import itertools
import re

import torch

# the question's expected answer, from its wh-words: first match wins
QUESTION_TYPES = [
    ("quantity", r"\bhow (many|much|long|far|old|large|big|tall)\b|\bwhat (percentage|percent|number)\b"),
    ("time", r"\bwhen\b|\b(what|which) (year|years|century|decade|date|day|month|time|period)\b"),
    ("person", r"\bwho\b|\bwhom\b|\bwhose\b"),
    ("place", r"\bwhere\b|\b(what|which) (country|city|state|place|region|location)\b"),
    ("reason", r"\bwhy\b"),
    ("manner", r"\bhow\b"),
    ("thing", r"\bwhat\b|\bwhich\b"),
]
# the last type is used only with `sentence_starts`: a capitalised word that opens a sentence says less about
# being a name ("The", "In") than one inside it
TOKEN_TYPES = ["digit", "capitalised word", "lowercase word", "word continuation", "other", "sentence start"]

DEFAULT_WINDOW = 12

STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers him
his how i if in into is it its itself just me more most my no nor not of off on once only or other our out over own
same she should so some such than that the their them then there these they this those through to too under until
up very was we were what when where which while who whom why will with would you your yours name named called
""".split())


_WORD_IDS: dict[str, int] = {}


@functools.lru_cache(maxsize=4)
def token_pieces(tokenizer) -> tuple[str, ...]:
    """The text of every token id; special tokens read as a space, so they separate words."""
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    return tuple(" " if i in special or p is None else tokenizer.convert_tokens_to_string([p])
                 for i, p in enumerate(pieces))


def word_ids(tokenizer, ids) -> torch.Tensor:
    """(n,) int64 for token ids (n,): each token gets the id of the lowercase word (maximal letter-or-digit run)
    its first letter or digit belongs to, so sub-word tokens of one word share it; -1 for tokens without one and
    for stopwords and one-character words. Ids are shared by every call in a process.

    A memory is passages each closed by a special token, which ends any word; so each passage's part is read
    once per process and remembered (a question's memory is mostly passages other questions retrieved)."""
    out = []
    for segment in _segments(tokenizer, ids):
        out.extend(_segment_word_ids(tokenizer, segment))
    return torch.tensor(out, dtype=torch.long)


def _segments(tokenizer, ids) -> list[tuple[int, ...]]:
    """`ids` cut after every special token: a memory's passages, each with its end entry (the last may be open).
    Words, sentences and sentence starts never cross a special token, so each piece is read on its own."""
    if isinstance(ids, torch.Tensor):  # the cuts found by one op rather than a Python loop over every id
        ids = ids.cpu()
        cuts = (torch.isin(ids, _special_tensor(tokenizer)).nonzero().flatten() + 1).tolist()
        ids = ids.tolist()
    else:
        ids, special = [int(t) for t in ids], _special_ids(tokenizer)
        cuts = [index + 1 for index, token in enumerate(ids) if token in special]
    bounds = sorted({0, *cuts, len(ids)})
    return [tuple(ids[start:end]) for start, end in itertools.pairwise(bounds)]


@functools.lru_cache(maxsize=4)
def _special_ids(tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.all_special_ids)


@functools.lru_cache(maxsize=4)
def _special_tensor(tokenizer) -> torch.Tensor:
    return torch.tensor(sorted(_special_ids(tokenizer)), dtype=torch.long)


@functools.lru_cache(maxsize=4096)  # passages: a few hundred tokens each
def _segment_word_ids(tokenizer, ids: tuple[int, ...]) -> tuple[int, ...]:
    pieces = token_pieces(tokenizer)
    out = [-1] * len(ids)
    members: list[int] = []
    word: list[str] = []

    def close():
        if word:
            text = "".join(word)
            if len(text) > 1 and text not in STOPWORDS:
                value = _WORD_IDS.setdefault(text, len(_WORD_IDS))
                for index in members:
                    out[index] = value
            word.clear()
            members.clear()

    for index, token in enumerate(ids):
        piece = pieces[int(token)] if 0 <= int(token) < len(pieces) else " "
        for char in piece:
            if char.isalnum():
                if not members or members[-1] != index:
                    members.append(index)
                word.append(char.lower())
            else:
                close()
    close()
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _sentence_ends(tokenizer) -> frozenset[int]:
    pieces = token_pieces(tokenizer)
    ends = {i for i, piece in enumerate(pieces) if piece.rstrip().endswith((".", "!", "?"))}
    return frozenset(ends | set(tokenizer.all_special_ids))


def sentence_ids(tokenizer, ids) -> torch.Tensor:
    """(n,) int64 sentence number of each token, counting from 0: a sentence ends after a token that ends in
    . ! or ? and at special tokens (the end entry of a passage), so passages never share a sentence."""
    ends = _sentence_ends(tokenizer)
    out, current = [], 0
    for token in ids:
        out.append(current)
        if int(token) in ends:
            current += 1
    return torch.tensor(out, dtype=torch.long)


@functools.lru_cache(maxsize=4)
def _alnum_edges(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    pieces = token_pieces(tokenizer)
    starts = torch.tensor([p[:1].isalnum() for p in pieces])
    ends = torch.tensor([p[-1:].isalnum() for p in pieces])
    return starts, ends


def inside_word(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """(M,) bool for paste ids (M,): entry m's token continues the word of entry m - 1's token (letters or digits
    on both sides, no space), so a span that ended before it would cut a word ("80|56020")."""
    starts, ends = _alnum_edges(tokenizer)
    ids = ids.cpu()
    previous = torch.cat([torch.zeros(1, dtype=torch.bool), ends[ids[:-1]]])
    return starts[ids] & previous


def question_words(tokenizer, question: str) -> torch.Tensor:
    """The distinct content-word ids of a question's own text (not the chat template around it)."""
    words = word_ids(tokenizer, tokenizer(question, add_special_tokens=False)["input_ids"])
    return torch.unique(words[words >= 0])


def type_count(sentence_starts: bool) -> int:
    return len(TOKEN_TYPES) - (not sentence_starts)


def feature_count(windows, sentences: bool, types: bool = False, sentence_starts: bool = False) -> int:
    return len(windows) + 2 * bool(sentences) + 1 + types * (len(QUESTION_TYPES) + 1) * type_count(sentence_starts)


def question_type(question: str) -> int:
    """Index into QUESTION_TYPES, or len(QUESTION_TYPES) when no wh-word matches."""
    text = question.lower()
    return next((i for i, (_, pattern) in enumerate(QUESTION_TYPES) if re.search(pattern, text)),
                len(QUESTION_TYPES))


@functools.lru_cache(maxsize=4)
def token_type_table(tokenizer) -> torch.Tensor:
    """(V,) int64 index into TOKEN_TYPES for every token id."""
    def kind(piece: str) -> int:
        body = piece.lstrip()
        if not body or not body[0].isalnum():
            return 4
        if body[0].isdigit():
            return 0
        if len(body) == len(piece):  # no leading space: inside a word
            return 3
        return 1 if body[0].isupper() else 2
    return torch.tensor([kind(p) for p in token_pieces(tokenizer)], dtype=torch.long)


def entry_token_types(tokenizer, ids, sentence_starts: bool = False) -> torch.Tensor:
    """(n,) int64 index into TOKEN_TYPES of each paste token id (n,); with `sentence_starts`, the first token of
    a sentence with a letter or digit in it is a "sentence start" when that is a capital letter."""
    ids = torch.as_tensor(ids, dtype=torch.long).cpu()
    types = token_type_table(tokenizer)[ids]
    if sentence_starts:
        pieces, ends = token_pieces(tokenizer), _sentence_ends(tokenizer)
        opening = True
        for index, token in enumerate(ids.tolist()):
            body = pieces[token].lstrip() if 0 <= token < len(pieces) else ""
            if opening and body[:1].isalnum():
                if body[0].isupper():
                    types[index] = TOKEN_TYPES.index("sentence start")
                opening = False
            if token in ends:
                opening = True
    return types


def memory_lexicon(tokenizer, ids, sentence_starts: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`word_ids`, `sentence_ids` and `entry_token_types` of a memory's paste ids (M,) at once, each (M,) int64.

    The three are read from each passage on its own (`_segments`), and a question's memory is mostly passages
    other questions retrieved: so each passage's three are remembered as tensors, and a memory joins them."""
    words, sentences, types, offset = [], [], [], 0
    for segment in _segments(tokenizer, ids):
        segment_words, segment_sentences, segment_types = _segment_lexicon(tokenizer, segment, sentence_starts)
        words.append(segment_words)
        sentences.append(segment_sentences + offset)
        types.append(segment_types)
        # a segment closes at a special token, which ends a sentence: the next one starts a new number
        offset += int(segment_sentences[-1]) + 1
    if not words:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, empty
    return torch.cat(words), torch.cat(sentences), torch.cat(types)


@functools.lru_cache(maxsize=4096)
def _segment_lexicon(tokenizer, ids: tuple[int, ...], sentence_starts: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(_segment_word_ids(tokenizer, ids), dtype=torch.long), sentence_ids(tokenizer, ids),
            entry_token_types(tokenizer, ids, sentence_starts))


def type_features(question_kind: int, token_types: torch.Tensor, sentence_starts: bool = False) -> torch.Tensor:
    """(M, (len(QUESTION_TYPES) + 1) * T) indicators of (question type, token type); T = `type_count`."""
    count = type_count(sentence_starts)
    features = torch.zeros((token_types.shape[0], (len(QUESTION_TYPES) + 1) * count))
    features.scatter_(1, (question_kind * count + token_types).unsqueeze(1), 1.0)
    return features


def lexical_features(query_words: torch.Tensor, memory_words: torch.Tensor, windows=(DEFAULT_WINDOW,),
                     sentences: torch.Tensor | None = None, question_kind: int | None = None,
                     token_types: torch.Tensor | None = None, sentence_starts: bool = False):
    """query_words (Q,) distinct word ids; memory_words (M,) the word id of each entry's paste token (-1: none);
    sentences (M,) each entry's sentence id, or None; question_kind and token_types (M,) for the answer-type
    prior, or None (with `sentence_starts`, token_types may be "sentence start") -> (M, F) float features in
    [0, 1]: [overlap within each window, (sentence share, sentence share / best share,) in_question, (type
    indicators)]; F = `feature_count`.

    Idf is counted over the memory itself, so a word that fills the memory (a document's title word repeated
    in every passage, or filler) says little about where in it the answer is.
    """
    size = memory_words.shape[0]
    types = None if token_types is None else type_features(question_kind, token_types, sentence_starts)
    plain = feature_count(windows, sentences is not None)
    features = torch.zeros((size, plain))
    if query_words.numel() > 0 and size > 0:
        _word_features(features, query_words, memory_words, windows, sentences)
    return features if types is None else torch.cat([features, types], 1)


def _word_features(features, query_words, memory_words, windows, sentences) -> None:
    size = memory_words.shape[0]
    present = (memory_words.unsqueeze(0) == query_words.unsqueeze(1)).float()  # (Q, M)
    counts = present.sum(1)  # (Q,)
    weights = torch.log1p(size / (1.0 + counts))  # (Q,)
    for column, window in enumerate(windows):
        near = torch.nn.functional.max_pool1d(present.unsqueeze(0), 2 * window + 1, stride=1, padding=window)[0]
        features[:, column] = (weights @ near) / weights.sum()  # (M,)
    if sentences is not None:
        _, sentence = torch.unique(sentences, return_inverse=True)  # (M,) in 0..S-1
        count = int(sentence.max()) + 1
        found = torch.zeros((present.shape[0], count)).scatter_reduce(1, sentence.expand_as(present), present,
                                                                       "amax")  # (Q, S)
        share = (weights @ found) / weights.sum()  # (S,)
        features[:, len(windows)] = share[sentence]
        features[:, len(windows) + 1] = share[sentence] / share.max().clamp(min=1e-6)
    features[:, -1] = present.amax(0)
