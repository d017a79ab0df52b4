"""Distillation from the split reader: its start and end targets over the training questions' gold passages, the
memory entries they name, the KL term, and a hidden run that follows it (tiny GGUF backbone, tiny SQuAD file)."""

import math
import random
from dataclasses import replace

import pytest
import torch

from cprag.errors import CheckpointError, ConfigError
from cprag.evaluation.squad import read_squad
from cprag.model.backbone import gguf_reference
from cprag.model.reader_checkpoint import new_reader
from cprag.training.distill import ReaderTargets, reader_targets, start_distillation
from cprag.training.reader_train import ReaderData
from tests.tiny_models import write_tiny_gguf
from tests.tiny_squad import smoke, tiny_squad


def _ready(tmp_path, **changes):
    from cprag.training.recipe import prepare

    write_tiny_gguf(tmp_path / "base.gguf")
    squad = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    ready = prepare(squad, smoke(**changes), base=gguf_reference(tmp_path / "base.gguf"))
    reader, _ = new_reader(gguf_reference(tmp_path / "base.gguf"), adapter_rank=4, lookahead=1, split_layer=1)
    texts = {pid: text for pid, (_, text) in read_squad(squad).passages.items()}
    data = ReaderData.build(ready.train.examples, ready.train.cache, 1, texts)
    return ready, reader, data


def test_reader_targets_are_distributions_over_each_gold_passage_and_round_trip(tmp_path):
    ready, reader, data = _ready(tmp_path)
    targets = reader_targets(reader, data, data.questions, top_k=5, batch_size=3, dtype=torch.float32)
    assert set(targets.start) == set(targets.end) == {q.qid for q in data.questions if not q.impossible}
    for q in data.questions:
        for positions, probs in (targets.start[q.qid], targets.end[q.qid]):
            assert 1 <= len(positions) <= 5 and abs(float(probs.sum()) - 1) < 1e-5
            assert (probs[:-1] >= probs[1:]).all()  # most probable first
            assert ((0 <= positions) & (positions < len(data.offsets[q.passage_id]))).all()
    targets.save(tmp_path / "targets.pt")
    again = ReaderTargets.load(tmp_path / "targets.pt")
    assert all(torch.equal(again.start[k][0], v[0]) for k, v in targets.start.items())
    (tmp_path / "other.pt").write_bytes(b"not a targets file")
    for wrong in ("missing.pt", "other.pt"):
        with pytest.raises(CheckpointError):
            ReaderTargets.load(tmp_path / wrong)
    # a run read later goes on from what is stored, reading only the questions it lacks
    partial = ReaderTargets({k: targets.start[k] for k in list(targets.start)[:2]},
                            {k: targets.end[k] for k in list(targets.start)[:2]})
    more = reader_targets(reader, data, data.questions, top_k=5, batch_size=3, dtype=torch.float32, done=partial)
    assert set(more.start) == set(targets.start)


def test_target_entries_paste_the_token_the_reader_would_start_on(tmp_path):
    ready, reader, data = _ready(tmp_path)
    ready.train.reader_targets = reader_targets(reader, data, data.questions, top_k=4, dtype=torch.float32)
    chosen = ready.train.examples.questions[:3]
    batch = ready.train.batch(chosen, 2, ready.tokenizer.bos_token_id, random.Random(0), [False, True, False])
    width = batch.memory_ids.shape[1]
    assert (batch.start_entries[1] == -1).all()  # asked without its passage: nothing to distil
    for row in (0, 2):
        q = chosen[row]
        positions, probs = ready.train.reader_targets.start[q.qid]
        for entry, position, p in zip(batch.start_entries[row], positions, batch.start_probs[row], strict=False):
            assert batch.passage_keys[int(entry) // width] == f"p/{q.passage_id}"
            # entry e pastes memory token e + 1: [BOS, t_0, t_1 ...], so the reader's position i
            assert batch.memory_ids.reshape(-1)[int(entry) + 1] == ready.train.examples.passages[q.passage_id].ids[
                int(position)]
            assert p > 0
        assert abs(float(batch.start_probs[row].sum()) - 1) < 1e-5


def test_the_kl_term_is_zero_where_the_copy_start_is_the_readers_and_grows_as_it_departs():
    entries = torch.tensor([[2, 0, -1], [-1, -1, -1]])
    probs = torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.0, 0.0]])
    same = torch.full((2, 3, 6), -30.0)
    same[0, 0, :4] = torch.log(torch.tensor([0.25, 1e-9, 0.75, 1e-9]))  # 4 memory entries, then the rest
    assert start_distillation(same, 4, entries, probs).abs() < 1e-4
    uniform = torch.zeros(2, 3, 6)
    expected = 0.75 * math.log(0.75 * 4) + 0.25 * math.log(0.25 * 4)  # KL(p ‖ uniform over 4 entries)
    assert abs(float(start_distillation(uniform, 4, entries, probs)) - expected) < 1e-5


def test_a_distilled_run_moves_the_copy_start_toward_the_reader(tmp_path):
    from cprag.training.train import batch_forward, train_model

    with pytest.raises(ConfigError, match="--reader-targets"):
        smoke(distill_weight=1.0)
    ready, reader, data = _ready(tmp_path, no_answer_fraction=0.0)
    ready.train.reader_targets = reader_targets(reader, data, data.questions, top_k=8, dtype=torch.float32)
    batch = ready.train.batch(ready.train.examples.questions[:4], 2, ready.tokenizer.bos_token_id,
                              random.Random(0), [False] * 4)

    def kl() -> float:
        with torch.no_grad():
            out, memory, _ = batch_forward(ready.model, batch, ready.train.cache, 1, "float32")
            return float(start_distillation(out.copy_log_attention, memory.size, batch.start_entries,
                                            batch.start_probs))

    before = kl()
    config = replace(smoke(epochs=30, batch_size=4, no_answer_fraction=0.0, pointer_weight=0.0),
                     reader_targets="given", distill_weight=5.0)
    train_model(ready.model, ready.tokenizer, ready.train, config)
    assert kl() < 0.7 * before


def test_the_targets_script_refuses_bad_input_in_one_line_and_keeps_what_is_stored(tmp_path):
    """`pipelines/reader_targets.py`: an unreadable training file, an --out that is not a targets file (left as
    it was), or a run whose activation cache was never built: one line on stderr and a non-zero exit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "pipelines" / "reader_targets.py"
    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    foreign = tmp_path / "notes.pt"
    foreign.write_bytes(b"someone's notes")
    env = {**os.environ, "CPRAG_CACHE": str(tmp_path / "cache")}
    for argv, words in (([str(tmp_path / "absent.json"), "--out", str(tmp_path / "t.pt")], "cannot read"),
                        ([str(data), "--out", str(foreign)], "not a reader-targets file"),
                        ([str(data), "--out", str(tmp_path / "t.pt")], "not an activation cache")):
        run = subprocess.run([sys.executable, str(script), *argv, "--steps", "1"], capture_output=True, text=True,
                             env=env)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == 1 and len(errors) == 1 and words in errors[0], run.stderr
    assert foreign.read_bytes() == b"someone's notes" and not (tmp_path / "t.pt").exists()
