"""Lexical match features: word grouping over byte-level tokens, and the overlap / in-question features."""

import math

import pytest
import torch

from cprag.model.lexical import lexical_features, question_words, sentence_ids, word_ids
from tests.tiny_models import tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("lexical"))


def test_sub_word_tokens_of_one_word_share_an_id_and_stopwords_get_none(tokenizer):
    ids = tokenizer("The Lighthouse, lighthouse<|im_end|>keeper of 1871 a", add_special_tokens=False)["input_ids"]
    words = word_ids(tokenizer, ids).tolist()
    pieces = [tokenizer.decode([i]) for i in ids]
    by_word = {}
    for piece, word in zip(pieces, words, strict=True):
        by_word.setdefault(word, []).append(piece)
    assert "".join(by_word[words[pieces.index("L")]]).replace(" ", "") == "Lighthouselighthouse"  # case folded
    keeper, year = words[pieces.index("k")], words[pieces.index("8")]
    assert keeper >= 0 and year >= 0 and len({keeper, year, words[pieces.index("L")]}) == 3  # the end token splits
    assert words[pieces.index("T")] == -1  # "the" is a stopword
    assert words[-1] == -1 and words[pieces.index(",")] == -1  # one-letter words and punctuation


def test_question_words_are_the_distinct_content_words(tokenizer):
    words = question_words(tokenizer, "Who kept the lighthouse, the LIGHTHOUSE?")
    passage = word_ids(tokenizer, tokenizer(" kept lighthouse", add_special_tokens=False)["input_ids"])
    assert sorted(words.tolist()) == sorted(set(passage[passage >= 0].tolist()))


def test_overlap_is_the_idf_weighted_share_of_question_words_within_the_window():
    query = torch.tensor([7, 9])
    memory = torch.tensor([7, -1, -1, -1, 9, -1, 9, -1])
    features = lexical_features(query, memory, windows=(1,))
    w7, w9 = math.log1p(8 / 2), math.log1p(8 / 3)  # idf over the memory: 7 occurs once, 9 twice
    expected = [w7, w7, 0, w9, w9, w9, w9, w9]
    assert torch.allclose(features[:, 0], torch.tensor(expected) / (w7 + w9))
    assert features[:, 1].tolist() == [1, 0, 0, 0, 1, 0, 1, 0]
    assert lexical_features(torch.tensor([], dtype=torch.long), memory).abs().sum() == 0


def test_sentence_features_share_within_each_sentence_and_relative_to_the_best():
    query = torch.tensor([7, 9])
    memory = torch.tensor([7, 9, -1, 9, -1, -1])
    sentences = torch.tensor([0, 0, 0, 5, 5, 8])
    features = lexical_features(query, memory, windows=(0,), sentences=sentences)
    w7, w9 = math.log1p(6 / 2), math.log1p(6 / 3)
    share = torch.tensor([1.0, 1.0, 1.0, w9 / (w7 + w9), w9 / (w7 + w9), 0.0])
    assert torch.allclose(features[:, 1], share) and torch.allclose(features[:, 2], share)  # the best share is 1
    assert features.shape == (6, 4) and features[:, 3].tolist() == [1, 1, 0, 1, 0, 0]


def test_sentences_end_at_full_stops_and_special_tokens(tokenizer):
    ids = tokenizer("One two. Three<|im_end|>four", add_special_tokens=False)["input_ids"]
    numbers = sentence_ids(tokenizer, ids).tolist()
    pieces = [tokenizer.decode([i]) for i in ids]
    assert numbers[pieces.index("O")] == numbers[pieces.index(".")] == 0
    assert numbers[pieces.index("T")] == 1 and numbers[pieces.index("f")] == 2


