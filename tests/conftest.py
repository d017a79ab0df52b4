import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never read or write the user's converted-backbone cache unless they ask for it."""
    monkeypatch.setenv("CPRAG_CACHE", str(tmp_path_factory.mktemp("cprag-cache")))
    # answers in fp32 unless a test says otherwise: tests compare them with models they load themselves
    monkeypatch.setenv("CPRAG_DTYPE", "float32")
