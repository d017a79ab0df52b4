"""Bring your own backbone: tiny random Llama and Qwen2 models written with `save_pretrained` go through `cprag
train --backbone`, index, ask, serve and reload; fingerprints keep indexes and checkpoints of different backbones
apart; a Hugging Face model id is read from a local Hugging Face cache (offline)."""

import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.errors import BackboneNotFound, ModelMismatch
from cprag.model.backbone import (
    PLAIN_CHAT_TEMPLATE,
    BaseReference,
    folder_reference,
    hub_reference,
    load_backbone,
    resolve_backbone,
)
from cprag.model.checkpoint import load_model, model_fingerprint, new_cplm
from cprag.model.depth import cp_layers, split_layer, top_blocks
from cprag.serve import ServeConfig, create_app
from tests.index_helpers import index_corpus, stored_rows
from tests.tiny_models import BOS, DOCS, EOS, VOCAB_SIZE, tiny_tokenizer, write_jsonl
from tests.tiny_squad import tiny_squad

QUESTIONS = ["When was the lighthouse built?", "When does the night ferry leave?"]
ASK = dict(k=2, min_confidence=0.0)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_config(architecture: str):
    """Sizes unlike SmolLM2's: 4 Llama blocks with tied embeddings, or 3 Qwen2 blocks (biased q/k/v projections)
    with an untied output head."""
    shared = dict(vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=96, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=EOS, rms_norm_eps=1e-5)
    if architecture == "llama":
        return LlamaConfig(num_hidden_layers=4, tie_word_embeddings=True, **shared)
    return Qwen2Config(num_hidden_layers=3, tie_word_embeddings=False, **shared)


