"""How an index stores CP keys: fp16, int8 with one scale per key, or product-quantized codes.

    float16  key_dim x 2 bytes per token                       (132 B per stored token with its id, at 64 dims)
    int8     key_dim bytes + a float16 scale per token         (70 B per stored token: 1/329 of a bf16 KV cache)
    pq       one byte per sub-vector (16 by default)           (20 B per stored token: 1/1152)

int8 keeps each key's direction to within about 0.4% of its largest component: the scale is the key's largest
absolute value over 127, so every component rounds to the nearest of 255 levels. The codec is recorded in the
manifest (`key_dtype`), chosen with `cprag index --keys`, and decoded when key shards are fetched.

pq splits a key into `subvectors` pieces and stores, for each, the nearest of 256 centroids learned by k-means
(FAISS) on keys of the corpus being indexed; the centroids (a `PQCodebook`, 64 KB) are stored in the index
beside the table and named in the manifest (`key_pq`). Keys are rounded to fp16 before they are quantized, so
codes computed from stored fp16 keys equal codes computed from the encoder's output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cprag.errors import ConfigError
from cprag.index.layout import PQ_CODEBOOK

KEY_CODECS = ("float16", "int8", "pq")
NAMES = {"fp16": "float16", "float16": "float16", "int8": "int8", "pq": "pq"}
PQ_SUBVECTORS = 16  # 4 dims each at key_dim 64: 16 B per key
PQ_CENTROIDS = 256  # one byte per code
PQ_TRAIN_KEYS = 65_536  # keys k-means learns from (FAISS wants at least 39 per centroid: 9,984)
PQ_MIN_KEYS = PQ_CENTROIDS


@dataclass
class PQCodebook:
    """Product-quantization centroids: `centroids[m, c]` is centroid c of sub-vector m. Kept as numpy, so it
    pickles to Ray actors; FAISS's quantizer for encoding is rebuilt from it on first use."""

    centroids: np.ndarray  # (subvectors, 256, key_dim / subvectors) float32

    name = "pq"

    @classmethod
    def train(cls, keys: np.ndarray, subvectors: int | None = None, seed: int = 0) -> PQCodebook:
        import faiss

        keys = np.ascontiguousarray(_as_stored(keys))
        subvectors = subvectors or pq_subvectors(keys.shape[1])
        if len(keys) < PQ_MIN_KEYS:
            raise ConfigError("--keys", "pq", f"needs at least {PQ_MIN_KEYS} keys (tokens) to learn its codebook, "
                              f"got {len(keys)}: use fp16 or int8 for a corpus this small")
        if keys.shape[1] % subvectors:
            raise ConfigError("--pq-subvectors", subvectors, f"must divide the key dimension ({keys.shape[1]})")
        quantizer = faiss.ProductQuantizer(keys.shape[1], subvectors, 8)
        quantizer.cp.seed = seed
        quantizer.cp.max_points_per_centroid = PQ_TRAIN_KEYS  # k-means on every key given, not a subsample
        quantizer.train(keys)
        centroids = faiss.vector_to_array(quantizer.centroids).reshape(subvectors, PQ_CENTROIDS, -1)
        return cls(centroids.astype(np.float32))

    @property
    def subvectors(self) -> int:
        return self.centroids.shape[0]

    def encode(self, keys: np.ndarray) -> np.ndarray:
        """(n, D) -> (n, subvectors) uint8: the nearest centroid of each sub-vector (FAISS's search)."""
        import faiss

        if getattr(self, "_quantizer", None) is None:  # built on first use, so the codebook pickles as numpy
            dim = self.centroids.shape[0] * self.centroids.shape[2]
            self._quantizer = faiss.ProductQuantizer(dim, self.subvectors, 8)
            faiss.copy_array_to_vector(np.ascontiguousarray(self.centroids).ravel(), self._quantizer.centroids)
        return self._quantizer.compute_codes(np.ascontiguousarray(_as_stored(keys))).reshape(len(keys), -1)

    def __getstate__(self) -> dict:
        return {"centroids": self.centroids}

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """(n, subvectors) uint8 -> (n, D) float32."""
        parts = self.centroids[np.arange(self.subvectors)[None, :], codes.astype(np.int64)]  # (n, M, d)
        return parts.reshape(len(codes), -1)

    def save(self, path: Path, staging: Path) -> None:
        """Write the centroids to `staging`, then rename it to `path` (cprag.index.layout names both)."""
        np.save(staging, self.centroids)
        os.replace(staging, path)

    @classmethod
    def load(cls, path: Path) -> PQCodebook:
        return cls(np.load(path).astype(np.float32))

    def describe(self) -> dict:
        return {"file": PQ_CODEBOOK, "subvectors": self.subvectors, "centroids": PQ_CENTROIDS,
                "key_dim": int(self.centroids.shape[0] * self.centroids.shape[2])}


def pq_subvectors(key_dim: int) -> int:
    """PQ_SUBVECTORS, or for small keys (tests' tiny models) the largest count below it that divides key_dim."""
    return next(m for m in range(min(PQ_SUBVECTORS, key_dim), 0, -1) if key_dim % m == 0)


def _as_stored(keys: np.ndarray) -> np.ndarray:
    return np.asarray(keys, dtype=np.float32).astype(np.float16).astype(np.float32)


Codec = str | PQCodebook  # a codec name, or the codebook of an index that stores pq codes


def codec_name(name: str, flag: str = "--keys") -> str:
    """The codec's canonical name ("fp16" is "float16"), or ConfigError naming `flag`."""
    if name not in NAMES:
        raise ConfigError(flag, name, "expected fp16, int8 or pq")
    return NAMES[name]


def bytes_per_key(key_dim: int, codec: Codec) -> int:
    if isinstance(codec, PQCodebook):
        return codec.subvectors
    return {"float16": 2 * key_dim, "int8": key_dim + 2, "pq": pq_subvectors(key_dim)}[codec]


def encode_keys(keys: np.ndarray, codec: Codec) -> bytes:
    """keys (n, D) float -> the stored bytes."""
    if isinstance(codec, PQCodebook):
        return codec.encode(keys).tobytes()
    if codec == "pq":
        raise ValueError("pq keys need the index's PQCodebook, not the name")
    if codec == "float16":
        return keys.astype("<f2").tobytes()
    keys = keys.astype(np.float32)
    scale = (np.abs(keys).max(axis=1) / 127.0).astype("<f2")  # (n,) rounded as it will be read back
    safe = np.where(scale > 0, scale.astype(np.float32), 1.0)[:, None]
    codes = np.clip(np.rint(keys / safe), -127, 127).astype(np.int8)
    return scale.tobytes() + codes.tobytes()


def decode_keys(blob: bytes, n: int, codec: Codec) -> np.ndarray:
    """The stored bytes of n keys -> (n, D): float16 as stored, or float32 for int8 and pq."""
    if isinstance(codec, PQCodebook):
        return codec.decode(np.frombuffer(blob, dtype=np.uint8).reshape(n, -1))
    if codec == "float16":
        return np.frombuffer(blob, dtype="<f2").reshape(n, -1)
    scale = np.frombuffer(blob, dtype="<f2", count=n).astype(np.float32)
    codes = np.frombuffer(blob, dtype=np.int8, offset=2 * n).reshape(n, -1)
    return codes.astype(np.float32) * scale[:, None]


def round_trip(keys: np.ndarray, codec: Codec) -> np.ndarray:
    """The keys as an index with this codec would give them back (for evaluating a codec without an index)."""
    return decode_keys(encode_keys(keys, codec), len(keys), codec)
