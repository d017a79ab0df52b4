"""Decoding from several first tokens (`start_beam`): each alternative is the greedy continuation of its first
token from the prompt, scored by the log-probability a single teacher-forced pass gives it."""

import pytest
import torch

from cprag.api import Index
from cprag.decoding.generate import generate
from cprag.decoding.memory import shared_memory
from cprag.decoding.prompt import end_of_turn_id, prompt_ids
from tests.index_helpers import index_corpus
from tests.tiny_models import DOCS, write_jsonl

QUESTIONS = ["When was the lighthouse built?", "Who designed the glass bridge?", "Where do the geese go?"]
MAX_NEW = 8


@torch.inference_mode()
def teacher_forced_log_prob(model, tokenizer, question, passages, alternative) -> float:
    """log p(the alternative's tokens, then its end) from one pass over prompt + answer."""
    memory, _, _ = shared_memory(passages)
    prompt = prompt_ids(tokenizer, question)
    starts = [0]
    for passage in passages:
        starts.append(starts[-1] + len(passage.ids))
    entries = [-1 if s is None else starts[s[0]] + s[1] for s in alternative.sources]
    feed = torch.tensor([prompt + alternative.token_ids])
    out = model(feed, memory=memory, prev_source=torch.tensor([[-1] * len(prompt) + entries]))
    at = len(prompt) - 1
    total = sum(float(out.log_probs[0, at + i, t]) for i, t in enumerate(alternative.token_ids))
    if len(alternative.token_ids) < MAX_NEW:  # it ended: the stop token it chose
        stops = [end_of_turn_id(tokenizer), tokenizer.eos_token_id]
        total += max(float(out.log_probs[0, at + len(alternative.token_ids), s]) for s in stops)
    return total


@pytest.fixture(scope="module")
def index(tmp_path_factory, checkpoint, embedder):  # noqa: F811
    root = tmp_path_factory.mktemp("beam")
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    return Index(root / "idx", checkpoint=checkpoint)


@pytest.mark.parametrize("question", QUESTIONS)
def test_each_start_is_decoded_from_the_prompt_and_the_likeliest_answer_is_kept(index, question):
    model, tokenizer = index.model, index.tokenizer
    passages = index.cache.get([h.passage_id for h in index.retrieve([question], 3)[0]], index.store.fetch)
    options = dict(max_new_tokens=MAX_NEW, whole_words=False)
    greedy = generate(model, tokenizer, question, passages, **options)
    beam = generate(model, tokenizer, question, passages, start_beam=3, **options)
    assert len(beam.alternatives) == 3 and len({a.token_ids[0] for a in beam.alternatives}) == 3
    first = beam.alternatives[0]  # the greedy first token comes first, and decodes to the greedy answer
    assert (first.token_ids, first.sources) == (greedy.token_ids, greedy.sources)
    assert beam.confidence == greedy.confidence  # abstention stays the greedy first token's
    for alternative in beam.alternatives:  # a KV cache not set back to the prompt would change these
        assert alternative.log_prob == pytest.approx(
            teacher_forced_log_prob(model, tokenizer, question, passages, alternative), abs=1e-3)
    best = max(beam.alternatives, key=lambda a: a.log_prob)
    assert (beam.answer, beam.token_ids) == (best.answer, best.token_ids)
    mean = generate(model, tokenizer, question, passages, start_beam=3, length_penalty=1.0, **options)
    assert mean.token_ids == max(beam.alternatives, key=lambda a: a.log_prob / len(a.token_ids)).token_ids


def test_start_beam_must_be_positive(index):
    with pytest.raises(ValueError, match="start_beam"):
        generate(index.model, index.tokenizer, QUESTIONS[0], [], start_beam=0)


def test_the_cli_takes_start_beam_and_refuses_zero(index, checkpoint):  # noqa: F811
    import json

    from typer.testing import CliRunner

    from cprag.cli import app

    base = ["--index", str(index.path), "--checkpoint", str(checkpoint), "-k", "2", "--min-retrieval-score", "-1"]
    bad = CliRunner().invoke(app, ["ask", QUESTIONS[0], "--start-beam", "0", *base])
    assert bad.exit_code == 2 and "--start-beam" in bad.output and len(bad.output.strip().splitlines()) == 1
    beam = CliRunner().invoke(app, ["ask", QUESTIONS[0], "--start-beam", "3", "--json", *base])
    assert beam.exit_code == 0, beam.output
    expected = index.ask(QUESTIONS[0], k=2, min_retrieval_score=-1, start_beam=3)
    assert json.loads(beam.stdout)["answer"] == expected.answer


@pytest.fixture(scope="module")
def reranked(tmp_path_factory, checkpoint, index):  # noqa: F811
    """The test checkpoint with a start reranker of beam 3 that always picks the third start."""
    import shutil

    from cprag.decoding.rerank import StartReranker, feature_count, prior_feature_count

    directory = tmp_path_factory.mktemp("reranked") / "checkpoint"
    shutil.copytree(checkpoint, directory)
    size = feature_count(prior_feature_count(index.model.config))
    weights = [0.0] * size
    weights[7 + 2] = 1.0  # the rank indicators follow the 7 log-probability features
    StartReranker(weights, [0.0] * size, [1.0] * size, beam=3, fitted_on={"test": True}).save(directory)
    return Index(index.path, checkpoint=directory), directory


def test_the_default_start_beam_is_the_reranker_s_and_streams_stay_greedy(reranked, index):
    opened, _ = reranked
    assert opened.start_beam == 3 and index.start_beam == 1  # no reranker: greedy
    options = dict(k=3, min_confidence=0.0, min_retrieval_score=-1.0)
    default = [opened.ask(q, **options).answer for q in QUESTIONS]
    assert default == [opened.ask(q, start_beam=3, **options).answer for q in QUESTIONS]
    greedy = [opened.ask(q, start_beam=1, **options).answer for q in QUESTIONS]
    assert default != greedy  # the third start was chosen, not the greedy one
    assert default == [a.answer for a in opened.ask_many(QUESTIONS, batch_size=2, **options)]
    heard = []
    streamed = opened.ask_many(QUESTIONS, on_token=lambda i, token, source: heard.append(i), **options)
    assert [a.answer for a in streamed] == greedy and heard  # a stream hears greedy's tokens only


def test_eval_squad_records_the_start_beam_it_decoded_with(reranked, tmp_path):
    import json

    from typer.testing import CliRunner

    from cprag.cli import app

    _, directory = reranked
    context = "The lighthouse at Varna Point was built in 18{}2 by the harbour board, and it still stands."
    data = {"version": "1.1", "data": [{"title": "Lighthouse", "paragraphs": [
        {"context": context.format(n), "qas": [{"id": f"q{n}", "question": "When was the lighthouse built?",
                                                "answers": [{"text": f"18{n}2", "answer_start": 43}]}]}
        for n in range(3)]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(data))
    for flags, beam in (([], 3), (["--start-beam", "1"], 1)):
        result = CliRunner().invoke(app, ["eval", "squad", str(path), "--oracle", "--modes", "hidden", "--out",
                                          str(tmp_path / f"out{beam}"), "--checkpoint", str(directory), "--json",
                                          *flags])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["eval/start_beam"] == beam
