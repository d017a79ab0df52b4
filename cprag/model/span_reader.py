"""The span reader: a reader that sees the passage, split so that its lower blocks read question and passage apart.

Blocks below `split_layer` run on the question's prompt alone and on each passage alone ([BOS] + its tokens, as
`cprag index` encodes it). Those states are exactly what the training activation cache holds
(`cprag.training.activations`), so training never runs the lower blocks. At the split the two join:

    [question prompt ; passage tokens ; null]  ->  blocks split..L-1 (own low-rank adapters)  ->  norm  ->  span head

The joined row is causal with the question first, so every passage state from the split up has read the question.
With `passage_attention = "both"` the passage's states also read one another both ways in the upper blocks (the
question stays causal and never reads the passage): a start is decided by what follows it, and nothing but the
causal mask the backbone was pretrained with keeps a passage position from reading it. Positions are renumbered
0..m+n for the joined row (rotary positions are applied inside attention; the cached states carry none). The last
position is a learned `null` state: it has read both sides, and its start and end scores are the no-answer output,
normalised together with the spans' (as BERT's on SQuAD 2.0).

Under the causal mask a state at token i has not read what follows i, yet a span's end is decided by what
follows it. The span head therefore reads each position's state with the states of the `lookahead` positions
after it (within the same joined row).

A question's rows (one per passage window) are normalised together (shared normalisation, Clark & Gardner 2018),
so raw scores compare across passages; the rows' null scores enter that normalisation as one entry, their
log-mean-exp, so that reading more passages does not by itself make "no answer" likelier.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from cprag.errors import ConfigError
from cprag.model.adapters import ALL_MODULES, build_adapters
from cprag.model.blocks import run_blocks
from cprag.model.depth import split_layer

PASSAGE_ATTENTION = ("causal", "both")
NEG = -1e4  # a masked score: far below any real one, finite so that bf16 and softmax stay well defined


@dataclass
class SpanReaderConfig:
    base_model: dict  # the BaseReference dict of the backbone (cprag.model.backbone)
    num_layers: int  # the backbone's depth
    hidden_size: int
    split_layer: int | None = None  # None: 60% of the depth (cprag.model.depth: 18 of 30)
    adapter_rank: int = 16
    adapter_alpha: float = 32.0
    lookahead: int = 2  # each position also sees the states of this many positions after it
    max_answer_tokens: int = 30  # the longest span the reader gives
    passage_attention: str = "causal"  # "both": passage positions read the whole passage in the upper blocks

    def __post_init__(self):
        if self.passage_attention not in PASSAGE_ATTENTION:
            raise ConfigError("passage_attention", self.passage_attention,
                              f"must be one of {', '.join(PASSAGE_ATTENTION)}")
        if self.split_layer is None:
            self.split_layer = split_layer(self.num_layers)
        if not 0 < self.split_layer < self.num_layers:
            raise ConfigError("split_layer", self.split_layer, f"must lie inside the backbone's {self.num_layers} "
                              "blocks")

    @property
    def adapter_layers(self) -> list[int]:
        return list(range(self.split_layer, self.num_layers))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> SpanReaderConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class JoinedRows:
    """Joined sequences packed into rows: what `SpanReader.top` reads and what its scores are indexed by."""

    hidden: torch.Tensor  # (R, T, H) states entering the split
    positions: torch.Tensor  # (R, T) position ids, restarting at 0 for each joined sequence
    ahead: torch.Tensor  # (R, T, lookahead) flat index (row * T + column) of each position's lookahead states,
    # R * T (a zero state) past the end of its own sequence
    places: list[tuple[int, int, int, int]]  # per sequence: (row, first column, question length, passage length)
    mask: torch.Tensor | None = None  # (R, 1, T, T) True where a position reads another; None: causal per sequence


def pack_joined(pairs: list[tuple[torch.Tensor, torch.Tensor]], null: torch.Tensor, lookahead: int,
                row_tokens: int, passage_both_ways: bool = False) -> JoinedRows:
    """Pack [question ; passage ; null] sequences into rows of about `row_tokens` (first fit, longest first).

    pairs: (question states (m, H), passage states (n, H)) per sequence; null (H,). With `passage_both_ways` the
    rows carry a mask in which each passage's positions read all of that passage (causal everywhere else)."""
    lengths = [len(q) + len(p) + 1 for q, p in pairs]
    rows: list[int] = []  # tokens used per row
    placed: list[tuple[int, int]] = [(0, 0)] * len(pairs)
    for index in sorted(range(len(pairs)), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(rows) if used + lengths[index] <= row_tokens), None)
        if row is None:
            rows.append(0)
            row = len(rows) - 1
        placed[index] = (row, rows[row])
        rows[row] += lengths[index]
    width = max(rows)
    dtype = pairs[0][0].dtype
    hidden = torch.zeros(len(rows), width, null.shape[-1], dtype=dtype, device=null.device)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    ahead = torch.full((len(rows), width, lookahead), len(rows) * width, dtype=torch.long)
    places = []
    for (q, p), (row, first), n in zip(pairs, placed, lengths, strict=True):
        hidden[row, first: first + len(q)] = q
        hidden[row, first + len(q): first + n - 1] = p
        hidden[row, first + n - 1] = null.to(dtype)
        positions[row, first: first + n] = torch.arange(n)
        for k in range(1, lookahead + 1):
            own = torch.arange(first + k, first + n)  # lookahead k stays inside the sequence
            ahead[row, first: first + n - k, k - 1] = row * width + own
        places.append((row, first, len(q), len(p)))
    for row, used in enumerate(rows):  # row padding: one more sequence of its own
        positions[row, used:] = torch.arange(width - used)
    mask = _both_ways_mask(places, positions) if passage_both_ways else None
    return JoinedRows(hidden, positions, ahead, places, mask)


