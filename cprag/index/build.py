"""`cprag index`: corpus -> passages -> CP keys + embeddings in LanceDB -> FAISS, resumable and incremental."""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cprag.errors import ConfigError, CorpusError, DiskFull, IndexCorrupt
from cprag.index.corpus import Passage, Skipped, read_corpus, split_document
from cprag.index.encode import encode_passages, tokenize_passage
from cprag.index.key_codec import PQ_TRAIN_KEYS, Codec, PQCodebook, codec_name, decode_keys, encode_keys
from cprag.index.layout import PQ_CODEBOOK, IndexLayout, faiss_files_for
from cprag.index.lock import WriteLock
from cprag.index.retrieve import APPROXIMATE_ABOVE, COMPRESSED_ABOVE, PassageIndex, passage_text_for_retrieval
from cprag.index.store import (
    FORMAT_VERSION,
    REBUILD,
    PassageStore,
    check_model,
    directory_bytes,
    error_line,
    now,
    read_manifest,
    row_for,
    write_manifest,
)
from cprag.model.checkpoint import model_fingerprint
from cprag.model.reproducible import blas_reproducible

if TYPE_CHECKING:
    from cprag.index.ray_runner import RayIndexSettings

OPTIMIZE_ABOVE = 10_000  # passages: below, a fetch's scan of the table takes a few milliseconds anyway


@dataclass
class IndexConfig:
    max_passage_tokens: int = 384
    chunk_passages: int = 64
    rebuild: bool = False
    key_codec: str = "float16"  # how keys are stored: "float16", "int8" or "pq" (cprag.index.key_codec)
    approximate_above: int = APPROXIMATE_ABOVE  # passages above which FAISS is an IVF (cprag.index.retrieve)
    compressed_above: int = COMPRESSED_ABOVE  # passages above which the IVF's vectors are 8-bit
    pq_subvectors: int | None = None  # --keys pq: one-byte codes per key (None: cprag.index.key_codec.pq_subvectors)
    glob: str | None = None  # --glob: the corpus folder's files to read, e.g. "**/*.html" (None: every readable one)

    def __post_init__(self):
        self.key_codec = codec_name(self.key_codec)
        if self.approximate_above < 1:
            raise ConfigError("--approximate-above", self.approximate_above, "must be at least 1")
        if self.compressed_above < 1:
            raise ConfigError("--compressed-above", self.compressed_above, "must be at least 1")
        if self.max_passage_tokens < 8:
            raise ConfigError("--max-passage-tokens", self.max_passage_tokens, "must be at least 8")
        if self.pq_subvectors is not None and self.pq_subvectors < 1:
            raise ConfigError("--pq-subvectors", self.pq_subvectors, "must be at least 1")
        if self.chunk_passages < 1:
            raise ConfigError("--chunk", self.chunk_passages, "must be at least 1")


@dataclass
class IndexReport:
    index: str
    documents: int
    passages: int
    encoded: int
    unchanged: int
    removed: int
    tokens_encoded: int
    encode_seconds: float
    seconds: float
    skipped: list[Skipped] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)

    @property
    def encode_tokens_per_second(self) -> float:
        return self.tokens_encoded / self.encode_seconds if self.encode_seconds else 0.0


def kv_cache_bytes_per_token(backbone_config, bytes_per_value: int = 2) -> int:
    """2 (K and V) x layers x kv heads x head dim values per token, in bf16 by default."""
    heads = backbone_config.num_key_value_heads or backbone_config.num_attention_heads
    head_dim = getattr(backbone_config, "head_dim", None)
    head_dim = head_dim or backbone_config.hidden_size // backbone_config.num_attention_heads
    return 2 * backbone_config.num_hidden_layers * heads * head_dim * bytes_per_value


def build_index(
    corpus: str | Path,
    index_dir: str | Path,
    model,
    tokenizer,
    embedder,
    config: IndexConfig | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    fingerprint: str | None = None,
    ray: RayIndexSettings | None = None,
) -> IndexReport:
    """Index a corpus into `index_dir`, adding only new or changed documents (upsert by id).

    `on_progress(stage, done, total)` reports progress. An interrupted run keeps every committed chunk; the next
    run picks up where it stopped. A second writer on the same directory is refused (`IndexLocked`), and the model
    fingerprint is checked under the lock, both before anything is written. Pass `fingerprint` when `model` was cast
    from its stored weights (bf16 encoding): an index belongs to the checkpoint, whatever dtype encoded it. Pass
    `ray` to encode on a Ray cluster (cprag.index.ray_runner): the same rows, written as Lance fragments by its actors.
    """
    config = config or IndexConfig()
    started = time.perf_counter()
    index_dir = Path(index_dir)
    window = model.config.max_position_embeddings
    if config.max_passage_tokens >= window:
        raise ConfigError("--max-passage-tokens", config.max_passage_tokens, f"must be below the window ({window})")
    fingerprint = fingerprint or model_fingerprint(model)
    documents_read = read_corpus(corpus, glob=config.glob)  # raises before anything stored is touched
    if not documents_read.documents:
        raise CorpusError(str(corpus), f"no readable documents ({len(documents_read.skipped)} skipped)")
    with WriteLock(index_dir):
        try:
            return _build_locked(documents_read, index_dir, model, tokenizer, embedder, config, fingerprint,
                                 started, on_progress, ray)
        except Exception as error:
            if not _disk_full(error):
                raise
            # every write is a commit or an atomic replace, so nothing finished was touched
            raise DiskFull(str(index_dir), error_line(error)) from None


