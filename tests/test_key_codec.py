"""Key codecs: what an index stores per key, and how close it gives the keys back."""

import numpy as np
import pytest

from cprag.errors import ConfigError
from cprag.key_codec import bytes_per_key, codec_name, decode_keys, encode_keys, round_trip


def test_fp16_is_stored_as_it_was_and_int8_within_half_a_level():
    keys = np.random.default_rng(0).normal(size=(50, 64)).astype(np.float32) * np.linspace(0.1, 9, 50)[:, None]
    assert np.array_equal(round_trip(keys, "float16"), keys.astype(np.float16))
    blob = encode_keys(keys, "int8")
    assert len(blob) == 50 * bytes_per_key(64, "int8") == 50 * 66
    back = decode_keys(blob, 50, "int8")
    level = np.abs(keys).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(back - keys) <= 0.51 * level + 1e-3 * level)  # rounding, plus the fp16 scale's own
    cosine = (back * keys).sum(1) / np.linalg.norm(back, axis=1) / np.linalg.norm(keys, axis=1)
    assert cosine.min() > 0.9995


def test_a_zero_key_and_names():
    zeros = np.zeros((2, 8), dtype=np.float32)
    assert np.array_equal(round_trip(zeros, "int8"), zeros)
    assert codec_name("fp16") == "float16" and codec_name("int8") == "int8"
    with pytest.raises(ConfigError, match="--keys"):
        codec_name("pq4")
