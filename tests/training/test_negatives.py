"""Unanswerable questions rewritten from answerable ones (cprag.training.negatives, pipelines/squad_negatives.py), and
training on them with their own passage in memory (`cprag train --negatives`)."""

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cprag.errors import CacheMismatch, ConfigError
from cprag.evaluation.squad import read_squad
from cprag.model.backbone import gguf_reference
from cprag.training.negatives import common_words, names, negatives_file, perturb
from tests.tiny_models import write_tiny_gguf
from tests.tiny_squad import SMOKE, tiny_squad

CONTEXT = ("The lighthouse on Ravel Point was built in 1871 by Margit Olsen. It is the largest lighthouse of the "
           "coast and was painted red in 1902.")


def test_names_skip_words_that_only_start_a_sentence():
    assert names("What did Margit Olsen build on Ravel Point?") == ["Margit Olsen", "Ravel Point"]
    assert names("Later the U.S. Navy came. Indeed it did.", common_words("later, indeed")) == ["U.S. Navy"]


def test_each_rule_makes_the_paragraph_no_longer_answer_the_question():
    rng = random.Random(0)
    entity = perturb("Who built the lighthouse on Ravel Point?", CONTEXT, ["Ravel Point", "Bay of Skerne"], rng,
                     ("entity",))
    assert entity.kind == "entity" and entity.replaced == "Ravel Point"
    assert entity.inserted in {"Margit Olsen", "Bay of Skerne"} and entity.inserted in entity.question
    number = perturb("Who built the lighthouse in 1871?", CONTEXT, [], rng, ("number",))
    assert number.replaced == "1871" and number.inserted not in CONTEXT and number.inserted.isdigit()
    antonym = perturb("What is the largest lighthouse of the coast?", CONTEXT, [], rng, ("antonym",))
    assert antonym.question == "What is the smallest lighthouse of the coast?"
    negation = perturb("Which lighthouse was painted red?", CONTEXT, [], rng, ("negation",))
    assert negation.question == "Which lighthouse was not painted red?"
    assert perturb("Why?", CONTEXT, [], rng) is None  # no rule applies


def test_the_negatives_file_mirrors_the_training_files_paragraphs(tmp_path):
    questions = ["Who built the lighthouse on Ravel Point?", "Which lighthouse was painted red?", "Why?"]
    raw = {"data": [{"title": title, "paragraphs": [{"context": CONTEXT, "qas": [
        {"id": f"{title}{i}", "question": q, "answers": [{"text": "1871", "answer_start": CONTEXT.index("1871")}]}
        for i, q in enumerate(questions)]}, {"context": "Margit Olsen kept it.", "qas": []}]}
        for title in ("Lighthouse", "Coast")]}
    data = tmp_path / "train.json"
    data.write_text(json.dumps(raw))
    written, counts = negatives_file(raw, share=1.0, seed=0, kinds=("entity", "number", "antonym", "negation"))
    assert [a["title"] for a in written["data"]] == [a["title"] for a in raw["data"]]
    assert [p["context"] for a in written["data"] for p in a["paragraphs"]] == \
        [p["context"] for a in raw["data"] for p in a["paragraphs"]]
    rewritten = [q for a in written["data"] for p in a["paragraphs"] for q in p["qas"]]
    assert len(rewritten) == 4 and counts["no rule applies"] == 2  # "Why?" has no rewrite
    assert all(q["is_impossible"] and q["answers"] == [] and q["id"].startswith("neg-") for q in rewritten)
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(written))
    read = read_squad(path, unanswerable=True)
    assert len(read.examples) == len(rewritten) and not any(e.answerable for e in read.examples)
    assert set(read.passages) == set(read_squad(data).passages)  # the same passage ids


def negatives_for(tmp_path) -> Path:
    """An unanswerable question over each paragraph of the tiny training file, and one over a paragraph it lacks."""
    data = json.loads(tiny_squad(tmp_path / "tiny.json").read_text())
    for article in data["data"]:
        for index, paragraph in enumerate(article["paragraphs"]):
            paragraph["qas"] = [{"id": f"neg-{article['title']}{index}", "question": "Who painted it blue?",
                                 "answers": [], "is_impossible": True}]
    data["data"] = data["data"] + [{"title": "Elsewhere", "paragraphs": [{"context": "Nothing here.", "qas": [
        {"id": "neg-x", "question": "Who?", "answers": [], "is_impossible": True}]}]}]
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(data))
    return path