def _disk_full(error: BaseException) -> bool:
    """ENOSPC from Python, or as LanceDB (Rust) and FAISS (C++) word it in their own exceptions."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    text = str(error)
    return "No space left on device" in text or "os error 28" in text


@dataclass
class _Plan:
    """What one run writes: the corpus's passages, those to encode (new or changed), and the stored rows to drop."""

    passages: list[Passage]
    metadata: dict[str, dict]  # document id -> its metadata
    stored: dict[str, tuple[str, str]]  # passage id -> (doc_id, doc_hash) of every row already in the table
    todo: list[Passage]
    stale: list[str]


@dataclass
class _Encoded:
    codec: Codec  # how the rows were stored: a codec name, or the PQ codebook they refer to
    tokens: int
    seconds: float


def _build_locked(documents_read, index_dir: Path, model, tokenizer, embedder, config: IndexConfig,
                  fingerprint: str, started: float, on_progress, ray: RayIndexSettings | None) -> IndexReport:
    layout = IndexLayout(index_dir)
    _prepare_directory(layout, config, fingerprint)
    passages: list[Passage] = []
    for document in documents_read.documents:
        passages.extend(split_document(document, tokenizer, config.max_passage_tokens))
    metadata = {d.id: d.metadata for d in documents_read.documents}
    manifest = _manifest(model, fingerprint, embedder, config, index_dir)
    store = _open_store(layout, manifest, embedder, config)
    plan = _plan(passages, metadata, store)
    if ray is None:
        encoded = _encode_here(layout, store, plan, model, tokenizer, embedder, config, on_progress)
    else:
        encoded = _encode_on_ray(layout, store, plan, model, tokenizer, embedder, config, on_progress, fingerprint,
                                 ray, manifest["encode_dtype"])
    store.delete(plan.stale)
    if store.count() >= OPTIMIZE_ABOVE:  # compaction and an id index: fetches stay lookups at millions of rows
        store.optimize()
    _commit(layout, store, manifest, encoded.codec, config)
    return IndexReport(
        index=str(index_dir), documents=len(documents_read.documents), passages=len(passages),
        encoded=len(plan.todo), unchanged=len(passages) - len(plan.todo), removed=len(plan.stale),
        tokens_encoded=encoded.tokens, encode_seconds=encoded.seconds, seconds=time.perf_counter() - started,
        skipped=documents_read.skipped, manifest=manifest,
    )


def _prepare_directory(layout: IndexLayout, config: IndexConfig, fingerprint: str) -> None:
    """Refuse an update the stored index cannot take, or clear it for --rebuild; then make sure it exists."""
    index_dir = layout.path
    if not config.rebuild and layout.manifest.is_file():  # under the lock: no writer can change it now
        existing = read_manifest(index_dir)
        check_model(index_dir, existing, fingerprint)
        stored_codec = existing.get("key_dtype", "float16")
        if stored_codec != config.key_codec:  # one table, one codec: mixing them would misread every other row
            raise ConfigError("--keys", config.key_codec, f"{index_dir} stores {stored_codec} keys; add --rebuild "
                              f"to re-encode the corpus as {config.key_codec}")
    if config.rebuild and index_dir.exists():
        layout.manifest.unlink(missing_ok=True)  # the commit point first
        shutil.rmtree(layout.lancedb, ignore_errors=True)
        layout.remove_faiss_files_except(keep=set())
        layout.pq_codebook.unlink(missing_ok=True)
    index_dir.mkdir(parents=True, exist_ok=True)


def _open_store(layout: IndexLayout, manifest: dict, embedder, config: IndexConfig) -> PassageStore:
    """The passages table, created on a first build, after a "building" manifest that says no version is whole."""
    if not layout.manifest.is_file():  # before the table: a table without a manifest reads as damaged
        write_manifest(layout.path, {**manifest, "status": "building"})
    try:
        return PassageStore(layout.path, embedder.dim, create=True, key_codec=config.key_codec)
    except IndexCorrupt:
        if read_manifest(layout.path).get("status") == "complete":
            raise  # a finished version is damaged: the user decides (--rebuild)
        # a first build killed while LanceDB created its table: nothing was ever committed, start the table over
        shutil.rmtree(layout.lancedb, ignore_errors=True)
        return PassageStore(layout.path, embedder.dim, create=True, key_codec=config.key_codec)


