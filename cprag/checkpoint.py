"""Saving and loading CPLM checkpoints, building a fresh CPLM on a base backbone, and model fingerprints.

A checkpoint built on a base backbone (config.base_model set) stores only what training changed: the CP head,
the `<copy>` row and the backbone tensors listed in `config.trained_backbone_params`. Everything else is read
from the base GGUF, whose sha256 the config records, so a 30 MB checkpoint stands for a 540 MB model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from cprag.adapters import merge
from cprag.backbone import BaseReference, default_reference, load_backbone
from cprag.config import CPLMConfig
from cprag.errors import CheckpointError

WEIGHTS = "model.safetensors"
BACKBONE_PREFIX = "backbone."


def new_cplm(ref: BaseReference | None = None, **config_overrides):
    """A CPLM with a freshly initialised CP head on a base backbone (the default GGUF when ref is None).

    Returns (model, tokenizer).
    """
    from cprag.model import CPLMForCausalLM

    ref = ref or default_reference()
    backbone, tokenizer = load_backbone(ref)
    config = CPLMConfig(backbone_config=backbone.config.to_dict(), base_model=ref.to_dict(), **config_overrides)
    return CPLMForCausalLM(config, backbone=backbone).eval(), tokenizer


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


def load_tokenizer(model):
    """The tokenizer that belongs to a CPLM: the base backbone's (converted once, then cached)."""
    if model.config.base_model is None:
        raise CheckpointError(model.config.name_or_path or "<in memory>", "no base backbone, hence no tokenizer")
    _, tokenizer = load_backbone(BaseReference.from_dict(model.config.base_model))
    return tokenizer


def model_fingerprint(model) -> str:
    """sha256 over the base GGUF's digest and every tensor a checkpoint stores: equal fingerprints, equal keys."""
    digest = hashlib.sha256()
    config = model.config
    digest.update(json.dumps(config.base_model or {}, sort_keys=True).encode())
    digest.update(json.dumps({"key_dim": config.key_dim, "key_sees_token": config.key_sees_token}).encode())
    for name, tensor in sorted(stored_state_dict(model).items()):
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


DEFAULT_CHECKPOINT = Path(__file__).parent / "checkpoints" / "default"
HEAD_SEED = 0


def load_model(path: str | Path | None = None, device: str | None = None):
    """(model, tokenizer) for inference from a checkpoint directory; with no path, the shipped default checkpoint,
    or a fresh CP head (seeded, so every process builds the same one) on the default backbone when none ships
    yet. Adapters are merged into the backbone weights (see cprag.adapters.merge)."""
    from cprag.model import CPLMForCausalLM

    if path is None and (DEFAULT_CHECKPOINT / "config.json").is_file():
        path = DEFAULT_CHECKPOINT
    if path is None:
        torch.manual_seed(HEAD_SEED)
        model, tokenizer = new_cplm()
    else:
        if not (Path(path) / "config.json").is_file():
            raise CheckpointError(str(path), "no config.json: not a CPLM checkpoint directory")
        model = CPLMForCausalLM.from_pretrained(path)
        tokenizer = load_tokenizer(model)
    if model.adapters is not None:
        merge(model.backbone, model.adapters)  # inference: no extra matmuls per step; stored tensors unchanged
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def held_out_articles(path: str | Path | None = None) -> list[str]:
    """The SQuAD articles a checkpoint's training held out for validation (from its train_config.json)."""
    directory = Path(path) if path is not None else DEFAULT_CHECKPOINT
    try:
        articles = json.loads((directory / "train_config.json").read_text())["validation_articles"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(str(directory), "no train_config.json naming its validation articles") from None
    return list(articles)
