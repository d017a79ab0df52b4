"""cprag: answer questions from documents the language model never reads, through Copy-Paste LM keys.

Importing cprag loads no model: everything heavy happens inside the functions that need it.

    import cprag
    index = cprag.Index("indexes/demo")
    print(index.ask("When was the lighthouse at Varna Point built?").answer)
"""

import os

# oneMKL's strict conditional numerical reproducibility: its kernels then give the same bits whatever the thread
# count and whatever else the cores are doing (without it, 1 and 2 threads gave different keys, in fp32 and bf16).
# MKL reads this once, at its first call, so it is set here, before torch loads; a user's own value wins.
# cprag.model.reproducible checks that it took.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
__all__ = ["Index", "ask", "build_index", "index_info"]


def __getattr__(name):
    # lazy, so `import cprag` stays cheap (torch, transformers and lancedb load on first use)
    if name in {"Index", "ask", "index_info"}:
        from cprag import api

        return getattr(api, name)
    if name == "build_index":
        from cprag.index.build import build_index

        return build_index
    raise AttributeError(f"module 'cprag' has no attribute {name!r}")
