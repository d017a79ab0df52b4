"""Batched decoding: many questions per backbone pass give exactly the answers of one question at a time."""

import pytest
import torch

from cprag.api import Index
from cprag.decoding.batched import batch_supported, generate_batch
from cprag.decoding.generate import generate
from cprag.decoding.prompt import SYSTEM, prompt_ids
from cprag.decoding.prompt_prefix import prompt_prefix
from cprag.errors import ConfigError
from tests.index_helpers import index_corpus
from tests.tiny_models import DOCS, tiny_checkpoint, write_jsonl

QUESTIONS = ["When was the lighthouse built?", "Who designed the glass bridge?", "Where do the geese go?",
             "What rings every hour?", "When does the night ferry leave?", "Which bell?",
             "Tell me about the granite lighthouse at Varna Point and the year it was built, please."]
HEADS = {  # a plain head; one that copies every token with a strong successor bias (long spans, whole words);
    # one with the lexical prior and end entries, as the shipped checkpoint has
    "plain": dict(),
    "copying": dict(copy_everything=True, successor=(6.0, 0.0)),
    "lexical-ends": dict(copy_everything=True, successor=(3.0, 1.0), lexical_prior=True, end_entries=True),
}


@pytest.fixture(scope="module", params=sorted(HEADS))
def index(request, tmp_path_factory, embedder):  # noqa: F811
    root = tmp_path_factory.mktemp(f"batch-{request.param}")
    checkpoint = tiny_checkpoint(root / "model", seed=3, **HEADS[request.param])
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    return Index(root / "idx", checkpoint=checkpoint)


def shards(index, question, k):
    hits = index.retrieve([question], k)[0]
    return index.cache.get([h.passage_id for h in hits], index.store.fetch)


def same(single, batched):
    assert (batched.answer, batched.token_ids, batched.sources) == (single.answer, single.token_ids, single.sources)
    assert batched.no_answer == single.no_answer
    assert [(c.doc_id, c.start, c.end) for c in batched.citations] == \
        [(c.doc_id, c.start, c.end) for c in single.citations]
    for name in ("confidence", "stop_probability"):
        a, b = getattr(single, name), getattr(batched, name)
        assert (a is None) == (b is None) and (a is None or a == pytest.approx(b, abs=1e-4))


def test_a_batch_answers_exactly_as_one_question_at_a_time(index):
    assert batch_supported(index.model, "hidden")
    # different k per question: memories of different sizes in one batch, one of them empty (closed book)
    memories = [shards(index, q, 1 + i % 3) if i != 5 else [] for i, q in enumerate(QUESTIONS)]
    singles = [generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12)
               for q, m in zip(QUESTIONS, memories, strict=True)]
    batched = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12)
    assert len(batched) == len(QUESTIONS)
    for single, generation in zip(singles, batched, strict=True):
        same(single, generation)
    prefix = prompt_prefix(index.model, index.tokenizer)
    for max_rows in (2, 3):  # a continuous batch: questions join as others finish, with and without the prefix
        for given in (None, prefix):
            joined = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, max_rows=max_rows,
                                    prefix=given)
            for single, generation in zip(singles, joined, strict=True):
                same(single, generation)
    for generation in batched:
        if generation.alternatives:  # per-token log-probs, as the single decoder records them
            assert len(generation.alternatives[0].token_log_probs) == len(generation.token_ids)


