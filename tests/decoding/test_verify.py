"""The answer verifier: the cited sentence, the backbone states it reads, its head, its threshold rule, and the
verifier stage of `Index.ask` on a tiny CPLM with the real LanceDB, FAISS and MiniLM retriever."""

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.decoding.verify import answer_sentence, cited_sentence, verifier_prompt, verifier_states
from cprag.errors import CheckpointError, ConfigError
from cprag.evaluation.bench import verify_latency
from cprag.evaluation.metrics import auc, threshold_at_rule
from cprag.model.answer_verifier import VERIFIER_FILE, AnswerVerifier
from cprag.model.checkpoint import DEFAULT_CHECKPOINT, load_model, model_fingerprint
from cprag.training.verifier_train import fit_head
from tests.index_helpers import index_corpus
from tests.tiny_models import DOCS, verifier_beside, write_jsonl

TEXT = "The tower was raised in 1871. Its keeper was Margit Olsen, who lit it. It fell in 1990."


def test_answer_sentence_is_the_sentence_holding_the_span():
    start = TEXT.index("Margit")
    assert answer_sentence(TEXT, start, start + 12) == "Its keeper was Margit Olsen, who lit it."
    across = TEXT.index("1871")
    assert answer_sentence(TEXT, across, TEXT.index("keeper")) == "The tower was raised in 1871. Its keeper was " \
        "Margit Olsen, who lit it."
    assert answer_sentence("no break at all", 3, 5) == "no break at all"
    assert verifier_prompt("a \n b", " who?  ").startswith("Context: a b\nQuestion: who?\n")


def test_states_of_a_batch_are_those_of_each_prompt_alone(copying_checkpoint):
    model, tokenizer = load_model(copying_checkpoint)
    texts = ["Context: short\nQuestion: who?", "Context: a much longer sentence about the tower\nQuestion: when?"]
    together = verifier_states(model, tokenizer, texts, [1], batch_size=2)
    alone = torch.cat([verifier_states(model, tokenizer, [t], [1]) for t in texts])
    assert together.shape == (2, 2 * model.config.hidden_size)
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(together[0], together[1])


def test_head_fits_saves_and_scores_as_its_formula_says(tmp_path):
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(400, 6, generator=generator)
    labels = (states[:, 0] + 0.5 * states[:, 3] > 0).long()
    mean, scale, weight, bias = fit_head(states, labels)
    verifier = AnswerVerifier(layers=[1], hidden_size=3, mean=mean.tolist(), scale=scale.tolist(),
                              weight=weight.tolist(), bias=bias, threshold=0.5)
    probability = verifier.probability(states)
    assert auc(labels.numpy() == 1, probability.numpy()) > 0.97
    expected = torch.sigmoid(((states - mean) / scale) @ weight + bias)
    torch.testing.assert_close(probability, expected)
    verifier.save(tmp_path)
    again = AnswerVerifier.load(tmp_path)
    torch.testing.assert_close(again.probability(states), probability)
    assert AnswerVerifier.load(tmp_path / "nowhere") is None
    assert verifier.withholds(0.4, None) and verifier.withholds(0.4, 0.9) and not verifier.withholds(0.6, None)
    verifier.keep_confidence = 0.5
    assert verifier.withholds(0.4, 0.49) and not verifier.withholds(0.4, 0.5)
    with pytest.raises(ValueError, match="does not read"):
        AnswerVerifier(layers=[1, 2], hidden_size=3, mean=[0.0] * 6, scale=[1.0] * 6, weight=[0.0] * 6, bias=0.0,
                       threshold=0.5)


def test_the_shipped_verifier_reads_the_shipped_checkpoints_states():
    model, _ = load_model(None)
    shipped = AnswerVerifier.load(DEFAULT_CHECKPOINT)
    assert shipped is not None and shipped.fits(model.config)
    assert shipped.fingerprint == model_fingerprint(model)  # fitted on this checkpoint's backbone, adapters merged
    assert len(shipped.weight) == (len(shipped.layers) + 1) * model.config.hidden_size
    assert 0.0 < shipped.threshold < 1.0 and 0.0 < shipped.keep_confidence <= 1.0


def test_threshold_rule_withholds_the_most_unanswerable_within_the_drop():
    # four answerable (F1 100, 100, 100, 0) and three unanswerable; dropping one answerable costs 25 points
    score = np.array([0.9, 0.8, 0.3, 0.05, 0.1, 0.2, 0.4])
    answerable = np.array([True, True, True, True, False, False, False])
    f1 = np.array([100, 100, 100, 0, 0, 0, 0.0])
    threshold, withheld = threshold_at_rule(score, answerable, f1, drop=5.0)
    assert withheld == pytest.approx(2 / 3) and 0.2 < threshold < 0.3  # the F1-0 answer goes free; 0.3 does not
    threshold, withheld = threshold_at_rule(score, answerable, f1, drop=30.0)
    assert withheld == 1.0 and 0.4 < threshold < 0.8
    assert auc(np.array([True, False, True, False]), np.array([0.5, 0.5, 0.9, 0.1])) == pytest.approx(0.875)


