"""The visible span reader: the backbone reads the question, then one passage, and a span head scores where the
answer starts and where it ends among the passage's tokens.

This is the extractive reader that sees the text (question first, so every passage state has read the question),
the fair baseline for hidden keys and the teacher they can be distilled from. The backbone is the CPLM's base,
with low-rank adapters of its own on `adapter_layers`; the head is one linear map per decision.

The backbone is causal, so a state at token i has not read what follows i, yet a span's end is decided by what
follows it ("Jacques Lefevre" ends before " (c. 1455"). Each position's features are therefore the states of the
position and of the `lookahead` positions after it, concatenated.

A question's passages are read one per row. Training normalises the start (and end) scores over all of a
question's rows together (shared normalisation, Clark & Gardner 2018), so scores compare across passages, which
is how the best span among k passages is chosen at question time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from cprag.model.adapters import ALL_MODULES, build_adapters

NEG = -1e4  # a masked score: far below any real one, finite so that bf16 and softmax stay well defined


@dataclass
class SpanReaderConfig:
    base_model: dict  # the BaseReference dict of the backbone (cprag.model.backbone)
    adapter_layers: list[int] = field(default_factory=lambda: list(range(12, 30)))
    adapter_rank: int = 16
    adapter_alpha: float = 32.0
    lookahead: int = 2  # each position also sees the states of this many positions after it
    max_answer_tokens: int = 30  # the longest span the reader gives
    hidden_size: int = 576

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> SpanReaderConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


class SpanHead(nn.Module):
    """Start and end scores from each position's state and the states after it."""

    def __init__(self, hidden_size: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.norm = nn.LayerNorm(hidden_size * (1 + lookahead))
        self.proj = nn.Linear(hidden_size * (1 + lookahead), 2)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, T, H) -> start scores (B, T), end scores (B, T)."""
        ahead = [F.pad(hidden[:, k:], (0, 0, 0, k)) for k in range(1, self.lookahead + 1)]  # (B, T, H) each
        features = torch.cat([hidden, *ahead], dim=-1)  # (B, T, H (1 + lookahead))
        scores = self.proj(self.norm(features))  # (B, T, 2)
        return scores[..., 0], scores[..., 1]


class SpanReader(nn.Module):
    def __init__(self, config: SpanReaderConfig, backbone: nn.Module):
        super().__init__()
        self.config = config
        self.backbone = backbone
        for parameter in self.backbone.parameters():
            parameter.requires_grad_(False)
        self.adapters = build_adapters(backbone, config.adapter_layers, list(ALL_MODULES), config.adapter_rank,
                                       config.adapter_alpha)
        self.span_head = SpanHead(config.hidden_size, config.lookahead)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a reader checkpoint stores: the adapters and the head (the backbone comes from its GGUF)."""
        return {name: tensor for name, tensor in self.state_dict().items() if not name.startswith("backbone.")}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, attention_mask (B, T) -> start, end scores (B, T), in fp32."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.span_head(hidden.float())


def shared_span_loss(start: torch.Tensor, end: torch.Tensor, candidates: torch.Tensor, gold_row: torch.Tensor,
                     gold_start: torch.Tensor, gold_end: torch.Tensor, rows_per_question: int) -> torch.Tensor:
    """Mean of the start and end cross-entropies, each normalised over all positions of a question's rows.

    start, end (Q·P, T) scores; candidates (Q·P, T) bool, the passage positions; gold_row (Q,) which of a
    question's P rows holds its answer; gold_start, gold_end (Q,) positions in that row.
    """
    rows, width = start.shape
    questions = rows // rows_per_question
    target = gold_row * width  # (Q,) the flat index of the gold row's first position
    mask = candidates.view(questions, rows_per_question * width)  # (Q, P·T)
    losses = []
    for scores, gold in ((start, gold_start), (end, gold_end)):
        flat = scores.view(questions, rows_per_question * width).masked_fill(~mask, NEG)  # (Q, P·T)
        losses.append(F.cross_entropy(flat, target + gold))
    return (losses[0] + losses[1]) / 2


def best_spans(start: torch.Tensor, end: torch.Tensor, starts_ok: torch.Tensor, ends_ok: torch.Tensor,
               max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best-scoring span of each row: start ≤ end < start + max_tokens, at allowed starts and ends.

    start, end (B, T) scores; starts_ok, ends_ok (B, T) bool. Returns (B,) score, first and last position.
    """
    rows, width = start.shape
    s = start.masked_fill(~starts_ok, NEG)  # (B, T)
    e = end.masked_fill(~ends_ok, NEG)
    best = torch.full((rows,), 2 * NEG, dtype=start.dtype, device=start.device)
    first = torch.zeros(rows, dtype=torch.long, device=start.device)
    length = torch.zeros(rows, dtype=torch.long, device=start.device)
    for d in range(min(max_tokens, width)):
        pair = s[:, : width - d] + e[:, d:]  # (B, T - d): span [i, i + d]
        value, where = pair.max(dim=-1)  # (B,)
        better = value > best
        best = torch.where(better, value, best)
        first = torch.where(better, where, first)
        length = torch.where(better, torch.full_like(length, d), length)
    return best, first, first + length