def test_answer_type_indicators_pair_the_question_type_with_the_pasted_token_type(tokenizer):
    from cprag.model.lexical import QUESTION_TYPES, TOKEN_TYPES, question_type, token_type_table, type_count

    names = [name for name, _ in QUESTION_TYPES] + ["none"]
    assert names[question_type("How many bells does it ring?")] == "quantity"
    assert names[question_type("In what year was it built?")] == "time"
    assert names[question_type("Who designed the bridge?")] == "person"
    assert names[question_type("Name the keeper.")] == "none"
    ids = tokenizer(" 1871 Margit keeps the,", add_special_tokens=False)["input_ids"]
    kinds = [TOKEN_TYPES[k] for k in token_type_table(tokenizer)[torch.tensor(ids)].tolist()]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert kinds[pieces.index("1")] == "digit" and kinds[pieces.index(",")] == "other"
    assert kinds[pieces.index("a")] == "word continuation"
    features = lexical_features(torch.tensor([5]), torch.tensor([5, -1]), windows=(1,), question_kind=2,
                                token_types=torch.tensor([0, 4]))
    types = type_count(sentence_starts=False)
    assert features.shape == (2, 2 + (len(QUESTION_TYPES) + 1) * types)  # overlap, in_question, types
    on = features[:, 2:].nonzero().tolist()
    assert on == [[0, 2 * types + 0], [1, 2 * types + 4]]


def test_inside_word_marks_tokens_that_continue_a_word(tokenizer):
    from cprag.model.lexical import inside_word

    ids = tokenizer("ab 1871.", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    inside = dict(zip(pieces, inside_word(tokenizer, torch.tensor(ids)).tolist(), strict=False))
    assert pieces[:2] == ["a", "b"] and inside_word(tokenizer, torch.tensor(ids)).tolist()[:2] == [False, True]
    assert inside["8"] and inside["7"] and not inside["."]


def test_sentence_starts_are_their_own_token_type_only_when_asked(tokenizer):
    from cprag.model.lexical import TOKEN_TYPES, entry_token_types, feature_count

    ids = tokenizer("The keeper met Margit. The end", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    plain = entry_token_types(tokenizer, ids)
    starts = entry_token_types(tokenizer, ids, sentence_starts=True)
    changed = (plain != starts).nonzero().flatten().tolist()
    assert [pieces[i] for i in changed] == ["T", "T"] and changed[1] > pieces.index(".")  # not "M" of Margit
    assert {TOKEN_TYPES[k] for k in starts[changed].tolist()} == {"sentence start"}
    assert "sentence start" not in {TOKEN_TYPES[k] for k in plain.tolist()}
    assert feature_count([3], False, True, True) - feature_count([3], False, True) == 8  # one type x 8 kinds


def test_a_memorys_lexicon_is_its_passages_read_alone_and_joined(tokenizer):
    """`memory_lexicon` remembers each passage's words, sentences and token types; joined, they are what reading
    the whole memory at once gives (sentence numbers run on across passages, a sentence start follows an end)."""
    from cprag.model.lexical import _segment_lexicon, entry_token_types, memory_lexicon

    first = tokenizer("Keeper Margit lit it. The lamp<|im_end|>", add_special_tokens=False)["input_ids"]
    second = tokenizer("Ships came. In 1871 the keeper<|im_end|>", add_special_tokens=False)["input_ids"]
    open_tail = tokenizer("Then fog", add_special_tokens=False)["input_ids"]
    for memory in (first + second + open_tail, second + first, open_tail, []):
        words, sentences, types = memory_lexicon(tokenizer, memory, sentence_starts=True)
        assert torch.equal(words, word_ids(tokenizer, memory)) and len(words) == len(memory)
        assert torch.equal(sentences, sentence_ids(tokenizer, memory))
        assert torch.equal(types, entry_token_types(tokenizer, memory, sentence_starts=True))
        # a memory's ids as a tensor (what decoding hands over) are cut into the same passages
        as_tensor = memory_lexicon(tokenizer, torch.tensor(memory, dtype=torch.long), sentence_starts=True)
        assert all(torch.equal(a, b) for a, b in zip(as_tensor, (words, sentences, types), strict=True))
    numbers = memory_lexicon(tokenizer, first + second)[1].tolist()
    assert numbers[len(first)] == numbers[len(first) - 1] + 1  # the second passage opens a new sentence
    assert _segment_lexicon.cache_info().hits > 0  # passages asked again were not read again
