"""`cprag eval scale`: an index of many synthetic passages written straight into the real schema, then what a
question costs at that size: FAISS search, fetching k key shards from LanceDB, disk bytes per token, memory.

Synthetic rows have random token ids, character spans and key bytes (`tokens` per passage; keys are random bytes
of the codec's size, so they do not compress, and are never decoded into answers), and embeddings drawn around
topic centres on the unit sphere, as sentence embeddings cluster by topic. Each query is a stored passage's
embedding plus noise, so it has a true nearest passage. (Uniformly random embeddings would have no neighbours worth
the name, and no approximate index finds those.) Nothing here loads a model.
"""

from __future__ import annotations

import json
import resource
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

from cprag.index.key_codec import PQ_CENTROIDS, PQ_SUBVECTORS, Codec, PQCodebook, bytes_per_key
from cprag.index.layout import IndexLayout, faiss_files_for
from cprag.index.retrieve import APPROXIMATE_ABOVE, COMPRESSED_ABOVE, PassageIndex
from cprag.index.store import FORMAT_VERSION, PassageStore, directory_bytes, now, passage_schema, write_manifest

EMBEDDING_DIM = 384
ROWS_PER_COMMIT = 20_000


def _embeddings(rng: np.random.Generator, centres: np.ndarray, count: int, spread: float = 0.35) -> np.ndarray:
    """`count` unit vectors around randomly chosen `centres` (C, E)."""
    points = centres[rng.integers(0, len(centres), size=count)]
    points = points + spread * rng.standard_normal(points.shape).astype(np.float32) / np.sqrt(points.shape[1] / 8)
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def _random_keys(rng: np.random.Generator, tokens: int, key_dim: int, codec: str) -> bytes:
    """Random stored keys of the codec's size (int8: valid fp16 scales, then random codes; pq: random codes)."""
    if codec == "float16":
        return rng.bytes(tokens * key_dim * 2)
    if codec == "pq":
        return rng.bytes(tokens * PQ_SUBVECTORS)
    return rng.random(tokens, dtype=np.float32).astype("<f2").tobytes() + rng.bytes(tokens * key_dim)