def test_rows_draft_their_copied_spans_and_keep_exactly_the_greedy_answer(index, request):
    memories = [shards(index, q, 1 + i % 3) for i, q in enumerate(QUESTIONS)]

    def decode(rows, draft):
        passes = []
        hook = index.model.register_forward_hook(lambda *_: passes.append(1))
        try:
            got = generate_batch(index.model, index.tokenizer, [QUESTIONS[i] for i in rows],
                                 [memories[i] for i in rows], 16, draft_tokens=draft)
        finally:
            hook.remove()
        return got, len(passes)

    everyone = range(len(QUESTIONS))
    (plain, _), (drafted, _) = decode(everyone, 0), decode(everyone, 8)
    for undrafted, generation in zip(plain, drafted, strict=True):  # drafts, rejections, padding change nothing
        same(undrafted, generation)
    # a batch lasts as long as its longest answer: among answers copied whole, drafting takes fewer passes
    copying = [i for i in everyone if plain[i].sources and all(s is not None for s in plain[i].sources)]
    if "copying" in request.node.name or "lexical" in request.node.name:
        assert sum(len(plain[i].token_ids) for i in copying) > 2 * len(copying) > 0
        (_, slow), (_, fast) = decode(copying, 0), decode(copying, 8)
        assert fast < slow, (fast, slow)


def test_the_prompts_fixed_beginning_run_once_changes_no_answer(index):
    prefix = prompt_prefix(index.model, index.tokenizer)
    prompts = [prompt_ids(index.tokenizer, q) for q in QUESTIONS]
    assert prefix is not None and prefix.length >= 5 and all(prefix.fits(p) for p in prompts)
    assert SYSTEM in index.tokenizer.decode(prefix.ids)  # the whole system turn, run once
    memories = [shards(index, q, 1 + i % 3) if i != 5 else [] for i, q in enumerate(QUESTIONS)]
    for question, memory in zip(QUESTIONS, memories, strict=True):
        mode = "hidden" if memory else "closed"
        plain = generate(index.model, index.tokenizer, question, memory, mode, 12)
        same(plain, generate(index.model, index.tokenizer, question, memory, mode, 12, prefix=prefix))
        beamed = [generate(index.model, index.tokenizer, question, memory, mode, 12, start_beam=3, prefix=f)
                  for f in (None, prefix)]
        same(*beamed)
    plain = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12)
    for a, b in zip(plain, generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, prefix=prefix),
                    strict=True):
        same(a, b)
    assert index.prefix is not None and index.prefix.ids == prefix.ids  # what Index.ask_many hands down


def test_abstention_and_the_token_limit_hold_per_question_in_a_batch(index):
    memories = [shards(index, q, 3) for q in QUESTIONS]
    confidences = [generate(index.model, index.tokenizer, q, m, max_new_tokens=3).confidence
                   for q, m in zip(QUESTIONS, memories, strict=True)]
    threshold = sorted(confidences)[len(confidences) // 2]  # about half the questions fall below it
    singles = [generate(index.model, index.tokenizer, q, m, max_new_tokens=3, min_confidence=threshold)
               for q, m in zip(QUESTIONS, memories, strict=True)]
    batched = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 3, min_confidence=threshold)
    assert sum(g.no_answer for g in batched) == sum(c < threshold for c in confidences)
    for single, generation in zip(singles, batched, strict=True):
        same(single, generation)
        assert len(generation.token_ids) <= 3


def test_a_batch_refuses_mismatched_inputs(index):
    with pytest.raises(ValueError, match="2 questions but 1 passage lists"):
        generate_batch(index.model, index.tokenizer, QUESTIONS[:2], [[]])


def test_the_batch_shares_one_device_copy_of_a_shard_retrieved_by_several_questions(index):
    first, second = shards(index, QUESTIONS[0], 2), shards(index, QUESTIONS[0] + " Really?", 2)
    assert {id(p) for p in first} & {id(p) for p in second}  # the cache hands out the same device tensors
    assert all(isinstance(p.keys, torch.Tensor) for p in first)


