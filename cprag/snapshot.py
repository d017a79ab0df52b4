"""Opening an index for reading: the last committed version, whole, while a writer may be updating it.

What a reader sees during `cprag index`:
- An index with a finished version: that version, until the writer's manifest replace commits the next one.
  The manifest names the LanceDB table version the FAISS files were built from; the table is opened at that
  version, so rows upserted or deleted since are invisible, and an update that is interrupted leaves readers on
  the old version. An `Index` already open keeps the version it opened (reopen it to see a newer one).
- The few milliseconds in which the writer replaces the FAISS files and then the manifest: the files are stamped
  with the table version they describe and stat-ed around the read, so a reader that catches them mid-replace
  reads again rather than pair new vectors with old ids.
- A first build (or a `--rebuild`) in progress: there is nothing finished to read, and the error says the index
  is being built (`IndexBusy`), never that it is damaged.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import IndexBusy, IndexCorrupt, IndexNotFound, IndexUnfinished
from cprag.lock import writer_pid
from cprag.retrieve import FAISS_FILE, FAISS_IDS, PassageIndex
from cprag.store import MANIFEST, REFRESH, PassageStore, read_manifest

# how long a reader waits out a writer's commit before saying the index is busy
COMMIT_WAIT_S = 5.0


@dataclass
class Snapshot:
    manifest: dict
    store: PassageStore
    passage_index: PassageIndex


def open_snapshot(path: str | Path, wait_s: float = COMMIT_WAIT_S) -> Snapshot:
    """The index's last committed version. Raises IndexBusy while a writer leaves nothing finished to read,
    IndexCorrupt / IndexNotFound when no writer explains what is wrong."""
    path = Path(path)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _read_consistent(path)
        except (_Moving, IndexCorrupt, IndexNotFound) as error:
            pid = writer_pid(path)
            if pid is None and not isinstance(error, _Moving):
                raise  # no writer: the index is what it is
            if pid is not None and isinstance(error, (IndexNotFound, IndexUnfinished)):
                raise IndexBusy(str(path), pid or None) from None  # a first build: nothing to wait for
            if pid is None and error.settled is not None:
                raise error.settled from None  # no writer will finish this commit
            if time.monotonic() >= deadline:
                raise IndexBusy(str(path), pid or None) from None
            time.sleep(0.05)


class _Moving(Exception):
    """The files changed while they were read, or describe different versions: a commit may be under way.
    `settled` is what it means when no writer is running."""

    def __init__(self, settled: IndexCorrupt | None = None):
        super().__init__()
        self.settled = settled


def _stamp(path: Path) -> tuple:
    stamps = []
    for name in (MANIFEST, FAISS_IDS, FAISS_FILE):
        try:
            info = os.stat(path / name)
            stamps.append((info.st_ino, info.st_mtime_ns, info.st_size))
        except FileNotFoundError:
            stamps.append(None)
    return tuple(stamps)


def _read_consistent(path: Path) -> Snapshot:
    before = _stamp(path)
    manifest = read_manifest(path)
    if manifest.get("status") != "complete":
        raise IndexUnfinished(str(path))
    version = manifest.get("table_version")  # absent in indexes written before versions were recorded
    store = PassageStore(path, manifest["retriever"]["dim"], version=version)
    passage_index = PassageIndex.load(path)
    if _stamp(path) != before:
        raise _Moving()
    if version is not None and passage_index.table_version != version:
        mismatch = IndexCorrupt(str(path), f"{FAISS_IDS} describes table version {passage_index.table_version} "
                                f"but manifest.json version {version}; " + REFRESH.format(path=path))
        if passage_index.table_version is not None and passage_index.table_version > version:
            raise _Moving(mismatch)  # FAISS files of the commit under way (or killed), manifest of the last one
        raise mismatch
    stored = store.count()
    if stored != len(passage_index):  # e.g. FAISS files copied from another build of this directory
        raise IndexCorrupt(str(path), f"{FAISS_IDS} lists {len(passage_index)} passages but the table holds "
                           f"{stored}; " + REFRESH.format(path=path))
    return Snapshot(manifest, store, passage_index)
