"""The split span reader: its span rules, packing, its loss with the null entry, training on the activation cache
that learns and resumes, and saved readers that read, refuse another base, and score beside hidden mode."""

import json

import pytest
import torch

from cprag.decoding.span_read import read_passages, windows, word_bounds
from cprag.errors import CacheMismatch, CheckpointError, ConfigError
from cprag.evaluation.oracle_qa import evaluate_oracle
from cprag.evaluation.squad import read_squad
from cprag.index.encode import tokenize_passage
from cprag.model.backbone import gguf_reference
from cprag.model.blocks import run_blocks
from cprag.model.checkpoint import new_cplm
from cprag.model.reader_checkpoint import check_reader_base, continue_from, load_reader, new_reader, save_reader
from cprag.model.span_reader import best_spans, pack_joined, question_scores, span_loss
from cprag.training.examples import activation_cache, prepare_examples
from cprag.training.reader_train import ReaderData, ReaderTrainConfig, train_reader
from tests.tiny_models import write_tiny_gguf
from tests.tiny_squad import tiny_squad

TINY_READER = {"adapter_rank": 4, "lookahead": 1}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader-base") / "tiny.gguf"
    write_tiny_gguf(path)
    return gguf_reference(path)


def test_the_split_defaults_to_a_fraction_of_the_depth(tiny_base):
    reader, _ = new_reader(tiny_base, **TINY_READER)
    assert reader.config.num_layers == 2 and reader.config.split_layer == 1  # round(0.6 * 2)
    assert reader.config.adapter_layers == [1]
    assert sorted({name.split("_")[0] for name in reader.adapters}) == ["layer1"]


def test_word_bounds_allow_whole_words_only(tiny_base):
    _, tokenizer = new_reader(tiny_base, **TINY_READER)
    text = "Jacques Lefevre (c. 1455)"
    tokens = tokenize_passage(tokenizer, text)
    starts, ends = word_bounds(text, tokens.offsets)
    began = [text[a:b].strip() for (a, b), ok in zip(tokens.offsets, starts, strict=True) if ok]
    ended = [text[a:b].strip() for (a, b), ok in zip(tokens.offsets, ends, strict=True) if ok]
    assert began == ["J", "L", "(", "c", ".", "1", ")"]  # byte tokens: first letters, and punctuation
    assert ended == ["s", "e", "(", "c", ".", "5", ")"]


def test_windows_cover_a_long_passage():
    assert windows(10, 16) == [(0, 10)]
    spans = windows(300, 128, stride=100)
    assert spans[0] == (0, 128) and spans[-1][1] == 300
    assert all(b - a <= 128 for a, b in spans)


def test_best_spans_respects_order_length_and_masks():
    start = torch.tensor([[0.0, 5.0, 0.0, 0.0, 8.0]])
    end = torch.tensor([[0.0, 0.0, 4.0, 0.0, 0.0]])
    ok = torch.ones_like(start, dtype=torch.bool)
    score, first, last = best_spans(start, end, ok, ok, max_tokens=5)
    assert (int(first), int(last)) == (1, 2) and float(score) == 9.0  # 5 + 4 beats 8 + 0 (start 4 ends at 4)
    score, first, last = best_spans(start, end, ok, ok, max_tokens=1)
    assert (int(first), int(last)) == (4, 4)  # one-token spans only
    no_end_two = ok.clone()
    no_end_two[0, 2] = False
    _, first, last = best_spans(start, end, ok, no_end_two, max_tokens=5)
    assert int(last) != 2


def test_packed_sequences_score_as_they_do_alone(tiny_base):
    """Packing joined rows together (and the lookahead at a row's end) must not change any sequence's scores."""
    reader, _ = new_reader(tiny_base, **TINY_READER)
    torch.manual_seed(1)
    for delta in reader.adapters.values():
        delta.lora_B.data.normal_(std=0.1)
    hidden = reader.config.hidden_size
    pairs = [(torch.randn(5, hidden), torch.randn(n, hidden)) for n in (9, 4, 7)]
    with torch.no_grad():
        packed = pack_joined(pairs, reader.null, reader.config.lookahead, row_tokens=64)
        assert packed.hidden.shape[0] == 1  # all three share one row
        start, end = reader.top(packed)
        for s, pair in enumerate(pairs):
            alone = pack_joined([pair], reader.null, reader.config.lookahead, row_tokens=64)
            start_alone, end_alone = reader.top(alone)
            row, first, m, n = packed.places[s]
            assert torch.allclose(start[row, first: first + m + n + 1], start_alone[0, : m + n + 1], atol=1e-4)
            assert torch.allclose(end[row, first: first + m + n + 1], end_alone[0, : m + n + 1], atol=1e-4)