def test_ask_many_answers_as_ask_does_and_the_cli_batches_the_same_way(index, tmp_path):
    import json

    from typer.testing import CliRunner

    from cprag.cli import app

    options = dict(k=2, min_retrieval_score=0.1, min_confidence=0.0)  # the floor withholds some, not all
    singles = [index.ask(q, **options) for q in QUESTIONS]
    many = index.ask_many(QUESTIONS, batch_size=4, **options)
    assert [a.no_answer_reason for a in many] == [a.no_answer_reason for a in singles]
    for single, answer in zip(singles, many, strict=True):
        assert (answer.answer, answer.passages, answer.confidence) == (single.answer, single.passages,
                                                                       single.confidence)
        assert [c.text for c in answer.citations] == [c.text for c in single.citations]
    questions = tmp_path / "q.txt"
    questions.write_text("\n".join(QUESTIONS) + "\n")
    base = ["ask", "--questions", str(questions), "--index", str(index.path), "-k", "2", "--min-retrieval-score",
            "0.1", "--min-confidence", "0", "--json", "--checkpoint", str(index.checkpoint)]
    runs = {size: CliRunner().invoke(app, [*base, "--batch-size", str(size)]) for size in (1, 3)}
    for run in runs.values():
        assert run.exit_code == 0, run.output
    assert [json.loads(line)["answer"] for line in runs[3].stdout.splitlines()] == [a.answer for a in singles]
    assert runs[1].stdout.count("\n") == runs[3].stdout.count("\n") == len(QUESTIONS)
    bad = CliRunner().invoke(app, [*base, "--batch-size", "0"])
    assert bad.exit_code == 2 and "--batch-size" in bad.output
    wrong = CliRunner().invoke(app, [*base, "--dtype", "float16"])
    assert wrong.exit_code == 2 and "--dtype" in wrong.output and "bfloat16" in wrong.output
    bf16 = CliRunner().invoke(app, [*base, "--dtype", "bfloat16"])
    assert bf16.exit_code == 0, bf16.output
    assert bf16.stdout.count("\n") == len(QUESTIONS)


def test_one_bad_question_stops_the_batch_before_any_answer(index):
    from cprag.errors import ConfigError

    with pytest.raises(ConfigError, match="empty"):
        index.ask_many([QUESTIONS[0], "   "], k=2)


def test_the_passage_prior_moves_copies_to_the_favoured_passage_and_batches_exactly(index):
    memories = [shards(index, q, 3) if i != 5 else [] for i, q in enumerate(QUESTIONS)]
    favour_last = [[0.0, 0.0, 1.0] if m else None for m in memories]
    plain = [generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12)
             for q, m in zip(QUESTIONS, memories, strict=True)]
    for single, q, m in zip(plain, QUESTIONS, memories, strict=True):  # weight 0 (or no scores): no prior at all
        same(single, generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12,
                              passage_scores=[0.0, 0.0, 1.0] if m else None, passage_prior=0.0))
    # 50 nats below the favoured passage: nothing is copied from the other two
    pushed = [generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12, passage_scores=s,
                       passage_prior=50.0) for q, m, s in zip(QUESTIONS, memories, favour_last, strict=True)]
    copied = [source for g in pushed for source in g.sources if source is not None]
    assert all(passage == 2 for passage, _ in copied)
    if any(source is not None and source[0] != 2 for g in plain for source in g.sources):
        assert [g.sources for g in pushed] != [g.sources for g in plain]  # the prior moved some copy
    # some rows without scores: a continuous batch joins memories with and without a bias
    mixed = [s if i % 2 else None for i, s in enumerate(favour_last)]
    singles = [generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12, passage_scores=s,
                        passage_prior=50.0) for q, m, s in zip(QUESTIONS, memories, mixed, strict=True)]
    for max_rows in (None, 2):
        batched = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, max_rows=max_rows,
                                 passage_scores=mixed, passage_prior=50.0)
        for single, generation in zip(singles, batched, strict=True):
            same(single, generation)


