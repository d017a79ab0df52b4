"""The training recipe end to end on a tiny GGUF backbone and a tiny SQuAD file the test writes: the activation
cache, adapters on the top block, no-answer examples, the visible form, resuming, and the lever screen."""

import json
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from cprag.errors import CacheMismatch, ConfigError, CorpusError
from cprag.evaluation.squad import article_split, read_squad
from cprag.model.backbone import gguf_reference
from cprag.training.config import TrainConfig
from cprag.training.recipe import train_checkpoint
from cprag.training.train import STATE_FILE
from tests.tiny_models import write_tiny_gguf
from tests.tiny_squad import FACTS, HEAD, SMOKE, smoke, tiny_squad


def test_smoke_training_saves_a_loadable_checkpoint_with_metrics(tmp_path):
    write_tiny_gguf(tmp_path / "base.gguf")
    data = tiny_squad(tmp_path / "tiny.json")
    # 4 distractors, as `cprag eval squad --oracle` uses
    metrics = train_checkpoint(data, tmp_path / "ckpt", smoke(distractors=4),
                               base=gguf_reference(tmp_path / "base.gguf"), validation_questions=4,
                               validation_modes=("hidden", "closed"))
    assert metrics["train/steps"] == 2 * (6 // 4) and metrics["qa/hidden/n"] == 2
    assert 0 <= metrics["qa/hidden/f1"] <= 100 and "qa/closed/em" in metrics
    assert 0 <= metrics["validation/tf/start"] <= 100 and 0 <= metrics["validation/tf/exact"] <= 100
    assert metrics["cache/tokens_built"] > 0
    config = json.loads((tmp_path / "ckpt" / "train_config.json").read_text())
    assert config["skipped"] == {} and len(config["validation_articles"]) == 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.config.end_entries and loaded.cp_head.doc_refiner is not None
    assert loaded.adapters is not None and loaded.config.adapter_layers == [1]
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


def prepared(tmp_path, config=SMOKE):
    from cprag.training.recipe import prepare

    write_tiny_gguf(tmp_path / "base.gguf")
    return prepare(tiny_squad(tmp_path / "tiny.json"), config, base=gguf_reference(tmp_path / "base.gguf"))


def test_cached_activations_give_the_full_forward_pass(tmp_path):
    ready = prepared(tmp_path)
    model, cache = ready.model, ready.train.cache
    question = ready.train.examples.questions[0]
    ids = torch.tensor([ready.train.prompts[question.qid] + question.answer_ids])
    with torch.no_grad():
        for delta in model.adapters.values():  # adapters that do something
            delta.lora_B.normal_(std=0.05)
        hidden, features, _ = model.encode_hidden(ids, torch.ones_like(ids))
        states, mask = cache.states([f"q/{question.qid}"])
        resumed, resumed_features = model.trained_states(states, mask, 1)
    assert cache.layers == [1] and states[1].shape[1] == ids.shape[1]
    # the cache keeps float16: equal up to its rounding (a misaligned position would be off by the whole value)
    assert not torch.allclose(resumed, model.trained_states(states, mask, 1)[0] * 0)
    assert torch.allclose(resumed, hidden, atol=1e-2) and torch.allclose(resumed_features, features, atol=1e-2)


def test_an_interrupted_cache_build_resumes_to_the_same_arrays(tmp_path):
    from cprag.training.examples import activation_cache, prepare_examples

    ready = prepared(tmp_path)
    model, tokenizer = ready.model, ready.tokenizer
    data = tmp_path / "tiny.json"
    examples = prepare_examples(tokenizer, read_squad(data))

    def build(directory, on_progress=None):
        return activation_cache(model, tokenizer, examples, data, 1, "float32", chunk_size=3, directory=directory,
                                on_progress=on_progress)

    def stop_after_two_chunks(done, total, tokens):
        if done >= 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "partial", stop_after_two_chunks)
    partial = activation_cache(model, tokenizer, examples, data, 1, "float32", chunk_size=3,
                               directory=tmp_path / "partial", build=False)[0]
    assert len(partial) == 6 and not partial.complete  # finished chunks are usable already
    resumed, figures = build(tmp_path / "partial")
    assert figures["cache/chunks_skipped"] == 2 and resumed.complete
    clean = build(tmp_path / "clean")[0]
    assert set(clean.where) == set(resumed.where)
    for key in clean.where:
        assert np.array_equal(clean.get(key), resumed.get(key))
    with pytest.raises(CacheMismatch, match="plan"):  # other chunking, same folder: refused, nothing overwritten
        activation_cache(model, tokenizer, examples, data, 1, "float32", chunk_size=4, directory=tmp_path / "clean")


