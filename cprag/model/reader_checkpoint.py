"""Saving and loading the span reader (`cprag.model.span_reader`).

A reader folder holds `reader_config.json` and `reader.safetensors`: the adapters, the null state and the span head.
The backbone comes from the base the config references (its sha256 is the reader's fingerprint: a reader is
refused beside a CPLM on another base). The shipped reader sits in `cprag/checkpoints/default/reader/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cprag.errors import CheckpointError
from cprag.model.adapters import merge
from cprag.model.backbone import BaseReference, as_reference, load_backbone
from cprag.model.runtime import reuse_freed_memory
from cprag.model.span_reader import SpanReader, SpanReaderConfig

READER_CONFIG = "reader_config.json"
READER_WEIGHTS = "reader.safetensors"
DEFAULT_READER = Path(__file__).resolve().parents[1] / "checkpoints" / "default" / "reader"


def new_reader(ref: BaseReference | str | None = None, seed: int = 0, **overrides):
    """A reader with fresh adapters, null state and head on a base backbone: a reference, or what `--backbone`
    takes (a GGUF file, a model folder, a Hugging Face model id); the default GGUF when None.

    Returns (reader, tokenizer)."""
    ref = as_reference(ref)
    backbone, tokenizer = load_backbone(ref)
    torch.manual_seed(seed)
    config = SpanReaderConfig(base_model=ref.to_dict(), num_layers=backbone.config.num_hidden_layers,
                              hidden_size=backbone.config.hidden_size, **overrides)
    return SpanReader(config, backbone), tokenizer


def warm_start(reader: SpanReader, checkpoint: str | Path) -> int:
    """Start the reader's adapters from a CPLM checkpoint's adapters on the same blocks (trained on the copy path,
    they already read SQuAD-like text). Returns how many adapters were taken; those of another rank are not."""
    path = Path(checkpoint) / "model.safetensors"
    if not path.is_file():
        raise CheckpointError(str(checkpoint), "no model.safetensors to warm-start the reader from")
    taken = 0
    with safe_open(str(path), "pt") as stored, torch.no_grad():
        names = set(stored.keys())
        for name, delta in reader.adapters.items():
            a, b = f"adapters.{name}.lora_A", f"adapters.{name}.lora_B"
            if a in names and stored.get_slice(a).get_shape() == list(delta.lora_A.shape):
                delta.lora_A.copy_(stored.get_tensor(a))
                delta.lora_B.copy_(stored.get_tensor(b))
                taken += 1
    return taken


def continue_from(reader: SpanReader, path: str | Path) -> dict:
    """Load a saved reader's adapters, null state and head into `reader`, so training goes on from them. The saved
    reader must be on the same base, with the same head shapes. It may be smaller: adapters on fewer blocks (a reader
    split higher; the other blocks keep their fresh identity adapters) or of a lower rank (padded: the extra rows of
    A keep their fresh values and the extra columns of B are zero, so every block computes what it computed).
    Returns what was taken: {"adapters": n, "fresh": [names], "rank": saved rank}."""
    check_reader_base(path, reader.config.base_model)
    if not reader_exists(path):
        raise CheckpointError(str(path), f"no span reader here ({READER_CONFIG} and {READER_WEIGHTS})")
    saved = json.loads((Path(path) / READER_CONFIG).read_text())
    stored = load_file(Path(path) / READER_WEIGHTS)
    expected = reader.trained_state()
    unknown = set(stored) - set(expected)
    rank = int(saved.get("adapter_rank", reader.config.adapter_rank))
    if unknown or rank > reader.config.adapter_rank:
        raise CheckpointError(str(path), "its tensors do not match this reader's config (blocks or rank beyond it)")
    rest = {k: v for k, v in stored.items() if not k.startswith("adapters.")}
    if any(v.shape != expected[k].shape for k, v in rest.items()):
        raise CheckpointError(str(path), "its null state or span head does not match this reader's config")
    reader.load_state_dict(rest, strict=False)
    # the same update at the new rank: (alpha_s / r_s) B_s A_s = (alpha / r) B A with B = B_s · (scale_s / scale)
    ratio = (float(saved.get("adapter_alpha", reader.config.adapter_alpha)) / rank) / next(
        iter(reader.adapters.values())).scale
    taken, fresh = 0, []
    with torch.no_grad():
        for name, delta in reader.adapters.items():
            a, b = f"adapters.{name}.lora_A", f"adapters.{name}.lora_B"
            if a not in stored:
                fresh.append(name)
                continue
            delta.lora_A[:rank].copy_(stored[a])
            delta.lora_B.zero_()
            delta.lora_B[:, :rank].copy_(stored[b] * ratio)
            taken += 1
    return {"adapters": taken, "fresh": fresh, "rank": rank}


def save_reader(reader: SpanReader, path: str | Path, extra: dict | None = None) -> Path:
    """Write the reader's config and trained tensors into `path` (each file atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in
             reader.trained_state().items()}
    staging = path / f".{READER_WEIGHTS}.tmp"
    save_file(state, staging)
    os.replace(staging, path / READER_WEIGHTS)
    config = reader.config.to_dict() | {"kind": "split-span-reader"} | (extra or {})
    (path / f".{READER_CONFIG}.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / f".{READER_CONFIG}.tmp", path / READER_CONFIG)
    return path


def reader_exists(path: str | Path | None = None) -> bool:
    path = Path(path) if path is not None else DEFAULT_READER
    return (path / READER_CONFIG).is_file() and (path / READER_WEIGHTS).is_file()


def reader_base(path: str | Path | None = None) -> dict:
    """The base reference a saved reader was trained on, without loading it."""
    path = Path(path) if path is not None else DEFAULT_READER
    return json.loads((path / READER_CONFIG).read_text())["base_model"]


def reader_fits(path: str | Path | None, model_base: dict | None) -> bool:
    """Whether the reader at `path` (a folder with one) was trained on the base `model_base` names (same sha256)."""
    return reader_base(path).get("sha256") == (model_base or {}).get("sha256")


def check_reader_base(path: str | Path | None, model_base: dict | None) -> None:
    """Refuse a reader trained on another base than the CPLM beside it (their sha256 differ). A folder with no
    reader is left to `load_reader`, which says so."""
    if not model_base or not reader_exists(path) or reader_fits(path, model_base):
        return
    found = reader_base(path).get("sha256")
    raise CheckpointError(str(path or DEFAULT_READER), f"this reader was trained on base {str(found)[:12]}, not on "
                          f"this checkpoint's base {str(model_base.get('sha256'))[:12]}")


def load_reader(path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                merged: bool = True):
    """(reader, tokenizer) from a reader folder (default: the shipped one), for inference unless `merged` is False
    (adapters kept apart, so training can go on)."""
    path = Path(path) if path is not None else DEFAULT_READER
    if not reader_exists(path):
        raise CheckpointError(str(path), f"no span reader here ({READER_CONFIG} and {READER_WEIGHTS}); train one "
                              "with `python pipelines/train_reader.py`")
    values = json.loads((path / READER_CONFIG).read_text())
    if values.get("kind") != "split-span-reader":
        raise CheckpointError(str(path), f"not a split span reader (kind {values.get('kind')!r}); retrain it with "
                              "`python pipelines/train_reader.py`")
    config = SpanReaderConfig.from_dict(values)
    backbone, tokenizer = load_backbone(BaseReference.from_dict(config.base_model))
    reader = SpanReader(config, backbone)
    stored = load_file(path / READER_WEIGHTS)
    expected = reader.trained_state()
    if set(stored) != set(expected) or any(stored[k].shape != expected[k].shape for k in stored):
        raise CheckpointError(str(path), "its tensors do not match its config")
    reader.load_state_dict(stored, strict=False)
    if merged:
        if torch.device(device).type == "cpu":
            reuse_freed_memory()  # a read allocates tens of MB per pass; fresh mappings cost the kernel each time
        merge(reader.backbone, reader.adapters)
        reader.backbone.to(device, dtype)
        reader.span_head.to(device, torch.float32)
        reader.adapters.to(device)
        reader.null.data = reader.null.data.to(device)
    return reader.eval(), tokenizer

