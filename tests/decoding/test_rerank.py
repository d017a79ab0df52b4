"""The start reranker: span features, its file in a checkpoint, and its choice among start-beam answers."""

import json
from dataclasses import asdict

import pytest
import torch

from cprag.api import Index
from cprag.decoding.generate import generate
from cprag.decoding.memory import lexical_prior, shared_memory
from cprag.decoding.rerank import MAX_RANK, RERANKER_FILE, SpanCandidate, StartReranker, feature_count, span_features
from tests.index_helpers import index_corpus
from tests.tiny_models import DOCS, write_jsonl

QUESTION = "Who designed the glass bridge?"
RANK_COLUMN = 7  # the first rank indicator: after the seven log-probability features


def candidate(answer: str, log_probs=(-1.0, -0.5), passage=0, prior=None) -> SpanCandidate:
    return SpanCandidate(answer, list(log_probs), sum(log_probs) - 0.1, prior, prior, passage)


def reranker_preferring(rank: int, size: int) -> StartReranker:
    weights = [0.0] * size
    weights[RANK_COLUMN + rank] = 1.0
    return StartReranker(weights, [0.0] * size, [1.0] * size, beam=3, fitted_on={})


def test_span_features_read_the_span_and_its_question():
    prior = [0.5] * 46
    candidates = [candidate("the glass bridge", prior=prior), candidate("Ada Lovelace", (-2.0,), passage=1),
                  candidate("1889", (-3.0, -0.2, -0.1), passage=None)]
    features = span_features(QUESTION, candidates)
    assert features.shape == (3, feature_count(46))
    repeated = features[:, 13]  # the share of the span's words that repeat the question
    assert repeated.tolist() == [1.0, 0.0, 0.0]
    assert features[:, 1].tolist() == [0.0, -1.0, -2.0]  # first-token log p against the best first token's
    ranks = features[:, RANK_COLUMN:RANK_COLUMN + MAX_RANK]
    assert ranks.argmax(1).tolist() == [0, 1, 2] and ranks.sum(1).tolist() == [1.0] * 3
    assert features[2, 15] == 1.0 and features[:2, 15].tolist() == [0.0, 0.0]  # not copied
    assert torch.isfinite(features).all()


def test_a_reranker_file_round_trips_and_a_bad_one_is_refused(tmp_path):
    reranker = reranker_preferring(1, 10)
    reranker.save(tmp_path)
    assert StartReranker.load(tmp_path) == reranker
    assert StartReranker.load(tmp_path / "elsewhere") is None
    (tmp_path / RERANKER_FILE).write_text((tmp_path / RERANKER_FILE).read_text().replace(
        '"format_version": 2', '"format_version": 9'))
    with pytest.raises(ValueError, match="format 9"):
        StartReranker.load(tmp_path)
    with pytest.raises(ValueError, match="differ in length"):
        StartReranker([1.0], [0.0, 0.0], [1.0], 2, {})
    with pytest.raises(ValueError, match="reads 10 features"):
        reranker.scores(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="hidden layer"):
        StartReranker([1.0, 1.0], [0.0] * 3, [1.0] * 3, 2, {}, hidden=[[0.0] * 3, [0.0] * 2], hidden_bias=[0.0, 0.0])


def test_a_hidden_layer_reranker_scores_through_its_units_and_a_linear_format_1_file_still_loads(tmp_path):
    size = feature_count(4)
    hidden = [[0.0] * size for _ in range(2)]
    hidden[0][RANK_COLUMN + 2], hidden[1][RANK_COLUMN] = 3.0, 1.0  # unit 0 fires on the third start
    reranker = StartReranker([1.0, -0.5], [0.0] * size, [2.0] * size, 3, {}, hidden=hidden, hidden_bias=[0.0, 0.1])
    candidates = [candidate("Ada Lovelace", prior=[0.1] * 4), candidate("1889", prior=[0.2] * 4),
                  candidate("the bridge", prior=[0.3] * 4)]
    features = span_features(QUESTION, candidates)
    units = torch.nn.functional.gelu(features / 2.0 @ torch.tensor(hidden).T + torch.tensor([0.0, 0.1]))
    torch.testing.assert_close(reranker.scores(features), units @ torch.tensor([1.0, -0.5]))
    assert reranker.choose(QUESTION, candidates) == 2 and reranker.prior_size == 4
    reranker.save(tmp_path)
    assert StartReranker.load(tmp_path) == reranker
    linear = reranker_preferring(1, size)
    values = {**asdict(linear), "format_version": 1}
    del values["hidden"], values["hidden_bias"]  # what a format-1 file holds
    (tmp_path / RERANKER_FILE).write_text(json.dumps(values))
    assert StartReranker.load(tmp_path).choose(QUESTION, candidates) == 1


