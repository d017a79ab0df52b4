"""Training settings: a plain dataclass (no torch import), validated where it is built, naming the CLI flag."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cprag.errors import ConfigError
from cprag.model.cpu_features import fastest_dtype
from cprag.model.depth import AUTO, resolve_head, split_layer

DTYPES = ("bfloat16", "float32")


@dataclass
class TrainConfig:
    epochs: float = 1.0
    lr: float = 2e-3
    # the adapters on the top backbone blocks: a smaller step than the freshly initialised head
    adapter_lr: float = 5e-4
    weight_decay: float = 0.01
    # scalars (successor bias, sink bias, the <copy> bias) must travel several nats, and Adam moves a parameter
    # by about lr per step: they get lr times this
    scalar_lr_scale: float = 50.0
    batch_size: int = 32
    distractors: int = 4
    end_weight: float = 3.0
    # weight of the position-exact pointer loss (-log attention on the entry each answer token comes from)
    pointer_weight: float = 1.0
    # distillation (cprag.training.distill): a file of the split reader's start distributions over the training
    # questions' gold passages (pipelines/reader_targets.py), and the weight of KL(reader start ‖ copy start)
    reader_targets: str | None = None
    distill_weight: float = 0.0
    # share of training questions asked with a memory that lacks their gold passage: stop at once, copy nothing
    no_answer_fraction: float = 0.2
    # share of those no-answer questions that see their own passage with the answer's sentences hidden (plus the
    # usual distractors) instead of distractors alone: passages about the question that do not answer it
    no_answer_in_passage: float = 0.0
    # a SQuAD 2.0 file of unanswerable questions over the training file's own paragraphs
    # (pipelines/squad_negatives.py): each is asked with its passage in memory and trained to stop at once
    negatives: str | None = None
    seed: int = 0
    # validation articles carved from the training file, when no separate validation file is given
    validation_fraction: float = 0.2
    save_every: int = 100
    max_steps: int | None = None
    # use only a seeded sample of this many training questions (the training-set size lever)
    max_questions: int | None = None
    # blocks below this one are frozen and cached once (cprag.training.activations); adapters must sit at or above it.
    # None: the first adapted block, or 60% of the backbone's depth without adapters (18 of SmolLM2-135M's 30)
    cache_layer: int | None = None
    # what the training steps and the activation cache compute in: bf16 autocast or fp32; "auto" (the default)
    # is bf16 where the CPU has bf16 units and fp32 where it would emulate them (cprag.model.cpu_features), and the
    # config records which; the cache keeps float16 either way
    dtype: str = "auto"
    cache_dtype: str = "auto"
    # where the cache is built and the steps run: "cpu", or "cuda" / "cuda:N" (bf16 there when dtype is "auto")
    device: str = "cpu"
    # every `visible_every` steps (0: never), `visible_batch` questions also train the visible form: passages in
    # the prompt, copied from their prompt keys as visible decoding does (the frozen blocks run for each)
    visible_every: int = 8
    visible_batch: int = 2
    # continue a finished run: start from the trained tensors of this checkpoint directory (same head config),
    # and skip the first `skip_steps` batches of the seeded epoch order, the ones that run already trained on;
    # the learning-rate schedule (warm-up, then annealing) covers the steps that remain
    init_from: str | None = None
    skip_steps: int = 0
    head: dict = field(default_factory=lambda: {
        "key_dim": 64, "key_sees_token": False, "doc_refine_layers": 1, "doc_refine_dim": 128,
        "end_entries": True, "successor_bias": True, "doc_lookahead": 2,
        "lexical_prior": True, "lexical_windows": [3, 12, 40], "lexical_sentences": True, "lexical_types": True,
        "copied_span_ends": "successor", "adapter_rank": 16,
        # placed by the backbone's depth (cprag.model.depth): layers 8, 16, 24 and blocks 18-29 of 30
        "cp_layers": AUTO, "adapter_layers": AUTO,
    })

    def __post_init__(self):
        fastest = fastest_dtype(self.device)
        self.dtype = fastest if self.dtype == "auto" else self.dtype
        self.cache_dtype = fastest if self.cache_dtype == "auto" else self.cache_dtype
        checks = [("--epochs", self.epochs, self.epochs > 0), ("--lr", self.lr, self.lr > 0),
                  ("--adapter-lr", self.adapter_lr, self.adapter_lr >= 0),
                  ("--scalar-lr-scale", self.scalar_lr_scale, self.scalar_lr_scale > 0),
                  ("--batch-size", self.batch_size, self.batch_size >= 1),
                  ("--distractors", self.distractors, self.distractors >= 0),
                  ("--end-weight", self.end_weight, self.end_weight > 0),
                  ("--pointer-weight", self.pointer_weight, self.pointer_weight >= 0),
                  ("--distill-weight", self.distill_weight, self.distill_weight >= 0),
                  ("--no-answer-fraction", self.no_answer_fraction, 0 <= self.no_answer_fraction < 1),
                  ("--no-answer-in-passage", self.no_answer_in_passage, 0 <= self.no_answer_in_passage <= 1),
                  ("--validation-fraction", self.validation_fraction, 0 < self.validation_fraction < 1),
                  ("--max-steps", self.max_steps, self.max_steps is None or self.max_steps >= 1),
                  ("--max-questions", self.max_questions, self.max_questions is None or self.max_questions >= 1),
                  ("--cache-layer", self.cache_layer, self.cache_layer is None or self.cache_layer >= 0),
                  ("--dtype", self.dtype, self.dtype in DTYPES),
                  ("--cache-dtype", self.cache_dtype, self.cache_dtype in DTYPES),
                  ("--device", self.device, self.device == "cpu" or self.device.split(":")[0] == "cuda"),
                  ("--visible-every", self.visible_every, self.visible_every >= 0),
                  ("--visible-batch", self.visible_batch, self.visible_batch >= 1),
                  ("--skip-steps", self.skip_steps, self.skip_steps >= 0),
                  ("--document-attention", self.head.get("document_attention", "causal"),
                   self.head.get("document_attention", "causal") in ("causal", "both"))]
        for flag, value, ok in checks:
            if not ok:
                raise ConfigError(flag, value, "out of range")
        if self.skip_steps and not self.init_from:
            raise ConfigError("--skip-steps", self.skip_steps, "needs --init-from: the steps skipped are the ones "
                              "that checkpoint was trained on")
        if self.distill_weight and not self.reader_targets:
            raise ConfigError("--distill-weight", self.distill_weight, "needs --reader-targets: the reader's "
                              "start distributions it distils")
        adapted = self.head.get("adapter_layers")
        if self.cache_layer is not None and isinstance(adapted, list) and adapted and min(adapted) < self.cache_layer:
            raise ConfigError("--cache-layer", self.cache_layer, f"adapters on blocks {adapted} sit below it: the "
                              "cache may only replace frozen blocks")

    def for_depth(self, depth: int) -> TrainConfig:
        """This config placed on a backbone of `depth` blocks: "auto" layers and the cache layer filled in, as the
        run records them."""
        head = dict(self.head)
        if head.get("adapter_layers") == AUTO and self.cache_layer is not None:  # train every block above the cache
            head["adapter_layers"] = list(range(self.cache_layer, depth))
        head = resolve_head(head, depth)
        adapted = head.get("adapter_layers") or []
        cache_layer = self.cache_layer
        if cache_layer is None:
            cache_layer = min(adapted) if adapted else split_layer(depth)
        outside = [i for i in adapted if not 0 <= i < depth]
        if outside:
            raise ConfigError("--adapter-layers", outside, f"the backbone has {depth} blocks (0-{depth - 1})")
        if not 0 <= cache_layer < depth:
            raise ConfigError("--cache-layer", cache_layer, f"the backbone has {depth} blocks (0-{depth - 1})")
        return replace(self, head=head, cache_layer=cache_layer)