def _plan(passages: list[Passage], metadata: dict, store: PassageStore) -> _Plan:
    stored = store.stored_hashes()
    todo = [p for p in passages if stored.get(p.passage_id) != (p.doc_id, p.doc_hash)]
    current_ids = {p.passage_id for p in passages}
    corpus_docs = {p.doc_id for p in passages}
    # a document of this corpus may now have fewer passages: its leftovers go, whether it changed in this run or in
    # an earlier one that was interrupted before its deletes; documents absent from this corpus are never removed
    stale = [pid for pid, (doc_id, _) in stored.items() if pid not in current_ids and doc_id in corpus_docs]
    return _Plan(passages, metadata, stored, todo, stale)


def _start_codec(layout: IndexLayout, store: PassageStore, plan: _Plan, model, tokenizer, embedder,
                 config: IndexConfig, on_progress) -> tuple[_Encoded, int]:
    """The codec rows are stored with, and how many passages of `todo` are stored already. With pq keys the
    codebook comes first: learned from the first chunks' keys, which are then stored as codes."""
    if config.key_codec != "pq":
        return _Encoded(config.key_codec, 0, 0.0), 0
    codec, first, tokens, seconds = _pq_codebook(layout, store, plan.stored, plan.todo, plan.metadata, model,
                                                 tokenizer, embedder, config, on_progress)
    return _Encoded(codec, tokens, seconds), first


def _encode_here(layout: IndexLayout, store: PassageStore, plan: _Plan, model, tokenizer, embedder,
                 config: IndexConfig, on_progress) -> _Encoded:
    """Encode `todo` in this process, one upsert (one LanceDB commit) per chunk."""
    encoded, first = _start_codec(layout, store, plan, model, tokenizer, embedder, config, on_progress)
    store.key_codec = encoded.codec
    todo = plan.todo
    for start in range(first, len(todo), config.chunk_passages):
        chunk = todo[start : start + config.chunk_passages]
        rows, seconds = encode_chunk(chunk, plan.metadata, model, tokenizer, embedder, encoded.codec)
        encoded.seconds += seconds
        encoded.tokens += sum(row["n_tokens"] - 1 for row in rows)  # the end-of-turn key is not a token read
        store.upsert(rows)
        if on_progress:
            on_progress("encode", start + len(chunk), len(todo))
    return encoded


def _encode_on_ray(layout: IndexLayout, store: PassageStore, plan: _Plan, model, tokenizer, embedder,
                   config: IndexConfig, on_progress, fingerprint: str, ray: RayIndexSettings, encode_dtype: str
                   ) -> _Encoded:
    """Encode `todo` on a Ray cluster (cprag.index.ray_runner); its actors append the rows as Lance fragments."""
    from dataclasses import replace

    from cprag.index.ray_runner import encode_on_ray

    encoded, first = _start_codec(layout, store, plan, model, tokenizer, embedder, config, on_progress)
    store.key_codec = encoded.codec
    todo = plan.todo
    # the actors encode in the dtype the manifest records: the driver's, unless the settings name one
    ray = replace(ray, dtype=ray.dtype or encode_dtype)

    store.delete([p.passage_id for p in todo[first:] if p.passage_id in plan.stored])  # appends must not repeat them
    def overall(stage: str, done: int, total: int) -> None:  # counted from the start of todo, as in _encode_here
        if on_progress:
            on_progress(stage, first + done, len(todo))

    tokens, seconds = encode_on_ray(store, todo[first:], plan.metadata, config.chunk_passages, encoded.codec,
                                    fingerprint, ray, encode_chunk, overall)
    encoded.tokens, encoded.seconds = encoded.tokens + tokens, encoded.seconds + seconds
    return encoded