@pytest.mark.parametrize("mask", ["causal", "both"])
def test_passages_read_both_ways_only_when_asked(tiny_base, mask):
    """With passage_attention "both" a passage position reads what follows it in its passage; the question never
    reads the passage; packed sequences still score as they do alone."""
    reader, _ = new_reader(tiny_base, **TINY_READER, passage_attention=mask)
    torch.manual_seed(2)
    for delta in reader.adapters.values():
        delta.lora_B.data.normal_(std=0.1)
    hidden = reader.config.hidden_size
    pairs = [(torch.randn(5, hidden), torch.randn(n, hidden)) for n in (9, 4, 7)]
    changed = list(pairs)
    last = changed[0][1].clone()
    last[-1] = torch.randn(hidden)  # the first passage's last token
    changed[0] = (changed[0][0], last)
    with torch.no_grad():
        packed, other = reader.pack(pairs, row_tokens=64), reader.pack(changed, row_tokens=64)
        (start, _), (start_other, _) = reader.top(packed), reader.top(other)
        row, first, m, n = packed.places[0]
        question = slice(first, first + m - 1)  # the last one's lookahead reads the first passage position
        early = slice(first + m, first + m + n - 2)  # passage positions before the changed one, past the lookahead
        assert torch.allclose(start[row, question], start_other[row, question], atol=1e-5)
        assert torch.allclose(start[row, early], start_other[row, early], atol=1e-5) == (mask == "causal")
        for s, pair in enumerate(pairs[1:], start=1):  # the other sequences do not see the change
            row, first, m, n = packed.places[s]
            assert torch.allclose(start[row, first: first + m + n + 1], start_other[row, first: first + m + n + 1],
                                  atol=1e-5)
            alone = reader.top(reader.pack([pair], row_tokens=64))[0]
            assert torch.allclose(start[row, first: first + m + n + 1], alone[0, : m + n + 1], atol=1e-4)
    with pytest.raises(ConfigError, match="passage_attention"):
        new_reader(tiny_base, **TINY_READER, passage_attention="sideways")


def test_the_loss_normalises_over_a_questions_rows_and_its_null_entry():
    torch.manual_seed(0)
    hidden = 4
    pairs = [(torch.zeros(2, hidden), torch.zeros(3, hidden)), (torch.zeros(2, hidden), torch.zeros(4, hidden))]
    joined = pack_joined(pairs, torch.zeros(hidden), 1, row_tokens=64)
    start, end = torch.randn(1, 13), torch.randn(1, 13)
    s, e = question_scores(start, end, joined, [0, 1])
    assert s.shape == (3 + 4 + 1,)
    assert [p[1] for p in joined.places] == [7, 0]  # longest first: the second sequence opens the row
    nulls = torch.stack([start[0, 12], start[0, 6]])  # each sequence's last position
    assert torch.isclose(s[-1], torch.logsumexp(nulls, 0) - torch.log(torch.tensor(2.0)))  # log-mean-exp
    assert torch.equal(s[:3], start[0, 9:12]) and torch.equal(s[3:7], start[0, 2:6])
    ok = torch.ones(8, dtype=torch.bool)
    answered = span_loss(s, e, ok, ok, 1, 2)
    expected = ((torch.logsumexp(s, 0) - s[1]) + (torch.logsumexp(e, 0) - e[2])) / 2
    assert torch.isclose(answered, expected)
    unanswerable = span_loss(s, e, ok, ok, None, None)
    assert torch.isclose(unanswerable, ((torch.logsumexp(s, 0) - s[-1]) + (torch.logsumexp(e, 0) - e[-1])) / 2)
    barred = ok.clone()
    barred[1] = False  # a position that cannot start a span takes no probability
    assert span_loss(s, e, barred, ok, 2, 2) < span_loss(s, e, ok, ok, 2, 2)


