"""The Copy-Paste Language Model: a causal backbone, its tied LM head with a `<copy>` entry, and the CP head.

Math only: loading the default backbone lives in `cprag.backbone`, checkpoints in `cprag.checkpoint`.
Shapes: B batch, T new positions, P past positions, M memory entries, H hidden size, D key dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import ModelOutput

from cprag.config import CPLMConfig
from cprag.mixture import copy_log_probs, gate_log_probs, mixture_log_probs, mixture_nll


@dataclass
class CopyMemory:
    """External keys (hidden documents), each paired with the token it pastes. Leading dim B or 1 (shared)."""

    keys: torch.Tensor  # (B|1, M, D)
    ids: torch.Tensor  # (B|1, M) int64
    mask: torch.Tensor | None = None  # (B|1, M) bool, True where an entry may be attended

    @property
    def size(self) -> int:
        return self.keys.shape[1]


@dataclass
class ContextState:
    """The running context: own-context keys, the tokens seen so far, and the backbone's KV cache."""

    keys: torch.Tensor  # (B, P, D) key of each past position
    ids: torch.Tensor  # (B, P) the tokens at those positions
    mask: torch.Tensor  # (B, P) bool, False on padding
    cache: object | None = None  # transformers Cache

    @property
    def length(self) -> int:
        return self.ids.shape[1]


@dataclass
class CPLMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None  # (B, T, V) mixture log p(next token)
    log_gate: torch.Tensor | None = None  # (B, T) log g
    copy_log_attention: torch.Tensor | None = None  # (B, T, M + P + T) log a over [external ; context]
    sink_log_attention: torch.Tensor | None = None  # (B, T)
    hidden_states: torch.Tensor | None = None  # (B, T, H)
    context: ContextState | None = None


