"""`cprag index --ray` on a real Ray cluster on 127.0.0.1 (`ray start --head`, two encoding actors): the same rows
as the single-process index, bit for bit, after a first build, an update, and a driver killed mid-run."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cprag.api import Index
from cprag.cli import app
from cprag.errors import ClusterError
from cprag.index.build import IndexConfig, build_index
from cprag.index.ray_runner import RayIndexSettings
from cprag.index.retrieve import MiniLMEmbedder
from cprag.index.store import PassageStore
from cprag.model.checkpoint import load_model
from tests.tiny_models import DOCS, tiny_checkpoint, with_extra_docs, write_jsonl

# loopback only: Ray otherwise advertises the machine's own address (and refuses a second node on loopback,
# so the cluster is one head node whose two CPUs hold the two encoding actors)
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)
    address = f"127.0.0.1:{_free_port()}"
    started = subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={address[10:]}",
                              "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
                             capture_output=True, text=True, env={**os.environ})
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env={**os.environ})
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def embedder():
    return MiniLMEmbedder()


def index_corpus(corpus, index_dir, checkpoint, embedder, ray=None, on_progress=None, chunk_passages=2):
    model, tokenizer = load_model(checkpoint)
    return build_index(corpus, index_dir, model, tokenizer, embedder,
                       IndexConfig(max_passage_tokens=120, chunk_passages=chunk_passages), on_progress, ray=ray)


def on_ray(cluster, checkpoint, **settings):
    return RayIndexSettings(address=cluster, workers=2, checkpoint=str(checkpoint), **settings)


def all_rows(index_dir):
    """Every column of every stored row (passage ids, token ids, keys, embeddings, ...), in passage-id order."""
    return PassageStore(index_dir, 384).table.to_arrow().sort_by("passage_id").to_pylist()


def same_rows(ray_rows, single_rows) -> bool:
    """The same rows: every column bit for bit, except the retriever's fp32 embeddings, which may differ in the last
    bits (an actor runs MiniLM on its own CPUs, and on some CPUs an fp32 matmul's sums depend on the thread count);
    keys, token ids and spans never do."""
    def without(rows):
        return [{k: v for k, v in row.items() if k != "embedding"} for row in rows]

    return without(ray_rows) == without(single_rows) and all(
        np.allclose(a["embedding"], b["embedding"], rtol=0, atol=1e-6)
        for a, b in zip(ray_rows, single_rows, strict=True))


def faiss_ids(index_dir):
    manifest = json.loads((Path(index_dir) / "manifest.json").read_text())
    return sorted(json.loads((Path(index_dir) / manifest["faiss"]["ids"]).read_text())["passage_ids"])


def test_a_ray_index_equals_the_single_process_index_through_an_update(tmp_path, cluster, checkpoint, embedder):
    corpus = tmp_path / "c.jsonl"
    write_jsonl(corpus, DOCS[:3])
    single = index_corpus(corpus, tmp_path / "single", checkpoint, embedder)
    report = index_corpus(corpus, tmp_path / "ray", checkpoint, embedder, on_ray(cluster, checkpoint))
    assert report.encoded == single.encoded == 3 and report.tokens_encoded == single.tokens_encoded
    assert same_rows(all_rows(tmp_path / "ray"), all_rows(tmp_path / "single"))

    long_text = " ".join(f"Long sentence {i} is here." for i in range(30))  # 'clock' changes and splits
    write_jsonl(corpus, DOCS[:2] + [{"id": "clock", "title": "River Clock", "text": long_text}] + DOCS[3:])
    index_corpus(corpus, tmp_path / "single", checkpoint, embedder)
    report = index_corpus(corpus, tmp_path / "ray", checkpoint, embedder, on_ray(cluster, checkpoint))
    assert report.unchanged == 2 and report.encoded == report.passages - 2 and report.removed == 1
    rows = all_rows(tmp_path / "ray")
    assert same_rows(rows, all_rows(tmp_path / "single")) and len({r["passage_id"] for r in rows}) == len(rows)
    assert faiss_ids(tmp_path / "ray") == faiss_ids(tmp_path / "single")
    manifest = report.manifest
    assert manifest["status"] == "complete" and manifest["counts"]["passages"] == len(rows)
    # the Ray-built index answers as any other
    assert Index(tmp_path / "ray", checkpoint=checkpoint).ask("When was the lighthouse built?", k=2).passages


def test_pq_keys_on_ray_use_the_codebook_the_driver_learned(tmp_path, cluster, checkpoint, embedder, monkeypatch):
    monkeypatch.setattr("cprag.index.build.PQ_TRAIN_KEYS", 300)  # the codebook from the first chunk or two, not all
    corpus = write_jsonl(tmp_path / "c.jsonl", with_extra_docs(12))

    def build(index_dir, ray=None):
        model, tokenizer = load_model(checkpoint)
        return build_index(corpus, index_dir, model, tokenizer, embedder,
                           IndexConfig(max_passage_tokens=120, chunk_passages=4, key_codec="pq"), ray=ray)

    single = build(tmp_path / "single")
    report = build(tmp_path / "ray", on_ray(cluster, checkpoint))  # the first chunks here, the rest on the actors
    assert report.encoded == single.encoded and report.manifest["key_pq"] == single.manifest["key_pq"]
    assert same_rows(all_rows(tmp_path / "ray"), all_rows(tmp_path / "single"))


def test_a_killed_ray_driver_resumes_to_the_single_process_index(tmp_path, cluster, checkpoint, embedder):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index_corpus(corpus, tmp_path / "single", checkpoint, embedder, chunk_passages=1)
    script = f"""
import os, signal
from cprag.model.checkpoint import load_model
from cprag.index.build import IndexConfig, build_index
from cprag.index.ray_runner import RayIndexSettings
from cprag.index.retrieve import MiniLMEmbedder
model, tokenizer = load_model({str(checkpoint)!r})
def kill(stage, done, total):
    if done >= 2:
        os.kill(os.getpid(), signal.SIGKILL)
build_index({str(corpus)!r}, {str(tmp_path / 'ray')!r}, model, tokenizer, MiniLMEmbedder(),
            IndexConfig(120, chunk_passages=1), on_progress=kill,
            ray=RayIndexSettings(address={cluster!r}, workers=2, checkpoint={str(checkpoint)!r}, commit_passages=1))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == -9, result.stderr[-2000:]
    assert json.loads((tmp_path / "ray" / "manifest.json").read_text())["status"] == "building"
    committed = len(all_rows(tmp_path / "ray"))
    assert 2 <= committed < len(DOCS)
    resumed = index_corpus(corpus, tmp_path / "ray", checkpoint, embedder, on_ray(cluster, checkpoint),
                           chunk_passages=1)
    assert resumed.unchanged == committed and resumed.encoded == len(DOCS) - committed
    assert same_rows(all_rows(tmp_path / "ray"), all_rows(tmp_path / "single"))
    assert faiss_ids(tmp_path / "ray") == faiss_ids(tmp_path / "single")


def test_cli_index_on_ray_reports_json_and_a_dead_address_is_one_line(tmp_path, cluster, checkpoint):
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    runner = CliRunner()
    with pytest.MonkeyPatch.context() as patch:  # a relative --index: the actors' working folder is not ours
        patch.chdir(tmp_path)
        result = runner.invoke(app, ["index", str(corpus), "--index", "idx", "--checkpoint", str(checkpoint),
                                     "--max-passage-tokens", "120", "--ray", cluster, "--ray-workers", "2", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ray"] == cluster and summary["encoded"] == len(DOCS) and summary["tokens_encoded"] > 0

    dead = f"127.0.0.1:{_free_port()}"
    shutil.copytree(tmp_path / "idx", tmp_path / "before")
    write_jsonl(corpus, DOCS + [{"id": "new", "title": "New", "text": "A new document arrives here."}])
    result = runner.invoke(app, ["index", str(corpus), "--index", str(tmp_path / "idx"), "--checkpoint",
                                 str(checkpoint), "--max-passage-tokens", "120", "--ray", dead])
    assert result.exit_code == 1 and "cannot index on the Ray cluster at " + dead in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert all_rows(tmp_path / "idx") == all_rows(tmp_path / "before")  # nothing stored was lost


def test_actors_with_another_checkpoint_refuse_to_encode(tmp_path, cluster, checkpoint, embedder):
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    with pytest.raises(ClusterError, match="every node needs the same checkpoint files"):
        index_corpus(corpus, tmp_path / "idx", checkpoint, embedder, on_ray(cluster, other))
    assert all_rows(tmp_path / "idx") == []


def test_ray_settings_name_their_flags():
    with pytest.raises(ValueError, match="--ray-workers"):
        RayIndexSettings(workers=0)
    with pytest.raises(ValueError, match="--ray-cpus-per-worker"):
        RayIndexSettings(cpus_per_worker=0)
