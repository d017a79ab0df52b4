"""Decoding from several first tokens (`start_beam`): each alternative is the greedy continuation of its first
token from the prompt, scored by the log-probability a single teacher-forced pass gives it."""

import pytest
import torch
from test_index_ask import DOCS, checkpoint, embedder, index_corpus, write_jsonl  # noqa: F401 - fixtures

from cprag.api import Index
from cprag.generate import generate, shared_memory
from cprag.prompt import end_of_turn_id, prompt_ids

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
