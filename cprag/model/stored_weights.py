"""The tensors a CPLM checkpoint stores, and putting them back: all of them, or, for a checkpoint built on a base
backbone, only what training changed (the CP head, the `<copy>` row and `config.trained_backbone_params`).

Beside the model class (which saves and loads through it) and below `cprag.model.checkpoint`, so neither imports
the other's module back.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from cprag.errors import CheckpointError
from cprag.model.backbone import BaseReference, load_backbone
from cprag.model.config import CPLMConfig

WEIGHTS = "model.safetensors"
BACKBONE_PREFIX = "backbone."


def stored_state_dict(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must hold: all of them, or only the trained ones when a base is referenced."""
    state = model.state_dict()
    if model.config.base_model is None:
        if any(delta.merged for delta in (getattr(model, "adapters", None) or {}).values()):
            raise CheckpointError(model.config.name_or_path or "<in memory>", "its adapters are merged into "
                                  "backbone weights it would store: save it before merging")
        return state
    trained = set(model.config.trained_backbone_params)
    return {
        name: tensor for name, tensor in state.items()
        if not name.startswith(BACKBONE_PREFIX) or name[len(BACKBONE_PREFIX):] in trained
    }



def load_on_base(cls, path: str | Path, config: CPLMConfig):
    """Rebuild a base-referencing checkpoint: base backbone from its GGUF, then the stored tensors on top."""
    if not (Path(path) / WEIGHTS).is_file():
        raise CheckpointError(str(path), f"{WEIGHTS} is missing")  # before the backbone load
    backbone, _ = load_backbone(BaseReference.from_dict(config.base_model))
    model = cls(config, backbone=backbone)
    load_trained_tensors(model, path)
    return model.eval()



def load_trained_tensors(model, path: str | Path, fields: tuple[str, ...] = ()) -> None:
    """Put a base-referencing checkpoint's stored tensors (head, adapters) into `model`, whose config must
    describe the same tensors and agree on `fields`: how `cprag train --init-from` continues a finished run."""
    weights = Path(path) / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(str(path), f"{WEIGHTS} is missing")
    stored_config = CPLMConfig.from_pretrained(path)
    for field in fields:
        theirs, ours = getattr(stored_config, field, None), getattr(model.config, field, None)
        if json.dumps(theirs) != json.dumps(ours):
            raise CheckpointError(str(path), f"its {field} is {theirs!r}, this run's is {ours!r}")
    stored = load_file(weights)
    expected = stored_state_dict(model)
    if set(stored) != set(expected):
        missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
        raise CheckpointError(str(path), f"weights do not match the config (missing {missing[:3]}, extra {extra[:3]})")
    for name, tensor in stored.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(str(path), f"{name} has shape {tuple(tensor.shape)}, the config wants "
                                  f"{tuple(expected[name].shape)}")
    model.load_state_dict(stored, strict=False)

