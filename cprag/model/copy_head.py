"""The CP head and what it reads: the external memory of document keys, the running own-context memory, and
the query/key maps with their optional refiners.

Shapes: B batch, T new positions, P past positions, M memory entries, H hidden size, D key dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from cprag.model.config import CPLMConfig
from cprag.model.lexical import feature_count


@dataclass
class CopyMemory:
    """External keys (hidden documents), each paired with the token it pastes. Leading dim B or 1 (shared)."""

    keys: torch.Tensor  # (B|1, M, D)
    ids: torch.Tensor  # (B|1, M) int64
    mask: torch.Tensor | None = None  # (B|1, M) bool, True where an entry may be attended
    prior: torch.Tensor | None = None  # (B|1, M, F) query-time lexical features (cprag.model.lexical)
    end_allowed: torch.Tensor | None = None  # (B|1, M) bool: whether entry m's "end here" twin may be chosen
    bias: torch.Tensor | None = None  # (B|1, M) added to entry m's scores and its twin's (the passage prior)

    @property
    def size(self) -> int:
        return self.keys.shape[1]


@dataclass
class ContextState:
    """The running context: own-context keys, the tokens seen so far, and the backbone's KV cache."""

    keys: torch.Tensor  # (B, P, D) key of each past position, without its paste token
    ids: torch.Tensor  # (B, P) the tokens at those positions
    mask: torch.Tensor  # (B, P) bool, False on padding
    cache: object | None = None  # transformers Cache
    refine: torch.Tensor | None = None  # (B, P, R) the query refiner's input at past positions
    copyable: torch.Tensor | None = None  # (B, P) bool, False where a position may not be copied (None: all may)

    @property
    def length(self) -> int:
        return self.ids.shape[1]


