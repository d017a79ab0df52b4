"""A disk cache of frozen backbone activations, so training never runs the frozen blocks twice.

Training changes only what sits above block `start` (adapters on the top blocks, the CP head), so the hidden
states entering block `start`, plus the `cp_layers` below it, fix everything for a token sequence. They are
computed once, in bf16 autocast where the CPU has bf16 matrix units, and kept as float16 arrays:

    DIR/plan.json           version, layers, hidden size, dtype, fingerprint and the sequence keys of each chunk
    DIR/chunk-00000.npy     (tokens, layers, hidden) float16: the chunk's sequences one after another
    DIR/chunk-00000.json    key, offset and length of each sequence in the array (written last: the chunk is done)

Chunks are written atomically as they finish, so an interrupted build resumes at the first missing chunk, and a
reader can already use every finished one (the plan orders sequences so that a prefix is a useful subset).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cprag.errors import CacheMismatch
from cprag.index.encode import length_batches

CACHE_VERSION = 1
FLOAT16_MAX = 65504.0


@dataclass
class CachePlan:
    layers: list[int]  # hidden-state indices kept per token (see CPLMForCausalLM.cached_layers)
    hidden_size: int
    fingerprint: str  # the base backbone's sha256: the frozen blocks are the base's own
    dtype: str  # "bfloat16" (autocast) or "float32": what the frozen blocks ran in
    chunks: list[list[str]]  # sequence keys, chunk by chunk

    def to_json(self) -> dict:
        return {"version": CACHE_VERSION, "layers": self.layers, "hidden_size": self.hidden_size,
                "fingerprint": self.fingerprint, "dtype": self.dtype, "chunks": self.chunks}


def plan_chunks(keys: list[str], chunk_size: int) -> list[list[str]]:
    return [keys[i : i + chunk_size] for i in range(0, len(keys), chunk_size)]


def _chunk_paths(directory: Path, index: int) -> tuple[Path, Path]:
    return directory / f"chunk-{index:05d}.npy", directory / f"chunk-{index:05d}.json"


def _write_atomic(path: Path, content: str | np.ndarray) -> None:
    """Write a text or an .npy file under a temporary name, then rename it: readers never see half of one."""
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "wb") as handle:
        if isinstance(content, str):
            handle.write(content.encode())
        else:
            np.save(handle, content)
    os.replace(staging, path)


@torch.inference_mode()
def build_cache(model, sequences: dict[str, list[int]], directory: str | Path, plan: CachePlan, start: int,
                pad_id: int, max_tokens: int = 4096,
                on_progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Run the frozen blocks 0..start-1 over every planned sequence and write the chunks not yet on disk.

    `on_progress(sequences done, total sequences, tokens done)`. Returns build figures (tokens, seconds,
    tokens per second of this run, chunks written and skipped, bytes on disk).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan_file = directory / "plan.json"
    if plan_file.is_file():
        found = json.loads(plan_file.read_text())
        if found != plan.to_json():
            raise CacheMismatch(str(directory), "its plan.json differs from this build's (data, layers, model "
                                "or chunking changed); remove the folder or use another")
    else:
        _write_atomic(plan_file, json.dumps(plan.to_json()))
    autocast = plan.dtype == "bfloat16"
    device = next(model.parameters()).device
    total = sum(len(c) for c in plan.chunks)
    done = tokens = written = skipped = 0
    started = time.perf_counter()
    for index, keys in enumerate(plan.chunks):
        array_path, index_path = _chunk_paths(directory, index)
        if index_path.is_file():
            done += len(keys)
            skipped += 1
            continue
        passages = [_Sequence(sequences[k]) for k in keys]
        arrays: list[np.ndarray | None] = [None] * len(keys)
        for batch, input_ids, attention in length_batches(passages, pad_id, max_tokens, prefix=False):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                states = model.frozen_states(input_ids.to(device), attention.to(device), start)
            stacked = torch.stack([states[i].float() for i in plan.layers], dim=2).cpu()  # (B, T, S, H)
            if stacked.abs().max() > FLOAT16_MAX:
                raise OverflowError(f"activations above the float16 range in chunk {index}")
            for row, position in enumerate(batch):
                arrays[position] = stacked[row, : len(passages[position].ids)].to(torch.float16).numpy()
            tokens += int(attention.sum())
        offsets = np.cumsum([0] + [a.shape[0] for a in arrays])
        _write_atomic(array_path, np.concatenate(arrays))
        _write_atomic(index_path, json.dumps({"keys": keys, "offsets": offsets[:-1].tolist(),
                                              "lengths": np.diff(offsets).tolist()}))
        done += len(keys)
        written += 1
        if on_progress:
            on_progress(done, total, tokens)
    seconds = time.perf_counter() - started
    return {"cache/tokens_built": tokens, "cache/seconds": round(seconds, 1),
            "cache/tokens_per_second": round(tokens / seconds, 1) if tokens else 0.0,
            "cache/chunks_written": written, "cache/chunks_skipped": skipped,
            "cache/bytes": sum(p.stat().st_size for p in directory.glob("chunk-*.npy"))}


@dataclass
class _Sequence:
    ids: list[int]  # length_batches reads `.ids`


class ActivationCache:
    """Read side: every finished chunk, memory-mapped; `get(key)` is a (T, S, H) float16 view."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        plan_file = self.directory / "plan.json"
        if not plan_file.is_file():
            raise CacheMismatch(str(self.directory), "no plan.json: not an activation cache")
        self.plan = json.loads(plan_file.read_text())
        self.layers: list[int] = self.plan["layers"]
        self.where: dict[str, tuple[np.ndarray, int, int]] = {}
        for index in range(len(self.plan["chunks"])):
            array_path, index_path = _chunk_paths(self.directory, index)
            if not index_path.is_file():
                continue
            spans = json.loads(index_path.read_text())
            array = np.load(array_path, mmap_mode="r")
            for key, offset, length in zip(spans["keys"], spans["offsets"], spans["lengths"], strict=True):
                self.where[key] = (array, offset, length)

    def include(self, other: ActivationCache, keep_own: bool = False) -> None:
        """Serve `other`'s sequences too (a second data file over the same passages: `cprag train --negatives`).
        Both must hold the same layers of the same backbone, computed in the same dtype. `keep_own`: a key both
        hold keeps this cache's sequence (another file's passage that happens to share its id)."""
        for field in ("layers", "hidden_size", "fingerprint", "dtype"):
            if self.plan[field] != other.plan[field]:
                raise CacheMismatch(str(other.directory), f"its {field} ({other.plan[field]}) differs from "
                                    f"{self.directory}'s ({self.plan[field]})")
        if keep_own:
            self.where = {**other.where, **self.where}
        else:
            self.where.update(other.where)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def __len__(self) -> int:
        return len(self.where)

    @property
    def complete(self) -> bool:
        return len(self.where) == sum(len(c) for c in self.plan["chunks"])

    def length(self, key: str) -> int:
        return self.where[key][2]

    def get(self, key: str) -> np.ndarray:
        array, offset, length = self.where[key]
        return array[offset : offset + length]

    def states(self, keys: list[str], lengths: list[int] | None = None) -> tuple[dict[int, torch.Tensor],
                                                                                torch.Tensor]:
        """Right-padded float32 states of several sequences (each cut to its `lengths` entry when given):
        ({layer: (B, T, H)}, mask (B, T) long)."""
        arrays = [self.get(k) for k in keys]
        if lengths is not None:
            arrays = [a[:n] for a, n in zip(arrays, lengths, strict=True)]
        width = max(a.shape[0] for a in arrays)
        batch = np.zeros((len(keys), width, len(self.layers), arrays[0].shape[-1]), dtype=np.float16)
        mask = torch.zeros((len(keys), width), dtype=torch.long)
        for row, array in enumerate(arrays):
            batch[row, : array.shape[0]] = array
            mask[row, : array.shape[0]] = 1
        tensor = torch.from_numpy(batch).float()
        return {layer: tensor[:, :, i] for i, layer in enumerate(self.layers)}, mask


    def packed(self, keys: list[str], row_tokens: int = 512) -> tuple[dict[int, torch.Tensor], torch.Tensor,
                                                                     list[tuple[int, int]]]:
        """Several sequences packed into rows of about `row_tokens` tokens (first fit, longest first; a longer
        sequence gets a row of its own), so that little is padding and attention stays within short rows.

        Returns ({layer: (R, T, H)} float32, position ids (R, T) restarting at 0 for each sequence, and for each
        key its (row, first column)). Row padding counts as one more sequence of its own.
        """
        arrays = [self.get(k) for k in keys]
        rows: list[list[int]] = []
        fill: list[int] = []
        placed: list[tuple[int, int]] = [(0, 0)] * len(keys)
        for index in sorted(range(len(keys)), key=lambda i: -arrays[i].shape[0]):
            length = arrays[index].shape[0]
            row = next((r for r, used in enumerate(fill) if used + length <= row_tokens), None)
            if row is None:
                rows.append([])
                fill.append(0)
                row = len(rows) - 1
            placed[index] = (row, fill[row])
            rows[row].append(index)
            fill[row] += length
        width = max(fill)
        batch = np.zeros((len(rows), width, len(self.layers), arrays[0].shape[-1]), dtype=np.float16)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for index, (row, first) in enumerate(placed):
            length = arrays[index].shape[0]
            batch[row, first : first + length] = arrays[index]
            positions[row, first : first + length] = torch.arange(length)
        for row, used in enumerate(fill):
            positions[row, used:] = torch.arange(width - used)
        tensor = torch.from_numpy(batch).float()
        return {layer: tensor[:, :, i] for i, layer in enumerate(self.layers)}, positions, placed


def cache_key(data_files: list[Path], fingerprint: str, layers: list[int], dtype: str, extra: str = "") -> str:
    """A folder name that changes whenever the cached activations would."""
    digest = hashlib.sha256()
    for path in data_files:
        digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
    digest.update(f"{CACHE_VERSION}|{fingerprint}|{layers}|{dtype}|{extra}".encode())
    return f"v{CACHE_VERSION}-L{'.'.join(map(str, layers))}-{dtype}-{digest.hexdigest()[:16]}"
