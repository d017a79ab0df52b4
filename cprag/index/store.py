"""The passages table of an index directory (LanceDB) and its manifest, the commit point that names the table version
and FAISS files readers open. What the directory holds, and why a commit is crash-safe: cprag.index.layout."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from cprag.errors import IndexCorrupt, IndexNotFound, ModelMismatch
from cprag.index.encode import PassageKeys
from cprag.index.key_codec import Codec, decode_keys, encode_keys
from cprag.index.layout import MANIFEST, TABLE, TABLE_DIR, IndexLayout, staging

FORMAT_VERSION = 2  # 2: FAISS files named by table version in the manifest
READABLE_FORMATS = (1, 2)  # 1: fixed FAISS file names (still read; the next update rewrites it as 2)


# where a passage sits in its original file (cprag.index.readers): last, and nullable, so a table written before
# they existed takes them as all-null columns (`PassageStore.add_location_columns`); null kind reads as "prose"
LOCATION_FIELDS = (
    ("kind", pa.string()),  # "prose", "code", "table" or "links"
    ("page", pa.int32()),  # 1-based PDF page where the passage starts
    ("anchor", pa.string()),  # HTML id or Markdown slug of the passage's heading
)
LOCATION_COLUMNS = tuple(name for name, _ in LOCATION_FIELDS)
# metadata keys that name a document's original file, in the order a link prefers them
SOURCE_KEYS = ("url", "source", "path")


def passage_schema(embedding_dim: int) -> pa.Schema:
    return pa.schema([
        ("passage_id", pa.string()),
        ("doc_id", pa.string()),
        ("title", pa.string()),
        ("text", pa.string()),
        ("char_start", pa.int32()),
        ("doc_hash", pa.string()),
        ("metadata", pa.string()),
        ("n_tokens", pa.int32()),
        ("token_ids", pa.binary()),  # int32 little-endian, one per token
        ("offsets", pa.binary()),  # int32 (start, end) per token, relative to the passage text
        ("keys", pa.binary()),  # (n_tokens, key_dim) in the manifest's key_dtype (cprag.index.key_codec): key j pastes
        # token_ids[j]
        ("embedding", pa.list_(pa.float32(), embedding_dim)),
        *LOCATION_FIELDS,
    ])


@dataclass
class StoredPassage:
    passage_id: str
    doc_id: str
    title: str
    text: str
    char_start: int
    keys: PassageKeys
    kind: str = "prose"
    page: int | None = None
    anchor: str | None = None
    source: str | None = None  # the document's URL or file path (its metadata's url, source or path), for links

    @property
    def n_tokens(self) -> int:
        return len(self.keys.ids)


def write_manifest(path: Path, manifest: dict) -> None:
    """Atomic replace: a reader never sees half a manifest."""
    file = IndexLayout(path).manifest
    staging(file).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(staging(file), file)


REBUILD = "rebuild it with: cprag index CORPUS --index {path} --rebuild"
REFRESH = "rerun cprag index CORPUS --index {path} (it rebuilds the FAISS index from the stored passages)"


def read_manifest(path: Path) -> dict:
    path = Path(path)
    layout = IndexLayout(path)
    file = layout.manifest
    if not file.is_file():
        if layout.lancedb.is_dir():  # a table without its manifest: the model that wrote the keys is unknown
            raise IndexCorrupt(str(path), f"{MANIFEST} is missing, so the model that wrote the keys is unknown; "
                               + REBUILD.format(path=path))
        raise IndexNotFound(str(path))
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = getattr(error, "msg", "not UTF-8")
        raise IndexCorrupt(str(path), f"{MANIFEST} is not valid JSON ({reason}); "
                           + REBUILD.format(path=path)) from None
    if not isinstance(manifest, dict):
        raise IndexCorrupt(str(path), f"{MANIFEST} is not a JSON object; " + REBUILD.format(path=path))
    version = manifest.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise IndexCorrupt(str(path), f"{MANIFEST} has format version {version}, newer than this cprag reads "
                           f"({FORMAT_VERSION}): upgrade cprag, or " + REBUILD.format(path=path))
    if version not in READABLE_FORMATS:
        raise IndexCorrupt(str(path), f"{MANIFEST} has format version {version}, expected {FORMAT_VERSION}; "
                           + REBUILD.format(path=path))
    return manifest


def check_model(path: Path, manifest: dict, fingerprint: str) -> None:
    if manifest["model_fingerprint"] != fingerprint:
        raise ModelMismatch(f"index {path}", manifest["model_fingerprint"], fingerprint, REBUILD.format(path=path))


class PassageStore:
    """The LanceDB passages table of one index directory."""

    def __init__(self, path: str | Path, embedding_dim: int, create: bool = False, version: int | None = None,
                 key_codec: Codec = "float16"):
        """`version`: read that committed LanceDB version of the table (a reader's snapshot) instead of the
        latest; the store is then read-only. `key_codec`: how the keys are stored (cprag.index.key_codec)."""
        import lancedb

        self.path = Path(path)
        self.layout = IndexLayout(self.path)
        self.embedding_dim = embedding_dim
        self.key_codec = key_codec
        try:
            self.db = lancedb.connect(str(self.layout.lancedb))
            exists = TABLE in self.db.list_tables().tables
            if exists or create:
                self.table = (self.db.open_table(TABLE) if exists
                              else self.db.create_table(TABLE, schema=passage_schema(embedding_dim)))
        except Exception as error:  # lance reports damaged files as OSError / RuntimeError / ValueError
            raise self.unreadable(error) from None
        if not (exists or create):
            raise IndexCorrupt(str(path), f"the passages table {TABLE_DIR} is missing; "
                               + REBUILD.format(path=path))
        if version is not None:
            try:
                self.table.checkout(version)
            except Exception as error:  # the version's files removed (a cleanup, a half-copied directory)
                raise self.unreadable(error) from None
        elif create:
            self.add_location_columns()

    def add_location_columns(self) -> None:
        """Give a table written before passages had a kind, page and anchor those columns, all null, so this
        writer's rows fit it; readers of its earlier versions see the columns those versions have."""
        missing = [field for field in LOCATION_FIELDS if field[0] not in self.table.schema.names]
        if not missing:
            return
        try:
            self.table.add_columns(pa.schema(missing))
        except Exception as error:
            raise self.unreadable(error) from None

    def optimize(self) -> None:
        """Compact the table's fragments and (re)build a BTREE index on passage_id, so fetching a handful of
        passages by id stays a lookup, not a scan, at millions of rows."""
        from lancedb.index import BTree

        self.table.optimize()
        self.table.create_index("passage_id", config=BTree(), replace=True)  # the column comes first

    @property
    def version(self) -> int:
        return self.table.version

    @property
    def uri(self) -> str:
        """The Lance dataset directory of the table, where Ray actors write fragments (cprag.index.ray_runner)."""
        return str(self.layout.table_dataset.resolve())  # actors have their own working dirs

    @property
    def data_storage_version(self) -> str:
        """The Lance file format of the table's data files, which fragments written elsewhere must share."""
        return self.table.to_lance().data_storage_version

    def append_fragments(self, fragments: list) -> None:
        """Commit Lance fragments written elsewhere (by Ray actors) as one Append on the latest version."""
        import lance

        if not fragments:
            return
        self.table.checkout_latest()
        lance.LanceDataset.commit(self.uri, lance.LanceOperation.Append(fragments), read_version=self.version)
        self.table.checkout_latest()

    def tokens_of(self, passage_ids: set[str]) -> int:
        """Passage tokens (without each passage's end-of-turn key) stored for these ids."""
        rows = self.table.to_arrow().select(["passage_id", "n_tokens"]).to_pydict()
        return sum(n - 1 for pid, n in zip(rows["passage_id"], rows["n_tokens"], strict=True) if pid in passage_ids)

    def unreadable(self, error: Exception) -> IndexCorrupt:
        return IndexCorrupt(str(self.path), f"the passages table {TABLE_DIR} is unreadable "
                            f"({error_line(error)}); " + REBUILD.format(path=self.path))

    def count(self) -> int:
        return self.table.count_rows()

    def stored_hashes(self) -> dict[str, tuple[str, str]]:
        """passage_id -> (doc_id, doc_hash) of every stored row."""
        rows = self.table.to_arrow().select(["passage_id", "doc_id", "doc_hash"]).to_pydict()
        return dict(zip(rows["passage_id"], zip(rows["doc_id"], rows["doc_hash"], strict=True), strict=True))

    def upsert(self, rows: list[dict]) -> None:
        """Insert or replace rows by passage id, in one commit."""
        if not rows:
            return
        data = pa.Table.from_pylist(rows, schema=passage_schema(self.embedding_dim))
        self.table.merge_insert("passage_id").when_matched_update_all().when_not_matched_insert_all().execute(data)

    def delete(self, passage_ids: list[str]) -> None:
        for start in range(0, len(passage_ids), 500):
            chunk = passage_ids[start : start + 500]
            self.table.delete("passage_id IN (" + ", ".join(_sql_string(p) for p in chunk) + ")")

    def embeddings(self) -> tuple[list[str], np.ndarray]:
        data = self.table.to_arrow().select(["passage_id", "embedding"])
        ids = data.column("passage_id").to_pylist()
        flat = data.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        return ids, np.asarray(flat, dtype=np.float32).reshape(len(ids), self.embedding_dim)

    def fetch(self, passage_ids: list[str]) -> dict[str, StoredPassage]:
        """Passages with their keys, by id, in one filtered scan (milliseconds for a handful of ids)."""
        if not passage_ids:
            return {}
        where = "passage_id IN (" + ", ".join(_sql_string(p) for p in passage_ids) + ")"
        columns = ["passage_id", "doc_id", "title", "text", "char_start", "metadata", "n_tokens", "token_ids",
                   "offsets", "keys"]
        columns += [name for name in LOCATION_COLUMNS if name in self.table.schema.names]  # absent in old tables
        try:
            rows = self.table.search().where(where).select(columns).limit(len(passage_ids)).to_arrow().to_pylist()
        except Exception as error:  # a data file removed or truncated under the table
            raise self.unreadable(error) from None
        found = {}
        for row in rows:
            n = row["n_tokens"]
            keys = decode_keys(row["keys"], n, self.key_codec)
            found[row["passage_id"]] = StoredPassage(
                passage_id=row["passage_id"], doc_id=row["doc_id"], title=row["title"], text=row["text"],
                char_start=row["char_start"],
                keys=PassageKeys(
                    keys=keys, ids=np.frombuffer(row["token_ids"], dtype=np.int32),
                    offsets=np.frombuffer(row["offsets"], dtype=np.int32).reshape(n, 2),
                ),
                kind=row.get("kind") or "prose", page=row.get("page"), anchor=row.get("anchor"),
                source=_source(row["metadata"]),
            )
        return found

    def totals(self) -> dict:
        data = self.table.to_arrow().select(["doc_id", "n_tokens", "keys", "token_ids"])
        tokens = int(pa.compute.sum(data.column("n_tokens")).as_py() or 0)
        key_bytes = int(pa.compute.sum(pa.compute.binary_length(data.column("keys"))).as_py() or 0)
        id_bytes = int(pa.compute.sum(pa.compute.binary_length(data.column("token_ids"))).as_py() or 0)
        return {
            "documents": len(set(data.column("doc_id").to_pylist())),
            "passages": data.num_rows,
            "tokens": tokens,
            "key_and_id_bytes": key_bytes + id_bytes,
        }


def error_line(error: BaseException) -> str:
    """The first line of an error from LanceDB or FAISS, without the Rust source path lance appends."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r",\s*/\S*\.cargo/.*$", "", line)[:200]


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def row_for(passage, keys: PassageKeys, embedding: np.ndarray, metadata: dict, key_codec: Codec = "float16"
            ) -> dict:
    return {
        "passage_id": passage.passage_id, "doc_id": passage.doc_id, "title": passage.title, "text": passage.text,
        "char_start": passage.char_start, "doc_hash": passage.doc_hash,
        "metadata": json.dumps(metadata, ensure_ascii=False), "n_tokens": len(keys.ids),
        "token_ids": keys.ids.astype("<i4").tobytes(), "offsets": keys.offsets.astype("<i4").tobytes(),
        "keys": encode_keys(keys.keys, key_codec), "embedding": embedding.astype(np.float32).tolist(),
        "kind": passage.kind, "page": passage.page, "anchor": passage.anchor,
    }


def _source(metadata: str | None) -> str | None:
    """The document's URL or file path from a row's metadata JSON, or None."""
    try:
        fields = json.loads(metadata) if metadata else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(fields, dict):
        return None
    return next((str(fields[k]) for k in SOURCE_KEYS if isinstance(fields.get(k), str) and fields[k]), None)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