class DocumentRefiner(nn.Module):
    """Bidirectional layers over a passage's hidden states, adding to its keys what comes after each token.

    Only for external memory: documents are encoded offline and whole, while own-context keys stay causal.
    """

    def __init__(self, hidden_size: int, dim: int, layers: int, key_dim: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=max(1, dim // 32), dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.up = nn.Linear(dim, key_dim)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, H), mask (B, T) bool -> key corrections (B, T, D)."""
        return self.up(self.layers(self.down(hidden), src_key_padding_mask=~mask))


class QueryRefiner(nn.Module):
    """Causal layers over the question side's CP input within a sliding window, adding to each query what the
    question said before it (the backbone's state at a position is shaped for predicting the next token)."""

    def __init__(self, hidden_size: int, dim: int, layers: int, key_dim: int, outputs: int, window: int):
        super().__init__()
        self.window = window
        self.down = nn.Linear(hidden_size, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=max(1, dim // 32), dim_feedforward=2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.up = nn.ModuleList(nn.Linear(dim, key_dim) for _ in range(outputs))  # queries, then end queries

    def forward(self, inputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """inputs (B, S, R) = `down` of every position so far (right padded), positions (B, Q) -> (B, Q, R).

        Only the window before the earliest query is run; padding sits after every real position, so the causal
        mask alone keeps it out.
        """
        low = max(0, int(positions.min()) - self.window + 1)
        inputs = inputs[:, low:]
        index = torch.arange(low, low + inputs.shape[1], device=inputs.device)
        distance = index.unsqueeze(1) - index.unsqueeze(0)  # (S, S) query minus key position
        blocked = (distance < 0) | (distance >= self.window)
        out = self.layers(inputs, mask=blocked)  # (B, S, R)
        return out.gather(1, (positions - low).unsqueeze(-1).expand(-1, -1, out.shape[-1]))


def key_context(keys: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """The mean of the attendable keys within `width` entries of each entry: keys (B|1, M, D), mask (B|1, M)
    bool -> (B|1, M, D). Entries of other passages count too where passages sit side by side (decoding)."""
    weights = mask.to(keys.dtype).unsqueeze(1)  # (B, 1, M)
    summed = nn.functional.avg_pool1d(keys.transpose(1, 2) * weights, 2 * width + 1, stride=1, padding=width,
                                      count_include_pad=False)
    counts = nn.functional.avg_pool1d(weights, 2 * width + 1, stride=1, padding=width, count_include_pad=False)
    return (summed / counts.clamp(min=1e-6)).transpose(1, 2)


def projection(inputs: int, outputs: int, mlp_dim: int) -> nn.Module:
    """A linear map, or a one-hidden-layer GELU MLP when `mlp_dim` > 0."""
    if not mlp_dim:
        return nn.Linear(inputs, outputs)
    return nn.Sequential(nn.Linear(inputs, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, outputs))


class CopyHead(nn.Module):
    """Query and key projections into a D-dim space, and a learned sink key that hands mass back to p_gen.

    Options (config): keys that see the token they paste, a bidirectional refiner for document keys, "end here"
    entries read by a second query, and a learned bias toward the successor of the last copied entry.
    """

    def __init__(self, config: CPLMConfig):
        super().__init__()
        hidden_size, key_dim = config.cp_input_size, config.key_dim
        self.key_dim = key_dim
        self.q_proj = projection(hidden_size, key_dim, config.head_mlp_dim)
        self.k_proj = projection(hidden_size, key_dim, config.head_mlp_dim)
        self.sink_key = nn.Parameter(torch.zeros(key_dim))
        self.sink_bias = nn.Parameter(torch.zeros(()))
        self.paste_embedding = nn.Embedding(config.vocab_size, key_dim) if config.key_sees_token else None
        self.end_q_proj = projection(hidden_size, key_dim, config.head_mlp_dim) if config.end_entries else None
        self.context_q_proj = projection(hidden_size, key_dim, config.head_mlp_dim) if config.key_context else None
        self.successor = nn.Parameter(torch.zeros(2)) if config.successor_bias else None  # (continue, end)
        # weights of the lexical features (cprag.model.lexical) for copy entries and for their "end here" twins
        features = feature_count(config.lexical_window_sizes, config.lexical_sentences, config.lexical_types,
                                 config.lexical_sentence_starts)
        self.lexical = nn.Parameter(torch.zeros(features)) if config.lexical_prior else None
        self.lexical_end = nn.Parameter(torch.zeros(features)) if config.lexical_prior and config.end_entries else None
        self.query_refiner = (
            QueryRefiner(hidden_size, config.query_refine_dim, config.query_refine_layers, key_dim,
                         2 if config.end_entries else 1, config.query_refine_window)
            if config.query_refine_layers else None
        )
        self.lookahead = nn.ModuleList(nn.Linear(hidden_size, key_dim) for _ in range(config.doc_lookahead))
        self.doc_refiner = (
            DocumentRefiner(hidden_size, config.doc_refine_dim, config.doc_refine_layers, key_dim)
            if config.doc_refine_layers else None
        )

    def queries(self, hidden: torch.Tensor, refined: torch.Tensor | None = None) -> torch.Tensor:
        queries = self.q_proj(hidden)  # (..., D)
        return queries if refined is None else queries + self.query_refiner.up[0](refined)

    def end_queries(self, hidden: torch.Tensor, refined: torch.Tensor | None = None) -> torch.Tensor:
        queries = self.end_q_proj(hidden)  # (..., D)
        return queries if refined is None else queries + self.query_refiner.up[1](refined)

    def keys(self, hidden: torch.Tensor, paste_ids: torch.Tensor) -> torch.Tensor:
        return self.with_paste_tokens(self.k_proj(hidden), paste_ids)  # (..., D)

    def with_paste_tokens(self, keys: torch.Tensor, paste_ids: torch.Tensor) -> torch.Tensor:
        if self.paste_embedding is None:
            return keys
        return keys + self.paste_embedding(paste_ids)

    def scores(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """queries (B, T, D), keys (B|1, M, D) -> scores (B, T, M)."""
        return torch.matmul(queries, keys.transpose(-1, -2).to(queries.dtype)) / math.sqrt(self.key_dim)

    def sink_scores(self, queries: torch.Tensor) -> torch.Tensor:
        return (queries @ self.sink_key) / math.sqrt(self.key_dim) + self.sink_bias  # (B, T)


def context_memory(
    past: ContextState | None, keys: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
    query_positions: torch.Tensor | None = None, copyable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ContextState]:
    """Own-context memory for T new positions after P past ones.

    Entry j is the key of position j and pastes the token at j + 1, so a query at absolute position t may use
    j < t only: never itself (its next token is unknown) and never a later position.
    `copyable` (B, T) bars new positions from being copied while the backbone still attends to them (a visible
    prompt's passages, which are copied through their memory entries instead); past positions keep theirs.
    Returns keys (B, P+T, D), paste ids (B, P+T), allowed (B, Q, P+T) and the updated state, whose keys stay
    without paste tokens because the last position's next token is not known yet. Queries are the T new
    positions, or the absolute `query_positions` (B, Q) when only some of them are needed (training).
    """
    barred = copyable is not None or (past is not None and past.copyable is not None)
    if barred:
        copyable = copyable if copyable is not None else torch.ones_like(mask)
        if past is not None:
            copyable = torch.cat([past.copyable if past.copyable is not None else torch.ones_like(past.mask),
                                  copyable], dim=1)
    if past is not None:
        keys = torch.cat([past.keys, keys], dim=1)
        ids = torch.cat([past.ids, ids], dim=1)
        mask = torch.cat([past.mask, mask], dim=1)
    total, new = ids.shape[1], keys.shape[1] - (past.length if past is not None else 0)
    paste_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # (B, P+T)
    if query_positions is None:
        query_positions = torch.arange(total - new, total, device=ids.device).unsqueeze(0)  # (1, T)
    causal = torch.arange(total, device=ids.device) < query_positions.unsqueeze(-1)  # (B|1, Q, P+T)
    allowed = causal & (mask & copyable if barred else mask).unsqueeze(1)  # (B, Q, P+T)
    state = ContextState(keys=keys, ids=ids, mask=mask, copyable=copyable if barred else None)
    return keys, paste_ids, allowed, state


