import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# answers in fp32 unless a test says otherwise (tests compare them with models they load themselves); set at
# import, before any fixture of any scope opens an Index
os.environ["CPRAG_DTYPE"] = "float32"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never read or write the user's converted-backbone cache unless they ask for it."""
    monkeypatch.setenv("CPRAG_CACHE", str(tmp_path_factory.mktemp("cprag-cache")))
