"""The visible span reader: its span rules, its loss, training that learns and resumes, and saved readers."""

import json

import pytest
import torch

from cprag.decoding.span_read import question_prefix, read_passages, windows, word_bounds
from cprag.evaluation.oracle_qa import evaluate_oracle
from cprag.evaluation.squad import read_squad
from cprag.index.encode import tokenize_passage
from cprag.model.backbone import gguf_reference
from cprag.model.reader_checkpoint import load_reader, new_reader
from cprag.model.span_reader import best_spans, shared_span_loss
from cprag.training.reader_train import ReaderTrainConfig, prepare_reader_data, train_reader
from tests.tiny_models import write_tiny_gguf
from tests.tiny_squad import tiny_squad

TINY_READER = {"adapter_layers": [1], "adapter_rank": 4, "lookahead": 1}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("reader-base") / "tiny.gguf"
    write_tiny_gguf(path)
    return gguf_reference(path)


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


def test_shared_loss_normalises_over_a_questions_rows():
    torch.manual_seed(0)
    start, end = torch.randn(4, 6), torch.randn(4, 6)
    candidates = torch.ones(4, 6, dtype=torch.bool)
    candidates[:, :2] = False
    gold_row, gold_start, gold_end = torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])
    loss = shared_span_loss(start, end, candidates, gold_row, gold_start, gold_end, rows_per_question=2)
    expected = []
    for q in range(2):
        rows = slice(2 * q, 2 * q + 2)
        for scores, gold in ((start, gold_start), (end, gold_end)):
            flat = scores[rows][:, 2:].reshape(-1)
            target = scores[2 * q + int(gold_row[q]), int(gold[q])]
            expected.append(torch.logsumexp(flat, 0) - target)
    assert torch.isclose(loss, torch.stack(expected).mean(), atol=1e-5)


def test_training_learns_resumes_and_the_saved_reader_reads(tiny_base, tmp_path):
    squad = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    reader, tokenizer = new_reader(tiny_base, **TINY_READER)
    data = prepare_reader_data(tokenizer, read_squad(squad))
    assert len(data.examples) == 8 and data.skipped == 0
    config = ReaderTrainConfig(max_steps=30, questions_per_step=4, distractors=1, lr=3e-2, head_lr=3e-2,
                               warmup_steps=1, save_every=15, log_every=5, dtype="float32")
    train_reader(reader, tokenizer, data, config, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [5, 10, 15, 20, 25, 30]
    assert lines[-1]["loss"] < lines[0]["loss"]  # it learns the eight facts

    # a longer rerun resumes at step 30 from state.pt, not from scratch
    more = ReaderTrainConfig(**{**config.__dict__, "max_steps": 35})
    again, _ = new_reader(tiny_base, **TINY_READER)
    train_reader(again, tokenizer, data, more, tmp_path / "run")
    lines = [json.loads(line) for line in (tmp_path / "run" / "progress.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 35 and len(lines) == 7

    loaded, tokenizer = load_reader(tmp_path / "run" / "reader")
    contexts = [c for _, c in read_squad(squad).passages.values()]
    answers = read_passages(loaded, tokenizer, ["When was the lighthouse built?"], [contexts[:3]])
    answer = answers[0]
    assert answer is not None and answer.text in contexts[answer.passage]
    assert contexts[answer.passage][answer.char_start:answer.char_end] == answer.text
    assert 0.0 < answer.probability <= 1.0
    # the merged reader scores as the trained one did before saving
    row = question_prefix(tokenizer, "Who was the keeper?")
    ids = torch.tensor([row])
    with torch.no_grad():
        assert torch.allclose(again.eval()(ids, torch.ones_like(ids))[0], loaded(ids, torch.ones_like(ids))[0],
                              atol=1e-4)

    data_all = read_squad(squad)
    results = evaluate_oracle(None, tokenizer, data_all.examples, data_all.passages, ["reader"], distractors=2,
                              reader=loaded)
    assert len(results) == 8 and {r.mode for r in results} == {"reader"}
    assert all(r.prediction in data_all.passages[r.passages[0]][1] or any(
        r.prediction in data_all.passages[p][1] for p in r.passages) for r in results)
    assert sum(r.f1 for r in results) / len(results) > 25  # trained on these very facts


def test_eval_squad_scores_a_saved_reader_beside_hidden_mode(tiny_base, tmp_path):
    from typer.testing import CliRunner

    from cprag.cli import app
    from cprag.model.reader_checkpoint import save_reader
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
