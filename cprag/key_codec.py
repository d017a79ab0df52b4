"""How an index stores CP keys: fp16, or int8 with one scale per key.

    float16  key_dim x 2 bytes per token                       (132 B per stored token with its id, at 64 dims)
    int8     key_dim bytes + a float16 scale per token         (70 B per stored token: 1/329 of a bf16 KV cache)

int8 keeps each key's direction to within about 0.4% of its largest component: the scale is the key's largest
absolute value over 127, so every component rounds to the nearest of 255 levels. The codec is recorded in the
manifest (`key_dtype`), chosen with `cprag index --keys`, and decoded when key shards are fetched.
"""

from __future__ import annotations

import numpy as np

from cprag.errors import ConfigError

KEY_CODECS = ("float16", "int8")
NAMES = {"fp16": "float16", "float16": "float16", "int8": "int8"}


def codec_name(name: str, flag: str = "--keys") -> str:
    """The codec's canonical name ("fp16" is "float16"), or ConfigError naming `flag`."""
    if name not in NAMES:
        raise ConfigError(flag, name, "expected fp16 or int8")
    return NAMES[name]


def bytes_per_key(key_dim: int, codec: str) -> int:
    return 2 * key_dim if codec == "float16" else key_dim + 2


def encode_keys(keys: np.ndarray, codec: str) -> bytes:
    """keys (n, D) float -> the stored bytes."""
    if codec == "float16":
        return keys.astype("<f2").tobytes()
    keys = keys.astype(np.float32)
    scale = (np.abs(keys).max(axis=1) / 127.0).astype("<f2")  # (n,) rounded as it will be read back
    safe = np.where(scale > 0, scale.astype(np.float32), 1.0)[:, None]
    codes = np.clip(np.rint(keys / safe), -127, 127).astype(np.int8)
    return scale.tobytes() + codes.tobytes()


def decode_keys(blob: bytes, n: int, codec: str) -> np.ndarray:
    """The stored bytes of n keys -> (n, D): float16 as stored, or float32 for int8."""
    if codec == "float16":
        return np.frombuffer(blob, dtype="<f2").reshape(n, -1)
    scale = np.frombuffer(blob, dtype="<f2", count=n).astype(np.float32)
    codes = np.frombuffer(blob, dtype=np.int8, offset=2 * n).reshape(n, -1)
    return codes.astype(np.float32) * scale[:, None]


def round_trip(keys: np.ndarray, codec: str) -> np.ndarray:
    """The keys as an index with this codec would give them back (for evaluating a codec without an index)."""
    return decode_keys(encode_keys(keys, codec), len(keys), codec)