class CopyHead(nn.Module):
    """Query and key projections into a D-dim space, and a learned sink key that hands mass back to p_gen."""

    def __init__(self, hidden_size: int, key_dim: int, vocab_size: int, key_sees_token: bool = False):
        super().__init__()
        self.key_dim = key_dim
        self.q_proj = nn.Linear(hidden_size, key_dim)
        self.k_proj = nn.Linear(hidden_size, key_dim)
        self.sink_key = nn.Parameter(torch.zeros(key_dim))
        self.sink_bias = nn.Parameter(torch.zeros(()))
        # optional: a key also sees the token it would paste (zero-initialised, so it starts as a no-op)
        self.paste_embedding = nn.Embedding(vocab_size, key_dim) if key_sees_token else None

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.q_proj(hidden)  # (..., D)

    def keys(self, hidden: torch.Tensor, paste_ids: torch.Tensor) -> torch.Tensor:
        return self.with_paste_tokens(self.k_proj(hidden), paste_ids)  # (..., D)

    def with_paste_tokens(self, keys: torch.Tensor, paste_ids: torch.Tensor) -> torch.Tensor:
        if self.paste_embedding is None:
            return keys
        return keys + self.paste_embedding(paste_ids)

    def scores(self, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries (B, T, D), keys (B|1, M, D) -> memory scores (B, T, M) and sink scores (B, T)."""
        scale = 1.0 / math.sqrt(self.key_dim)
        memory = torch.matmul(queries, keys.transpose(-1, -2).to(queries.dtype)) * scale
        sink = (queries @ self.sink_key) * scale + self.sink_bias
        return memory, sink


def context_memory(
    past: ContextState | None, keys: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ContextState]:
    """Own-context memory for T new positions after P past ones.

    Entry j is the key of position j and pastes the token at j + 1, so a query at absolute position t may use
    j < t only: never itself (its next token is unknown) and never a later position.
    Returns keys (B, P+T, D), paste ids (B, P+T), allowed (B, T, P+T) and the updated state, whose keys stay
    without paste tokens because the last position's next token is not known yet.
    """
    if past is not None:
        keys = torch.cat([past.keys, keys], dim=1)
        ids = torch.cat([past.ids, ids], dim=1)
        mask = torch.cat([past.mask, mask], dim=1)
    total, new = ids.shape[1], keys.shape[1] - (past.length if past is not None else 0)
    paste_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # (B, P+T)
    query_pos = torch.arange(total - new, total, device=ids.device)  # (T,)
    causal = torch.arange(total, device=ids.device).unsqueeze(0) < query_pos.unsqueeze(1)  # (T, P+T)
    allowed = causal.unsqueeze(0) & mask.unsqueeze(1)  # (B, T, P+T)
    state = ContextState(keys=keys, ids=ids, mask=mask)
    return keys, paste_ids, allowed, state


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
            for proj in (module.q_proj, module.k_proj):
                nn.init.normal_(proj.weight, std=std)
                nn.init.zeros_(proj.bias)
            nn.init.zeros_(module.sink_key)
            nn.init.zeros_(module.sink_bias)
            if module.paste_embedding is not None:
                nn.init.zeros_(module.paste_embedding.weight)
        elif module is getattr(self, "copy_gate", None):
            # open gate at start: the <copy> logit sits near the logsumexp of the LM logits (design notes)
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, self.config.copy_bias_init)
        elif isinstance(module, nn.Linear) and self._belongs_to_cp_head(module):
            pass  # initialised with its CopyHead
        else:
            super()._init_weights(module)

    def _belongs_to_cp_head(self, module: nn.Module) -> bool:
        head = getattr(self, "cp_head", None)
        return head is not None and (module is head.q_proj or module is head.k_proj)


class CPLMForCausalLM(CPLMPreTrainedModel):
    """Backbone + tied LM head with a `<copy>` entry + CP head, trained on the NLL of the mixture."""

    def __init__(self, config: CPLMConfig, backbone: nn.Module | None = None):
        super().__init__(config)
        self.backbone = backbone if backbone is not None else AutoModel.from_config(config.backbone_config)
        self.copy_gate = nn.Linear(config.hidden_size, 1)  # the `<copy>` row of the LM head
        self.cp_head = CopyHead(config.hidden_size, config.key_dim, config.vocab_size, config.key_sees_token)
        self.post_init()
        if backbone is None:
            return
        # post_init may re-initialise what it finds; a given (pretrained) backbone must keep its weights
        self._init_weights(self.copy_gate)
        self._init_weights(self.cp_head)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.get_input_embeddings()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits from the rows tied to the input embeddings. (..., H) -> (..., V)."""
        return hidden @ self.get_input_embeddings().weight.T

    def _cp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        # the stop-gradient ablation: the CP head still trains, but its gradient never reaches the backbone
        return hidden.detach() if self.config.stop_cp_grad else hidden

    def encode_hidden(self, input_ids, attention_mask=None, cache=None, use_cache=False, position_ids=None):
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
            position_ids=position_ids,
        )
        return out.last_hidden_state, out.cache  # (B, T, H)

    def document_keys(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> CopyMemory:
        """Encode documents on their own. input_ids (B, T) -> a memory of T-1 keys per document.

        Position j's key pastes token j + 1; the last position has no next token and gives no key.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden, _ = self.encode_hidden(input_ids, attention_mask)
        paste_ids = input_ids[:, 1:]
        keys = self.cp_head.keys(self._cp_input(hidden[:, :-1]), paste_ids)  # (B, T-1, D)
        mask = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        return CopyMemory(keys=keys, ids=paste_ids, mask=mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        memory: CopyMemory | None = None,
        context: ContextState | None = None,
        targets: torch.Tensor | None = None,
        target_weights: torch.Tensor | None = None,
        use_cache: bool = False,
        return_log_probs: bool = True,
        position_ids: torch.Tensor | None = None,
    ) -> CPLMOutput:
        """input_ids (B, T). `targets` (B, T) is the token each position should predict, -100 where ignored.

        The copy memory is the external `memory` followed by the causal own context (past + these positions).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        full_mask = attention_mask if context is None else torch.cat([context.mask.long(), attention_mask], dim=1)
        hidden, cache = self.encode_hidden(
            input_ids, full_mask, cache=context.cache if context else None, use_cache=use_cache,
            position_ids=position_ids,
        )
        cp_hidden = self._cp_input(hidden)
        queries = self.cp_head.queries(cp_hidden)  # (B, T, D)
        own_keys = self.cp_head.k_proj(cp_hidden)  # (B, T, D), without the paste token: it may not be known yet
        ctx_base, ctx_ids, ctx_allowed, state = context_memory(context, own_keys, input_ids, attention_mask.bool())
        ctx_keys = self.cp_head.with_paste_tokens(ctx_base, ctx_ids)
        state.cache = cache

        batch, steps = input_ids.shape
        keys, ids, allowed = ctx_keys, ctx_ids, ctx_allowed  # ctx_ids are paste ids here
        if memory is not None:
            ext_mask = memory.mask if memory.mask is not None else torch.ones_like(memory.ids, dtype=torch.bool)
            keys = torch.cat([memory.keys.to(ctx_keys.dtype).expand(batch, -1, -1), ctx_keys], dim=1)
            ids = torch.cat([memory.ids.expand(batch, -1), ctx_ids], dim=1)
            ext_allowed = ext_mask.expand(batch, -1).unsqueeze(1).expand(-1, steps, -1)
            allowed = torch.cat([ext_allowed, ctx_allowed], dim=-1)  # (B, T, M+P+T)

        scores, sink = self.cp_head.scores(queries, keys)
        copy = copy_log_probs(scores, sink, allowed)
        gate = gate_log_probs(self.lm_logits(hidden), self.copy_gate(hidden).squeeze(-1))
        ids_for_positions = ids.unsqueeze(1)  # (B, 1, M+P+T), shared by every query position

        loss = None
        if targets is not None:
            weights = (targets != -100).to(hidden.dtype)
            if target_weights is not None:
                weights = weights * target_weights
            loss = mixture_nll(gate, copy, ids_for_positions, targets, weights)
        log_probs = mixture_log_probs(gate, copy, ids_for_positions) if return_log_probs else None
        return CPLMOutput(
            loss=loss, log_probs=log_probs, log_gate=gate.log_g, copy_log_attention=copy.log_a,
            sink_log_attention=copy.log_a_sink, hidden_states=hidden, context=state,
        )

    def save_pretrained(self, save_directory, **kwargs):
        """Save the config and the stored tensors (the trained ones only, when a base backbone is referenced)."""
        from cprag.checkpoint import stored_state_dict

        kwargs.setdefault("state_dict", stored_state_dict(self))
        return super().save_pretrained(save_directory, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config: CPLMConfig | None = None, **kwargs):
        from cprag.checkpoint import load_on_base

        config = config or CPLMConfig.from_pretrained(pretrained_model_name_or_path)
        if config.base_model is not None:
            return load_on_base(cls, pretrained_model_name_or_path, config)
        return super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)


AutoConfig.register("cplm", CPLMConfig, exist_ok=True)
AutoModel.register(CPLMConfig, CPLMForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(CPLMConfig, CPLMForCausalLM, exist_ok=True)