def write_tiny_folder(directory, architecture: str, seed: int = 0):
    """A random causal LM and the tiny byte-level tokenizer, saved as a model folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    scratch = directory.parent / f"tokenizer-{architecture}"
    scratch.mkdir(exist_ok=True)
    tiny_tokenizer(scratch).save_pretrained(directory)
    return directory


def train(tmp_path, folder, out):
    data = tiny_squad(tmp_path / "tiny.json", missing_answer=False)
    result = CliRunner().invoke(app, ["train", str(data), "--backbone", str(folder), "--out", str(out),
                                      "--max-steps", "2", "--batch-size", "4", "--distractors", "1",
                                      "--dtype", "float32", "--validation-questions", "2", "--json"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory, embedder):
    root = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_folder(root / "base", request.param)
    checkpoint = train(root, folder, root / "ckpt")
    index_corpus(write_jsonl(root / "c.jsonl", DOCS), root / "idx", checkpoint, embedder)
    return request.param, folder, checkpoint, root / "idx"


def test_training_places_the_recipe_by_depth_and_records_the_backbone(trained):
    architecture, folder, checkpoint, _ = trained
    config = json.loads((checkpoint / "config.json").read_text())
    depth = tiny_config(architecture).num_hidden_layers
    assert config["backbone_config"]["model_type"] == architecture
    assert config["base_model"] == {"kind": "folder", "path": str(folder.resolve()),
                                    "sha256": folder_reference(folder).sha256}
    assert config["adapter_layers"] == top_blocks(depth) and config["cp_layers"] == cp_layers(depth)
    recorded = json.loads((checkpoint / "train_config.json").read_text())["train"]
    assert recorded["cache_layer"] == split_layer(depth) and recorded["head"]["adapter_layers"] == top_blocks(depth)
    model, _ = load_model(checkpoint)
    assert model.backbone.config.model_type == architecture
    # Qwen2's output rows are its own, not the embeddings: they come with the backbone and score the vocabulary
    untied = getattr(model.backbone, "lm_head", None)
    assert (untied is not None) == (architecture == "qwen2")
    hidden = torch.randn(2, 48)
    rows = untied.weight if untied is not None else model.backbone.get_input_embeddings().weight
    assert torch.equal(model.lm_logits(hidden), hidden @ rows.T)


def test_index_ask_and_serve_answer_alike_and_a_reload_gives_the_same_keys_and_answers(trained, tmp_path, embedder):
    _, _, checkpoint, index_dir = trained
    index = Index(index_dir, checkpoint=checkpoint)
    answers = [index.ask(q, **ASK) for q in QUESTIONS]
    assert all(a.mode == "hidden" for a in answers)
    again = Index(index_dir, checkpoint=checkpoint)  # a fresh load of checkpoint and backbone
    assert [index.ask(q, **ASK).answer for q in QUESTIONS] == [a.answer for a in answers]
    assert [again.ask(q, **ASK).answer for q in QUESTIONS] == [a.answer for a in answers]
    index_corpus(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "idx", checkpoint, embedder)
    assert stored_rows(tmp_path / "idx") == stored_rows(index_dir)
    with TestClient(create_app(index.path, lambda: index, ServeConfig())) as client:
        for question, answer in zip(QUESTIONS, answers, strict=True):
            body = client.post("/v1/ask", json={"question": question, "k": 2, "min_confidence": 0.0})
            assert body.status_code == 200, body.text
            assert body.json()["answer"] == answer.answer


def test_an_index_of_one_backbone_is_refused_by_a_checkpoint_of_another(trained, tmp_path_factory):
    architecture, _, _, index_dir = trained
    other = "qwen2" if architecture == "llama" else "llama"
    root = tmp_path_factory.mktemp(f"other-{other}")
    model, _ = new_cplm(write_tiny_folder(root / "base", other), key_dim=8)
    model.save_pretrained(root / "ckpt")
    with pytest.raises(ModelMismatch, match="index"):
        Index(index_dir, checkpoint=root / "ckpt").ask(QUESTIONS[0], **ASK)


def test_the_fingerprint_refuses_an_index_of_the_same_backbone_with_another_head(trained, tmp_path):
    _, folder, _, index_dir = trained
    torch.manual_seed(7)
    model, _ = new_cplm(folder, key_dim=8)
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ModelMismatch, match="index") as refused:
        Index(index_dir, checkpoint=tmp_path / "ckpt").ask(QUESTIONS[0], **ASK)
    assert "--rebuild" in str(refused.value) and "\n" not in str(refused.value)  # one line, naming the remedy


def test_a_changed_backbone_folder_is_refused_in_one_line(tmp_path):
    folder = write_tiny_folder(tmp_path / "base", "llama")
    model, _ = new_cplm(folder, key_dim=8)
    model.save_pretrained(tmp_path / "ckpt")
    write_tiny_folder(tmp_path / "base", "llama", seed=1)  # other weights in the same place
    with pytest.raises(ModelMismatch, match="base backbone"):
        load_model(tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(BackboneNotFound, match="no model folder"):
        load_model(tmp_path / "ckpt")


def fake_hub_cache(root, folder, repo: str):
    """The layout huggingface_hub keeps a downloaded model in: refs/main naming a commit, its snapshot folder."""
    cached = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, cached / "snapshots" / COMMIT)
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text(COMMIT)
    return cached


def test_a_hub_model_id_is_read_from_the_hugging_face_cache_with_its_commit(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # nothing here talks to the network
    folder = write_tiny_folder(tmp_path / "base", "qwen2")
    cached = fake_hub_cache(tmp_path / "hub", folder, "tiny-org/tiny-qwen2")
    ref = resolve_backbone("tiny-org/tiny-qwen2")
    assert ref.to_dict() == {"kind": "hub", "id": "tiny-org/tiny-qwen2", "revision": COMMIT,
                             "sha256": folder_reference(folder).sha256}
    torch.manual_seed(0)
    from_hub, _ = new_cplm(ref, key_dim=8)
    torch.manual_seed(0)
    from_folder, _ = new_cplm(folder, key_dim=8)
    assert model_fingerprint(from_hub) == model_fingerprint(from_folder)  # the same weights, wherever they sit
    from_hub.save_pretrained(tmp_path / "ckpt")
    assert model_fingerprint(load_model(tmp_path / "ckpt")[0]) == model_fingerprint(from_hub)
    shutil.rmtree(cached)
    with pytest.raises(BackboneNotFound, match=f"hf download tiny-org/tiny-qwen2 --revision {COMMIT}"):
        load_model(tmp_path / "ckpt")
    with pytest.raises(BackboneNotFound, match="Hugging Face Hub"):
        hub_reference("tiny-org/absent")


@pytest.mark.parametrize("name, words", [("no-such-model", "not a Hugging Face model id"),
                                          ("missing/dir/model.gguf", "not a Hugging Face model id")])
def test_a_backbone_that_is_not_there_is_one_line_and_a_failed_exit(tmp_path, name, words):
    data = tiny_squad(tmp_path / "tiny.json")
    result = CliRunner().invoke(app, ["train", str(data), "--backbone", name, "--out", str(tmp_path / "ckpt")])
    assert result.exit_code != 0
    assert words in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_a_missing_folder_beside_local_ones_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()  # "models/my-llama" reads as owner/name, but "models" is a folder here
    with pytest.raises(BackboneNotFound, match="no such GGUF file or model folder in models"):
        resolve_backbone("models/my-llama")


def test_a_weights_file_that_is_not_a_gguf_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(BackboneNotFound, match="model folder"):
        resolve_backbone(tmp_path / "model.safetensors")


def test_a_base_model_without_a_chat_template_gets_plain_turns(tmp_path):
    folder = write_tiny_folder(tmp_path / "base", "llama")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    _, tokenizer = load_backbone(BaseReference.from_dict(folder_reference(folder).to_dict()))
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    from cprag.decoding.prompt import prompt_ids

    text = tokenizer.decode(prompt_ids(tokenizer, "Who built it?"))
    assert text.startswith("System: ") and text.endswith("Assistant: ") and "User: Who built it?" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_training_on_a_gpu_this_machine_lacks_is_one_line(tmp_path):
    data = tiny_squad(tmp_path / "tiny.json")
    result = CliRunner().invoke(app, ["train", str(data), "--device", "cuda", "--out", str(tmp_path / "ckpt")])
    assert result.exit_code != 0 and "no CUDA device" in result.output
    assert len(result.output.strip().splitlines()) == 1
