"""Small versioned JSON files beside a checkpoint (`verifier.json`, `passage_prior.json`): a fitted piece of
decoding that travels with the weights it was fitted on, read back only in the format this cprag writes."""

from __future__ import annotations

import json
from pathlib import Path


def save_sidecar(path: Path, format_version: int, values: dict, indent: int | None = None) -> Path:
    """`values` under a `format_version` key, as one JSON document with a trailing newline."""
    path.write_text(json.dumps({"format_version": format_version, **values}, indent=indent) + "\n")
    return path


def load_sidecar(path: Path, format_version: int, what: str) -> dict | None:
    """The values saved at `path` without their format version; None when there is no such file; ValueError
    naming `what` when it holds another format."""
    if not path.exists():
        return None
    values = json.loads(path.read_text())
    if values.pop("format_version", None) != format_version:
        raise ValueError(f"{path}: not {what} format {format_version}")
    return values