@pytest.fixture(scope="module")
def demo_index(tmp_path_factory, copying_checkpoint, embedder):
    directory = tmp_path_factory.mktemp("verify")
    index_corpus(write_jsonl(directory / "c.jsonl", DOCS), directory / "idx", copying_checkpoint, embedder)
    return directory / "idx"


def test_the_verifier_withholds_below_its_threshold_and_keeps_the_span(tmp_path, demo_index, copying_checkpoint):
    question = "When was the lighthouse built?"
    always = Index(demo_index, checkpoint=verifier_beside(copying_checkpoint, tmp_path / "low", 0.0))
    kept = always.ask(question, k=2, max_new_tokens=4, min_retrieval_score=-1)
    assert kept.answerable is not None and 0 < kept.answerable < 1 and kept.no_answer is False
    assert kept.citations and "verify" in kept.timings_ms
    passages = always.cache.get([p["passage_id"] for p in kept.passages], always.store.fetch)
    assert cited_sentence(kept.citations, passages) in " ".join(p.passage.text for p in passages)
    never = Index(demo_index, checkpoint=verifier_beside(copying_checkpoint, tmp_path / "high", 1.0))
    withheld = never.ask(question, k=2, max_new_tokens=4, min_retrieval_score=-1)
    assert withheld.no_answer and withheld.no_answer_reason == "verifier" and withheld.answer == ""
    assert withheld.withheld_answer == kept.answer and withheld.withheld_citations == kept.citations
    assert withheld.answerable == kept.answerable and withheld.passages == kept.passages
    confident = Index(demo_index, checkpoint=verifier_beside(copying_checkpoint, tmp_path / "gate", 1.0,
                                                             keep_confidence=kept.confidence))
    gated = confident.ask(question, k=2, max_new_tokens=4, min_retrieval_score=-1)
    assert gated.answer == kept.answer and gated.answerable == kept.answerable  # confident enough to keep
    unverified = never.ask(question, k=2, max_new_tokens=4, min_retrieval_score=-1, verify=False)
    assert unverified.answer == kept.answer and unverified.answerable is None
    payload = withheld.to_json()
    assert payload["withheld_citations"][0]["text"] == kept.citations[0].text
    figures = verify_latency(always, [question, "Who designed the bridge?"], k=2)
    assert figures["latency/verify@k2_ms"] > 0 and figures["latency/verified_over_hidden_ask@k2"] > 0


def test_verify_without_a_verifier_or_with_another_checkpoints_is_refused(tmp_path, demo_index, copying_checkpoint):
    plain = Index(demo_index, checkpoint=copying_checkpoint)
    assert plain.verifier is None and plain.ask("Who?", k=1, max_new_tokens=2).answerable is None
    with pytest.raises(ConfigError, match="ships no verifier"):
        plain.ask("Who?", k=1, verify=True)
    with pytest.raises(CheckpointError, match="another checkpoint"):
        Index(demo_index, checkpoint=verifier_beside(copying_checkpoint, tmp_path / "other", 0.5, "f" * 64))
    broken = tmp_path / "broken"
    shutil.copytree(copying_checkpoint, broken)
    (broken / VERIFIER_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable verifier.json"):
        Index(demo_index, checkpoint=broken)


def test_ask_cli_verify_flags(tmp_path, demo_index, copying_checkpoint):
    checkpoint = verifier_beside(copying_checkpoint, tmp_path / "ckpt", 1.0)
    runner = CliRunner()
    base = ["ask", "When was the lighthouse built?", "--index", str(demo_index), "--checkpoint", str(checkpoint),
            "-k", "2", "--max-new-tokens", "4", "--min-retrieval-score", "-1", "--json"]
    verified = json.loads(runner.invoke(app, base).stdout)
    assert verified["no_answer_reason"] == "verifier" and verified["withheld_citations"]
    plain = json.loads(runner.invoke(app, [*base, "--no-verify"]).stdout)
    assert plain["answerable"] is None and plain["answer"] == verified["withheld_answer"]
    refused = runner.invoke(app, [*base[:5], str(copying_checkpoint), *base[6:], "--verify"])
    assert refused.exit_code != 0 and "ships no verifier" in refused.output
