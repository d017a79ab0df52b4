"""An index is a pure function of its corpus, model and flags: the same rows on one thread or two, alone or beside a
process that keeps every core busy, with fp16 and int8 keys (cprag.model.reproducible). The competing load is
started and stopped here. `--ray` against the single process is tests/index/test_ray_index.py."""

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest

from tests.index_helpers import stored_rows
from tests.tiny_models import DOCS, tiny_checkpoint, with_extra_docs, write_jsonl

# matrix products whose sums oneMKL splits across threads by default (seen: 4 x 576 by 576 x 576)
PRODUCTS = """
import hashlib, json, sys
{imports}
import torch
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
digest = hashlib.sha256()
for m, k, n in [(1, 576, 1536), (4, 576, 576), (16, 1536, 576), (1, 1536, 576), (200, 576, 576)]:
    digest.update(torch.nn.functional.linear(torch.randn(m, k), torch.randn(n, k)).numpy().tobytes())
print(json.dumps({{"digest": digest.hexdigest(), "reproducible": {reproducible}}}))
"""


@contextmanager
def busy_cores():
    """Every core spinning in another process, for as long as the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _products(threads: int, with_cprag: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    script = PRODUCTS.format(
        imports="import cprag\nfrom cprag.model.reproducible import blas_reproducible" if with_cprag else "",
        reproducible="blas_reproducible()" if with_cprag else "None")
    done = subprocess.run([sys.executable, "-c", script, str(threads)], capture_output=True, text=True, env=env,
                          check=True)
    return json.loads(done.stdout)


def test_importing_cprag_makes_matrix_products_independent_of_threads_and_load():
    one = _products(1, with_cprag=True)
    if one["reproducible"] is None:
        pytest.skip("torch's BLAS here is not oneMKL")
    assert one["reproducible"] is True
    assert _products(2, with_cprag=True)["digest"] == one["digest"]
    with busy_cores():
        assert _products(2, with_cprag=True)["digest"] == one["digest"]
    # without cprag's setting the same products are left to MKL's default; where that splits sums by thread
    # count (it did on the Xeons and EPYCs measured), the digests differ: the setting is what makes them agree
    plain = {_products(threads, with_cprag=False)["digest"] for threads in (1, 2)}
    assert len(plain) in (1, 2)


def _build(corpus, index_dir, checkpoint, codec: str, threads: int | None = None) -> list:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    subprocess.run([sys.executable, "-m", "cprag", "index", str(corpus), "--index", str(index_dir), "--checkpoint",
                    str(checkpoint), "--keys", codec, "--max-passage-tokens", "120", "--json"], env=env, check=True,
                   capture_output=True)
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["reproducible_blas"] in (True, None)
    return stored_rows(index_dir)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A tiny CPLM as wide as the default backbone: its key projection reads 2 x 576 values per token, a product
    oneMKL's default splits by thread count (narrower ones it does not)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("wide"), hidden=576, cp_layers=[1])


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_an_index_built_beside_a_competing_load_or_on_one_thread_equals_one_built_alone(tmp_path, wide_checkpoint,
                                                                                       codec):
    checkpoint = wide_checkpoint
    corpus = write_jsonl(tmp_path / "c.jsonl", with_extra_docs(6))
    alone = _build(corpus, tmp_path / "alone", checkpoint, codec)
    assert len(alone) == len(DOCS) + 6
    with busy_cores():
        loaded = _build(corpus, tmp_path / "loaded", checkpoint, codec)
    assert loaded == alone
    assert _build(corpus, tmp_path / "one-thread", checkpoint, codec, threads=1) == alone