def test_training_moves_the_head_and_the_adapters_and_lowers_the_loss(tmp_path):
    from cprag.training.train import teacher_forced_validation, train_model

    ready = prepared(tmp_path)
    config = smoke(epochs=40, batch_size=4, no_answer_fraction=0.0)
    before = teacher_forced_validation(ready.model, ready.tokenizer, ready.train, config)
    report = train_model(ready.model, ready.tokenizer, ready.train, config)
    assert sum(report.losses[-3:]) / 3 < 0.85 * sum(report.losses[:3]) / 3
    after = teacher_forced_validation(ready.model, ready.tokenizer, ready.train, config)
    assert after["tf/token"] > before["tf/token"]  # the questions it trained on, answered better step by step
    assert all(delta.lora_B.abs().sum() > 0 for delta in ready.model.adapters.values())
    assert all(not p.requires_grad for p in ready.model.backbone.parameters())


def test_a_frozen_backbone_trains_the_head_alone(tmp_path):
    from cprag.training.train import train_model

    head = {**HEAD, "adapter_layers": None}
    ready = prepared(tmp_path, smoke(head=head))
    assert ready.model.adapters is None
    base = {n: p.detach().clone() for n, p in ready.model.backbone.named_parameters()}
    train_model(ready.model, ready.tokenizer, ready.train, smoke(head=head, epochs=4))
    assert all(torch.equal(base[n], p) for n, p in ready.model.backbone.named_parameters())


def test_no_answer_questions_lack_their_passage_and_learn_to_hand_the_copy_mass_back(tmp_path):
    import random

    from cprag.training.train import batch_forward, train_model

    ready = prepared(tmp_path)
    data, model = ready.train, ready.model
    chosen = data.examples.questions[:4]
    rng = random.Random(0)
    batch = data.batch(chosen, 2, ready.tokenizer.bos_token_id, rng, [True, False, True, False])
    width = batch.memory_ids.shape[1]
    for row, q in enumerate(chosen):
        slot = [k.split("/", 1)[1] for k in batch.passage_keys].index(q.passage_id)
        sees_gold = batch.question_memory_mask[row, slot * width]
        assert bool(sees_gold) == (row % 2 == 1)  # no-answer rows never see their gold passage
        assert batch.question_memory_mask[row].view(-1, width)[:, 0].sum() == 3  # gold or one more, + 2 others
    assert batch.targets[0, 0] == chosen[0].end_id and (batch.targets[0, 1:] == -100).all()

    def copy_mass():
        with torch.no_grad():
            out, _, _ = batch_forward(model, batch, data.cache, 1, "float32")
        return 1 - out.generator_log_weight[batch.no_answer, 0].exp().mean().item()

    before = copy_mass()
    train_model(model, ready.tokenizer, data, smoke(epochs=30, no_answer_fraction=0.9))
    assert copy_mass() < 0.5 * before


def test_the_visible_form_trains_alongside_and_decodes(tmp_path):
    from cprag.decoding.generate import generate
    from cprag.evaluation.oracle_qa import OracleMemory
    from cprag.training.train import train_model

    ready = prepared(tmp_path)
    before = {n: p.detach().clone() for n, p in ready.model.named_parameters() if n.startswith("adapters.")}
    report = train_model(ready.model, ready.tokenizer, ready.train, smoke(epochs=6, visible_every=1,
                                                                          visible_batch=2))
    assert report.visible_examples == 2 * report.steps
    assert any(not torch.equal(before[n], p) for n, p in ready.model.named_parameters() if n in before)
    example = read_squad(tmp_path / "tiny.json").examples[0]
    passages = read_squad(tmp_path / "tiny.json").passages
    answer = generate(ready.model, ready.tokenizer, example.question,
                      OracleMemory(ready.model, ready.tokenizer, passages).get([example.passage_id]), "visible",
                      max_new_tokens=4)
    assert answer.token_ids and answer.confidence is not None


def test_interrupted_training_resumes_from_its_last_saved_step(tmp_path):
    from cprag.training.train import train_model

    config = smoke(epochs=4, batch_size=2, save_every=3)
    straight = train_model((ready := prepared(tmp_path)).model, ready.tokenizer, ready.train, config)

    def stop_after_four(step, total, loss):
        if step == 4:
            raise KeyboardInterrupt

    ready = prepared(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        train_model(ready.model, ready.tokenizer, ready.train, config, tmp_path / "run", stop_after_four)
    ready = prepared(tmp_path)
    resumed = train_model(ready.model, ready.tokenizer, ready.train, config, tmp_path / "run")
    assert resumed.resumed_from == 3 and resumed.steps == straight.steps
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-3)


