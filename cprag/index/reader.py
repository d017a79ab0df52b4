"""Opening an index for reading: the last committed version, whole, while a writer may be updating it.

What a reader sees during `cprag index`:
- An index with a finished version: that version, until the writer's manifest replace commits the next one.
  The manifest names the LanceDB table version and the FAISS files built from it. The table is opened at that
  version, so rows upserted or deleted since are invisible, and the writer puts the next version's FAISS files
  beside the old ones, so an update in progress, or one killed anywhere, leaves readers on the old version.
  An `Index` already open keeps the version it opened (reopen it to see a newer one).
- The instant of a commit: a reader that read the old manifest may find its FAISS files already removed; the
  manifest has changed by then, so it reads the new one.
- A first build (or a `--rebuild`) in progress: there is nothing finished to read, and the error says the index
  is being built (`IndexBusy`), never that it is damaged.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from cprag.errors import IndexBusy, IndexCorrupt, IndexNotFound, IndexUnfinished
from cprag.index.key_codec import Codec, PQCodebook
from cprag.index.layout import LEGACY_FAISS_FILES, MANIFEST, PQ_CODEBOOK, IndexLayout, is_faiss_name
from cprag.index.lock import writer_pid
from cprag.index.retrieve import PassageIndex
from cprag.index.store import REBUILD, REFRESH, PassageStore, error_line, read_manifest

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
        except _Moving:
            if time.monotonic() >= deadline:  # commits keep landing: a writer is churning
                raise IndexBusy(str(path), writer_pid(path) or None) from None
        except (IndexCorrupt, IndexNotFound):
            pid = writer_pid(path)
            if pid is None:
                raise  # no writer: the index is what it is
            # only a first build or a --rebuild (no finished version yet) leaves a reader nothing whole to read
            raise IndexBusy(str(path), pid or None) from None
        time.sleep(0.05)


class _Moving(Exception):
    """The manifest was replaced while the files it named were read: a commit landed."""


def manifest_stamp(path: Path) -> tuple | None:
    """(inode, mtime, size) of the manifest, or None: it changes with every commit."""
    try:
        info = os.stat(IndexLayout(path).manifest)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def faiss_files(path: Path, manifest: dict) -> dict[str, str]:
    if manifest.get("format_version") == 1:
        return LEGACY_FAISS_FILES
    files = manifest.get("faiss")
    valid = isinstance(files, dict) and all(is_faiss_name(files.get(k)) for k in ("index", "ids"))
    if not valid:
        raise IndexCorrupt(str(path), f"{MANIFEST} names no valid FAISS files; " + REFRESH.format(path=path))
    return files


def stored_codec(path: Path, manifest: dict) -> Codec:
    """How the index's keys are stored: a codec name, or its PQ codebook."""
    name = manifest.get("key_dtype", "float16")
    if name != "pq":
        return name
    file = IndexLayout(path).file(manifest.get("key_pq", {}).get("file", PQ_CODEBOOK))
    try:
        return PQCodebook.load(file)
    except (OSError, ValueError) as error:
        raise IndexCorrupt(str(path), f"the pq codebook {file.name} is unreadable ({error_line(error)}); "
                           + REBUILD.format(path=path)) from None


def _read_consistent(path: Path) -> Snapshot:
    before = manifest_stamp(path)
    manifest = read_manifest(path)
    if manifest.get("status") != "complete":
        raise IndexUnfinished(str(path))
    version = manifest.get("table_version")  # absent in indexes written before versions were recorded
    files = faiss_files(path, manifest)
    try:
        store = PassageStore(path, manifest["retriever"]["dim"], version=version,
                             key_codec=stored_codec(path, manifest))
        passage_index = PassageIndex.load(path, files, layout=manifest.get("faiss_layout"))
        if version is not None and passage_index.table_version != version:
            raise IndexCorrupt(str(path), f"{files['ids']} describes table version {passage_index.table_version} "
                               f"but {MANIFEST} version {version}; " + REFRESH.format(path=path))
    except IndexCorrupt:
        if manifest_stamp(path) != before:
            raise _Moving() from None
        raise
    stored = store.count()
    if stored != len(passage_index):  # e.g. FAISS files copied from another build of this directory
        raise IndexCorrupt(str(path), f"{files['ids']} lists {len(passage_index)} passages but the table holds "
                           f"{stored}; " + REFRESH.format(path=path))
    return Snapshot(manifest, store, passage_index)
