"""The generator as `cprag.model.runtime.place` sets it up for inference: a bf16 backbone whose linear layers are packed
for oneDNN (the same outputs, faster), and a CP head kept in fp32."""

import platform
import sys

import pytest
import torch

from cprag.model.lexical import _segment_word_ids, word_ids
from cprag.model.packed_weights import PackedLinear, pack_linears, packing_supported
from cprag.model.runtime import place, reuse_freed_memory
from tests.tiny_models import VOCAB_SIZE, tiny_cplm, tiny_tokenizer

needs_packing = pytest.mark.skipif(not packing_supported("cpu", torch.bfloat16), reason="no oneDNN bf16 here")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("packed-tok"))


@needs_packing
def test_packed_linears_give_bit_for_bit_the_outputs_of_the_plain_ones():
    plain = tiny_cplm(seed=1).to(torch.bfloat16)
    packed = tiny_cplm(seed=1).to(torch.bfloat16)
    assert pack_linears(packed.backbone) == 7 * packed.config.backbone_config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows, width in ((1, 1), (3, 9), (16, 20)):
            ids = torch.randint(0, VOCAB_SIZE, (rows, width), generator=gen)
            assert torch.equal(packed.backbone(input_ids=ids).last_hidden_state,
                               plain.backbone(input_ids=ids).last_hidden_state)
    assert packed.backbone.state_dict().keys() == plain.backbone.state_dict().keys()


@needs_packing
def test_a_packed_layer_falls_back_to_the_plain_weight_where_autograd_needs_it():
    linear = torch.nn.Linear(8, 4).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    inputs = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    packed(inputs).sum().backward()  # autograd needs the plain weight
    assert inputs.grad is not None and linear.weight.grad is not None
    with torch.inference_mode():
        assert torch.equal(packed(inputs), linear(inputs))


def test_place_keeps_the_cp_head_and_the_copy_gate_in_fp32():
    model = place(tiny_cplm(seed=2), "cpu", torch.bfloat16)
    assert model.head_dtype == torch.float32 and model.copy_gate.weight.dtype == torch.float32
    assert model.backbone.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, VOCAB_SIZE, (2, 6))
    with torch.inference_mode():
        out = model(ids)
        memory = model.document_keys(ids)
    assert out.log_probs.dtype == torch.float32 and memory.keys.dtype == torch.float32
    assert torch.allclose(out.log_probs.exp().sum(-1), torch.ones(2, 6), atol=1e-4)
    assert (model.packed_lm_head is not None) == packing_supported("cpu", torch.bfloat16)


def test_a_memorys_word_ids_are_those_of_reading_it_whole(tokenizer):
    first = tokenizer("The granite lighthouse at Varna Point", add_special_tokens=False)["input_ids"]
    second = tokenizer("lighthouse keepers of Varna", add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id
    memory = first + [end] + second + [end] + first + [end]
    whole = list(_segment_word_ids.__wrapped__(tokenizer, tuple(memory)))  # uncached, in one piece
    assert word_ids(tokenizer, memory).tolist() == whole
    assert word_ids(tokenizer, memory).tolist() == whole  # again, from the remembered passages


@needs_packing
def test_fused_packed_blocks_give_transformers_hidden_states_and_cache_at_decoding_sizes():
    from transformers import DynamicCache

    plain = tiny_cplm(seed=4).to(torch.bfloat16)
    fused = place(tiny_cplm(seed=4), "cpu", torch.bfloat16)
    assert all(hasattr(layer, "packed_weights") for layer in fused.backbone.layers)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows, width in ((1, 1), (1, 9), (4, 12)):
            prompt = torch.randint(0, VOCAB_SIZE, (rows, 20), generator=gen)
            step = torch.randint(0, VOCAB_SIZE, (rows, width), generator=gen)
            outs, caches = [], []
            for model in (plain, fused):
                cache = DynamicCache(config=model.backbone.config)
                model.backbone(input_ids=prompt, cache=cache, use_cache=True)
                outs.append(model.backbone(input_ids=step, cache=cache, use_cache=True, output_hidden_states=True,
                                           position_ids=torch.arange(20, 20 + width).expand(rows, -1)))
                caches.append(cache)
            assert all(torch.equal(a, b) for a, b in zip(outs[0].hidden_states, outs[1].hidden_states, strict=True))
            assert torch.equal(outs[0].last_hidden_state, outs[1].last_hidden_state)
            assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                       for a, b in zip(caches[0].layers, caches[1].layers, strict=True))
        # a batch's left-padded prompt pass and a step after it: attention under a padding mask
        prompt = torch.randint(0, VOCAB_SIZE, (3, 14), generator=gen)
        mask = torch.ones_like(prompt)
        mask[0, :5], mask[2, :2] = 0, 0
        step = torch.randint(0, VOCAB_SIZE, (3, 4), generator=gen)
        outs = []
        for model in (plain, fused):
            cache = DynamicCache(config=model.backbone.config)
            first = model.backbone(input_ids=prompt, attention_mask=mask, cache=cache, use_cache=True)
            second = model.backbone(input_ids=step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1),
                                    cache=cache, use_cache=True)
            outs.append((first.last_hidden_state, second.last_hidden_state))
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    ids = torch.randint(0, VOCAB_SIZE, (2, 5), generator=gen)
    with torch.enable_grad():  # autograd runs transformers' own block forward
        fused.backbone(input_ids=ids).last_hidden_state.float().sum().backward()
    assert fused.backbone.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"),
                    reason="mallopt is glibc's")
def test_large_tensors_come_from_the_reusable_heap_rather_than_fresh_mappings():
    # a (rows, positions, vocabulary) tensor of ~28 MB, as a batch pass allocates: with the setting glibc serves it
    # from the heap (where a freed block is reused) instead of a fresh mapping the kernel must zero again
    def in_heap(address: int) -> bool:
        for line in open("/proc/self/maps"):
            span, *rest = line.split()
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return rest[-1] == "[heap]"
        return False

    assert reuse_freed_memory()
    tensor = torch.empty(144 * 49152, dtype=torch.float32)
    assert in_heap(tensor.data_ptr())