@pytest.fixture(scope="module")
def index(tmp_path_factory, checkpoint, embedder):  # noqa: F811
    root = tmp_path_factory.mktemp("rerank")
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    return Index(root / "idx", checkpoint=checkpoint)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_generate_answers_with_the_alternative_the_reranker_scores_highest(index, rank):
    passages = index.cache.get([h.passage_id for h in index.retrieve([QUESTION], 3)[0]], index.store.fetch)
    beam = generate(index.model, index.tokenizer, QUESTION, passages, max_new_tokens=8, start_beam=3)
    prior = lexical_prior(index.model, index.tokenizer, QUESTION, shared_memory(passages)[0].ids[0])
    reranker = reranker_preferring(rank, feature_count(0 if prior is None else prior.shape[-1]))
    chosen = generate(index.model, index.tokenizer, QUESTION, passages, max_new_tokens=8, start_beam=3,
                      reranker=reranker)
    assert chosen.token_ids == beam.alternatives[rank].token_ids
    assert [a.token_ids for a in chosen.alternatives] == [a.token_ids for a in beam.alternatives]
    for alternative in beam.alternatives:  # per-token log-probs add up to the whole (with the end's)
        assert sum(alternative.token_log_probs) >= alternative.log_prob - 1e-4
        assert len(alternative.token_log_probs) == len(alternative.entries) == len(alternative.token_ids)


def test_an_index_loads_its_checkpoints_reranker_and_refuses_one_of_another_checkpoint(index, checkpoint):  # noqa: F811
    import shutil

    from cprag.decoding.rerank import prior_feature_count
    from cprag.errors import CheckpointError

    assert index.reranker is None  # the tiny checkpoint ships none: answers are the likeliest
    copy = checkpoint.parent / "with-reranker"
    shutil.copytree(checkpoint, copy, dirs_exist_ok=True)
    size = feature_count(prior_feature_count(index.model.config))
    reranker_preferring(1, size).save(copy)
    opened = Index(index.path, checkpoint=copy)
    assert opened.reranker == reranker_preferring(1, size)
    question = "Who designed the glass bridge?"
    beam = opened.ask(question, k=3, min_retrieval_score=-1, min_confidence=0, start_beam=3)
    passages = opened.cache.get([h.passage_id for h in opened.retrieve([question], 3)[0]], opened.store.fetch)
    plain = generate(opened.model, opened.tokenizer, question, passages, start_beam=3)
    assert beam.answer == plain.alternatives[1].answer  # the reranker's choice, not the likeliest
    reranker_preferring(1, size + 1).save(copy)
    with pytest.raises(CheckpointError, match="another checkpoint"):
        Index(index.path, checkpoint=copy)


@pytest.mark.parametrize("prior_size", [0, 4, 46])
def test_a_reranker_reads_candidates_with_and_without_lexical_features(prior_size):
    reranker = reranker_preferring(2, feature_count(prior_size))
    assert reranker.prior_size == prior_size
    prior = [0.25] * prior_size if prior_size else None
    candidates = [candidate("Ada Lovelace", prior=prior), candidate("1889", passage=None),  # a generated token
                  candidate("the bridge", prior=prior)]
    assert reranker.choose(QUESTION, candidates) == 2


def test_the_dtype_is_bf16_on_cuda_and_on_cpus_with_bf16_units_unless_overridden(monkeypatch):
    from cprag.errors import ConfigError
    from cprag.model import runtime

    monkeypatch.delenv("CPRAG_DTYPE", raising=False)
    assert runtime.resolve_dtype("cuda") == torch.bfloat16
    expected = torch.bfloat16 if runtime.CPU_BF16_DEFAULT and runtime.cpu_has_bf16_units() else torch.float32
    assert runtime.resolve_dtype("cpu") == expected
    assert runtime.resolve_dtype("cpu", "float32") == torch.float32
    monkeypatch.setenv("CPRAG_DTYPE", "float32")
    assert runtime.resolve_dtype("cuda") == torch.float32
    with pytest.raises(ConfigError, match="--dtype"):
        runtime.resolve_dtype("cpu", "float16")
