"""The CUDA path: the same keys and answers on a GPU as on the CPU. Skipped where torch sees no CUDA device;
`pipelines/gpu_check.sh` runs them on a machine that has one. Only the last test needs LanceDB, which a bare GPU
machine may lack (its wheels are larger than a device call can carry)."""

import pytest
import torch

from cprag.decoding.generate import generate
from cprag.evaluation.oracle_qa import OracleMemory
from cprag.index.encode import encode_passages, tokenize_passage
from cprag.model.checkpoint import load_model
from tests.tiny_models import DOCS, tiny_checkpoint, write_jsonl

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]
QUESTIONS = ["When was the lighthouse built?", "Who designed the glass bridge?", "What rings every hour?"]
PASSAGES = {d["id"]: (d["title"], d["text"]) for d in DOCS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


def test_keys_encoded_on_the_gpu_match_the_cpu_keys(checkpoint):
    model, tokenizer = load_model(checkpoint)
    passages = [tokenize_passage(tokenizer, d["text"]) for d in DOCS]
    on_cpu = dict(encode_passages(model, passages, bos_id=tokenizer.bos_token_id))
    on_gpu = dict(encode_passages(model.to("cuda"), passages, bos_id=tokenizer.bos_token_id))
    for index, keys in on_cpu.items():
        assert (keys.ids == on_gpu[index].ids).all()
        cpu, gpu = (torch.as_tensor(k.keys, dtype=torch.float32).flatten() for k in (keys, on_gpu[index]))
        assert torch.nn.functional.cosine_similarity(cpu, gpu, dim=0) > 0.999


@pytest.mark.parametrize("mode", ["hidden", "visible"])
def test_fp32_answers_on_the_gpu_equal_the_cpu_answers(checkpoint, mode):
    answers = {}
    for device in ("cpu", "cuda"):
        model, tokenizer = load_model(checkpoint, device=device)
        memory = OracleMemory(model, tokenizer, PASSAGES)
        passages = memory.get(sorted(PASSAGES)[:3])
        assert all(p.keys.device.type == device for p in passages)
        answers[device] = [(g.answer, g.sources) for g in (
            generate(model, tokenizer, q, passages, mode, 8, start_beam=2) for q in QUESTIONS)]
    assert answers["cuda"] == answers["cpu"]


def test_an_index_opened_on_the_gpu_answers_in_bf16_with_valid_citations(tmp_path, checkpoint):
    pytest.importorskip("lancedb", reason="LanceDB is not installed on this machine")
    from cprag.api import Index
    from cprag.index.retrieve import MiniLMEmbedder
    from tests.index_helpers import index_corpus

    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, MiniLMEmbedder())
    gpu = Index(tmp_path / "idx", checkpoint=checkpoint, device="cuda")
    assert next(gpu.model.parameters()).dtype == torch.bfloat16
    for question in QUESTIONS:
        answer = gpu.ask(question, k=3, min_retrieval_score=-1, min_confidence=0)
        assert answer.answer
        for citation in answer.citations:
            assert citation.text and citation.text in " ".join(d["text"] for d in DOCS)


def test_training_on_the_gpu_builds_the_cache_there_and_follows_the_cpu_run(tmp_path):
    """fp32 steps on the GPU and on the CPU from the same seed: the same checkpoint layout, and losses that agree
    to float rounding (the kernels differ, so not bit for bit)."""
    from dataclasses import replace

    from cprag.model.backbone import gguf_reference
    from cprag.training.recipe import prepare
    from cprag.training.train import train_model
    from tests.tiny_models import write_tiny_gguf
    from tests.tiny_squad import SMOKE, tiny_squad

    write_tiny_gguf(tmp_path / "base.gguf")
    data = tiny_squad(tmp_path / "tiny.json")
    losses = {}
    for device in ("cpu", "cuda"):
        config = replace(SMOKE, device=device, visible_every=1, visible_batch=1)
        ready = prepare(data, config, base=gguf_reference(tmp_path / "base.gguf"))
        assert ready.model.copy_gate.weight.device.type == device
        losses[device] = train_model(ready.model, ready.tokenizer, ready.train, ready.config).losses
    assert len(losses["cuda"]) == len(losses["cpu"]) > 0
    assert all(abs(a - b) < 1e-3 * max(1.0, abs(a)) for a, b in zip(losses["cpu"], losses["cuda"], strict=True))
