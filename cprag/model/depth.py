"""Where things sit in a backbone, as fractions of its depth, so one recipe fits any number of blocks.

SmolLM2-135M has 30 blocks, and the recipe was worked out there: the CP head reads the states entering blocks 8, 16
and 24 beside the final one, adapters train blocks 18-29, and blocks 0-17 are frozen and cached (the span reader
joins question and passage at block 18 too). The same fractions place them on a backbone of any depth.
"""

from __future__ import annotations

AUTO = "auto"  # a head setting resolved against the backbone's depth when the model is built
SPLIT_FRACTION = 0.6  # below it, frozen blocks read each sequence alone (and are cached); above it, adapters train
CP_LAYER_FRACTIONS = (4 / 15, 8 / 15, 4 / 5)  # middle-layer states the CP head reads beside the final one


def split_layer(depth: int) -> int:
    """The first trained block: 60% of the depth (18 of 30), at least 1 and below the last block when there is
    room for both sides."""
    return min(max(round(SPLIT_FRACTION * depth), 1), max(depth - 1, 1))


def cp_layers(depth: int) -> list[int]:
    """Hidden-state indices (0 = embeddings) the CP head reads beside the final state: [8, 16, 24] of 30."""
    return sorted({min(max(round(f * depth), 1), depth) for f in CP_LAYER_FRACTIONS})


def top_blocks(depth: int) -> list[int]:
    """The blocks adapters train by default: the split and every block above it (18-29 of 30)."""
    return list(range(split_layer(depth), depth))


def resolve_head(head: dict, depth: int) -> dict:
    """`head` with its "auto" layer settings placed on a backbone of `depth` blocks (other values unchanged)."""
    resolved = dict(head)
    if resolved.get("cp_layers") == AUTO:
        resolved["cp_layers"] = cp_layers(depth)
    if resolved.get("adapter_layers") == AUTO:
        resolved["adapter_layers"] = top_blocks(depth)
    return resolved
