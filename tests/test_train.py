"""The training recipe end to end on a tiny GGUF backbone and a tiny SQuAD file the test writes."""

import json

import pytest
import torch
from tiny_models import write_tiny_gguf
from transformers import AutoModelForCausalLM

from cprag.backbone import gguf_reference
from cprag.errors import ConfigError, CorpusError
from cprag.recipe import train_checkpoint
from cprag.squad import article_split, read_squad
from cprag.train import STATE_FILE
from cprag.train_config import TrainConfig

FACTS = [
    ("Lighthouse", "The lighthouse was built in 1871.", "When was the lighthouse built?", "1871"),
    ("Lighthouse", "Its keeper was Margit.", "Who was the keeper?", "Margit"),
    ("Bridge", "The bridge opened in 2009.", "When did the bridge open?", "2009"),
    ("Bridge", "It crosses the Ravel gorge.", "What does it cross?", "the Ravel gorge"),
    ("Clock", "The clock rings every hour.", "How often does it ring?", "every hour"),
    ("Clock", "A monk named Anselm built it.", "Who built the clock?", "Anselm"),
    ("Geese", "Geese arrive in October.", "When do geese arrive?", "October"),
    ("Geese", "They roost on the lake.", "Where do they roost?", "on the lake"),
]


def tiny_squad(path, missing_answer=True):
    articles = {}
    for title, context, question, answer in FACTS:
        paragraphs = articles.setdefault(title, [])
        qas = [{"id": f"{title}{len(paragraphs)}", "question": question,
                "answers": [{"text": answer, "answer_start": context.index(answer)}]}]
        paragraphs.append({"context": context, "qas": qas})
    if missing_answer:  # an answer that is not where it claims to be: skipped and counted
        articles["Geese"][0]["qas"].append({"id": "bad", "question": "?", "answers": [{"text": "zebra",
                                                                                       "answer_start": 3}]})
    path.write_text(json.dumps({"data": [{"title": t, "paragraphs": p} for t, p in articles.items()]}))
    return path


SMOKE = dict(epochs=2, batch_size=4, distractors=2, lr=5e-3, validation_fraction=0.25, save_every=2,
             head={"key_dim": 8, "key_sees_token": True, "doc_refine_layers": 1, "doc_refine_dim": 16,
                   "end_entries": True, "successor_bias": True, "cp_layers": [1], "doc_lookahead": 1})


