"""The answer verifier's head: a standardised logistic regression over the backbone's states.

After hidden mode has chosen a span, the backbone reads one short prompt, "Context: <the sentence the span was
copied from> / Question: <q> / Is the answer in the context?" (`cprag.decoding.verify`). Its states at the last
token, at a few blocks and after the final norm, are concatenated, standardised, and scored:

    z = (x - mean) / scale                          x: (N, F) states, F = (len(layers) + 1) · hidden_size
    p(answerable) = sigmoid(z · weight + bias)      (N,)

Below `threshold` the answer is withheld, unless the copy path's confidence in it is at least `keep_confidence`
(`withholds`). The head ships beside a checkpoint as `verifier.json`; the weights it
reads are the checkpoint's own backbone (adapters merged), so a verifier fitted for one checkpoint says so when
given another (`fits`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cprag.model.sidecar import load_sidecar, save_sidecar

VERIFIER_FILE = "verifier.json"
FORMAT_VERSION = 1
PROMPT_TEMPLATE = "Context: {sentence}\nQuestion: {question}\nIs the answer in the context?"


@dataclass
class AnswerVerifier:
    layers: list[int]  # hidden-state indices read besides the final norm's output (0 is the embeddings)
    hidden_size: int
    mean: list[float]  # (F,) of the training states
    scale: list[float]  # (F,) their standard deviations (plus a small floor)
    weight: list[float]  # (F,) over the standardised states
    bias: float
    threshold: float  # answers with p(answerable) below this are withheld...
    # ...unless the copy path is this confident in them (its first-token probability; above 1: never kept). On
    # real documents the confidence tells right answers from wrong ones and the verifier barely does (eval/levers.md)
    keep_confidence: float = 2.0
    prompt: str = PROMPT_TEMPLATE
    max_tokens: int = 256  # the prompt is cut to this many tokens (a run-on "sentence" stays cheap)
    fingerprint: str = ""  # the model fingerprint of the checkpoint whose states it reads ("" : not recorded)
    fitted_on: str = ""  # the training pairs and the threshold's rule, in words

    def __post_init__(self):
        features = (len(self.layers) + 1) * self.hidden_size
        if not len(self.mean) == len(self.scale) == len(self.weight) == features:
            raise ValueError(f"verifier head of {len(self.weight)} weights does not read {features} features")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"verifier threshold {self.threshold} is not a probability")

    @property
    def features(self) -> int:
        return len(self.weight)

    def fits(self, model_config) -> bool:
        """Whether the checkpoint's backbone gives the states this head reads."""
        blocks = model_config.backbone_config.num_hidden_layers
        return self.hidden_size == model_config.hidden_size and all(0 <= layer <= blocks for layer in self.layers)

    def withholds(self, probability: float, confidence: float | None) -> bool:
        """Whether an answer with this p(answerable) and copy-path confidence is withheld."""
        return probability < self.threshold and (confidence is None or confidence < self.keep_confidence)

    def probability(self, states: torch.Tensor) -> torch.Tensor:
        """(N, F) states → (N,) p(answerable), in float32 whatever the model's dtype."""
        mean, scale, weight = (torch.tensor(v, dtype=torch.float32, device=states.device)
                               for v in (self.mean, self.scale, self.weight))
        z = (states.float() - mean) / scale  # (N, F)
        return torch.sigmoid(z @ weight + self.bias)  # (N,)

    def save(self, directory: str | Path) -> Path:
        return save_sidecar(Path(directory) / VERIFIER_FILE, FORMAT_VERSION, asdict(self))

    @classmethod
    def load(cls, directory: str | Path) -> AnswerVerifier | None:
        """The verifier saved in a checkpoint directory, or None when it has none."""
        values = load_sidecar(Path(directory) / VERIFIER_FILE, FORMAT_VERSION, "verifier")
        return None if values is None else cls(**values)