def write_synthetic_index(directory: str | Path, passages: int, tokens: int = 128, key_dim: int = 64,
                          key_codec: str = "float16", approximate_above: int = APPROXIMATE_ABOVE, seed: int = 0,
                          compressed_above: int = COMPRESSED_ABOVE, vocab_size: int = 1 << 15,
                          on_progress: Callable[[str, int, int], None] | None = None) -> tuple[dict, np.ndarray]:
    """Write `passages` synthetic rows (one LanceDB commit per 20,000), compact the table, index `passage_id`,
    build FAISS and the manifest. Returns the build timings and the embeddings (N, 384) written. Token ids are
    random below `vocab_size`: they fill their column, whose size is what is measured."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(16, passages // 400), EMBEDDING_DIM)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    write_manifest(directory, {"format_version": FORMAT_VERSION, "status": "building", "synthetic": True})
    stored_codec: Codec = key_codec
    if key_codec == "pq":  # a random codebook: fetches decode random codes through it, as a real index's would
        stored_codec = PQCodebook(rng.standard_normal((PQ_SUBVECTORS, PQ_CENTROIDS, key_dim // PQ_SUBVECTORS))
                                  .astype(np.float32))
        layout = IndexLayout(directory)
        stored_codec.save(layout.pq_codebook, layout.pq_codebook_staging)
    store = PassageStore(directory, EMBEDDING_DIM, create=True, key_codec=stored_codec)
    schema = passage_schema(EMBEDDING_DIM)
    started, embeddings = time.perf_counter(), []
    # every row's keys are its own random bytes, of the codec's size: repeated blobs would let the columnar store
    # compress them, and the disk figure would flatter; 10^10 random floats would only time the generator
    for first in range(0, passages, ROWS_PER_COMMIT):
        count = min(ROWS_PER_COMMIT, passages - first)
        vectors = _embeddings(rng, centres, count)
        embeddings.append(vectors)
        names = [f"s{first + i:09d}" for i in range(count)]
        ids = rng.integers(0, vocab_size, size=(count, tokens), dtype=np.int32)
        ends = rng.integers(1, 9, size=(count, tokens), dtype=np.int32).cumsum(axis=1)  # word-like character spans
        spans = np.stack([ends - 1, ends], axis=-1).astype("<i4")
        table = pa.table({
            "passage_id": names, "doc_id": names, "title": [""] * count, "text": [""] * count,
            "char_start": pa.array(np.zeros(count, dtype=np.int32)), "doc_hash": ["synthetic"] * count,
            "metadata": ["{}"] * count, "n_tokens": pa.array(np.full(count, tokens, dtype=np.int32)),
            "token_ids": [row.astype("<i4").tobytes() for row in ids], "offsets": [row.tobytes() for row in spans],
            "keys": [_random_keys(rng, tokens, key_dim, key_codec) for _ in range(count)],
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), EMBEDDING_DIM),
            "kind": ["prose"] * count, "page": pa.nulls(count, pa.int32()), "anchor": pa.nulls(count, pa.string()),
        }, schema=schema)
        store.table.add(table)
        if on_progress:
            on_progress("write", first + count, passages)
    written = time.perf_counter() - started
    tick = time.perf_counter()
    store.optimize()
    # nobody reads this table's earlier versions: drop their files, so the disk figure is what one version holds
    with warnings.catch_warnings():  # lancedb warns that older versions go: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        store.table.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
    optimized = time.perf_counter() - tick
    tick = time.perf_counter()
    vectors = np.concatenate(embeddings)
    names = [f"s{i:09d}" for i in range(passages)]
    passage_index = PassageIndex.build(names, vectors, approximate_above, seed, compressed_above)
    files = faiss_files_for(store.version)
    passage_index.save(directory, files, store.version)
    faiss_seconds = time.perf_counter() - tick
    manifest = {
        "format_version": FORMAT_VERSION, "status": "complete", "synthetic": True, "model_fingerprint": "synthetic",
        "key_dim": key_dim, "key_dtype": key_codec, "token_id_dtype": "int32",
        "retriever": {"name": "synthetic", "dim": EMBEDDING_DIM}, "table_version": store.version, "faiss": files,
        "faiss_layout": passage_index.layout, "created": now(), "updated": now(),
        **({"key_pq": stored_codec.describe()} if isinstance(stored_codec, PQCodebook) else {}),
        "counts": {"documents": passages, "passages": passages, "tokens": passages * tokens},
        "bytes_per_token": bytes_per_key(key_dim, key_codec) + 4,
    }
    write_manifest(directory, manifest)
    build = {"write_seconds": round(written, 1), "optimize_seconds": round(optimized, 1),
             "faiss_seconds": round(faiss_seconds, 1), "faiss_layout": passage_index.layout}
    return build, vectors


def _percentiles(milliseconds: list[float]) -> tuple[float, float]:
    return float(np.percentile(milliseconds, 50)), float(np.percentile(milliseconds, 99))


def measure_scale(directory: str | Path, vectors: np.ndarray, queries: int = 500, k: int = 5, seed: int = 0
                  ) -> dict[str, float]:
    """FAISS search and key-shard fetch latencies (one question at a time), recall@k of the index against exact
    search, disk bytes per stored token and the process's peak memory, for a `write_synthetic_index` directory."""
    from cprag.index.reader import open_snapshot

    directory = Path(directory)
    snapshot = open_snapshot(directory)
    manifest, store, index = snapshot.manifest, snapshot.store, snapshot.passage_index
    rng = np.random.default_rng(seed + 1)
    asked = vectors[rng.integers(0, len(vectors), size=queries)]
    asked = asked + 0.05 * rng.standard_normal(asked.shape).astype(np.float32)
    asked /= np.linalg.norm(asked, axis=1, keepdims=True)
    search_ms, fetch_ms, hits = [], [], []
    for query in asked:
        tick = time.perf_counter()
        found = index.search(query[None], k)[0]
        search_ms.append((time.perf_counter() - tick) * 1000)
        hits.append(found)
    for found in hits[: min(200, queries)]:
        tick = time.perf_counter()
        shards = store.fetch([h.passage_id for h in found])
        fetch_ms.append((time.perf_counter() - tick) * 1000)
        assert len(shards) == len(found)
    exact_sample = asked[: min(200, queries)]
    recall = index.recall_against_exact(index.passage_ids, vectors, exact_sample, k)
    tokens = manifest["counts"]["tokens"]
    search, fetch = _percentiles(search_ms), _percentiles(fetch_ms)
    return {
        "scale/passages": manifest["counts"]["passages"], "scale/tokens": tokens, "scale/queries": queries,
        "scale/faiss": manifest["faiss_layout"]["kind"],
        "scale/search_p50_ms": round(search[0], 3), "scale/search_p99_ms": round(search[1], 3),
        f"scale/recall@{k}_vs_exact": round(recall, 4),
        f"scale/fetch_p50_ms@k{k}": round(fetch[0], 2), f"scale/fetch_p99_ms@k{k}": round(fetch[1], 2),
        "scale/bytes_per_token": manifest["bytes_per_token"],
        "scale/disk_bytes_per_token": round(directory_bytes(directory) / max(tokens, 1), 2),
        "scale/peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def extrapolate(figures: dict, passages: int) -> dict[str, float]:
    """Storage and memory at `passages`, scaled linearly from the measured run (search and fetch latencies are
    not extrapolated: they depend on the FAISS layout and on LanceDB's index, which the report discusses)."""
    factor = passages / figures["scale/passages"]
    tokens = figures["scale/tokens"] * factor
    return {
        "tokens": tokens,
        "disk_gb": round(figures["scale/disk_bytes_per_token"] * tokens / 1e9, 1),
        "faiss_gb": round(passages * EMBEDDING_DIM * 4 / 1e9, 1),  # IVF-Flat keeps every float32 vector
    }


def write_scale_report(out_dir: str | Path, figures: dict, build: dict) -> list[Path]:
    """summary.json (the figures, build timings, and the linear extrapolation) and report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {**figures, **{f"build/{k}": v for k, v in build.items()}}
    projected = {n: extrapolate(figures, n) for n in (10_000_000, 100_000_000)}
    summary["scale/extrapolated"] = {str(n): v for n, v in projected.items()}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in figures.items())
    lines = "\n".join(f"| {n:,} | {v['tokens']:,.0f} | {v['disk_gb']} | {v['faiss_gb']} |"
                      for n, v in projected.items())
    (out_dir / "report.md").write_text(
        f"# cprag eval scale (one run)\n\n{__doc__.strip()}\n\n| figure | value |\n|---|---|\n{rows}\n\n"
        f"Build: {json.dumps(build)}\n\n## On paper: storage at 10 and 100 million passages\n\n"
        f"| passages | tokens | key store on disk (GB) | IVF-Flat vectors in memory (GB) |\n|---|---|---|---|\n"
        f"{lines}\n")
    return [out_dir / "summary.json", out_dir / "report.md"]
