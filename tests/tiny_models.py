"""Tiny random models for tests: a Llama config, a CPLM on it, a GGUF file written from it, a checkpoint saved
from one, and the five-document corpus the index tests use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, LlamaConfig

from cprag.model.answer_verifier import AnswerVerifier
from cprag.model.backbone import gguf_reference
from cprag.model.checkpoint import load_model, model_fingerprint, new_cplm
from cprag.model.config import CPLMConfig
from cprag.model.cplm import CPLMForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġ", "a")]
VOCAB_SIZE = 256 + len(MERGES) + len(SPECIAL_TOKENS)
BOS, EOS = VOCAB_SIZE - 2, VOCAB_SIZE - 1
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a byte-level BPE vocabulary with no merges."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes, strict=True))]


def tiny_llama_config(vocab_size: int = VOCAB_SIZE, hidden: int = 32, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, rms_norm_eps=1e-5,
    )


def tiny_cplm(seed: int = 0, **config) -> CPLMForCausalLM:
    torch.manual_seed(seed)
    backbone = tiny_llama_config()
    return CPLMForCausalLM(CPLMConfig(backbone_config=backbone.to_dict(), key_dim=8, **config)).eval()


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp stores q/k rotary halves interleaved; transformers undoes this on load
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2):
    """Write a random Llama (2 layers unless told) with a byte-level tokenizer as an F32 GGUF. Returns the source
    LlamaModel."""
    import gguf

    torch.manual_seed(seed)
    config = tiny_llama_config(hidden=hidden, layers=layers)
    model = AutoModel.from_config(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    normal = byte_tokens() + ["".join(pair) for pair in MERGES]
    writer.add_token_list(normal + SPECIAL_TOKENS)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(normal) + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS))
    writer.add_token_merges([" ".join(pair) for pair in MERGES])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, value: torch.Tensor) -> None:
        writer.add_tensor(name, value.detach().float().numpy().copy())

    tensor("token_embd.weight", model.embed_tokens.weight)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        tensor(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(attn.q_proj.weight.detach().numpy(),
                                                            config.num_attention_heads).copy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(attn.k_proj.weight.detach().numpy(),
                                                            config.num_key_value_heads).copy())
        tensor(f"blk.{i}.attn_v.weight", attn.v_proj.weight)
        tensor(f"blk.{i}.attn_output.weight", attn.o_proj.weight)
        tensor(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        tensor(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        tensor(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        tensor(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    tensor("output_norm.weight", model.norm.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def tiny_tokenizer(directory: Path):
    """The tokenizer of a tiny GGUF file written into `directory`, loaded as cprag loads a backbone."""
    from cprag.model.backbone import gguf_reference, load_backbone

    path = Path(directory) / "tiny.gguf"
    write_tiny_gguf(path)
    return load_backbone(gguf_reference(path), use_cache=False)[1]


DOCS = [
    {"id": "lighthouse", "title": "Varna Point", "text": "The lighthouse was built in 1871 from granite."},
    {"id": "bridge", "title": "Glass Bridge", "text": "The glass bridge opened to walkers in 2009."},
    {"id": "clock", "title": "River Clock", "text": "The river clock rings a bell every hour."},
    {"id": "geese", "title": "Lake Merrow", "text": "Pink-footed geese arrive at the lake in October."},
    {"id": "ferry", "title": "Night Ferry", "text": "The night ferry leaves at eleven and arrives at six."},
]


def with_extra_docs(count: int = 8) -> list[dict]:
    """DOCS and `count` more of about 90 bytes (tokens) each: enough keys (> 256) to learn a pq codebook."""
    words = "granite harbour lantern keeper tower storm coast signal bridge river".split()
    return DOCS + [{"id": f"extra{i}", "title": f"Extra {i}",
                    "text": " ".join(words[(i + j) % len(words)] for j in range(14)) + "."} for i in range(count)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def tiny_checkpoint(directory, seed=0, copy_everything=False, successor=None, hidden=32, **head):
    """A CPLM on a tiny GGUF base, saved as a checkpoint; optionally forced to copy every token, with a
    successor bias of the given (continue, end) weights, and with other head options (given random weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_tiny_gguf(directory / "base.gguf", hidden=hidden)
    torch.manual_seed(seed)
    options = dict(successor_bias=True) if successor else {}
    model, _ = new_cplm(gguf_reference(directory / "base.gguf"), key_dim=8, copy_bias_init=0.0, **options, **head)
    with torch.no_grad():
        if model.cp_head.query_refiner is not None:
            for up in model.cp_head.query_refiner.up:
                up.weight.normal_()
        if model.cp_head.lexical is not None:
            model.cp_head.lexical.copy_(torch.tensor([3.0, -2.0]))
    if copy_everything:
        with torch.no_grad():
            model.copy_gate.bias.fill_(1e4)
            model.cp_head.sink_bias.fill_(-1e4)
    if successor:
        with torch.no_grad():
            model.cp_head.successor.copy_(torch.tensor(successor))
    model.save_pretrained(directory / "ckpt")
    return directory / "ckpt"


def verifier_beside(checkpoint, directory, threshold: float, fingerprint: str | None = None,
                    keep_confidence: float = 2.0):
    """A copy of the checkpoint with a verifier head of random weights and the given threshold."""
    shutil.copytree(checkpoint, directory)
    model, _ = load_model(checkpoint)
    width = 2 * model.config.hidden_size
    generator = torch.Generator().manual_seed(1)
    AnswerVerifier(layers=[1], hidden_size=model.config.hidden_size, mean=[0.0] * width, scale=[1.0] * width,
                   weight=(0.1 * torch.randn(width, generator=generator)).tolist(), bias=0.0, threshold=threshold,
                   fingerprint=model_fingerprint(model) if fingerprint is None else fingerprint,
                   keep_confidence=keep_confidence).save(directory)
    return directory
