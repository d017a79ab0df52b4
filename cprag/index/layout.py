"""The index directory: a LanceDB table of passages with their CP keys, a FAISS index, and a manifest.

    DIR/manifest.json      format version, model fingerprint, key dim, retriever, counts, bytes per token
    DIR/lancedb/passages   one row per passage: ids, title, text, token ids + offsets, keys (fp16, int8 or pq
                           codes), embedding
    DIR/faiss-vN.index     inner-product index over passage embeddings of table version N (row i = FAISS id i)
    DIR/faiss-vN.ids.json  passage id of each FAISS row, and N
    DIR/keys-pq.npy        with pq keys: the codebook every stored code refers to (cprag.index.key_codec)
    DIR/.write.lock        the writer's advisory lock (cprag.index.lock)

Format 1 indexes kept their FAISS files under fixed names (`faiss.index`, `faiss_ids.json`); they are still read.
A file is written under its staging name (`NAME.tmp`; the codebook's is `keys-pq.tmp.npy`) and then renamed, so a
file under its final name is always whole.

Rows are written in chunks, each one LanceDB commit, so an interrupted build keeps every finished chunk and a
rerun skips them. The manifest is the commit point: it names the LanceDB table version that the FAISS files were
built from, and the FAISS files of that version, and readers open exactly those (cprag.index.reader). A commit writes
the next version's FAISS files beside the old ones, replaces the manifest, and only then removes the old files, so
an update in progress, or one killed anywhere, leaves readers on the last finished version. A first build's
manifest says "building" until it finishes.

Only this module spells these names; every other module asks an `IndexLayout` for its paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
LANCEDB = "lancedb"
TABLE = "passages"
TABLE_DIR = f"{LANCEDB}/{TABLE}"  # how messages name the table
PQ_CODEBOOK = "keys-pq.npy"
WRITE_LOCK = ".write.lock"
STAGING_SUFFIX = ".tmp"
FAISS_PREFIX = "faiss"
LEGACY_FAISS_FILES = {"index": "faiss.index", "ids": "faiss_ids.json"}
# every FAISS file of any version, current or legacy name, and their staging copies
FAISS_GLOBS = ("faiss-v*.index", "faiss-v*.ids.json", "faiss.index", "faiss_ids.json", "faiss*" + STAGING_SUFFIX)


def faiss_files_for(table_version: int) -> dict[str, str]:
    """The FAISS files of one committed version. A commit writes new files beside the old ones and then replaces
    the manifest that names them, so the files a manifest names are never rewritten under a reader."""
    return {"index": f"faiss-v{table_version}.index", "ids": f"faiss-v{table_version}.ids.json"}


def is_faiss_name(name: object) -> bool:
    """A FAISS file name a manifest may record: a plain name inside the index directory."""
    return isinstance(name, str) and "/" not in name and name.startswith(FAISS_PREFIX)


def staging(file: Path) -> Path:
    """Where `file` is written before the rename that makes it whole under its own name."""
    return file.with_name(file.name + STAGING_SUFFIX)


@dataclass(frozen=True)
class IndexLayout:
    """The paths of one index directory."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))  # a str is welcome too

    @property
    def manifest(self) -> Path:
        return self.path / MANIFEST

    @property
    def lancedb(self) -> Path:
        """The LanceDB database folder (holds the passages table)."""
        return self.path / LANCEDB

    @property
    def table_dataset(self) -> Path:
        """The Lance dataset directory of the passages table."""
        return self.lancedb / f"{TABLE}.lance"

    @property
    def pq_codebook(self) -> Path:
        return self.path / PQ_CODEBOOK

    @property
    def pq_codebook_staging(self) -> Path:
        # np.save appends ".npy" to a name without it, so the staging name keeps the suffix last
        return self.pq_codebook.with_suffix(STAGING_SUFFIX + ".npy")

    @property
    def write_lock(self) -> Path:
        return self.path / WRITE_LOCK

    def file(self, name: str) -> Path:
        """A file the manifest names (FAISS files, the codebook)."""
        return self.path / name

    def faiss_files_except(self, keep: set[str]) -> list[Path]:
        """FAISS files (and their staging copies) in the directory other than those named in `keep`."""
        return sorted({f for pattern in FAISS_GLOBS for f in self.path.glob(pattern) if f.name not in keep})

    def remove_faiss_files_except(self, keep: set[str]) -> None:
        for file in self.faiss_files_except(keep):
            file.unlink(missing_ok=True)
