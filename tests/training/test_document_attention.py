"""Documents read both ways in the trained blocks: training (packed, from the activation cache) and indexing
(`document_keys`) give the same keys, a key reads what follows it, and the fingerprint tells the two apart."""

import torch

from cprag.model.backbone import gguf_reference
from cprag.model.blocks import both_ways_mask
from cprag.model.checkpoint import model_fingerprint
from cprag.training.train import packed_features
from tests.tiny_models import tiny_cplm, write_tiny_gguf
from tests.tiny_squad import HEAD, smoke, tiny_squad


def _prepared(tmp_path, attention: str):
    from cprag.training.recipe import prepare

    write_tiny_gguf(tmp_path / "base.gguf")
    config = smoke(head={**HEAD, "document_attention": attention, "doc_lookahead": 0, "doc_refine_layers": 0})
    return prepare(tiny_squad(tmp_path / "tiny.json"), config, base=gguf_reference(tmp_path / "base.gguf"))


def test_packed_training_keys_are_the_index_keys_when_documents_read_both_ways(tmp_path):
    ready = _prepared(tmp_path, "both")
    model = ready.model
    assert model.config.document_attention == "both"
    pids = sorted(ready.train.examples.passages)[:3]
    keys = [f"p/{pid}" for pid in pids]
    with torch.no_grad():
        for delta in model.adapters.values():  # adapters that do something
            delta.lora_B.normal_(std=0.05)
        width = max(ready.train.cache.length(k) for k in keys)
        packed = packed_features(model, ready.train.cache, keys, 1, "float32", width)
        ids = [torch.tensor([ready.tokenizer.bos_token_id] + ready.train.examples.passages[p].ids) for p in pids]
        input_ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(i) for i in ids], batch_first=True)
        memory = model.document_keys(input_ids, mask)
        from_packed = model.document_keys_from_hidden(packed, input_ids, mask)
    real = mask.bool()
    # the cache keeps float16: equal up to its rounding
    assert torch.allclose(memory.keys[real], from_packed.keys[real], atol=2e-2)


def test_a_key_read_both_ways_sees_what_follows_it_and_a_causal_one_does_not():
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45]])
    changed = ids.clone()
    changed[0, -1] = 50
    for attention, differs in (("causal", False), ("both", True)):
        model = tiny_cplm(adapter_layers=[1], document_attention=attention)
        with torch.no_grad():
            before, after = model.document_keys(ids).keys, model.document_keys(changed).keys
        assert torch.allclose(before[0, :-2], after[0, :-2], atol=1e-6) != differs


def test_the_mask_reads_within_a_sequence_and_padding_reads_only_itself():
    mask = both_ways_mask(torch.tensor([[1, 1, 0]]))[0, 0]
    assert mask.tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    packed = both_ways_mask(position_ids=torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    assert packed[0, 2] and packed[2, 0] and not packed[1, 3] and packed[4, 3]


def test_the_fingerprint_tells_documents_read_both_ways_from_causal_ones():
    causal = tiny_cplm(adapter_layers=[1])
    both = tiny_cplm(adapter_layers=[1], document_attention="both")
    both.load_state_dict(causal.state_dict())
    assert model_fingerprint(causal) != model_fingerprint(both)


def test_a_screen_goes_on_from_a_checkpoint_and_writes_one_that_reads_documents_both_ways(tmp_path):
    """`pipelines/continue_screen.py`: N more steps from a finished run on its cache, teacher-forced figures, and
    a checkpoint folder beside them that loads and encodes documents the new way."""
    import importlib.util
    import json
    from pathlib import Path

    from cprag.model.checkpoint import load_model
    from cprag.training.recipe import train_checkpoint

    write_tiny_gguf(tmp_path / "base.gguf")
    data = tiny_squad(tmp_path / "tiny.json")
    validation = tiny_squad(tmp_path / "dev.json")
    train_checkpoint(data, tmp_path / "ckpt", smoke(), base=gguf_reference(tmp_path / "base.gguf"),
                     validation_questions=2)
    script = Path(__file__).resolve().parents[2] / "pipelines" / "continue_screen.py"
    spec = importlib.util.spec_from_file_location("continue_screen", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main([str(data), "--validation", str(validation), "--out", str(tmp_path / "arm"), "--checkpoint",
                        str(tmp_path / "ckpt"), "--steps", "2", "--document-attention", "both", "--tf", "4"])
    assert code == 0
    result = json.loads((tmp_path / "arm" / "result.json").read_text())
    assert result["steps"] == 1 and 0 <= result["tf/start"] <= 100  # one epoch of a few questions: one step
    assert len((tmp_path / "arm" / "progress.jsonl").read_text().splitlines()) == result["steps"]
    before, _ = load_model(tmp_path / "ckpt")
    after, _ = load_model(tmp_path / "arm" / "checkpoint")
    assert after.config.document_attention == "both" and model_fingerprint(after) != model_fingerprint(before)