def test_a_finished_run_continues_from_its_checkpoint_on_the_questions_it_had_not_reached(tmp_path):
    import random

    from cprag.errors import CheckpointError
    from cprag.training.recipe import prepare
    from cprag.training.train import _article_grouped_order, _skipped_order, train_model

    config = smoke(epochs=4, batch_size=2, max_steps=2)
    first = prepared(tmp_path, config)
    train_model(first.model, first.tokenizer, first.train, config)
    first.model.save_pretrained(tmp_path / "ckpt")
    trained = {n: p.detach().clone() for n, p in first.model.named_parameters() if not n.startswith("backbone.")}
    go_on = smoke(epochs=4, batch_size=2, init_from=str(tmp_path / "ckpt"), skip_steps=2)
    again = prepare(tmp_path / "tiny.json", go_on, base=gguf_reference(tmp_path / "base.gguf"))
    named = dict(again.model.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in trained.items())
    questions = again.train.examples.questions
    assert _skipped_order(questions, random.Random(0), go_on) == _article_grouped_order(questions,
                                                                                       random.Random(0))[4:]
    report = train_model(again.model, again.tokenizer, again.train, go_on)
    assert report.steps == 4 * (6 // 2) and len(report.losses) == report.steps - 2
    with pytest.raises(ConfigError, match="--skip-steps"):  # nothing left to train
        train_model(again.model, again.tokenizer, again.train, replace(go_on, skip_steps=12))
    with pytest.raises(ConfigError, match="--init-from"):
        smoke(skip_steps=2)
    other = smoke(init_from=str(tmp_path / "ckpt"), head={**HEAD, "key_dim": 16})
    with pytest.raises(CheckpointError, match="key_dim"):
        prepare(tmp_path / "tiny.json", other, base=gguf_reference(tmp_path / "base.gguf"))


def test_bad_training_input_is_reported(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "wrong.json").write_text('{"data": [{"title": "x"}]}')
    for name, message in [("empty.json", "empty"), ("broken.json", "not valid JSON"), ("wrong.json", "SQuAD")]:
        with pytest.raises(CorpusError, match=message):
            read_squad(tmp_path / name)
    with pytest.raises(ConfigError, match="--lr"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match="--cache-layer"):  # the cache may only stand in for frozen blocks
        TrainConfig(cache_layer=26, head={**TrainConfig().head, "adapter_layers": [24, 25]})
    with pytest.raises(ConfigError, match="--no-answer-fraction"):
        TrainConfig(no_answer_fraction=1.0)


def test_article_split_never_splits_an_article(tmp_path):
    data = read_squad(tiny_squad(tmp_path / "tiny.json"))
    train, validation = article_split(data, 0.25, seed=0)
    assert len(validation) == 1 and not train & validation and train | validation == {f[0] for f in FACTS}


def test_a_lever_screen_reports_teacher_forced_metrics_on_both_splits(tmp_path):
    from cprag.training.recipe import screen_variant

    head = {**HEAD, "lexical_prior": True, "query_refine_layers": 1, "query_refine_dim": 16}
    config = smoke(max_steps=2, head=head)
    ready = prepared(tmp_path, config)
    metrics = screen_variant(ready, config)
    assert metrics["train/steps"] == 2
    assert metrics["validation/tf/n"] == len(ready.validation.examples.questions) > 0
    for key in ("validation/tf/start", "validation/tf/exact", "train/tf/start", "train/tf/token"):
        assert 0 <= metrics[key] <= 100
    head = ready.model.cp_head  # the lexical weights and the query refiner were trained
    assert head.lexical.abs().sum() > 0 and head.query_refiner.up[0].weight.abs().sum() > 0


def test_the_config_round_trips_through_json(tmp_path):
    config = smoke(max_questions=3)
    assert TrainConfig(**json.loads(json.dumps(asdict(config)))) == config


def test_the_pointer_loss_names_the_exact_entry_of_each_answer_token(tmp_path):
    import random

    from cprag.training.train import batch_forward, pointer_loss

    ready = prepared(tmp_path)
    data = ready.train
    chosen = data.examples.questions[:3]
    batch = data.batch(chosen, 2, ready.tokenizer.bos_token_id, random.Random(0), [False, True, False])
    width = batch.memory_ids.shape[1]
    for row, q in enumerate(chosen):
        entries = batch.gold_entries[row]
        if row == 1:
            assert (entries == -1).all()  # a no-answer question copies nothing
            continue
        n = len(q.answer_ids)
        for step in range(n):  # entry e of the shared memory pastes passage token (e % width)
            entry = int(entries[step])
            assert batch.passage_keys[entry // width] == f"p/{q.passage_id}"
            assert batch.memory_ids.reshape(-1)[entry + 1] == q.answer_ids[step]
        assert entries[n] == batch.memory_ids.numel() + int(entries[n - 1]) + 1  # the end twin after the answer
    with torch.no_grad():
        out, _, _ = batch_forward(ready.model, batch, data.cache, 1, "float32")
        assert pointer_loss(out, batch.gold_entries, batch.weights) > 0


def test_adapter_layers_flag_parses_ranges_lists_and_none():
    from cprag.cli.train import parse_layers

    assert parse_layers("24-29") == [24, 25, 26, 27, 28, 29]
    assert parse_layers("24,26, 28") == [24, 26, 28] and parse_layers("none") == []
    with pytest.raises(ConfigError, match="--adapter-layers"):
        parse_layers("top")


def test_in_passage_no_answers_hide_only_the_answer_sentences_unless_the_answer_recurs():
    import random

    from cprag.training.batches import answer_sentences, make_batch
    from cprag.training.examples import PassageTokens, TrainQuestion

    # passage tokens 10..17 in three sentences: [10 11 .] [12 13 14 .] [15 16]; 90 stands for "."
    ids = [10, 11, 90, 12, 13, 14, 90, 15, 16]
    sentences = {"A#0": torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2]), "A#1": torch.tensor([0, 0]),
                 "A#2": torch.tensor([0, 0])}
    passages = {"A#0": PassageTokens(ids, [(0, 0)] * len(ids)), "A#1": PassageTokens([20, 21], [(0, 0)] * 2),
                "A#2": PassageTokens([30, 31], [(0, 0)] * 2)}
    q = TrainQuestion("q", "A#0", "?", prompt_len=3, span=(4, 5), answer_ids=[13, 14], end_id=99)
    hidden = answer_sentences(q, ids, sentences)
    assert hidden.tolist() == [False, False, False, True, True, True, True, False, False]
    recurring = TrainQuestion("r", "A#0", "?", prompt_len=3, span=(3, 3), answer_ids=[12], end_id=99)
    assert answer_sentences(recurring, ids[:7] + [12, 16], sentences) is None  # token 12 again in sentence 2
    assert answer_sentences(q, ids, None) is None

    pool = {"A#0": ["A#1", "A#2"]}
    batch = make_batch([q, q, q], {"q": [1, 2, 3]}, passages, pool, 1, 0, random.Random(0),
                       [True, True, False], in_passage=[True, False, False], sentences=sentences)
    width = batch.memory_ids.shape[1]
    slot = [k.split("/", 1)[1] for k in batch.passage_keys].index("A#0")
    seen = batch.question_memory_mask.view(3, -1, width)
    # row 0: its own passage minus the answer sentence (entry j pastes token j), the end entry, one distractor
    assert seen[0, slot, : len(ids) + 1].tolist() == [True, True, True, False, False, False, False, True, True, True]
    assert seen[0].any(-1).sum() == 2
    assert not seen[1, slot].any() and seen[1].any(-1).sum() == 2  # distractors alone
    assert seen[2, slot, : len(ids) + 1].all()  # answerable: the whole gold passage
    assert batch.no_answer.tolist() == [True, True, False]
    assert batch.targets[0, 0] == 99 and (batch.gold_entries[0] == -1).all()
    with pytest.raises(ConfigError, match="--no-answer-in-passage"):
        TrainConfig(no_answer_in_passage=1.5)


def test_auto_dtype_is_bf16_only_where_the_cpu_has_bf16_units():
    from cprag.model.cpu_features import cpu_has_bf16_units

    expected = "bfloat16" if cpu_has_bf16_units() else "float32"
    config = TrainConfig()
    assert config.dtype == config.cache_dtype == expected
    assert TrainConfig(dtype="float32", cache_dtype="bfloat16").cache_dtype == "bfloat16"  # an explicit choice stays
    with pytest.raises(ConfigError, match="--dtype"):
        TrainConfig(dtype="float16")


def test_a_speed_figure_names_the_cpu_kind_by_its_best_units():
    from cprag.model.cpu_features import cpu_has_bf16_units, cpu_name, cpu_units

    assert cpu_units({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == "AMX-BF16"
    assert cpu_units({"avx2", "avx512f", "avx512_bf16"}) == "AVX512-BF16"
    assert cpu_units({"avx2", "fma"}) == "AVX2"
    assert cpu_units(set()) == ""
    assert cpu_name().endswith(f"with {cpu_units()}") if cpu_units() else cpu_name()
    assert ("BF16" in cpu_units()) == cpu_has_bf16_units()
