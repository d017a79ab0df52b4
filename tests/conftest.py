import os

import pytest

from cprag.index.retrieve import MiniLMEmbedder
from tests.tiny_models import tiny_checkpoint

# answers in fp32 unless a test says otherwise (tests compare them with models they load themselves); set at
# import, before any fixture of any scope opens an Index
os.environ["CPRAG_DTYPE"] = "float32"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never read or write the user's converted-backbone cache unless they ask for it."""
    monkeypatch.setenv("CPRAG_CACHE", str(tmp_path_factory.mktemp("cprag-cache")))


# a tiny CPLM checkpoint and the real retriever, built once per test module
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def copying_checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("copying"), copy_everything=True)


@pytest.fixture(scope="module")
def embedder():
    return MiniLMEmbedder()