def _reader_data(tiny_base, tmp_path, reader):
    squad = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    data = read_squad(squad)
    model, tokenizer = new_cplm(tiny_base, cp_layers=[1], adapter_layers=[1], adapter_rank=4, key_dim=8)
    examples = prepare_examples(tokenizer, data)
    cache, _ = activation_cache(model, tokenizer, examples, squad, reader.config.split_layer, "float32",
                                directory=tmp_path / "cache")
    texts = {pid: text for pid, (_, text) in data.passages.items()}
    return ReaderData.build(examples, cache, reader.config.split_layer, texts), tokenizer, squad


def test_training_on_the_cache_learns_resumes_and_the_saved_reader_reads(tiny_base, tmp_path):
    reader, _ = new_reader(tiny_base, **TINY_READER)
    data, tokenizer, squad = _reader_data(tiny_base, tmp_path, reader)
    assert len(data.questions) == 8
    config = ReaderTrainConfig(max_steps=30, questions_per_step=4, distractors=1, no_answer_fraction=0.0,
                               lr=3e-2, head_lr=3e-2, warmup_steps=1, save_every=15, log_every=5,
                               snapshot_questions=[40], dtype="float32")
    train_reader(reader, data, config, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [5, 10, 15, 20, 25, 30]
    assert lines[-1]["loss"] < lines[0]["loss"]  # it learns the eight facts
    assert (tmp_path / "run" / "reader-q40" / "reader.safetensors").is_file()  # the learning-curve snapshot

    # a longer rerun resumes at step 30 from state.pt, not from scratch
    more = ReaderTrainConfig(**{**config.__dict__, "max_steps": 35})
    again, _ = new_reader(tiny_base, **TINY_READER)
    train_reader(again, data, more, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 35 and len(lines) == 7

    loaded, tokenizer = load_reader(tmp_path / "run" / "reader")
    contexts = [c for _, c in read_squad(squad).passages.values()]
    answers = read_passages(loaded, tokenizer, ["When was the lighthouse built?"], [contexts[:3]])
    answer = answers[0]
    assert answer is not None and answer.text in contexts[answer.passage]
    assert contexts[answer.passage][answer.char_start:answer.char_end] == answer.text
    assert 0.0 < answer.probability <= 1.0 and 0.0 < answer.null_probability <= 1.0
    assert answer.no_answer == (answer.null_score > answer.score)
    # questions read together answer as they do one at a time
    together = read_passages(loaded, tokenizer, ["Who was the keeper?", "When was the lighthouse built?"],
                             [contexts[:2], contexts[:3]])
    assert together[1].text == answer.text and abs(together[1].score - answer.score) < 1e-3
    # the merged reader reads as the trained one did before saving
    again.eval()
    with torch.no_grad():
        before = read_passages(again, tokenizer, ["When was the lighthouse built?"], [contexts[:3]])[0]
    assert before.text == answer.text and abs(before.score - answer.score) < 1e-3

    data_all = read_squad(squad)
    results = evaluate_oracle(None, tokenizer, data_all.examples, data_all.passages, ["reader"], distractors=2,
                              reader=loaded)
    assert len(results) == 8 and {r.mode for r in results} == {"reader"}
    for r in results:
        given = r.withheld_answer if r.no_answer else r.prediction
        assert any(given in data_all.passages[p][1] for p in r.passages)
        assert r.no_answer == (r.prediction == "")
    assert sum(r.f1 for r in results) / len(results) > 25  # trained on these very facts


def test_questions_asked_without_their_passage_teach_the_null_entry(tiny_base, tmp_path):
    reader, _ = new_reader(tiny_base, **TINY_READER)
    data, tokenizer, squad = _reader_data(tiny_base, tmp_path, reader)
    contexts = [c for _, c in read_squad(squad).passages.values()]
    questions = ["When was the lighthouse built?", "Who built the clock?"]
    with torch.no_grad():
        before = read_passages(reader.eval(), tokenizer, questions, [contexts[2:5], contexts[4:7]])
    config = ReaderTrainConfig(max_steps=20, questions_per_step=4, no_answer_fraction=1.0, lr=3e-2, head_lr=3e-2,
                               warmup_steps=1, save_every=100, dtype="float32")
    train_reader(reader, data, config, tmp_path / "run")
    with torch.no_grad():
        after = read_passages(reader.eval(), tokenizer, questions, [contexts[2:5], contexts[4:7]])
    assert all(a.no_answer for a in after)
    assert all(a.null_probability > 5 * b.null_probability for a, b in zip(after, before, strict=True))


def test_two_training_files_train_together_and_unanswerable_questions_read_their_own_passage(tiny_base, tmp_path):
    import random

    from cprag.training.examples import Examples, prepare_negatives
    from cprag.training.reader_train import _question_rows

    reader, _ = new_reader(tiny_base, **TINY_READER)
    (tmp_path / "first").mkdir()
    first, _, _ = _reader_data(tiny_base, tmp_path / "first", reader)
    reviews = tmp_path / "reviews.json"
    context = "The kettle boils fast. The lid sticks after a month."
    reviews.write_text(json.dumps({"version": "v2.0", "data": [{"title": "kettle", "paragraphs": [{
        "context": context, "qas": [
            {"id": "r1", "question": "How fast does it boil?", "answers": [{"text": "fast", "answer_start": 17}]},
            {"id": "r2", "question": "Is the handle comfortable?", "answers": [], "is_impossible": True}]}]}]}))
    model, tokenizer = new_cplm(tiny_base, cp_layers=[1], adapter_layers=[1], adapter_rank=4, key_dim=8)
    answerable = read_squad(reviews)
    examples = prepare_examples(tokenizer, answerable)
    unanswerable = prepare_negatives(tokenizer, read_squad(reviews, unanswerable=True), answerable)
    examples = Examples(examples.passages, examples.questions + unanswerable.questions, examples.skipped)
    cache, _ = activation_cache(model, tokenizer, examples, reviews, reader.config.split_layer, "float32",
                                directory=tmp_path / "reviews-cache")
    texts = first.texts | {"kettle#0": context}
    data = ReaderData.build_many([(_first_examples(tiny_base, tmp_path / "first"), first.cache),
                                  (examples, cache)], reader.config.split_layer, texts)
    assert len(data.questions) == 8 + 2
    impossible = next(q for q in data.questions if q.qid == "r2")
    pairs: list = []
    asked = _question_rows(data, impossible, False, 1, random.Random(0), pairs)
    assert asked.gold is None and len(pairs) == 2  # its own passage, then a distractor from another file
    assert torch.equal(pairs[0][1], data.passage("kettle#0"))
    # a later file's other paragraph under the same id (NQ and SQuAD share Wikipedia titles): the earlier file
    # keeps the id, its states and its text; the later file's question on it is left out
    other = tmp_path / "other.json"
    other_context = "A kettle whistles when the water is ready."
    other.write_text(json.dumps({"version": "v2.0", "data": [{"title": "kettle", "paragraphs": [{
        "context": other_context, "qas": [{"id": "o1", "question": "When does it whistle?",
                                           "answers": [{"text": "when the water is ready", "answer_start": 18}]}]}]}]}))
    other_examples = prepare_examples(tokenizer, read_squad(other))
    other_cache, _ = activation_cache(model, tokenizer, other_examples, other, reader.config.split_layer, "float32",
                                      directory=tmp_path / "other-cache")
    kept = ReaderData.build_many([(examples, cache), (other_examples, other_cache)], reader.config.split_layer,
                                 {"kettle#0": context})
    assert sorted(q.qid for q in kept.questions) == ["r1", "r2"]
    assert torch.equal(kept.passage("kettle#0"), data.passage("kettle#0"))
    assert kept.by_article["kettle"] == ["kettle#0"]


def _first_examples(tiny_base, tmp_path):
    squad = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    _, tokenizer = new_cplm(tiny_base, cp_layers=[1], adapter_layers=[1], adapter_rank=4, key_dim=8)
    return prepare_examples(tokenizer, read_squad(squad))


def test_a_gold_span_inside_a_word_is_never_masked(tiny_base, tmp_path):
    import random
    from dataclasses import replace

    from cprag.training.reader_train import _question_rows

    reader, _ = new_reader(tiny_base, **TINY_READER)
    data, _, _ = _reader_data(tiny_base, tmp_path, reader)
    question = next(q for q in data.questions if q.span[1] > q.span[0])
    inside = replace(question, span=(question.span[0] + 1, question.span[1]))  # from its answer's 2nd character
    asked = _question_rows(data, inside, False, 1, random.Random(0), [])
    assert asked.gold == inside.span and bool(asked.starts_ok[asked.gold[0]])
    whole = _question_rows(data, question, False, 1, random.Random(0), [])
    assert not bool(whole.starts_ok[whole.gold[0] + 1])  # elsewhere a word's inside stays barred


def test_a_cache_without_the_split_or_too_few_questions_is_refused(tiny_base, tmp_path):
    reader, _ = new_reader(tiny_base, **TINY_READER)
    data, tokenizer, squad = _reader_data(tiny_base, tmp_path, reader)
    texts = data.texts
    examples = prepare_examples(tokenizer, read_squad(squad))
    with pytest.raises(CacheMismatch, match="not the reader's split"):
        ReaderData.build(examples, data.cache, 0, texts)
    assert len(ReaderData.build(examples, data.cache, 1, texts, max_questions=99).questions) == 8  # a small file
    del data.cache.where[f"q/{examples.questions[3].qid}"]  # a cache whose build stopped early
    with pytest.raises(CacheMismatch, match="build more"):
        ReaderData.build(examples, data.cache, 1, texts, max_questions=8)


def test_a_reader_on_another_base_is_refused_in_one_line(tiny_base, tmp_path):
    reader, _ = new_reader(tiny_base, **TINY_READER)
    save_reader(reader, tmp_path / "reader")
    check_reader_base(tmp_path / "reader", {"sha256": tiny_base.sha256})  # the same base: fine
    with pytest.raises(CheckpointError, match="trained on base") as refused:
        check_reader_base(tmp_path / "reader", {"sha256": "0" * 64})
    assert "\n" not in str(refused.value)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "reader_config.json").write_text(json.dumps({"kind": "span-reader"}))
    (tmp_path / "old" / "reader.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a split span reader"):
        load_reader(tmp_path / "old")


def test_training_goes_on_from_a_saved_reader_and_refuses_another_shape(tiny_base, tmp_path):
    trained, _ = new_reader(tiny_base, seed=1, **TINY_READER)
    with torch.no_grad():
        trained.null.add_(1.0)
        next(iter(trained.adapters.values())).lora_B.add_(0.5)
    save_reader(trained, tmp_path / "reader")
    fresh, _ = new_reader(tiny_base, seed=2, **TINY_READER)
    assert continue_from(fresh, tmp_path / "reader") == {"adapters": 7, "fresh": [], "rank": 4}
    for name, tensor in trained.trained_state().items():
        assert torch.equal(fresh.trained_state()[name], tensor), name
    lower_rank, _ = new_reader(tiny_base, adapter_rank=2, lookahead=1)
    with pytest.raises(CheckpointError, match="do not match"):
        continue_from(lower_rank, tmp_path / "reader")
    other_head, _ = new_reader(tiny_base, adapter_rank=4, lookahead=2)
    with pytest.raises(CheckpointError, match="span head"):
        continue_from(other_head, tmp_path / "reader")
    with pytest.raises(CheckpointError, match="no span reader"):
        continue_from(fresh, tmp_path / "nothing")


def test_a_reader_grows_to_a_higher_rank_and_a_lower_split_reading_as_before(tmp_path):
    """Going on from a smaller reader: a higher rank is padded and new blocks get identity adapters, so before any
    training step the grown reader scores every position as the saved one does, given the same states at the
    saved reader's split."""
    write_tiny_gguf(tmp_path / "deep.gguf", layers=4)
    ref = gguf_reference(tmp_path / "deep.gguf")
    saved, _ = new_reader(ref, seed=1, split_layer=2, adapter_rank=2, lookahead=1, passage_attention="both")
    torch.manual_seed(3)
    with torch.no_grad():
        for delta in saved.adapters.values():
            delta.lora_B.normal_(std=0.1)
    save_reader(saved, tmp_path / "small")
    grown, _ = new_reader(ref, seed=2, split_layer=1, adapter_rank=8, lookahead=1, passage_attention="both")
    taken = continue_from(grown, tmp_path / "small")
    assert taken["adapters"] == 14 and taken["rank"] == 2 and all(n.startswith("layer1_") for n in taken["fresh"])
    assert len(taken["fresh"]) == 7
    for name, delta in grown.adapters.items():  # the same update at the new rank and scale
        if name not in taken["fresh"]:
            assert torch.allclose(delta.delta_weight(), saved.adapters[name].delta_weight(), atol=1e-6), name
        else:
            assert not delta.delta_weight().any()
    hidden = saved.config.hidden_size
    pairs = [(torch.randn(4, hidden), torch.randn(6, hidden))]
    with torch.no_grad():  # the grown reader's blocks 2-3 and head on the same states entering block 2
        joined = saved.pack(pairs, 64)
        start, end = saved.top(joined)
        again = grown.pack(pairs, 64)
        hidden_states, _ = run_blocks(grown.backbone, again.hidden, None, 2, 4, position_ids=again.positions,
                                      mask=again.mask)
        start_grown, end_grown = grown.span_head(grown.backbone.norm(hidden_states).float(), again.ahead)
    assert torch.allclose(start, start_grown, atol=1e-5) and torch.allclose(end, end_grown, atol=1e-5)


def test_eval_squad_scores_a_saved_reader_beside_hidden_mode(tiny_base, tmp_path):
    from typer.testing import CliRunner

    from cprag.cli import app
    from tests.tiny_models import tiny_checkpoint

    squad = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    checkpoint = tiny_checkpoint(tmp_path / "model")
    reader, _ = new_reader(tiny_base, **TINY_READER)
    save_reader(reader, tmp_path / "reader")
    runner = CliRunner()
    args = ["eval", "squad", str(squad), "--oracle", "--limit", "3", "--checkpoint", str(checkpoint), "--json"]
    result = runner.invoke(app, [*args, "--modes", "hidden,reader", "--reader", str(tmp_path / "reader"),
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["qa/reader/n"] == 3 and summary["qa/hidden/n"] == 3 and "latency/reader/p50_ms" in summary
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    by_mode = {mode: [r["passages"] for r in rows if r["mode"] == mode] for mode in ("hidden", "reader")}
    assert by_mode["hidden"] == by_mode["reader"]  # both read the same seeded passages
    assert "| reader | 3 |" in (tmp_path / "out" / "report.md").read_text()

    missing = runner.invoke(app, [*args, "--modes", "reader", "--reader", str(tmp_path / "nowhere"),
                                  "--out", str(tmp_path / "out2")])
    assert missing.exit_code != 0 and "no span reader here" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    unknown = runner.invoke(app, [*args, "--modes", "hidden,reeder", "--out", str(tmp_path / "out3")])
    assert unknown.exit_code != 0 and "reader" in unknown.stderr


def test_negatives_over_the_training_paragraphs_are_read_with_their_own_passage(tiny_base, tmp_path):
    """`pipelines/train_reader.py --negatives`: rewritten questions over the training file's own paragraphs are
    cached (prompts only), served by the training file's cache, and trained to answer null over their passage."""
    import random

    from cprag.training.examples import cached_negatives
    from cprag.training.reader_train import _question_rows
    from tests.training.test_negatives import negatives_for

    reader, _ = new_reader(tiny_base, **TINY_READER)
    data, _, squad = _reader_data(tiny_base, tmp_path, reader)
    model, tokenizer = new_cplm(tiny_base, cp_layers=[1], adapter_layers=[1], adapter_rank=4, key_dim=8)
    path = negatives_for(tmp_path)
    negatives, figures = cached_negatives(model, tokenizer, path, read_squad(squad), data.cache,
                                          reader.config.split_layer, "float32")
    assert negatives.skipped == {"paragraph not in the training file": 1} and figures
    assert data.add_negatives(negatives.questions) == len(negatives.questions) == 8
    assert data.add_negatives([]) == 0 and len(data.questions) == 16
    asked = _question_rows(data, data.questions[-1], False, 1, random.Random(0), pairs := [])
    assert asked.gold is None and torch.equal(pairs[0][1], data.passage(data.questions[-1].passage_id))
    assert torch.equal(pairs[0][0], data.prompt(data.questions[-1]))


def test_the_training_script_refuses_unreadable_files_in_one_line(tmp_path):
    """`pipelines/train_reader.py` with a training or negatives file it cannot read, or a split outside the
    backbone: one line on stderr, a non-zero exit, and no run state written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "pipelines" / "train_reader.py"
    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    env = {**os.environ, "CPRAG_CACHE": str(tmp_path / "cache")}
    for argv, words, code in (([str(tmp_path / "absent.json")], "cannot read", 1),
                              ([str(data), "--no-build"], "not an activation cache", 1),  # no cache built yet
                              ([str(data), "--negatives", str(tmp_path / "absent-negatives.json")], "cannot read", 1),
                              ([str(data), "--split-layer", "40"], "must lie inside", 2),
                              ([str(data), "--split-layer", "24"], "are adapted", 2)):
        run = subprocess.run([sys.executable, str(script), *argv, "--out", str(tmp_path / "run"), "--max-steps",
                              "1"], capture_output=True, text=True, env=env)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == code and len(errors) == 1 and words in errors[0], run.stderr
        assert not (tmp_path / "run" / "state.pt").exists()
