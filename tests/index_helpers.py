"""Building and reading back a tiny index in tests."""

import time

from cprag.index.build import IndexConfig, build_index
from cprag.index.store import PassageStore
from cprag.model.checkpoint import load_model


def index_corpus(corpus, index_dir, checkpoint, embedder, **config):
    model, tokenizer = load_model(checkpoint)
    return build_index(corpus, index_dir, model, tokenizer, embedder, IndexConfig(max_passage_tokens=120, **config))


def stored_rows(index_dir):
    table = PassageStore(index_dir, 384).table.to_arrow().sort_by("passage_id")
    return table.select(["passage_id", "doc_hash", "token_ids", "keys"]).to_pylist()


def wait_for(path, process, seconds=120):
    deadline = time.time() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.time() < deadline, "the writer never started"
        time.sleep(0.1)


def writer_script(checkpoint, corpus, index_dir, marker, pause):
    """A `build_index` in another process that marks its first committed chunk and then writes slowly."""
    return f"""
import pathlib, time
from cprag.model.checkpoint import load_model
from cprag.index.build import IndexConfig, build_index
from cprag.index.retrieve import MiniLMEmbedder
model, tokenizer = load_model({str(checkpoint)!r})
def slow(stage, done, total):
    pathlib.Path({str(marker)!r}).write_text(str(done))
    time.sleep({pause})
build_index({str(corpus)!r}, {str(index_dir)!r}, model, tokenizer, MiniLMEmbedder(),
            IndexConfig(120, chunk_passages=1), on_progress=slow)
"""