def _both_ways_mask(places: list[tuple[int, int, int, int]], positions: torch.Tensor) -> torch.Tensor:
    """(R, 1, T, T): causal within each packed sequence (a sequence starts where its position is 0), and each
    passage's block read both ways."""
    starts = (positions == 0).long().cumsum(-1)  # (R, T) which packed sequence a column belongs to
    same = starts[:, :, None] == starts[:, None, :]  # (R, T, T)
    mask = same & torch.ones_like(same[0]).tril()  # (R, T, T)
    for row, first, m, n in places:
        mask[row, first + m: first + m + n, first + m: first + m + n] = True
    return mask[:, None]


class SpanHead(nn.Module):
    """Start and end scores from each position's state and the states after it."""

    def __init__(self, hidden_size: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.norm = nn.LayerNorm(hidden_size * (1 + lookahead))
        self.proj = nn.Linear(hidden_size * (1 + lookahead), 2)

    def forward(self, hidden: torch.Tensor, ahead: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (R, T, H); ahead (R, T, lookahead) flat indices (R·T: zeros) -> start, end scores (R, T)."""
        rows, width, size = hidden.shape
        flat = torch.cat([hidden.reshape(rows * width, size), hidden.new_zeros(1, size)])  # (R·T + 1, H)
        following = flat[ahead.reshape(-1)].reshape(rows, width, self.lookahead * size)  # (R, T, H·lookahead)
        scores = self.proj(self.norm(torch.cat([hidden, following], dim=-1)))  # (R, T, 2)
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
        # the no-answer position's state at the split, at the scale of the states there
        self.null = nn.Parameter(torch.randn(config.hidden_size) / math.sqrt(config.hidden_size))
        self.span_head = SpanHead(config.hidden_size, config.lookahead)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a reader checkpoint stores: the adapters, the null state and the head (the backbone is the base's)."""
        return {name: tensor for name, tensor in self.state_dict().items() if not name.startswith("backbone.")}

    def bottom(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids of sequences read alone -> the states entering the split (B, T, H)."""
        hidden = self.backbone.embed_tokens(input_ids)
        hidden, _ = run_blocks(self.backbone, hidden, attention_mask, 0, self.config.split_layer)
        return hidden

    def pack(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], row_tokens: int) -> JoinedRows:
        """`pack_joined` with this reader's null state, lookahead and passage attention."""
        return pack_joined(pairs, self.null, self.config.lookahead, row_tokens,
                           self.config.passage_attention == "both")

    def top(self, joined: JoinedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Joined rows -> start, end scores (R, T) in fp32, from blocks split..L-1, the final norm and the head."""
        mask = None if joined.mask is None else joined.mask.to(joined.hidden.device)
        hidden, _ = run_blocks(self.backbone, joined.hidden, None, self.config.split_layer, self.config.num_layers,
                               position_ids=joined.positions.to(joined.hidden.device), mask=mask)
        hidden = self.backbone.norm(hidden).float()
        return self.span_head(hidden, joined.ahead.to(hidden.device))


def question_scores(start: torch.Tensor, end: torch.Tensor, joined: JoinedRows, sequences: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One question's start and end logits over its sequences' passage positions, then its null entry
    (log-mean-exp of the sequences' null scores): two (N + 1,) tensors, passages in `sequences` order."""
    starts, ends, null_starts, null_ends = [], [], [], []
    for s in sequences:
        row, first, m, n = joined.places[s]
        starts.append(start[row, first + m: first + m + n])
        ends.append(end[row, first + m: first + m + n])
        null_starts.append(start[row, first + m + n])
        null_ends.append(end[row, first + m + n])
    log_count = math.log(len(sequences))
    null_start = torch.logsumexp(torch.stack(null_starts), 0) - log_count
    null_end = torch.logsumexp(torch.stack(null_ends), 0) - log_count
    return torch.cat([*starts, null_start[None]]), torch.cat([*ends, null_end[None]])


def span_loss(start: torch.Tensor, end: torch.Tensor, start_ok: torch.Tensor, end_ok: torch.Tensor,
              gold_start: int | None, gold_end: int | None) -> torch.Tensor:
    """Mean of the start and end cross-entropies of one question over its (N + 1,) logits (the last is null);
    positions that cannot start (end) a span are masked. An unanswerable question's target is null."""
    losses = []
    for scores, ok, gold in ((start, start_ok, gold_start), (end, end_ok, gold_end)):
        masked = scores.masked_fill(~ok, NEG)
        target = len(scores) - 1 if gold is None else gold
        losses.append(torch.logsumexp(masked, 0) - masked[target])
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
