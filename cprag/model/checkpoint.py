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

from cprag.errors import CheckpointError
from cprag.model.adapters import merge
from cprag.model.backbone import BaseReference, as_reference, load_backbone
from cprag.model.config import CPLMConfig
from cprag.model.cplm import CPLMForCausalLM
from cprag.model.depth import resolve_head
from cprag.model.stored_weights import stored_state_dict


def new_cplm(ref: BaseReference | str | None = None, **config_overrides):
    """A CPLM with a freshly initialised CP head on a base backbone: a reference, or what `--backbone` takes (a
    GGUF file, a model folder, a Hugging Face model id); the default GGUF when None. `cp_layers` and
    `adapter_layers` may be "auto": placed by the backbone's depth (cprag.model.depth).

    Returns (model, tokenizer).
    """
    ref = as_reference(ref)
    backbone, tokenizer = load_backbone(ref)
    return cplm_on(backbone, ref, **config_overrides), tokenizer


def cplm_on(backbone, ref: BaseReference, **config_overrides):
    """A CPLM with a freshly initialised CP head on a loaded backbone (what `ref` loaded)."""
    overrides = resolve_head(config_overrides, backbone.config.num_hidden_layers)
    config = CPLMConfig(backbone_config=backbone.config.to_dict(), base_model=ref.to_dict(), **overrides)
    return CPLMForCausalLM(config, backbone=backbone).eval()








def load_tokenizer(model):
    """The tokenizer that belongs to a CPLM: the base backbone's (converted once, then cached)."""
    if model.config.base_model is None:
        raise CheckpointError(model.config.name_or_path or "<in memory>", "no base backbone, hence no tokenizer")
    _, tokenizer = load_backbone(BaseReference.from_dict(model.config.base_model))
    return tokenizer


def model_fingerprint(model) -> str:
    """sha256 over the base backbone's digest and every tensor a checkpoint stores: equal fingerprints, equal
    keys."""
    digest = hashlib.sha256()
    config = model.config
    base = BaseReference.from_dict(config.base_model).identity() if config.base_model else {}
    digest.update(json.dumps(base, sort_keys=True).encode())
    digest.update(json.dumps({"key_dim": config.key_dim, "key_sees_token": config.key_sees_token}).encode())
    if config.document_attention != "causal":  # the same tensors give other keys (a causal one's stay as they were)
        digest.update(json.dumps({"document_attention": config.document_attention}).encode())
    for name, tensor in sorted(stored_state_dict(model).items()):
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "default"
HEAD_SEED = 0


def load_model(path: str | Path | None = None, device: str | None = None,
               backbone: BaseReference | str | Path | None = None):
    """(model, tokenizer) for inference from a checkpoint directory, which names its own backbone. With no path,
    the shipped default checkpoint; with no path and a `backbone` (a GGUF file, a model folder or a Hugging Face
    model id), a fresh CP head on it, seeded so every process builds the same one (as on the default backbone
    when no checkpoint ships). Adapters are merged into the backbone weights (see cprag.model.adapters.merge)."""
    if path is None and backbone is None and (DEFAULT_CHECKPOINT / "config.json").is_file():
        path = DEFAULT_CHECKPOINT
    if path is None:
        torch.manual_seed(HEAD_SEED)
        model, tokenizer = new_cplm(backbone)
    else:
        if backbone is not None:
            raise CheckpointError(str(path), "a checkpoint names its own backbone: give a checkpoint or a backbone")
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
