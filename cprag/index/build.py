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
from cprag.index.key_codec import PQ_FILE, PQ_TRAIN_KEYS, Codec, PQCodebook, codec_name, decode_keys, encode_keys
from cprag.index.lock import WriteLock
from cprag.index.retrieve import (
    APPROXIMATE_ABOVE,
    COMPRESSED_ABOVE,
    FAISS_GLOBS,
    PassageIndex,
    faiss_files_for,
    passage_text_for_retrieval,
)
from cprag.index.store import (
    FORMAT_VERSION,
    MANIFEST,
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
    documents_read = read_corpus(corpus)  # raises before anything stored is touched
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


def _build_locked(documents_read, index_dir: Path, model, tokenizer, embedder, config: IndexConfig,
                  fingerprint: str, started: float, on_progress, ray: RayIndexSettings | None) -> IndexReport:
    if not config.rebuild and (index_dir / MANIFEST).is_file():  # under the lock: no writer can change it now
        existing = read_manifest(index_dir)
        check_model(index_dir, existing, fingerprint)
        stored_codec = existing.get("key_dtype", "float16")
        if stored_codec != config.key_codec:  # one table, one codec: mixing them would misread every other row
            raise ConfigError("--keys", config.key_codec, f"{index_dir} stores {stored_codec} keys; add --rebuild "
                              f"to re-encode the corpus as {config.key_codec}")
    if config.rebuild and index_dir.exists():
        (index_dir / MANIFEST).unlink(missing_ok=True)  # the commit point first
        shutil.rmtree(index_dir / "lancedb", ignore_errors=True)
        _remove_faiss_files(index_dir, keep=set())
        (index_dir / PQ_FILE).unlink(missing_ok=True)
    index_dir.mkdir(parents=True, exist_ok=True)

    passages: list[Passage] = []
    for document in documents_read.documents:
        passages.extend(split_document(document, tokenizer, config.max_passage_tokens))
    metadata = {d.id: d.metadata for d in documents_read.documents}

    manifest = _manifest(model, fingerprint, embedder, config, index_dir)
    if not (index_dir / MANIFEST).is_file():  # before the table: a table without a manifest reads as damaged
        write_manifest(index_dir, {**manifest, "status": "building"})
    try:
        store = PassageStore(index_dir, embedder.dim, create=True, key_codec=config.key_codec)
    except IndexCorrupt:
        if read_manifest(index_dir).get("status") == "complete":
            raise  # a finished version is damaged: the user decides (--rebuild)
        # a first build killed while LanceDB created its table: nothing was ever committed, start the table over
        shutil.rmtree(index_dir / "lancedb", ignore_errors=True)
        store = PassageStore(index_dir, embedder.dim, create=True, key_codec=config.key_codec)
    stored = store.stored_hashes()
    todo = [p for p in passages if stored.get(p.passage_id) != (p.doc_id, p.doc_hash)]
    current_ids = {p.passage_id for p in passages}
    corpus_docs = {p.doc_id for p in passages}
    # a document of this corpus may now have fewer passages: its leftovers go, whether it changed in this run or in
    # an earlier one that was interrupted before its deletes; documents absent from this corpus are never removed
    stale = [pid for pid, (doc_id, _) in stored.items() if pid not in current_ids and doc_id in corpus_docs]

    codec, first, tokens_encoded, encode_seconds = config.key_codec, 0, 0, 0.0
    if codec == "pq":  # the codebook first: learned from the first chunks' keys, which are then stored as codes
        codec, first, tokens_encoded, encode_seconds = _pq_codebook(index_dir, store, stored, todo, metadata, model,
                                                                    tokenizer, embedder, config, on_progress)
    store.key_codec = codec
    if ray is None:
        for start in range(first, len(todo), config.chunk_passages):
            chunk = todo[start : start + config.chunk_passages]
            rows, seconds = encode_chunk(chunk, metadata, model, tokenizer, embedder, codec)
            encode_seconds += seconds
            tokens_encoded += sum(row["n_tokens"] - 1 for row in rows)  # the end-of-turn key is not a token read
            store.upsert(rows)
            if on_progress:
                on_progress("encode", start + len(chunk), len(todo))
    else:
        from dataclasses import replace

        from cprag.index.ray_runner import encode_on_ray

        # the actors encode in the dtype the manifest records: the driver's, unless the settings name one
        ray = replace(ray, dtype=ray.dtype or manifest["encode_dtype"])

        store.delete([p.passage_id for p in todo[first:] if p.passage_id in stored])  # appends must not repeat them
        def overall(stage: str, done: int, total: int) -> None:  # counted from the start of todo, as above
            if on_progress:
                on_progress(stage, first + done, len(todo))

        ray_tokens, ray_seconds = encode_on_ray(store, todo[first:], metadata, config.chunk_passages, codec,
                                                fingerprint, ray, encode_chunk, overall)
        tokens_encoded, encode_seconds = tokens_encoded + ray_tokens, encode_seconds + ray_seconds
    store.delete(stale)
    if store.count() >= OPTIMIZE_ABOVE:  # compaction and an id index: fetches stay lookups at millions of rows
        store.optimize()

    # commit: the new version's FAISS files beside the old ones, then the manifest that names them
    passage_ids, vectors = store.embeddings()
    faiss_files = faiss_files_for(store.version)
    passage_index = PassageIndex.build(passage_ids, vectors, config.approximate_above,
                                       compressed_above=config.compressed_above)
    passage_index.save(index_dir, faiss_files, store.version)
    totals = store.totals()
    named = set(faiss_files.values())
    # the previous version's FAISS files stay until this manifest commits: they are not this version's bytes
    disk_bytes = directory_bytes(index_dir) - sum(f.stat().st_size for f in _faiss_files(index_dir, keep=named))
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
    write_manifest(index_dir, manifest)
    _remove_faiss_files(index_dir, keep=named)  # no manifest names them any more
    return IndexReport(
        index=str(index_dir), documents=len(documents_read.documents), passages=len(passages), encoded=len(todo),
        unchanged=len(passages) - len(todo), removed=len(stale), tokens_encoded=tokens_encoded,
        encode_seconds=encode_seconds, seconds=time.perf_counter() - started, skipped=documents_read.skipped,
        manifest=manifest,
    )


def _pq_codebook(index_dir: Path, store, stored: dict, todo: list[Passage], metadata: dict, model, tokenizer,
                 embedder, config: IndexConfig, on_progress) -> tuple[PQCodebook, int, int, float]:
    """The index's PQ codebook, and how far into `todo` learning it got: (codebook, passages stored, tokens
    encoded, encode seconds). An index that has one keeps it (its stored codes depend on it); a new one learns it
    from the keys of the first chunks (up to PQ_TRAIN_KEYS), saves it, and stores those chunks as codes."""
    if (index_dir / PQ_FILE).is_file():
        return PQCodebook.load(index_dir / PQ_FILE), 0, 0, 0.0
    if stored:  # codes without their codebook cannot be read back
        raise IndexCorrupt(str(index_dir), f"{PQ_FILE} is missing, so the stored pq keys cannot be decoded; "
                           + REBUILD.format(path=index_dir))
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
    codebook.save(index_dir / PQ_FILE)  # before any code is committed
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


def _faiss_files(index_dir: Path, keep: set[str]) -> list[Path]:
    """FAISS files (and their staging copies) in `index_dir` other than those named in `keep`."""
    return sorted({f for pattern in FAISS_GLOBS for f in index_dir.glob(pattern) if f.name not in keep})


def _remove_faiss_files(index_dir: Path, keep: set[str]) -> None:
    for file in _faiss_files(index_dir, keep):
        file.unlink(missing_ok=True)


def _manifest(model, fingerprint: str, embedder, config: IndexConfig, index_dir: Path) -> dict:
    previous = {}
    if (index_dir / MANIFEST).is_file():
        previous = read_manifest(index_dir)
    return {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": fingerprint,
        "base_model": model.config.base_model,
        "key_dim": model.config.key_dim,
        "key_dtype": config.key_codec,
        "encode_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "token_id_dtype": "int32",
        "retriever": embedder.describe(),
        "max_passage_tokens": config.max_passage_tokens,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(model.config.backbone_config),
        "created": previous.get("created", now()),
    }
