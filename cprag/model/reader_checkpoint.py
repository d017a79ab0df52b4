"""Saving and loading the visible span reader (`cprag.model.span_reader`).

A reader folder holds `reader_config.json` and `reader.safetensors`: the adapters and the span head only. The
backbone comes from the base GGUF the config references, as a CPLM checkpoint's does. The shipped reader sits in
`cprag/checkpoints/default/reader/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cprag.errors import CheckpointError
from cprag.model.adapters import merge
from cprag.model.backbone import BaseReference, default_reference, load_backbone
from cprag.model.span_reader import SpanReader, SpanReaderConfig

READER_CONFIG = "reader_config.json"
READER_WEIGHTS = "reader.safetensors"
DEFAULT_READER = Path(__file__).resolve().parents[1] / "checkpoints" / "default" / "reader"


def new_reader(ref: BaseReference | None = None, seed: int = 0, **overrides):
    """A reader with fresh adapters and head on a base backbone (the default GGUF when ref is None).

    Returns (reader, tokenizer)."""
    ref = ref or default_reference()
    backbone, tokenizer = load_backbone(ref)
    torch.manual_seed(seed)
    config = SpanReaderConfig(base_model=ref.to_dict(), hidden_size=backbone.config.hidden_size, **overrides)
    return SpanReader(config, backbone), tokenizer


def save_reader(reader: SpanReader, path: str | Path, extra: dict | None = None) -> Path:
    """Write the reader's config and trained tensors into `path` (each file atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in
             reader.trained_state().items()}
    staging = path / f".{READER_WEIGHTS}.tmp"
    save_file(state, staging)
    os.replace(staging, path / READER_WEIGHTS)
    config = reader.config.to_dict() | {"kind": "span-reader"} | (extra or {})
    (path / f".{READER_CONFIG}.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / f".{READER_CONFIG}.tmp", path / READER_CONFIG)
    return path


def reader_exists(path: str | Path | None = None) -> bool:
    path = Path(path) if path is not None else DEFAULT_READER
    return (path / READER_CONFIG).is_file() and (path / READER_WEIGHTS).is_file()


def load_reader(path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                merged: bool = True):
    """(reader, tokenizer) from a reader folder (default: the shipped one), for inference unless `merged` is False
    (adapters kept apart, so training can go on)."""
    path = Path(path) if path is not None else DEFAULT_READER
    if not reader_exists(path):
        raise CheckpointError(str(path), f"no span reader here ({READER_CONFIG} and {READER_WEIGHTS}); train one "
                              "with `python pipelines/train_reader.py`")
    config = SpanReaderConfig.from_dict(json.loads((path / READER_CONFIG).read_text()))
    backbone, tokenizer = load_backbone(BaseReference.from_dict(config.base_model))
    reader = SpanReader(config, backbone)
    stored = load_file(path / READER_WEIGHTS)
    expected = reader.trained_state()
    if set(stored) != set(expected):
        raise CheckpointError(str(path), "its tensors do not match its config")
    reader.load_state_dict(stored, strict=False)
    if merged:
        merge(reader.backbone, reader.adapters)
        reader.backbone.to(device, dtype)
        reader.span_head.to(device, torch.float32)
        reader.adapters.to(device)
    return reader.eval(), tokenizer
