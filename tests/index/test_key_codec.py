"""Key codecs: what an index stores per key, and how close it gives the keys back."""

import numpy as np
import pytest

from cprag.errors import ConfigError
from cprag.index.key_codec import bytes_per_key, codec_name, decode_keys, encode_keys, round_trip


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
    assert codec_name("pq") == "pq"


def test_pq_codes_are_the_nearest_centroids_learned_reproducibly_and_pickle():
    import pickle

    from cprag.index.key_codec import PQCodebook

    rng = np.random.default_rng(0)
    keys = rng.normal(size=(4000, 64)).astype(np.float32)
    codebook = PQCodebook.train(keys)
    assert codebook.centroids.shape == (16, 256, 4)
    assert np.array_equal(codebook.centroids, PQCodebook.train(keys).centroids)  # seeded k-means
    blob = encode_keys(keys[:50], codebook)
    assert len(blob) == 50 * bytes_per_key(64, codebook) == 50 * 16
    back = decode_keys(blob, 50, codebook)
    # each sub-vector decodes to its nearest centroid: no centroid is closer than the chosen one
    parts, chosen = keys[:50].astype(np.float16).astype(np.float32).reshape(50, 16, 4), back.reshape(50, 16, 4)
    nearest = ((parts[:, :, None] - codebook.centroids[None]) ** 2).sum(-1).min(-1)
    assert np.allclose(((parts - chosen) ** 2).sum(-1), nearest, atol=1e-5)
    error = ((back - keys[:50]) ** 2).sum() / (keys[:50] ** 2).sum()
    assert error < 0.2  # Gaussian keys are PQ's worst case; real keys have structure
    assert pickle.loads(pickle.dumps(codebook)).encode(keys[:50]).tobytes() == blob  # to Ray actors, as numpy
    with pytest.raises(ConfigError, match="at least 256 keys"):
        PQCodebook.train(keys[:100])
    assert bytes_per_key(8, "pq") == 8 and bytes_per_key(64, "pq") == 16
