"""The Copy-Paste Language Model: a causal backbone, its tied LM head with a `<copy>` entry, and the CP head.

Math only: loading the default backbone lives in `cprag.model.backbone`, checkpoints in `cprag.model.checkpoint`.
Shapes: B batch, T new positions, P past positions, M memory entries, H hidden size, D key dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import ModelOutput

from cprag.model.adapters import LowRankDelta, build_adapters
from cprag.model.backbone import output_weight
from cprag.model.blocks import both_ways_mask, run_blocks
from cprag.model.config import CPLMConfig
from cprag.model.copy_head import (
    ContextState,
    CopyHead,
    CopyMemory,
    context_memory,
    key_context,
)
from cprag.model.mixture import (
    copy_log_probs,
    gate_log_probs,
    gate_log_probs_from_stats,
    generator_weight_log,
    mixture_log_probs,
    mixture_target_log_probs,
    weighted_loss,
)
from cprag.model.stored_weights import load_on_base, stored_state_dict


@dataclass
class CPLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None  # (B, T, V) mixture log p(next token)
    log_gate: torch.Tensor | None = None  # (B, T) log g
    copy_log_attention: torch.Tensor | None = None  # (B, T, E + P + T) log a over [external ; context]
    sink_log_attention: torch.Tensor | None = None  # (B, T)
    generator_log_weight: torch.Tensor | None = None  # (B, T) log(1 - g + g·a_sink): the weight p_gen gets
    target_log_probs: torch.Tensor | None = None  # (B, T) mixture log p(target), when targets are given
    hidden_states: torch.Tensor | None = None  # (B, T, H)
    context: ContextState | None = None


def cp_features(last_hidden: torch.Tensor, hidden_states: tuple | dict | None,
                layers: list[int] | None) -> torch.Tensor:
    """The CP head's input: RMS-normalised hidden states of `layers`, then the final (normed) hidden state.

    last_hidden (B, T, H), hidden_states: the backbone's per-layer states, indexable by layer (a tuple, or a dict
    holding at least `layers`) -> (B, T, H * (len(layers) + 1)).
    """
    if not layers:
        return last_hidden
    parts = [hidden_states[i] * torch.rsqrt(hidden_states[i].pow(2).mean(-1, keepdim=True) + 1e-6) for i in layers]
    return torch.cat([*parts, last_hidden], dim=-1)


class CPLMPreTrainedModel(PreTrainedModel):
    config_class = CPLMConfig
    config: CPLMConfig
    base_model_prefix = "cplm"
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, CopyHead):
            std = self.config.backbone_config.initializer_range
            for proj in (module.q_proj, module.k_proj, module.end_q_proj, module.context_q_proj):
                linears = [] if proj is None else [m for m in proj.modules() if isinstance(m, nn.Linear)]
                for depth, linear in enumerate(linears):  # the input layer at the backbone's scale
                    nn.init.normal_(linear.weight, std=std if depth == 0 else 1 / math.sqrt(linear.in_features))
                    nn.init.zeros_(linear.bias)
            nn.init.zeros_(module.sink_key)
            nn.init.zeros_(module.sink_bias)
            if module.paste_embedding is not None:
                nn.init.zeros_(module.paste_embedding.weight)
            if module.successor is not None:
                nn.init.zeros_(module.successor)
            for proj in module.lookahead:  # start as a no-op on the keys
                nn.init.zeros_(proj.weight)
                nn.init.zeros_(proj.bias)
            for weights in (module.lexical, module.lexical_end):
                if weights is not None:
                    nn.init.zeros_(weights)
            if module.query_refiner is not None:
                module.query_refiner.apply(_reset_torch_defaults)
                for up in module.query_refiner.up:  # starts as a no-op on the queries
                    nn.init.zeros_(up.weight)
                    nn.init.zeros_(up.bias)
            if module.doc_refiner is not None:
                module.doc_refiner.apply(_reset_torch_defaults)
                nn.init.zeros_(module.doc_refiner.up.weight)  # starts as a no-op on the keys
                nn.init.zeros_(module.doc_refiner.up.bias)
        elif module is getattr(self, "copy_gate", None):
            # open gate at start: the <copy> logit sits near the logsumexp of the LM logits (design notes)
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, self.config.copy_bias_init)
        elif isinstance(module, LowRankDelta):
            module.reset_parameters()
        elif self._belongs_to_cp_head(module):
            pass  # initialised with its CopyHead
        else:
            super()._init_weights(module)

    def _belongs_to_cp_head(self, module: nn.Module) -> bool:
        head = getattr(self, "cp_head", None)
        return head is not None and any(module is m for m in head.modules())


def _reset_torch_defaults(module: nn.Module) -> None:
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
    elif isinstance(module, nn.Linear | nn.LayerNorm):
        module.reset_parameters()


class CPLMForCausalLM(CPLMPreTrainedModel):
    """Backbone + tied LM head with a `<copy>` entry + CP head, trained on the NLL of the mixture."""

    def __init__(self, config: CPLMConfig, backbone: nn.Module | None = None):
        super().__init__(config)
        self.backbone = backbone if backbone is not None else AutoModel.from_config(config.backbone_config)
        if backbone is None and not getattr(config.backbone_config, "tie_word_embeddings", True):
            self.backbone.add_module("lm_head", nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.copy_gate = nn.Linear(config.hidden_size, 1)  # the `<copy>` row of the LM head
        self.packed_lm_head: nn.Module | None = None  # the tied rows as one fast linear (cprag.model.runtime.place)
        self.cp_head = CopyHead(config)
        self.adapters = build_adapters(self.backbone, config.adapter_layers, config.adapted_modules,
                                       config.adapter_rank, config.adapter_alpha) if config.adapter_layers else None
        self.post_init()
        if backbone is None:
            return
        # post_init may re-initialise what it finds; a given (pretrained) backbone must keep its weights
        self._init_weights(self.copy_gate)
        self._init_weights(self.cp_head)
        for delta in (self.adapters or {}).values():
            delta.reset_parameters()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.get_input_embeddings()

    @property
    def head_dtype(self) -> torch.dtype:
        """The CP head's precision, which may be finer than the backbone's (cprag.model.runtime.place)."""
        return self.cp_head.sink_key.dtype

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits from the backbone's output rows (tied to the input embeddings, or its own untied
        head), in `hidden`'s dtype. (..., H) -> (..., V)."""
        weight = output_weight(self.backbone)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden.to(weight.dtype)).to(hidden.dtype)
        return (hidden.to(weight.dtype) @ weight.T).to(hidden.dtype)

    def _cp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        # the stop-gradient ablation: the CP head still trains, but its gradient never reaches the backbone
        return hidden.detach() if self.config.stop_cp_grad else hidden

    def encode_hidden(self, input_ids, attention_mask=None, cache=None, use_cache=False, position_ids=None):
        """-> final hidden states (B, T, H), CP-head input (B, T, C) and the KV cache."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
            position_ids=position_ids, output_hidden_states=bool(self.config.cp_layers),
        )
        features = cp_features(out.last_hidden_state, out.hidden_states, self.config.cp_layers)
        return out.last_hidden_state, features, out.cache

    def cached_layers(self, start: int | None = None) -> list[int]:
        """Hidden-state indices that fix everything above block `start` (default: the first adapted block): the
        `cp_layers` below it and its input. A cache of these (cprag.training.activations) replaces blocks 0..start-1."""
        start = self.config.first_trained_layer if start is None else start
        if self.config.adapter_layers and start > self.config.first_trained_layer:
            raise ValueError(f"blocks from {self.config.first_trained_layer} are adapted: a cache must stop there")
        return sorted({i for i in self.config.cp_layers or [] if i < start} | {start})

    def frozen_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      start: int | None = None) -> dict[int, torch.Tensor]:
        """{i: hidden states (B, T, H) entering block i} for i in `cached_layers(start)`: blocks 0..start-1 only."""
        keep = set(self.cached_layers(start))
        _, saved = run_blocks(self.backbone, self.backbone.embed_tokens(input_ids), attention_mask, 0, max(keep),
                              keep)
        return saved

    def trained_states(self, states: dict[int, torch.Tensor], attention_mask: torch.Tensor | None,
                       start: int | None = None, position_ids: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """From `frozen_states(..., start)`, the rest of the backbone (where any adapters are) -> final hidden
        states (B, T, H) and the CP head's input (B, T, C), as `encode_hidden` gives them. Packed sequences and
        `mask` (B, 1, T, T) as in `run_blocks`."""
        start = self.config.first_trained_layer if start is None else start
        keep = {i for i in self.config.cp_layers or [] if i > start}
        hidden, saved = run_blocks(self.backbone, states[start], attention_mask, start,
                                   self.config.backbone_config.num_hidden_layers, keep, position_ids, mask)
        hidden = self.backbone.norm(hidden)
        return hidden, cp_features(hidden, {**states, **saved}, self.config.cp_layers)

    def document_keys(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CopyMemory:
        """Encode documents on their own. input_ids (B, T) = [BOS, t_1 .. t_n] -> a memory of T keys each.

        Key j pastes the token at j + 1; the key of the last token pastes the end-of-turn token ("the text
        ends here"), so every passage token, and the end right after the passage, can be copied.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if self.config.document_attention == "both":
            states = self.frozen_states(input_ids, attention_mask, self.config.first_trained_layer)
            _, features = self.trained_states(states, None, mask=both_ways_mask(attention_mask))
        else:
            _, features, _ = self.encode_hidden(input_ids, attention_mask)
        return self.document_keys_from_hidden(features, input_ids, attention_mask)

    def document_keys_from_hidden(self, features, input_ids, attention_mask) -> CopyMemory:
        """CP-head input (B, T, C) of [BOS, t_1 .. t_n] (right padded) -> keys (B, T, D), ids (B, T), mask (B, T)."""
        mask = attention_mask.bool()
        features = features.to(self.head_dtype)
        last = (mask.sum(-1) - 1).clamp(min=0).unsqueeze(1)  # (B, 1)
        paste_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        paste_ids = paste_ids.scatter(1, last, self.config.end_id).masked_fill(~mask, 0)
        cp_hidden = self._cp_input(features)
        keys = self.cp_head.keys(cp_hidden, paste_ids)  # (B, T, D)
        if self.cp_head.lookahead:
            ahead = cp_hidden.masked_fill(~mask.unsqueeze(-1), 0.0)
            for proj in self.cp_head.lookahead:  # the o-th one sees h_{j+o}; zeros past the end
                ahead = torch.cat([ahead[:, 1:], torch.zeros_like(ahead[:, :1])], dim=1)
                keys = keys + proj(ahead)
        if self.cp_head.doc_refiner is not None:
            keys = keys + self.cp_head.doc_refiner(cp_hidden, mask)
        return CopyMemory(keys=keys, ids=paste_ids, mask=mask)

    def external_scores(self, queries, end_queries, memory: CopyMemory, prev_source: torch.Tensor | None,
                        context_queries: torch.Tensor | None = None):
        """Scores of the external entries, then of their "end here" twins when enabled, with the successor bias,
        the lexical prior, the passage prior (`memory.bias`) and the key-context match.

        queries, end_queries, context_queries (B, T, D) (None when not configured); prev_source (B, T): the
        external entry the previous token was copied from, or -1.
        Returns scores (B, T, E), paste ids (B, E), allowed (B, T, E) with E = M, or 2M (continue, then end).
        """
        batch, steps = queries.shape[:2]
        keys = memory.keys.expand(batch, -1, -1)
        ids = memory.ids.expand(batch, -1)
        entry_mask = memory.mask if memory.mask is not None else torch.ones_like(memory.ids, dtype=torch.bool)
        mask = entry_mask.expand(batch, -1).unsqueeze(1).expand(-1, steps, -1)
        head = self.cp_head
        parts, part_ids = [head.scores(queries, keys)], [ids]
        if context_queries is not None:
            context = key_context(memory.keys, entry_mask, self.config.key_context)  # (B|1, M, D)
            parts[0] = parts[0] + head.scores(context_queries, context.expand(batch, -1, -1))
        if end_queries is not None:
            parts.append(head.scores(end_queries, keys))
            part_ids.append(torch.full_like(ids, self.config.end_id))
        if head.lexical is not None and memory.prior is not None:
            prior = memory.prior.to(parts[0].dtype)  # (B|1, M, F)
            weights = [head.lexical, head.lexical_end][: len(parts)]
            parts = [part + (prior @ weight).unsqueeze(1) for part, weight in zip(parts, weights, strict=True)]
        if memory.bias is not None:  # the same for an entry and its twin: only choices across passages move
            bias = memory.bias.to(parts[0].dtype).expand(batch, -1).unsqueeze(1)  # (B, 1, M)
            parts = [part + bias for part in parts]
        if head.successor is not None and prev_source is not None:
            successor = prev_source + 1
            valid = (prev_source >= 0) & (successor < memory.size)
            bump = nn.functional.one_hot(successor.clamp(0, memory.size - 1), memory.size).to(parts[0].dtype)
            bump = bump * valid.unsqueeze(-1)  # (B, T, M)
            parts = [part + weight * bump for part, weight in zip(parts, head.successor, strict=False)]
        allowed = [mask] * len(parts)
        if len(parts) == 2 and memory.end_allowed is not None:
            allowed[1] = mask & memory.end_allowed.expand(batch, -1).unsqueeze(1)
        if len(parts) == 2 and self.config.copied_span_ends == "successor" and prev_source is not None:
            # while copying, only the twin right after the last copied entry may end the span
            only = nn.functional.one_hot((prev_source + 1).clamp(0, memory.size - 1), memory.size).bool()
            copying = ((prev_source >= 0) & (prev_source + 1 < memory.size)).unsqueeze(-1)  # (B, T, 1)
            allowed[1] = allowed[1] & (only | ~copying)
        return torch.cat(parts, -1), torch.cat(part_ids, -1), torch.cat(allowed, -1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        memory: CopyMemory | None = None,
        context: ContextState | None = None,
        targets: torch.Tensor | None = None,
        target_weights: torch.Tensor | None = None,
        prev_source: torch.Tensor | None = None,
        use_cache: bool = False,
        return_log_probs: bool = True,
        position_ids: torch.Tensor | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> CPLMOutput:
        """input_ids (B, T). `targets` (B, T) is the token each position should predict, -100 where ignored.

        The copy memory is the external `memory` followed by the causal own context (past + these positions).
        `query_positions` (B, Q) limits the outputs to those absolute positions (a prefill needs only its last).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        full_mask = attention_mask if context is None else torch.cat([context.mask.long(), attention_mask], dim=1)
        hidden, features, cache = self.encode_hidden(
            input_ids, full_mask, cache=context.cache if context else None, use_cache=use_cache,
            position_ids=position_ids,
        )
        out = self.forward_hidden(hidden, input_ids, attention_mask, memory, context, targets, target_weights,
                                  prev_source, return_log_probs=return_log_probs, cp_features=features,
                                  query_positions=query_positions)
        out.context.cache = cache
        return out

    def forward_hidden(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        memory: CopyMemory | None = None,
        context: ContextState | None = None,
        targets: torch.Tensor | None = None,
        target_weights: torch.Tensor | None = None,
        prev_source: torch.Tensor | None = None,
        lm_stats: tuple[torch.Tensor, torch.Tensor] | None = None,
        return_log_probs: bool = True,
        query_positions: torch.Tensor | None = None,
        cp_features: torch.Tensor | None = None,
        copyable: torch.Tensor | None = None,
    ) -> CPLMOutput:
        """Everything after the backbone, from its final hidden states (B, T, H) and the CP head's input
        `cp_features` (B, T, C), which is the final hidden state itself unless `cp_layers` are configured.

        `lm_stats` = (logsumexp of the LM logits (B, Q), LM logit of each target (B, Q)) replaces the (B, Q, V)
        LM logits when only the loss is needed: training on cached features never builds the vocabulary matrix.
        `query_positions` (B, Q) restricts predictions (and targets, prev_source, lm_stats) to those positions,
        while every position still contributes its own-context key. `copyable` (B, T): see `context_memory`.
        """
        head = self.cp_head
        # a bf16 backbone's states enter an fp32 head as fp32 (cprag.model.runtime.place); a no-op when they agree
        hidden = hidden.to(self.head_dtype)
        cp_hidden = self._cp_input((hidden if cp_features is None else cp_features).to(self.head_dtype))
        own_keys = head.k_proj(cp_hidden)  # (B, T, D), without the paste token: it may not be known yet
        ctx_base, ctx_ids, allowed, state = self._own_context(context, own_keys, input_ids, attention_mask,
                                                              query_positions, copyable, prev_source)
        refined = self._refined(cp_hidden, context, state, query_positions)  # (B, Q, R), or None
        if query_positions is not None:
            index = (query_positions - (context.length if context is not None else 0)).unsqueeze(-1)
            hidden = hidden.gather(1, index.expand(-1, -1, hidden.shape[-1]))  # (B, Q, H)
            cp_hidden = cp_hidden.gather(1, index.expand(-1, -1, cp_hidden.shape[-1]))  # (B, Q, C)
        queries = head.queries(cp_hidden, refined)  # (B, Q, D)
        scores = head.scores(queries, head.with_paste_tokens(ctx_base, ctx_ids))  # (B, T, P+T)
        ids = ctx_ids
        if memory is not None:
            end_queries = head.end_queries(cp_hidden, refined) if head.end_q_proj is not None else None
            context_queries = head.context_q_proj(cp_hidden) if head.context_q_proj is not None else None
            ext_scores, ext_ids, ext_allowed = self.external_scores(queries, end_queries, memory, prev_source,
                                                                    context_queries)
            scores = torch.cat([ext_scores, scores], dim=-1)
            ids = torch.cat([ext_ids, ids], dim=-1)
            allowed = torch.cat([ext_allowed, allowed], dim=-1)  # (B, T, E+P+T)
        copy = copy_log_probs(scores, head.sink_scores(queries), allowed)
        copy_logit = self.copy_gate(hidden).squeeze(-1)
        ids_for_positions = ids.unsqueeze(1)  # (B, 1, E+P+T), shared by every query position

        log_p_gen_target = None
        # at inference the logits' buffer is reused for log_p_gen, then for the mixture (nothing else reads it)
        reuse_logits = not torch.is_grad_enabled()
        if lm_stats is not None:
            gate = gate_log_probs_from_stats(lm_stats[0], copy_logit)
            log_p_gen_target = lm_stats[1] - lm_stats[0]
        else:
            gate = gate_log_probs(self.lm_logits(hidden), copy_logit, in_place=reuse_logits)
        loss = target_log_probs = None
        if targets is not None:
            target_log_probs = mixture_target_log_probs(gate, copy, ids_for_positions, targets.clamp(min=0),
                                                        log_p_gen_target)
            loss = weighted_loss(target_log_probs, targets, target_weights, hidden.dtype)
        wants_log_probs = return_log_probs and lm_stats is None
        log_probs = (mixture_log_probs(gate, copy, ids_for_positions, in_place=reuse_logits)
                     if wants_log_probs else None)
        return CPLMOutput(
            loss=loss, log_probs=log_probs, log_gate=gate.log_g, copy_log_attention=copy.log_a,
            sink_log_attention=copy.log_a_sink, generator_log_weight=generator_weight_log(gate, copy),
            target_log_probs=target_log_probs, hidden_states=hidden, context=state,
        )

    def _own_context(self, context, own_keys, input_ids, attention_mask, query_positions, copyable, prev_source):
        """The own-context entries (`context_memory`) with the checkpoint's rules on where an answer may end:
        (base keys (B, P+T, D), ids (B, P+T), allowed (B, Q, P+T), the running ContextState)."""
        ctx_base, ctx_ids, allowed, state = context_memory(context, own_keys, input_ids, attention_mask.bool(),
                                                           query_positions, copyable)
        if not self.config.own_context_ends:
            allowed = allowed & (ctx_ids != self.config.end_id).unsqueeze(1)
        if self.config.copied_span_ends == "successor" and prev_source is not None:
            copying = (prev_source >= 0).unsqueeze(-1)  # (B, Q, 1)
            allowed = allowed & ~(copying & (ctx_ids == self.config.end_id).unsqueeze(1))
        return ctx_base, ctx_ids, allowed, state

    def _refined(self, cp_hidden, context, state, query_positions):
        """The query refiner's reading of the context around each query (B, Q, R), or None without one; its
        down-projected states join the running context (`state.refine`)."""
        head = self.cp_head
        if head.query_refiner is None:
            return None
        down = head.query_refiner.down(cp_hidden)  # (B, T, R)
        state.refine = down if context is None or context.refine is None else torch.cat([context.refine, down], 1)
        absolute = query_positions if query_positions is not None else \
            torch.arange(state.length - down.shape[1], state.length, device=down.device).unsqueeze(0)
        return head.query_refiner(state.refine, absolute.expand(down.shape[0], -1))

    def save_pretrained(self, save_directory, **kwargs):
        """Save the config and the stored tensors (the trained ones only, when a base backbone is referenced)."""
        kwargs.setdefault("state_dict", stored_state_dict(self))
        return super().save_pretrained(save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config: CPLMConfig | None = None, **kwargs):
        config = config or CPLMConfig.from_pretrained(pretrained_model_name_or_path)
        if config.base_model is not None:
            return load_on_base(cls, pretrained_model_name_or_path, config)
        return super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)


AutoConfig.register("cplm", CPLMConfig, exist_ok=True)
AutoModel.register(CPLMConfig, CPLMForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(CPLMConfig, CPLMForCausalLM, exist_ok=True)
