"""The passage prior: the retriever's opinion of each passage, added to the copy scores of its entries.

The CP head ranks every entry of every passage in memory by itself; the retriever has already scored each
passage against the question (cosine similarity of sentence embeddings). Adding `weight · (s_p - max_q s_q)` to
the scores of passage p's entries (and of their "end here" twins, so choices inside a passage do not move) is the
usual retriever-reader fusion, here as a log-prior over passages: the best passage keeps its scores, the others are
pushed down by how much less similar they are. The weight is a property of a checkpoint, fitted on training-file
questions it never trained on (`eval/passage-prior/`), and saved beside it as `passage_prior.json`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.errors import ConfigError
from cprag.model.sidecar import load_sidecar, save_sidecar

PASSAGE_PRIOR_FILE = "passage_prior.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class PassagePrior:
    weight: float  # nats per unit of cosine similarity below the best passage's
    similarity: str = "cosine of all-MiniLM-L6-v2 embeddings (the index's retriever)"
    fitted_on: str = ""  # what chose the weight, in words

    def __post_init__(self):
        check_weight(self.weight)

    def save(self, directory: str | Path) -> Path:
        return save_sidecar(Path(directory) / PASSAGE_PRIOR_FILE, FORMAT_VERSION, asdict(self), indent=1)

    @classmethod
    def load(cls, directory: str | Path) -> PassagePrior | None:
        """The prior saved in a checkpoint directory, or None when it has none."""
        values = load_sidecar(Path(directory) / PASSAGE_PRIOR_FILE, FORMAT_VERSION, "passage-prior")
        return None if values is None else cls(**values)


def check_weight(weight: float) -> float:
    """The weight as a float, or ConfigError naming --passage-prior (negative or NaN)."""
    if not weight >= 0:  # also refuses NaN
        raise ConfigError("--passage-prior", weight, "must be at least 0 (0 turns the prior off)")
    return float(weight)


def passage_bias(scores: Sequence[float] | None, sizes: Sequence[int], weight: float,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """(1, M) bias of every memory entry: `weight · (s_p - max s)` for each of passage p's `sizes[p]` entries.
    None (no bias) without scores or at weight 0, so the answer is then exactly the unbiased one."""
    if scores is None or weight == 0 or not sizes:
        return None
    if len(scores) != len(sizes):
        raise ValueError(f"{len(scores)} passage scores for {len(sizes)} passages")
    relative = torch.tensor(scores, dtype=torch.float32) - max(scores)
    return (weight * relative).repeat_interleave(torch.tensor(list(sizes))).unsqueeze(0).to(device, dtype)
