"""A least-recently-used cache of key shards on the generator's device, shared by every question in a process."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cprag.index.store import StoredPassage


@dataclass
class DevicePassage:
    passage: StoredPassage  # text, ids and offsets for citations (host memory)
    keys: torch.Tensor  # (n, D) on the device, in the cache's dtype (KEY_CACHE_DTYPE)
    ids: torch.Tensor  # (n,) int64 on the device

    @classmethod
    def from_stored(cls, stored: StoredPassage, device, dtype: torch.dtype) -> DevicePassage:
        """Move a stored passage's keys (in `dtype`) and token ids (int64) to `device`."""
        keys = torch.from_numpy(np.array(stored.keys.keys)).to(device, dtype)
        return cls(passage=stored, keys=keys, ids=torch.from_numpy(stored.keys.ids.astype(np.int64)).to(device))

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.ids.numel() * self.ids.element_size()


# shards are cached at the precision indexes store keys in (fp16; an int8 or PQ index decodes to about that), half
# of fp32's bytes; a question's memory is built from them in the CP head's dtype (cprag.model.runtime.place)
KEY_CACHE_DTYPE = torch.float16


class KeyCache:
    """passage id -> DevicePassage, evicting the least recently used once `max_bytes` is exceeded."""

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_bytes: int = 512 * 2**20):
        self.device, self.dtype, self.max_bytes = torch.device(device), dtype, max_bytes
        self.entries: OrderedDict[str, DevicePassage] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, passage_ids: list[str], load: Callable[[list[str]], dict[str, StoredPassage]]) -> list[DevicePassage]:
        """The shards for `passage_ids`, in order, loading the missing ones with one `load` call."""
        missing = [pid for pid in passage_ids if pid not in self.entries]
        self.hits += len(passage_ids) - len(missing)
        self.misses += len(missing)
        if missing:
            for pid, stored in load(missing).items():
                self._put(pid, stored)
        found = []
        for pid in passage_ids:
            if pid in self.entries:
                self.entries.move_to_end(pid)
                found.append(self.entries[pid])
        self._evict(keep=set(passage_ids))
        return found

    def _put(self, pid: str, stored: StoredPassage) -> None:
        entry = DevicePassage.from_stored(stored, self.device, self.dtype)
        self.entries[pid] = entry
        self.bytes += entry.nbytes

    def _evict(self, keep: set[str]) -> None:
        for pid in list(self.entries):
            if self.bytes <= self.max_bytes:
                break
            if pid not in keep:
                self.bytes -= self.entries.pop(pid).nbytes

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses}
