"""Training settings: a plain dataclass (no torch import), validated where it is built, naming the CLI flag."""

from __future__ import annotations

from dataclasses import dataclass, field

from cprag.errors import ConfigError


@dataclass
class TrainConfig:
    epochs: float = 6.0
    lr: float = 2e-3
    weight_decay: float = 0.01
    # scalars (successor bias, sink bias, the <copy> bias) must travel several nats, and Adam moves a parameter
    # by about lr per step: they get lr times this
    scalar_lr_scale: float = 50.0
    batch_size: int = 16
    distractors: int = 4
    end_weight: float = 3.0
    seed: int = 0
    validation_fraction: float = 0.2
    save_every: int = 100
    max_steps: int | None = None
    # "hidden": passages as keys, the backbone reads the question (features cached once). "visible": passages in
    # the prompt and the CP head over its own context; the frozen backbone runs every batch (slow on CPU)
    form: str = "hidden"
    head: dict = field(default_factory=lambda: {
        "key_dim": 64, "key_sees_token": False, "doc_refine_layers": 1, "doc_refine_dim": 128,
        "end_entries": True, "successor_bias": True, "cp_layers": [8, 16, 24], "doc_lookahead": 0,
        "lexical_prior": True, "lexical_windows": [3, 12, 40], "lexical_sentences": True, "lexical_types": True,
        "copied_span_ends": "successor",
    })

    def __post_init__(self):
        checks = [("--epochs", self.epochs, self.epochs > 0), ("--lr", self.lr, self.lr > 0),
                  ("--scalar-lr-scale", self.scalar_lr_scale, self.scalar_lr_scale > 0),
                  ("--batch-size", self.batch_size, self.batch_size >= 1),
                  ("--distractors", self.distractors, self.distractors >= 0),
                  ("--end-weight", self.end_weight, self.end_weight > 0),
                  ("--validation-fraction", self.validation_fraction, 0 < self.validation_fraction < 1)]
        checks.append(("--form", self.form, self.form in ("hidden", "visible")))
        for flag, value, ok in checks:
            if not ok:
                raise ConfigError(flag, value, "out of range")