def test_training_with_negatives_keeps_their_passage_and_learns_to_stop(tmp_path):
    from cprag.training.recipe import prepare
    from cprag.training.train import batch_forward, train_model

    write_tiny_gguf(tmp_path / "base.gguf")
    config = replace(SMOKE, negatives=str(negatives_for(tmp_path)), validation_fraction=0.25)
    ready = prepare(tmp_path / "tiny.json", config, base=gguf_reference(tmp_path / "base.gguf"))
    impossible = [q for q in ready.train.examples.questions if q.impossible]
    # only those over training passages: the held-out article's and the missing paragraph's are left out
    trained = {q.passage_id for q in ready.train.examples.questions if not q.impossible}
    assert {q.passage_id for q in impossible} == trained and all(q.answer_ids == [] for q in impossible)
    assert ready.figures["negatives/questions"] == len(impossible)
    answerable = [q for q in ready.train.examples.questions if not q.impossible][:1]
    chosen = impossible[:1] + answerable
    batch = ready.train.batch(chosen, 2, ready.tokenizer.bos_token_id, random.Random(0),
                              [q.impossible for q in chosen])
    width = batch.memory_ids.shape[1]
    for row, q in enumerate(chosen):
        slot = [k.split("/", 1)[1] for k in batch.passage_keys].index(q.passage_id)
        assert batch.question_memory_mask[row, slot * width]  # a rewritten question sees its own passage
        assert batch.question_memory_mask[row].view(-1, width)[:, 0].sum() == 3  # its passage + 2 others
    assert batch.targets[0, 0] == impossible[0].end_id and (batch.targets[0, 1:] == -100).all()
    assert (batch.gold_entries[0] == -1).all() and batch.no_answer[0]

    def copy_mass():
        with torch.no_grad():
            out, _, _ = batch_forward(ready.model, batch, ready.train.cache, 1, "float32")
        return 1 - out.generator_log_weight[batch.no_answer, 0].exp().mean().item()

    before = copy_mass()
    train_model(ready.model, ready.tokenizer, ready.train, replace(config, epochs=30, no_answer_fraction=0.0))
    assert copy_mass() < 0.5 * before


def test_negatives_over_none_of_the_training_paragraphs_are_refused(tmp_path):
    from cprag.training.recipe import prepare

    write_tiny_gguf(tmp_path / "base.gguf")
    tiny_squad(tmp_path / "tiny.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"data": [{"title": "Elsewhere", "paragraphs": [{"context": "Nothing.", "qas": [
        {"id": "n", "question": "Who?", "answers": [], "is_impossible": True}]}]}]}))
    with pytest.raises(ConfigError, match="--negatives"):
        prepare(tmp_path / "tiny.json", replace(SMOKE, negatives=str(other)),
                base=gguf_reference(tmp_path / "base.gguf"))


def test_a_cache_of_another_dtype_is_not_mixed_in(tmp_path):
    from cprag.training.activations import ActivationCache

    for name, dtype in (("a", "float32"), ("b", "bfloat16")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plan.json").write_text(json.dumps({"version": 1, "layers": [1], "hidden_size": 8,
                                                               "fingerprint": "f", "dtype": dtype, "chunks": []}))
    with pytest.raises(CacheMismatch, match="dtype"):
        ActivationCache(tmp_path / "a").include(ActivationCache(tmp_path / "b"))


def test_the_pipeline_script_writes_the_file_and_refuses_bad_input(tmp_path):


    script = Path(__file__).resolve().parents[2] / "pipelines" / "squad_negatives.py"
    data = tiny_squad(tmp_path / "tiny.json")
    run = subprocess.run([sys.executable, str(script), str(data), "--out", str(tmp_path / "neg.json"), "--share",
                          "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["out"] == str(tmp_path / "neg.json") and (tmp_path / "neg.json").is_file()
    for bad in (["--share", "0"], ["--kinds", "synonym"]):
        run = subprocess.run([sys.executable, str(script), str(data), "--out", str(tmp_path / "x.json"), *bad],
                             capture_output=True, text=True)
        assert run.returncode == 2 and run.stderr.startswith("error:")
    (tmp_path / "empty.json").write_text("")
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "empty.json"), "--out", str(tmp_path / "y.json")],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "not a readable SQuAD file" in run.stderr and not (tmp_path / "y.json").exists()