def test_smoke_training_saves_a_loadable_checkpoint_with_metrics(tmp_path):
    write_tiny_gguf(tmp_path / "base.gguf")
    data = tiny_squad(tmp_path / "tiny.json")
    # 4 distractors, as `cprag eval squad --oracle` uses
    metrics = train_checkpoint(data, tmp_path / "ckpt", TrainConfig(**{**SMOKE, "distractors": 4}),
                               base=gguf_reference(tmp_path / "base.gguf"), validation_questions=4,
                               validation_modes=("hidden", "closed"))
    assert metrics["train/steps"] == 2 * (6 // 4) and metrics["qa/hidden/n"] == 2
    assert 0 <= metrics["qa/hidden/f1"] <= 100 and "qa/closed/em" in metrics
    assert 0 <= metrics["validation/tf/start"] <= 100 and 0 <= metrics["validation/tf/exact"] <= 100
    config = json.loads((tmp_path / "ckpt" / "train_config.json").read_text())
    assert config["skipped"] == {"answer not found at its offset": 1}
    assert set(config["train_articles"]).isdisjoint(config["validation_articles"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.end_entries and loaded.cp_head.doc_refiner is not None
    assert not (tmp_path / "ckpt" / STATE_FILE).exists()
    # `cprag eval squad --held-out` asks the checkpoint's validation questions and scores them the same
    from typer.testing import CliRunner

    from cprag.cli import app

    result = CliRunner().invoke(app, ["eval", "squad", str(data), "--oracle", "--held-out", "--modes", "hidden",
                                      "--limit", "4", "--out", str(tmp_path / "eval"), "--checkpoint",
                                      str(tmp_path / "ckpt"), "--json"])
    assert result.exit_code == 0, result.output
    validated = [json.loads(line) for line in (tmp_path / "ckpt" / "validation.jsonl").read_text().splitlines()]
    evaluated = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    hidden = [(r["qid"], r["passages"], r["prediction"]) for r in validated if r["mode"] == "hidden"]
    assert hidden == [(r["qid"], r["passages"], r["prediction"]) for r in evaluated]
    assert json.loads(result.stdout)["qa/hidden/em"] == metrics["qa/hidden/em"]


def fresh_model_and_features(tmp_path):
    """(data, model, tokenizer, passage features, question features, question text) on the tiny SQuAD file."""
    from cprag.checkpoint import new_cplm
    from cprag.features import extract_features

    write_tiny_gguf(tmp_path / "base.gguf")
    data = read_squad(tiny_squad(tmp_path / "tiny.json"))
    torch.manual_seed(0)
    model, tokenizer = new_cplm(gguf_reference(tmp_path / "base.gguf"), **SMOKE["head"])
    passages, questions, _ = extract_features(model, tokenizer, data)
    return data, model, tokenizer, passages, questions, {e.qid: e.question for e in data.examples}


def test_training_changes_the_head_and_lowers_the_loss(tmp_path):
    from cprag.train import teacher_forced_validation, train_head

    data, model, tokenizer, passages, questions, text = fresh_model_and_features(tmp_path)
    config = TrainConfig(**{**SMOKE, "epochs": 30, "batch_size": 8})
    before = teacher_forced_validation(model, tokenizer, questions, passages, text, distractors=2)
    report = train_head(model, tokenizer, questions, passages, text, config)
    assert sum(report.losses[-3:]) / 3 < 0.85 * sum(report.losses[:3]) / 3
    after = teacher_forced_validation(model, tokenizer, questions, passages, text, distractors=2)
    assert after["tf/token"] > before["tf/token"]  # the questions it trained on, answered better step by step


def test_the_visible_form_trains_the_head_to_copy_from_the_prompt(tmp_path):
    from cprag.generate import generate
    from cprag.train import train_head

    data, model, tokenizer, passages, questions, text = fresh_model_and_features(tmp_path)
    before = {n: p.detach().clone() for n, p in model.cp_head.named_parameters()}
    config = TrainConfig(**{**SMOKE, "epochs": 20, "batch_size": 4, "distractors": 1, "form": "visible"})
    report = train_head(model, tokenizer, questions, passages, text, config)
    assert sum(report.losses[-3:]) / 3 < 0.85 * sum(report.losses[:3]) / 3
    assert not torch.equal(before["q_proj.weight"], model.cp_head.q_proj.weight)
    assert all(not n.startswith("backbone.") for n, p in model.named_parameters() if p.requires_grad)
    example = data.examples[0]
    from cprag.qa_eval import OracleMemory

    answer = generate(model, tokenizer, example.question, OracleMemory(model, tokenizer, data.passages).get(
        [example.passage_id]), "visible", max_new_tokens=4)
    assert answer.token_ids  # the visible path decodes with the trained head
    with pytest.raises(ConfigError, match="--form"):
        TrainConfig(form="sideways")


def test_interrupted_training_resumes_from_its_last_saved_step(tmp_path):
    from cprag.checkpoint import new_cplm
    from cprag.features import extract_features
    from cprag.train import train_head

    write_tiny_gguf(tmp_path / "base.gguf")
    data = read_squad(tiny_squad(tmp_path / "tiny.json"))
    text = {e.qid: e.question for e in data.examples}
    config = TrainConfig(**{**SMOKE, "epochs": 4, "batch_size": 2, "save_every": 3})

    def fresh():
        torch.manual_seed(0)
        return new_cplm(gguf_reference(tmp_path / "base.gguf"), **SMOKE["head"])

    model, tokenizer = fresh()
    passages, questions, _ = extract_features(model, tokenizer, data)
    straight = train_head(model, tokenizer, questions, passages, text, config)

    def stop_after_four(step, total, loss):
        if step == 4:
            raise KeyboardInterrupt

    model, tokenizer = fresh()
    with pytest.raises(KeyboardInterrupt):
        train_head(model, tokenizer, questions, passages, text, config, tmp_path / "run", stop_after_four)
    model, tokenizer = fresh()
    resumed = train_head(model, tokenizer, questions, passages, text, config, tmp_path / "run")
    assert resumed.resumed_from == 3 and resumed.steps == straight.steps
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-3)


def test_bad_training_input_is_reported(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "wrong.json").write_text('{"data": [{"title": "x"}]}')
    for name, message in [("empty.json", "empty"), ("broken.json", "not valid JSON"), ("wrong.json", "SQuAD")]:
        with pytest.raises(CorpusError, match=message):
            read_squad(tmp_path / name)
    with pytest.raises(ConfigError, match="--lr"):
        TrainConfig(lr=0)


def test_article_split_never_splits_an_article(tmp_path):
    data = read_squad(tiny_squad(tmp_path / "tiny.json"))
    train, validation = article_split(data, 0.25, seed=0)
    assert len(validation) == 1 and not train & validation and train | validation == {f[0] for f in FACTS}


def test_a_lever_screen_reports_teacher_forced_metrics_on_both_splits(tmp_path):
    from cprag.recipe import prepare, screen_variant

    write_tiny_gguf(tmp_path / "base.gguf")
    data = tiny_squad(tmp_path / "tiny.json")
    head = {**SMOKE["head"], "lexical_prior": True, "query_refine_layers": 1, "query_refine_dim": 16}
    config = TrainConfig(**{**SMOKE, "max_steps": 2, "head": head})
    prepared = prepare(data, config, base=gguf_reference(tmp_path / "base.gguf"))
    metrics = screen_variant(prepared, config)
    assert metrics["train/steps"] == 2
    assert metrics["validation/tf/n"] == len(prepared.split(prepared.validation_articles)) > 0
    for key in ("validation/tf/start", "validation/tf/exact", "train/tf/start", "train/tf/token"):
        assert 0 <= metrics[key] <= 100
    head = prepared.model.cp_head  # the lexical weights and the query refiner were trained
    assert head.lexical.abs().sum() > 0 and head.query_refiner.up[0].weight.abs().sum() > 0