def test_ask_weighs_its_retrieval_scores_in_only_when_asked(index):
    assert index.passage_prior == 0.0  # a checkpoint without passage_prior.json
    question = QUESTIONS[0]
    hits = index.retrieve([question], 3)[0]
    memory = shards(index, question, 3)
    for weight in (0.0, 50.0):
        answer = index.ask(question, k=3, passage_prior=weight, min_confidence=0.0, min_retrieval_score=-1.0)
        expected = generate(index.model, index.tokenizer, question, memory, "hidden", 32,
                            passage_scores=[h.score for h in hits], passage_prior=weight, prefix=index.prefix)
        assert answer.answer == expected.answer
        assert [(c.doc_id, c.start, c.end) for c in answer.citations] == \
            [(c.doc_id, c.start, c.end) for c in expected.citations]
    with pytest.raises(ConfigError, match="--passage-prior"):
        index.ask(question, k=3, passage_prior=-1.0)


def test_the_cli_passes_the_passage_prior_and_refuses_a_negative_one(index):
    import json

    from typer.testing import CliRunner

    from cprag.cli import app

    base = ["ask", QUESTIONS[1], "--index", str(index.path), "-k", "3", "--min-retrieval-score", "-1",
            "--min-confidence", "0", "--json", "--checkpoint", str(index.checkpoint)]
    run = CliRunner().invoke(app, [*base, "--passage-prior", "50"])
    assert run.exit_code == 0, run.output
    expected = index.ask(QUESTIONS[1], k=3, passage_prior=50.0, min_confidence=0.0, min_retrieval_score=-1.0)
    assert json.loads(run.stdout)["answer"] == expected.answer
    bad = CliRunner().invoke(app, [*base, "--passage-prior", "-1"])
    assert bad.exit_code == 2 and "--passage-prior" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_the_end_bias_cuts_or_lengthens_answers_defaults_to_the_checkpoints_and_batches_exactly(index):
    memories = [shards(index, q, 2) if i != 5 else [] for i, q in enumerate(QUESTIONS)]
    modes = ["hidden" if m else "closed" for m in memories]

    def answers(end_bias, **options):
        return [generate(index.model, index.tokenizer, q, m, mode, 12, end_bias=end_bias, **options)
                for q, m, mode in zip(QUESTIONS, memories, modes, strict=True)]

    plain = answers(None)  # the checkpoint's end_bias: 0 for this one
    for single, zero in zip(plain, answers(0.0), strict=True):
        same(single, zero)
    # ending always wins after the first token (never the end with passages); never wins at all
    for mode, cut in zip(modes, answers(1e4, whole_words=False), strict=True):
        assert len(cut.token_ids) == (1 if mode == "hidden" else 0)
    assert all(len(g.token_ids) == 12 for g in answers(-1e4))
    index.model.config.end_bias = 1e4  # a checkpoint's own end_bias is what None means
    try:
        for default, cut in zip(answers(None, whole_words=False), answers(1e4, whole_words=False), strict=True):
            same(default, cut)
    finally:
        index.model.config.end_bias = 0.0
    for bias in (-3.0, 3.0):  # moderate biases move some choices; a batch still answers as one at a time
        singles = answers(bias)
        for max_rows in (None, 2):
            batched = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, max_rows=max_rows,
                                     end_bias=bias)
            for single, generation in zip(singles, batched, strict=True):
                same(single, generation)