def _commit(layout: IndexLayout, store: PassageStore, manifest: dict, codec: Codec, config: IndexConfig) -> None:
    """The new version's FAISS files beside the old ones, then the manifest that names them, then the old files
    go. `manifest` is completed in place with what the committed version holds."""
    passage_ids, vectors = store.embeddings()
    faiss_files = faiss_files_for(store.version)
    passage_index = PassageIndex.build(passage_ids, vectors, config.approximate_above,
                                       compressed_above=config.compressed_above)
    passage_index.save(layout.path, faiss_files, store.version)
    totals = store.totals()
    named = set(faiss_files.values())
    # the previous version's FAISS files stay until this manifest commits: they are not this version's bytes
    disk_bytes = directory_bytes(layout.path) - sum(f.stat().st_size for f in layout.faiss_files_except(named))
    if isinstance(codec, PQCodebook):
        manifest["key_pq"] = codec.describe()
    manifest.update(
        status="complete", table_version=store.version, faiss=faiss_files, faiss_layout=passage_index.layout,
        counts={"documents": totals["documents"], "passages": totals["passages"], "tokens": totals["tokens"]},
        bytes_per_token=round(totals["key_and_id_bytes"] / max(totals["tokens"], 1), 2),
        disk_bytes_per_token=round(disk_bytes / max(totals["tokens"], 1), 2),
        updated=now(),
    )
    manifest["kv_cache_over_keys"] = round(manifest["kv_cache_bytes_per_token"] / max(manifest["bytes_per_token"], 1),
                                           1)
    write_manifest(layout.path, manifest)
    layout.remove_faiss_files_except(keep=named)  # no manifest names them any more


def _pq_codebook(layout: IndexLayout, store, stored: dict, todo: list[Passage], metadata: dict, model, tokenizer,
                 embedder, config: IndexConfig, on_progress) -> tuple[PQCodebook, int, int, float]:
    """The index's PQ codebook, and how far into `todo` learning it got: (codebook, passages stored, tokens
    encoded, encode seconds). An index that has one keeps it (its stored codes depend on it); a new one learns it
    from the keys of the first chunks (up to PQ_TRAIN_KEYS), saves it, and stores those chunks as codes."""
    if layout.pq_codebook.is_file():
        return PQCodebook.load(layout.pq_codebook), 0, 0, 0.0
    if stored:  # codes without their codebook cannot be read back
        raise IndexCorrupt(str(layout.path), f"{PQ_CODEBOOK} is missing, so the stored pq keys cannot be decoded; "
                           + REBUILD.format(path=layout.path))
    sample: list[dict] = []
    first, seen, seconds = 0, 0, 0.0
    while first < len(todo) and seen < PQ_TRAIN_KEYS:
        rows, took = encode_chunk(todo[first : first + config.chunk_passages], metadata, model, tokenizer, embedder,
                                  "float16")
        sample.extend(rows)
        first, seen, seconds = first + len(rows), seen + sum(row["n_tokens"] for row in rows), seconds + took
    keys = [decode_keys(row["keys"], row["n_tokens"], "float16") for row in sample]
    codebook = PQCodebook.train(np.concatenate(keys) if keys else np.zeros((0, model.config.key_dim)),
                                config.pq_subvectors)
    codebook.save(layout.pq_codebook, layout.pq_codebook_staging)  # before any code is committed
    for row, row_keys in zip(sample, keys, strict=True):
        row["keys"] = encode_keys(row_keys, codebook)
    for start in range(0, len(sample), config.chunk_passages):
        store.upsert(sample[start : start + config.chunk_passages])
        if on_progress:
            on_progress("encode", min(start + config.chunk_passages, first), len(todo))
    return codebook, first, sum(row["n_tokens"] - 1 for row in sample), seconds


def encode_chunk(chunk: list[Passage], metadata: dict, model, tokenizer, embedder, key_codec: Codec
                 ) -> tuple[list[dict], float]:
    """Rows of the passages table for one chunk, and the seconds the backbone took. The single-process path and
    each Ray actor (cprag.index.ray_runner) encode exactly these chunks, so their keys agree bit for bit on CPU."""
    tokenized = [tokenize_passage(tokenizer, p.text) for p in chunk]
    tick = time.perf_counter()
    keys = dict(encode_passages(model, tokenized, bos_id=tokenizer.bos_token_id))
    seconds = time.perf_counter() - tick
    embeddings = embedder.embed([passage_text_for_retrieval(p.title, p.text) for p in chunk])
    return [row_for(p, keys[i], embeddings[i], metadata[p.doc_id], key_codec) for i, p in enumerate(chunk)], seconds


def _manifest(model, fingerprint: str, embedder, config: IndexConfig, index_dir: Path) -> dict:
    previous = {}
    if IndexLayout(index_dir).manifest.is_file():
        previous = read_manifest(index_dir)
    return {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": fingerprint,
        "base_model": model.config.base_model,
        "key_dim": model.config.key_dim,
        "key_dtype": config.key_codec,
        "encode_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        # keys that do not depend on the thread count or a competing load (cprag.model.reproducible)
        "reproducible_blas": blas_reproducible(),
        "token_id_dtype": "int32",
        "retriever": embedder.describe(),
        "max_passage_tokens": config.max_passage_tokens,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(model.config.backbone_config),
        "created": previous.get("created", now()),
    }