def test_ask_and_the_cli_pass_the_end_bias_and_refuse_a_nan_one(index):
    import json

    from typer.testing import CliRunner

    from cprag.cli import app

    options = dict(k=3, min_confidence=0.0, min_retrieval_score=-1.0)
    memory = shards(index, QUESTIONS[1], 3)
    cited = {}
    for bias in (-1e4, 1e4):  # ask decodes with the bias it is given, as generate does
        answer = index.ask(QUESTIONS[1], end_bias=bias, **options)
        expected = generate(index.model, index.tokenizer, QUESTIONS[1], memory, "hidden", 32, end_bias=bias,
                            whole_words=True, prefix=index.prefix)
        if bias < 0:
            assert len(expected.token_ids) == 32
        assert answer.answer == expected.answer
        cited[bias] = [(c.doc_id, c.start, c.end) for c in answer.citations]
        assert cited[bias] == [(c.doc_id, c.start, c.end) for c in expected.citations]
    if cited[-1e4]:  # heads that copy: 32 copied tokens cite more than the few before the first end
        assert cited[-1e4] != cited[1e4]
    long = index.ask(QUESTIONS[1], end_bias=-1e4, **options)
    base = ["ask", QUESTIONS[1], "--index", str(index.path), "-k", "3", "--min-retrieval-score", "-1",
            "--min-confidence", "0", "--json", "--checkpoint", str(index.checkpoint)]
    run = CliRunner().invoke(app, [*base, "--end-bias", "-10000"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["answer"] == long.answer
    bad = CliRunner().invoke(app, [*base, "--end-bias", "nan"])
    assert bad.exit_code == 2 and "--end-bias" in bad.output and len(bad.output.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="--end-bias"):
        index.ask(QUESTIONS[1], end_bias=float("inf"), **options)


def test_a_start_beam_decodes_its_alternatives_as_rows_and_answers_as_generate_does(index):
    from cprag.decoding.rerank import StartReranker, feature_count, prior_feature_count

    memories = [shards(index, q, 1 + i % 3) if i != 5 else [] for i, q in enumerate(QUESTIONS)]
    size = feature_count(prior_feature_count(index.model.config))
    weights = torch.randn(size, generator=torch.Generator().manual_seed(0)).tolist()
    rerankers = {"likeliest": None, "reranker": StartReranker(weights, [0.0] * size, [1.0] * size, 3, {})}
    for name, reranker in rerankers.items():
        singles = [generate(index.model, index.tokenizer, q, m, "hidden" if m else "closed", 12, start_beam=3,
                            reranker=reranker) for q, m in zip(QUESTIONS, memories, strict=True)]
        assert any(len(g.alternatives) == 3 for g in singles)
        for max_rows in (None, 4):  # 4 rows: alternatives of one question in different passes of the batch
            batched = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, max_rows=max_rows,
                                     start_beam=3, reranker=reranker)
            for single, generation in zip(singles, batched, strict=True):
                same(single, generation)
                assert [(a.answer, a.token_ids, a.sources, a.entries) for a in generation.alternatives] == \
                    [(a.answer, a.token_ids, a.sources, a.entries) for a in single.alternatives], name
                assert [a.log_prob for a in generation.alternatives] == pytest.approx(
                    [a.log_prob for a in single.alternatives], abs=1e-4)
    # abstention is the greedy first token's, for every alternative
    withheld = generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, start_beam=3, min_confidence=1.0)
    assert all(g.no_answer and not g.alternatives for g, m in zip(withheld, memories, strict=True) if m)
    with pytest.raises(ValueError, match="stream"):
        generate_batch(index.model, index.tokenizer, QUESTIONS, memories, 12, start_beam=2,
                       on_token=lambda *_: None)


def test_ask_many_decodes_a_start_beam_in_one_batch_with_the_answers_of_one_at_a_time(index):
    options = dict(k=3, min_confidence=0.0, min_retrieval_score=-1.0, start_beam=3)
    one_by_one = [index.ask(q, **options) for q in QUESTIONS]
    for batch_size in (1, 4):
        many = index.ask_many(QUESTIONS, batch_size=batch_size, **options)
        for a, b in zip(one_by_one, many, strict=True):
            assert (a.answer, a.no_answer) == (b.answer, b.no_answer)
            assert [(c.doc_id, c.start, c.end) for c in a.citations] == \
                [(c.doc_id, c.start, c.end) for c in b.citations]
    memory = shards(index, QUESTIONS[0], 3)
    alone = generate(index.model, index.tokenizer, QUESTIONS[0], memory, "hidden", 32, start_beam=3,
                     reranker=index.reranker, prefix=index.prefix, passage_scores=None)
    assert one_by_one[0].answer == alone.answer  # what ask answers is the single decoder's start-beam answer
